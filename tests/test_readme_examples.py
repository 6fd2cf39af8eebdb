"""The README's runnable examples run as they are written.

A ```python block that follows the line ``<!-- tests/test_readme_examples.py runs the python
block after this line -->`` is executed here, in CPU mode or on a GPU alike, in a namespace of
its own; its own asserts are the check. The other blocks of the README are sketches (their
tensors are not defined) and are not run."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- tests/test_readme_examples.py runs the python block after this line -->"
BLOCK = re.compile(r"\A\s*```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def marked_blocks():
    """(line number of the block's first code line, code) for every marked block."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for marker in re.finditer(re.escape(MARKER), text):
        rest = text[marker.end():]
        block = BLOCK.match(rest)
        assert block, f"README.md line {text.count(chr(10), 0, marker.start()) + 1}: no ```python block after the marker"
        first_line = text.count("\n", 0, marker.end() + block.start(1)) + 1
        blocks.append((first_line, block.group(1)))
    return blocks


def test_the_readme_marks_its_packed_batch_example():
    codes = [code for _, code in marked_blocks()]
    assert any("cu_seqlens=" in code for code in codes), "README.md: the packed-batch example lost its marker"


@pytest.mark.parametrize("first_line, code", [pytest.param(*block, id=f"README.md:{block[0]}")
                                              for block in marked_blocks()])
def test_readme_block_runs(first_line, code):
    # Padded with blank lines, so that a traceback names the README's own line.
    source = "\n" * (first_line - 1) + code
    exec(compile(source, str(README), "exec"), {"__name__": "readme_example"})
