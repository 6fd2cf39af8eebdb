"""python -m ttx_tutorial.bench: the quick run in CPU mode writes one row per contender, shape,
dtype and mode with honest errors, its CSV, JSON and plots; --record merges one recording into a
copy of the recorded data and keeps that file's invariants and every notebook figure."""

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch
import triton

import test_recorded_data as recorded_invariants
import ttx_tutorial
from ttx_tutorial import bench
from ttx_tutorial.testing import TOLERANCES, poisoned_allocations, run_python

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "ttx_tutorial" / "course" / "data" / "h200.json"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run in a fresh process in CPU mode, recording into a copy of the data file."""
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"CPU mode runs on Triton 3.9's interpreter; triton {triton.__version__}'s fails inside the kernels")
    folder = tmp_path_factory.mktemp("bench")
    # A copy of the recorded data. A file holds one device's figures: this copy stands for the
    # CPU's, and keeps the GPU's rows.
    copy = json.loads(DATA.read_text())
    copy["env"]["gpu"] = bench.CPU_DEVICE
    data = folder / "recorded.json"
    data.write_text(json.dumps(copy))
    # As `python -m ttx_tutorial.bench --quick ...` in CPU mode.
    result = run_python("import runpy; runpy.run_module('ttx_tutorial.bench', run_name='__main__')",
                        "--quick", "--out", str(folder / "out"), "--record", str(data), timeout=300,
                        TTX_TUTORIAL_DEVICE="cpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((folder / "out" / "bench.json").read_text())
    return folder, report, json.loads(data.read_text()), result.stdout


def expected_points():
    (B, H, D, E), lengths = bench.QUICK_SWEEP["cpu"]
    shapes = [("shapes", shape) for shape in bench.QUICK_SHAPES["cpu"]]
    shapes += [("sweep", (B, H, T, D, E)) for T in lengths]
    return {(part, shape, impl, mode, label)
            for part, shape in shapes for impl in (*ttx_tutorial.METHODS, "sdpa_softmax")
            for mode in bench.MODES for label in ("fp32", "bf16")}


def test_the_quick_run_writes_one_measured_row_per_point(quick_run):
    _, report, _, _ = quick_run
    assert report["complete"]
    rows = report["rows"]
    points = [(r["part"], tuple(r["shape"]), r["impl"], r["mode"], r["dtype"]) for r in rows]
    assert len(points) == len(set(points)), "a point was measured twice"
    assert set(points) == expected_points()
    for row in rows:
        assert row["note"] is None, row
        assert row["ms"] > 0 and row["host_us"] > 0 and row["gpu_ms"] is None  # no GPU: no graph
        assert math.isclose(row["bandwidth_TBps"], row["floor_ms"] * report["env"]["copy_TBps"] / row["ms"],
                            rel_tol=1e-9)


def test_every_forward_error_is_finite_and_within_the_dtype_tolerance(quick_run):
    _, report, _, _ = quick_run
    tolerance = {"fp32": TOLERANCES[torch.float32], "bf16": TOLERANCES[torch.bfloat16]}
    for row in report["rows"]:
        if row["mode"] == "fwd":
            assert math.isfinite(row["rel_err"]) and row["rel_err"] <= tolerance[row["dtype"]], row
        else:
            assert row["rel_err"] is None


def test_float32_rows_name_the_products_of_their_kernel_file(quick_run):
    """Each float32 row of chunked and scan names the products PyTorch's default setting gave its
    tensor cores (chunked's split into bfloat16 parts, scan's 3xTF32), other rows none; the
    record keeps them, so that tests/test_auto.py applies the rule with the recording's."""
    _, report, recorded, _ = quick_run
    expected = {"chunked": "bf16x3_manual", "scan": "tf32x3"}
    for row in report["rows"]:
        assert row["float32_products"] == (expected.get(row["impl"]) if row["dtype"] == "fp32" else None), row
    newest = list(recorded["recordings"])[-1]
    kept = [row for row in recorded["rows"]
            if row["recording"] == newest and row["dtype"] == "fp32" and row["impl"] in expected]
    assert kept and all(row["float32_products"] == expected[row["impl"]] for row in kept)


