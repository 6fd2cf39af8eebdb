"""The recorded GPU figures (ttx_tutorial/course/data/*.json): every row names its recording by date,
GPU, versions and command; no row of a Triton method is superseded by a later recording; and
notebook figures take their rows from one recording only."""

import json
import re
from pathlib import Path

import pytest

from ttx_tutorial.course.figures import load_recorded, latest_recording, recording_name, rows_of_one_recording

ROOT = Path(__file__).resolve().parent.parent
DATA = sorted((ROOT / "ttx_tutorial" / "course" / "data").glob("*.json"))
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("[0-9]*.ipynb"))
TRITON_METHODS = ("recurrent", "chunked", "scan")


@pytest.fixture(scope="module", params=[path.stem for path in DATA])
def recorded(request):
    return load_recorded(request.param)


def test_every_row_belongs_to_a_listed_recording_and_every_recording_has_rows(recorded):
    listed = list(recorded["recordings"])
    used = {row["recording"] for row in recorded["rows"]}
    assert used == set(listed)
    assert all("run" not in row for row in recorded["rows"]), "rows name their recording, not a number"


def test_recordings_are_named_by_date_gpu_versions_and_command(recorded):
    example = recording_name({"date": "2026-11-30", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130",
                              "triton": "3.6.0"}, "python benchmarks/gpu_check.py --parts sweep")
    named = re.compile(r"\d{4}-\d{2}-\d{2} .+, torch \S+, triton \S+: \S.*")
    assert named.fullmatch(example)
    for name in recorded["recordings"]:
        assert named.fullmatch(name), f"recording {name!r} is not named by date, GPU, versions and command"


def test_no_row_of_a_triton_method_is_superseded_by_a_later_recording(recorded):
    """Rows of a kernel re-measured later were taken on older code: the file keeps the newest."""
    order = {name: i for i, name in enumerate(recorded["recordings"])}
    newest = {}
    for row in recorded["rows"]:
        if row["impl"] not in TRITON_METHODS:
            continue
        key = (row["part"], tuple(row["shape"]), row["impl"], row["mode"], row["dtype"], row["config"])
        newest.setdefault(key, set()).add(row["recording"])
    stale = {key: sorted(names, key=order.get) for key, names in newest.items() if len(names) > 1}
    assert not stale, f"rows measured again in a later recording: {stale}"


FIGURE = {"recordings": {"old": {}, "new": {}}, "rows": [
    {"shape": [1, 8, 1024, 64, 64], "impl": "recurrent", "mode": "fwd", "part": "sweep", "recording": "old"},
    {"shape": [1, 8, 2048, 64, 64], "impl": "recurrent", "mode": "fwd", "part": "sweep", "recording": "new"},
    {"shape": [1, 8, 2048, 64, 64], "impl": "scan", "mode": "fwd", "part": "sweep", "recording": "old"},
]}


def test_a_figure_that_would_mix_recordings_is_refused():
    with pytest.raises(ValueError, match="2 recordings; a figure shows one"):
        rows_of_one_recording(FIGURE, part="sweep", shape_prefix=(1, 8))
    name, rows = rows_of_one_recording(FIGURE, part="sweep", recording="old")
    assert name == "old" and len(rows) == 2
    with pytest.raises(LookupError):
        rows_of_one_recording(FIGURE, part="shapes")


def test_the_latest_recording_is_chosen_when_asked():
    assert latest_recording(FIGURE, part="sweep", impl="recurrent") == ("new", [FIGURE["rows"][1]])
    assert latest_recording(FIGURE, part="sweep", impl="scan")[0] == "old"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebooks_select_recorded_rows_through_one_recording(path):
    """Reading recorded["rows"] directly could draw two recordings in one figure."""
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
        assert '["rows"]' not in source and "['rows']" not in source, (
            f"{path.name} reads recorded rows directly; use ttx_tutorial.course.figures.rows_of_one_recording "
            "or latest_recording")
