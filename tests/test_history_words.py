"""The product speaks of itself only: no file that ships or that a learner reads names the
numbered rounds of work or recordings that produced it. Recordings are named by date, GPU,
versions and command; the dated history of the work lives in benchmarks/NOTES.md."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A word that names a round of work followed by its number: a session, a run or runs (not before
# a unit or "times", nor before a version number), an issue with "#" and up to four digits
# (not another project's numbered issue: five digits, or "Triton" before it, which may end the
# line before). The examples below are joined from these words, so that this file, checked
# like every other, holds none whole.
SESSION, RUN, ISSUE = "session", "run", "issue #"
HISTORY_WORDS = re.compile(
    r"\bsessions? \d+\b"
    r"|\bruns? \d+(?![\d.]|\s*(?:µs|us|ms|s|seconds|minutes|times|x|×)\b)"
    r"|(?<!Triton )(?<!triton )\bissues? #\d{1,4}\b",
    re.IGNORECASE)
ALLOWED = {"benchmarks/NOTES.md"}


def product_files():
    """Tracked and new files of the repository, text only, but for the dated history."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # an unpacked sdist: no git, every file is product
        names = [str(path.relative_to(ROOT)) for path in ROOT.rglob("*") if path.is_file()]
    else:
        names = listed.stdout.splitlines()
    for name in sorted(set(names) - ALLOWED):
        path = ROOT / name
        if not path.is_file() or ".egg-info" in name or "__pycache__" in name:
            continue
        try:
            yield name, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # images and other binary files


@pytest.mark.parametrize("text, found", [
    (f"({SESSION} 5, final code)", True), (f"{RUN} 13's figures", True), (f"{RUN}s 10, 11 and 14", True),
    (f"{RUN.title()} 13 ran two", True), (f"the shapes of {ISSUE}5", True), (f"{RUN.title()}s 1-3", True),
    (f"the kernel {RUN}s 75 µs", False), (f"CI {RUN}s 3.11", False), (f"Triton {ISSUE}11584", False),
    (f"# {ISSUE}11584)", False), (f"{RUN} it again", False), (f"a re{RUN} 2", False),
])
def test_the_pattern_finds_history_words_and_nothing_else(text, found):
    assert bool(HISTORY_WORDS.search(text)) == found


def test_no_product_file_names_rounds_of_work():
    hits = []
    for name, text in product_files():
        for line_number, line in enumerate(text.splitlines(), start=1):
            for match in HISTORY_WORDS.finditer(line):
                hits.append(f"{name}:{line_number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    assert not hits, "history words in product files:\n" + "\n".join(hits)
