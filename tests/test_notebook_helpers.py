"""The notebook helpers: excerpts that fail loudly, the mode banner, progress, and the code the
notebooks print (excerpts only, every marker present)."""

import ast
import importlib
import io
import json
import re
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import triton
import triton.language as tl

import ttx_tutorial
from ttx_tutorial.course.notebook import banner, excerpt, progress, triton_imported_first
from ttx_tutorial.testing import run_python

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("[0-9]*.ipynb"))


def sample(x):
    total = 0
    for step in range(x):  # the loop
        total += step
    total *= 2  # doubled
    return total


@triton.jit
def sample_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(x_ptr + offs, x * 2)


def test_an_excerpt_runs_from_its_start_marker_up_to_its_stop_marker():
    assert excerpt(sample, "for step", "total *= 2") == (
        "    for step in range(x):  # the loop\n        total += step")
    assert excerpt(sample, "# doubled") == "    total *= 2  # doubled\n    return total"


def test_an_excerpt_of_a_kernel_reads_its_python_source():
    assert excerpt(sample_kernel, "x = tl.load", "tl.store") == "    x = tl.load(x_ptr + offs)"


@pytest.mark.parametrize("start, stop, message", [
    ("offs_w = tl.arange", None, "start marker 'offs_w = tl.arange' not found"),
    ("for step", "slot = ", "stop marker 'slot = ' not found after 'for step'"),
    ("total", None, "start marker 'total' is on 4 lines"),
])
def test_a_missing_or_ambiguous_marker_raises_instead_of_printing_the_whole_function(start, stop, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        excerpt(sample, start, stop)


def test_the_banner_names_the_mode_and_tells_gpu_learners_to_rerun():
    text = banner()
    assert ttx_tutorial.describe() in text
    if ttx_tutorial.on_gpu():
        assert "GPU MODE" in text
    else:
        assert "CPU MODE" in text and "run all cells again" in text and "GPU MODE" in text


def test_the_banner_says_when_triton_was_imported_first():
    """Imported before ttx_tutorial, Triton made its own functions for a GPU: the first cell of a
    notebook says so, where it would otherwise claim a working CPU mode."""
    if ttx_tutorial.on_gpu():
        pytest.skip("the import order only matters for the CPU interpreter")
    child = run_python("import triton\nimport ttx_tutorial\nprint(ttx_tutorial.banner())\n", timeout=300,
                       TTX_TUTORIAL_DEVICE="cpu")
    assert "TRITON WAS IMPORTED BEFORE ttx_tutorial" in child.stdout, child.stdout + child.stderr
    assert "import ttx_tutorial first" in child.stdout.splitlines()[-2]  # describe()'s line too
    assert not triton_imported_first()  # this process imported them in order


def test_progress_yields_every_item_and_reports_on_stderr():
    err = io.StringIO()
    with redirect_stderr(err):
        assert list(progress(range(3), "configs")) == [0, 1, 2]
    assert "configs: 1/3" in err.getvalue() and "configs: 3/3 done" in err.getvalue()


# --- what the notebooks print ----------------------------------------------------------------

def code_cells(path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            yield "".join(cell["source"])


def excerpt_calls(path):
    """(function expression, start, stop) of every ``excerpt(...)`` call with literal markers."""
    for source in code_cells(path):
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.startswith(("%", "!"))))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "excerpt":
                markers = [arg.value for arg in node.args[1:] if isinstance(arg, ast.Constant)]
                yield ast.unparse(node.args[0]), *markers, *([None] * (2 - len(markers)))


def resolve(expression):
    """``module.function`` of the package, e.g. ``scan._scan_start_states`` or
    ``ttx_tutorial.references.loop``; None for a function the notebook defines itself."""
    *module_path, name = expression.split(".")
    for prefix in ("", "ttx_tutorial.", "ttx_tutorial.kernels."):
        try:
            module = importlib.import_module(prefix + ".".join(module_path))
        except (ImportError, ValueError):
            continue
        if hasattr(module, name):
            return getattr(module, name)
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_every_excerpt_marker_of_the_notebooks_exists(path):
    for expression, start, stop in excerpt_calls(path):
        function = resolve(expression)
        if function is not None:
            excerpt(function, start, stop)  # raises ValueError naming a missing marker


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebooks_print_excerpts_not_whole_functions(path):
    for source in code_cells(path):
        assert "getsource(" not in source, (
            f"{path.name} prints a whole function with inspect.getsource; print "
            "ttx_tutorial.course.notebook.excerpt(function, start, stop) of the lines the text is about")