def test_csv_and_plots_are_written(quick_run):
    folder, report, _, _ = quick_run
    with open(folder / "out" / "bench.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(report["rows"])
    assert [row["ms"] for row in table] == [str(row["ms"]) for row in report["rows"]]
    plots = sorted(path.name for path in (folder / "out").glob("*.png"))
    assert plots == sorted(f"{name}_{part}_{dtype}.png" for name in ("time", "bandwidth")
                           for part in ("shapes", "sweep") for dtype in ("fp32", "bf16"))
    for name in plots:
        assert (folder / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_run_prints_its_comparison_with_the_peers(quick_run):
    *_, stdout = quick_run
    table = stdout.split("fastest of ours against the fastest peer")[1]
    for shape in bench.QUICK_SHAPES["cpu"]:
        assert len(re.findall(re.escape(str(shape)) + r" +(fp32|bf16) +fwd", table)) == 4  # two dtypes, two modes


def test_the_record_keeps_the_data_files_invariants(quick_run):
    _, report, recorded, _ = quick_run
    recorded_invariants.test_every_row_belongs_to_a_listed_recording_and_every_recording_has_rows(recorded)
    recorded_invariants.test_recordings_are_named_by_date_gpu_versions_and_command(recorded)
    recorded_invariants.test_no_row_of_a_triton_method_is_superseded_by_a_later_recording(recorded)
    newest = list(recorded["recordings"])[-1]
    assert newest == report["env"]["recording"]
    assert newest.endswith(": python -m ttx_tutorial.bench --quick"), "where results go is not part of the name"
    assert sum(row["recording"] == newest for row in recorded["rows"]) == len(report["rows"])


def test_the_record_keeps_what_the_notebook_figures_read_and_drops_the_rest(quick_run):
    _, _, recorded, _ = quick_run
    before = json.loads(DATA.read_text())
    # The quick run re-measures none of the old rows: the old rows kept are those a figure read.
    read = {json.dumps(row, sort_keys=True) for rows in bench.figure_rows(before) for row in rows}
    kept = [row for row in recorded["rows"] if row["recording"] in before["recordings"]]
    assert {json.dumps(row, sort_keys=True) for row in kept} == read
    assert {"precision", "peers", "overhead", "sweep", "shapes"} <= {row["part"] for row in kept}
    assert not {"tune", "trace"} & {row["part"] for row in kept}, "no figure reads these"


def test_the_record_follows_every_kind_of_row_the_notebooks_draw():
    """figure_rows mirrors the notebooks' selections: a notebook that starts to draw another
    part must be taught to the record, or the record would drop that part's rows."""
    drawn = set()
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                drawn |= set(re.findall(r"part=[\"'](\w+)[\"']", "".join(cell["source"])))
    kept = {row["part"] for rows in bench.figure_rows(json.loads(DATA.read_text())) for row in rows}
    assert drawn == kept == {"shapes", "peers", "sweep", "precision", "overhead"}


OLD = "2026-01-01 NVIDIA H200, torch 2.11, triton 3.6: python -m ttx_tutorial.bench --shapes 1,8,256,64"
OLD_TUNE = "2026-01-01 NVIDIA H200, torch 2.11, triton 3.6: python benchmarks/gpu_check.py --parts tune"


def synthetic_file(path):
    def row(impl, T, recording, part="shapes", config=None):
        return {"shape": [1, 8, T, 64, 64], "impl": impl, "mode": "fwd", "dtype": "bf16", "ms": 1.0,
                "rel_err": 1e-3, "config": config, "part": part, "recording": recording}

    path.write_text(json.dumps({"env": {}, "about": "test", "recordings": {OLD: {}, OLD_TUNE: {}}, "rows": [
        row("chunked", 256, OLD), row("scan", 256, OLD), row("chunked", 256, OLD_TUNE, "tune", "default")]}))


def new_rows(*impls):
    return [{"shape": [1, 8, 256, 64, 64], "impl": impl, "mode": "fwd", "dtype": "bf16", "ms": 0.5,
             "host_us": 20.0, "gpu_ms": 0.4, "rel_err": 2e-3, "part": "shapes", "note": None} for impl in impls]


ENV = {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11", "triton": "3.6", "python": "3.12", "date": "2026-02-02",
       "fla": None, "copy_TBps": 4.2, "command": "python -m ttx_tutorial.bench --shapes 1,8,256,64"}


def test_a_re_measured_row_replaces_the_old_one_and_unread_recordings_go(tmp_path):
    path = tmp_path / "recorded.json"
    synthetic_file(path)
    merged = bench.record(path, new_rows("chunked") + [{**new_rows("recurrent")[0], "ms": None,
                                                        "note": "failed: x"}], ENV)
    assert merged == json.loads(path.read_text())
    name = list(merged["recordings"])[-1]
    assert [(row["impl"], row["recording"]) for row in merged["rows"]] == [("scan", OLD), ("chunked", name)]
    assert list(merged["recordings"]) == [OLD, name], "the tune recording is read by no figure"
    assert merged["rows"][-1]["gpu_ms"] == 0.4 and merged["rows"][-1]["host_us"] == 20.0
    # The same command again replaces its own recording, and a recording left without rows goes.
    merged = bench.record(path, new_rows("chunked", "scan"), ENV)
    assert [row["impl"] for row in merged["rows"]] == ["chunked", "scan"]
    assert list(merged["recordings"]) == [name]


def test_nothing_measured_and_another_device_are_refused_and_the_file_is_untouched(tmp_path):
    path = tmp_path / "recorded.json"
    synthetic_file(path)
    before = path.read_text()
    with pytest.raises(ValueError, match="every row was skipped or failed"):
        bench.record(path, [{**new_rows("chunked")[0], "ms": None, "note": "failed: x"}], ENV)
    bench.record(path, new_rows("chunked"), ENV)
    measured = path.read_text()
    with pytest.raises(ValueError, match="holds figures of NVIDIA H200, this run measured NVIDIA A100"):
        bench.record(path, new_rows("chunked"), {**ENV, "gpu": "NVIDIA A100"})
    assert path.read_text() == measured != before


def test_an_unwritten_or_wrong_output_shows_in_the_error_column():
    point = bench.Point((1, 2, 20, 8, 8), torch.float32, seed=1)
    with poisoned_allocations():
        unwritten = bench.measure(point, bench.Contender("unwritten", lambda q, k, v: torch.empty_like(v),
                                                         (torch.float32,)), "fwd", copy_TBps=1.0)
    assert unwritten["rel_err"] == math.inf
    sees_the_future = bench.Contender("non-causal", lambda q, k, v: (q @ k.transpose(-1, -2)) @ v, (torch.float32,))
    assert bench.measure(point, sees_the_future, "fwd", copy_TBps=1.0)["rel_err"] > 0.1
    right = bench.method_contenders(["cumsum"])[0]
    assert bench.measure(point, right, "fwd", copy_TBps=1.0)["rel_err"] <= TOLERANCES[torch.float32]


def test_a_dtype_a_contender_refuses_is_skipped_with_the_reason():
    point = bench.Point((1, 1, 8, 4, 4), torch.bfloat16, seed=2)
    row = bench.measure(point, bench.Contender("float32 only", lambda q, k, v: v, (torch.float32,)), "fwd", 1.0)
    assert row["ms"] is None and row["note"] == "skipped: float32 only takes fp32"


@pytest.mark.parametrize("arguments, message", [
    (["--shapes", "1,2,3"], "--shapes: '1,2,3' must be 4 or 5 positive integers"),
    (["--shapes", "1,2,x,4"], "--shapes: '1,2,x,4' is not B,H,T,D"),
    (["--sweep", "1,8,64:256"], "--sweep: '1,8,64:256' must be four positive B,H,D,E"),
    (["--dtypes", "float64"], "--dtypes: unknown 'float64'; choose from float32, float16, bfloat16"),
    (["--methods", "fast"], "--methods: unknown 'fast'; choose from loop"),
    (["--shapes", "", "--sweep", ""], "--shapes and --sweep are both empty: nothing to measure"),
    (["--modes", "bwd"], "--modes: unknown 'bwd'; choose from fwd, fwd+bwd"),
    (["--modes", ""], "--dtypes, --modes and one of --methods/--peers must name at least one"),
    (["--float32-settings", "low"], "--float32-settings: unknown 'low'; choose from highest, high, medium"),
    (["--dtypes", "bf16", "--float32-settings", "high"], "--dtypes must name float32"),
    (["--methods", "recurrent", "--float32-settings", "high"], "applies to chunked and scan: --methods names neither"),
])
def test_bad_arguments_are_refused_naming_the_option(arguments, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(arguments)
    assert message in capsys.readouterr().err


def test_output_and_record_files_are_refused_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    """Each refusal comes from the argument check, before the copy bandwidth is measured."""
    monkeypatch.setattr(bench, "copy_bandwidth_TBps", lambda quick: pytest.fail("measured before refusing"))
    a_file = tmp_path / "a_file"
    a_file.write_text("not json")
    another_device = tmp_path / "h200.json"
    another_device.write_text(DATA.read_text())
    this_device = bench.device_name()
    cases = [(["--note", "why"], "--note goes with --record"),
             (["--out", str(a_file)], "exists and is not a directory"),
             (["--record", str(tmp_path / "no_such_folder" / "x.json")], "does not exist"),
             (["--record", str(a_file)], "is not a recorded-data file")]
    if this_device != "NVIDIA H200":
        cases.append((["--record", str(another_device)],
                      f"holds figures of NVIDIA H200, this run would measure {this_device}"))
    for arguments, message in cases:
        with pytest.raises(SystemExit):
            bench.main(["--quick", *arguments])
        assert message in capsys.readouterr().err, arguments


def test_the_memory_floor_counts_each_tensor_once():
    """Forward: q, k (D each) and v (E) read, o (E) written. Forward+backward adds q, k, v and dO
    read, dq, dk (D each) and dv (E) written. D and E differ, so a tensor counted in the wrong
    width shows."""
    D, E = 3, 5
    assert bench.floor_bytes((2, 1, 7, D, E), torch.bfloat16, "fwd") == 2 * 7 * (D + D + E + E) * 2
    assert bench.floor_bytes((1, 1, 1, D, E), torch.float32, "fwd+bwd") == 4 * ((2 * D + 2 * E) + (2 * D + 2 * E)
                                                                               + (2 * D + E))


def test_short_dtype_names_are_accepted():
    assert bench.parse_names("fp32, bf16,float16", bench.DTYPES, "--dtypes", bench.DTYPE_ALIASES) == [
        "float32", "bfloat16", "float16"]


def test_float32_settings_add_rows_of_chunked_and_scan_under_each_and_a_table_of_their_own(tmp_path):
    """--float32-settings high: chunked and scan in float32 again under "high", as chunked@high and
    scan@high, naming the products that setting gave them; recurrent (no matrix products) and
    other dtypes get no such rows; PyTorch's setting is the run's again afterwards."""
    before = torch.get_float32_matmul_precision()
    code = bench.main(["--shapes", "1,1,20,8,16", "--sweep", "", "--dtypes", "fp32,bf16", "--modes", "fwd",
                       "--methods", "chunked,scan,recurrent", "--peers", "", "--float32-settings", "high",
                       "--out", str(tmp_path)])
    assert code == 0 and torch.get_float32_matmul_precision() == before
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    measured = {(row["impl"], row["dtype"]): row["float32_products"] for row in rows if row["ms"] is not None}
    assert measured == {("chunked", "fp32"): "bf16x3_manual", ("scan", "fp32"): "tf32x3", ("recurrent", "fp32"): None,
                        ("chunked@high", "fp32"): "tf32", ("scan@high", "fp32"): "tf32",
                        ("chunked", "bf16"): None, ("scan", "bf16"): None, ("recurrent", "bf16"): None}
    tables = (tmp_path / "bench.md").read_text().split("\n\n")
    titles = [table.splitlines()[0] for table in tables if table.strip() and not table.startswith("|")]
    assert titles == ["fp32:", "fp32, torch.set_float32_matmul_precision('high'):", "bf16:"]
    high_table = (tmp_path / "bench.md").read_text().split("'high'):")[1].split("bf16:")[0]
    assert "chunked@high | scan@high |" in high_table and "| recurrent |" not in high_table


def test_a_run_that_measures_nothing_fails_and_draws_no_plot(tmp_path, capsys):
    code = bench.main(["--shapes", "1,1,8,300", "--sweep", "", "--dtypes", "float32", "--modes", "fwd",
                       "--methods", "chunked", "--peers", "", "--out", str(tmp_path)])
    assert code == 1 and "nothing was measured" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png")) and (tmp_path / "bench.csv").exists()


@pytest.mark.gpu
def test_on_a_gpu_each_row_has_its_graph_replay_host_time_and_bandwidth():
    copy_TBps = bench.copy_bandwidth_TBps(quick=True)
    assert copy_TBps > 0.1
    point = bench.Point((2, 4, 512, 64, 64), torch.bfloat16, seed=3)
    found, _ = bench.peer_contenders(["sdpa_softmax", "fla_fused_chunk"])
    for contender in bench.method_contenders(["recurrent", "chunked", "scan", "cumsum"]) + found:
        for mode in bench.MODES:
            row = bench.measure(point, contender, mode, copy_TBps)
            assert row["note"] is None, row
            assert row["ms"] > 0 and row["gpu_ms"] > 0 and row["host_us"] > 0, row
            assert 0 < row["bandwidth_TBps"] < 2 * copy_TBps, row
            if mode == "fwd":
                assert row["rel_err"] <= TOLERANCES[torch.bfloat16], row


def test_the_fast_transformers_builder_names_a_wrong_source(tmp_path, benchmark_script):
    """benchmarks/build_fast_transformers.py refuses a folder that is not a fast-transformers
    checkout, naming the argument, before it writes anything. (The build itself needs the
    upstream source, which the repository does not hold: it runs on the GPU machine.)"""
    builder = benchmark_script("build_fast_transformers")
    with pytest.raises(FileNotFoundError, match="--source .* holds no fast_transformers/causal_product"):
        builder.main(["--source", str(tmp_path / "nothing"), "--target", str(tmp_path / "site")])
    assert not (tmp_path / "site").exists()


def test_the_markdown_tables_show_each_recorded_point_with_our_fastest_in_bold():
    """bench.md's tables, built from the newest recording with fla's kernels at (8, 16, 4096, 64) in
    bfloat16: one line per shape and mode, our fastest method in bold, and the peers' best over
    ours computed from the same rows."""
    from ttx_tutorial.course.figures import latest_recording, load_recorded, rows_of_one_recording

    recorded = load_recorded()
    name, _ = latest_recording(recorded, part="shapes", impl="fla_fused_chunk", dtype="bf16",
                               shape=[8, 16, 4096, 64, 64])
    _, rows = rows_of_one_recording(recorded, part="shapes", recording=name)
    # bfloat16 alone: a later recording may have replaced the other dtypes' rows of ours.
    rows = [{**row, "gpu_ms": row.get("gpu_ms")} for row in rows if row["dtype"] == "bf16"]
    text = bench.markdown_tables(rows)
    lines = [line for line in text.splitlines() if line.startswith("| (") and "mode" not in line]
    points = {(tuple(r["shape"]), r["mode"], r["dtype"]) for r in rows if r["impl"] != "sdpa_softmax"}
    assert len(lines) == len(points)
    for line in lines:
        assert line.count("**") == 2, line  # one bold cell: ours
    bf16 = [r for r in rows if r["dtype"] == "bf16"]
    row = {(r["impl"], r["mode"]): r for r in bf16 if tuple(r["shape"]) == (8, 16, 4096, 64, 64)}
    ours = min(row["chunked", "fwd"]["ms"], row["scan", "fwd"]["ms"], row["recurrent", "fwd"]["ms"])
    peers = min(row["fla_chunk", "fwd"]["ms"], row["fla_fused_chunk", "fwd"]["ms"])
    line = next(line for line in bench.markdown_tables(bf16).splitlines()
                if line.startswith("| (8, 16, 4096, 64, 64) | fwd |"))
    assert line.split("|")[-2].strip().startswith(f"{peers / ours:.2f}"), line
