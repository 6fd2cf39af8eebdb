"""ttx_tutorial.course.trace: the loads and stores of each program, recorded from an interpreted launch."""

import types

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import ttx_tutorial
from ttx_tutorial.course import trace
from ttx_tutorial.testing import run_python


@triton.jit
def _masked_copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _unmasked_copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def _tripled(x):
    return x * 3


@triton.jit
def _tile_kernel(x_ptr, y_ptr, R, C, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # A 2-D grid of tiles; calls a @triton.jit helper and tl.zeros (itself a @triton.jit function).
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    offs = offs_r[:, None] * stride_r + offs_c[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    tl.store(y_ptr + offs, acc + _tripled(tl.load(x_ptr + offs, mask=mask)), mask=mask)


@triton.jit
def _atomic_kernel(x_ptr):
    tl.atomic_add(x_ptr, 1.0)


_ABSENT = object()


def _triton_state():
    """Everything the recorder may touch: triton.language's namespaces and the interpreter's builder."""
    return ([(obj, dict(names)) for obj, names in trace.snapshot_language()],
            dict(vars(interpreter.interpreter_builder)))


def _assert_same_state(before, after, *, first_run=False):
    """``first_run``: the first interpreted run of a process may also import modules of
    triton.language (in GPU mode the interpreter reaches libdevice), which then appear as
    submodules of their package, and add triton.runtime.interpreter's own globals, the same
    objects, to the module of a function it rewrites, and the builder's grid position (see the
    test below)."""
    (language_before, builder_before), (language_after, builder_after) = before, after
    objects_before = [obj for obj, _ in language_before]
    if first_run:
        imported = [obj for obj, _ in language_after if not any(obj is seen for seen in objects_before)]
        modules = {obj.__name__ for obj in imported if isinstance(obj, types.ModuleType)}
        assert all(isinstance(obj, types.ModuleType) or obj.__module__ in modules for obj in imported), imported
        language_after = [(obj, names) for obj, names in language_after if obj not in imported]
    assert objects_before == [obj for obj, _ in language_after]

    def may_be_added(obj, name, value):
        if not first_run:
            return False
        submodule = isinstance(value, types.ModuleType) and value.__name__ == f"{obj.__name__}.{name}"
        return submodule or vars(interpreter).get(name, _ABSENT) is value

    for (obj, names_before), (_, names_after) in zip(language_before, language_after):
        changed = {name for name in names_before.keys() | names_after.keys()
                   if names_before.get(name, _ABSENT) is not names_after.get(name, _ABSENT)
                   and not (name not in names_before and may_be_added(obj, name, names_after[name]))}
        assert not changed, f"{obj!r} changed: {sorted(changed)}"
    # the builder's own place in a grid, which it sets at its first launch
    assert builder_after.keys() - builder_before.keys() <= ({"grid_idx", "grid_dim"} if first_run else set())
    assert builder_before.keys() <= builder_after.keys()
    for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw"):
        assert name not in builder_after, f"interpreter_builder.{name} still wrapped"


def test_masked_copy_with_a_tail_records_exact_offsets_per_program():
    n, block = 10, 4
    x = torch.randn(n)
    y = torch.full((n,), float("nan"))
    recording = trace.record(_masked_copy_kernel, (triton.cdiv(n, block),), x, y, n, BLOCK=block)

    assert torch.equal(y, x)  # the kernel really ran
    assert recording.grid == (3, 1, 1)
    assert list(recording.tensors) == ["x_ptr", "y_ptr"]
    for tensor, kind in (("x_ptr", "load"), ("y_ptr", "store")):
        assert recording.offsets(tensor, kind, program=0) == (0, 1, 2, 3)
        assert recording.offsets(tensor, kind, program=1) == (4, 5, 6, 7)
        assert recording.offsets(tensor, kind, program=2) == (8, 9)  # the tail: lanes 10, 11 masked
        (tail,) = recording.select(tensor, kind, program=2)
        assert tail.masked_offsets == (10, 11)
        assert tail.out_of_bounds == ()
    assert recording.offsets("x_ptr", "store") == ()
    assert [a.kind for a in recording.accesses] == ["load", "store"] * 3
    assert "tl.store(y_ptr + offs" in recording.select("y_ptr")[0].source


def test_missing_mask_is_recorded_as_out_of_bounds():
    # x and y sit at the start of larger buffers, so the overrun reads and writes memory we own.
    source, target = torch.arange(16.0), torch.full((16,), -1.0)
    x, y = source[:10], target[:10]
    recording = trace.record(_unmasked_copy_kernel, (3,), x, y, BLOCK=4)

    assert recording.offsets("x_ptr", "load", program=2) == (8, 9, 10, 11)
    assert recording.out_of_bounds("x_ptr", "load") == (10, 11)
    assert recording.out_of_bounds("y_ptr", "store") == (10, 11)
    assert recording.select("y_ptr", "store", program=2)[0].masked_offsets == ()
    assert target[10:12].tolist() == [10.0, 11.0]  # the neighbour's elements were overwritten
    assert "OUT OF BOUNDS 10-11" in recording.summary()


def test_two_dimensional_grid_helpers_and_strided_rows():
    rows, cols, padded = 5, 6, 8  # x: a (5, 6) view of (5, 8) rows, so its row stride is 8
    x = torch.randn(rows, padded)[:, :cols]
    y = torch.zeros(rows, padded)[:, :cols]
    recording = trace.record(_tile_kernel, (2, 2), x, y, rows, cols, padded, BLOCK_R=4, BLOCK_C=4)

    torch.testing.assert_close(y, 3 * x, rtol=0, atol=0)
    assert recording.grid == (2, 2, 1)
    expected = [r * padded + c for r in range(4, 5) for c in range(4, 6)]  # program (1, 1): rows 4, cols 4-5
    assert recording.offsets("y_ptr", "store", program=(1, 1)) == tuple(expected)
    assert set(recording.offsets("x_ptr", "load")) == {r * padded + c for r in range(rows) for c in range(cols)}
    assert recording.out_of_bounds() == ()


def test_recorder_leaves_triton_as_it_found_it():
    """As ``run_interpreted`` below: the first recording in a process may meet the interpreter's
    own additions; after it, neither a recording nor a refused kernel changes anything."""
    x = torch.randn(6, 6)
    for first in (True, False):
        before = _triton_state()
        trace.record(_tile_kernel, (2, 2), x, torch.empty_like(x), 6, 6, 6, BLOCK_R=4, BLOCK_C=4)
        _assert_same_state(before, _triton_state(), first_run=first)
    with pytest.raises(trace.UnsupportedKernel, match="atomic"):
        trace.record(_atomic_kernel, (1,), torch.zeros(1))
    _assert_same_state(before, _triton_state())
    # And an ordinary launch still works afterwards: interpreted in CPU mode, compiled on a GPU.
    y = torch.empty(3, device=ttx_tutorial.DEVICE)
    _masked_copy_kernel[(1,)](torch.ones(3, device=ttx_tutorial.DEVICE), y, 3, BLOCK=4)
    assert y.tolist() == [1.0, 1.0, 1.0]


def test_bad_arguments_are_refused_with_their_names():
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="@triton.jit"):
        trace.record(lambda x_ptr: None, (1,), x)
    with pytest.raises(ValueError, match="max_lanes"):
        trace.record(_masked_copy_kernel, (1,), x, x, 4, BLOCK=4, max_lanes=0)
    with pytest.raises(trace.UnsupportedKernel, match="more than"):
        trace.record(_masked_copy_kernel, (1,), x, x, 4, BLOCK=4, max_lanes=5)
    with pytest.raises(TypeError, match="do not match"):
        trace.record(_masked_copy_kernel, (1,), x, BLOCK=4)
    meta = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match="y_ptr is on meta"):
        trace.record(_masked_copy_kernel, (1,), x, meta, 4, BLOCK=4)
    recording = trace.record(_masked_copy_kernel, (1,), x, x.clone(), 4, BLOCK=4)
    with pytest.raises(ValueError, match="tensor must be one of"):
        recording.offsets("z_ptr")
    with pytest.raises(ValueError, match="kind must be"):
        recording.select(kind="read")
    with pytest.raises(TypeError, match="program must be"):
        recording.select(program="0")


def test_draw_returns_a_figure_with_one_panel_per_tensor_and_kind():
    matplotlib = pytest.importorskip("matplotlib")  # the notebooks extra; pip install -e .[test] lacks it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = torch.randn(10)
    recording = trace.record(_masked_copy_kernel, (3,), x, torch.empty_like(x), 10, BLOCK=4)
    figure = trace.draw(recording)
    titles = [ax.get_title(loc="left") for ax in figure.axes]
    assert titles == ["x_ptr (10), loads", "y_ptr (10), stores"]
    with pytest.raises(ValueError, match="not tensor arguments"):
        trace.draw(recording, tensors=["q_ptr"])
    with pytest.raises(ValueError, match="columns"):
        trace.draw(recording, columns=0)
    plt.close("all")


def test_the_legend_names_only_the_kinds_of_cell_the_picture_shows():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def legend(recording):
        return [text.get_text() for text in trace.draw(recording).legends[0].get_texts()]

    x = torch.randn(10)
    masked = legend(trace.record(_masked_copy_kernel, (3,), x, torch.empty_like(x), 10, BLOCK=4))
    assert masked[:3] == ["program 0", "program 1", "program 2"]
    assert masked[3].startswith("masked off") and "colour" in masked[3]
    assert not {"not touched", "outside the tensor", "several programs"} & set(masked)
    buffer = torch.zeros(16)
    unmasked = legend(trace.record(_unmasked_copy_kernel, (3,), buffer[:10], torch.zeros(16)[:10], BLOCK=4))
    assert "outside the tensor" in unmasked and not any(label.startswith("masked off") for label in unmasked)
    untouched = legend(trace.record(_masked_copy_kernel, (1,), x, torch.empty_like(x), 10, BLOCK=4))
    assert "not touched" in untouched
    plt.close("all")


_GPU_MODE_SCRIPT = """
import torch, triton, triton.language as tl
import ttx_tutorial
from triton.runtime.jit import JITFunction
from ttx_tutorial.course import trace
assert not ttx_tutorial.INTERPRETED and isinstance(tl.zeros, JITFunction)

@triton.jit
def helper(x):
    return x + 1

@triton.jit
def kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32) + tl.sum(x, axis=0)  # tl.sum: a JITFunction too
    tl.store(y_ptr + offs, acc + helper(x), mask=mask)

language = [(obj, dict(names)) for obj, names in trace.snapshot_language()]
x = torch.arange(6.0)
y = torch.empty(6)
recording = trace.record(kernel, (2,), x, y, 6, BLOCK=4)
assert y.tolist() == [7.0, 8.0, 9.0, 10.0, 14.0, 15.0], y  # x + 1 + the sum of its block
assert recording.offsets("y_ptr", "store", program=1) == (4, 5)
assert recording.select("y_ptr", program=1)[0].masked_offsets == (6, 7)
assert isinstance(tl.zeros, JITFunction) and isinstance(helper, JITFunction)
for obj, names in language:
    assert all(vars(obj).get(name) is value for name, value in names.items()), obj
print("recorded in GPU mode")
"""


def test_records_jit_functions_as_in_gpu_mode():
    # Outside the interpreter @triton.jit builds JITFunctions, as on a GPU machine; nothing here
    # touches a GPU, so this runs anywhere.
    result = run_python(_GPU_MODE_SCRIPT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recorded in GPU mode" in result.stdout


def test_padding_between_the_rows_of_a_view_is_out_of_bounds():
    # A (3, 4) view of (3, 6) rows; an unmasked 8-wide block per row reads the padding and beyond.
    x = torch.arange(18.0).reshape(3, 6)[:, :4]
    recording = trace.record(_unmasked_copy_kernel, (1,), x, torch.zeros(8), BLOCK=8)
    assert recording.offsets("x_ptr", "load") == tuple(range(8))
    assert recording.out_of_bounds("x_ptr", "load") == (4, 5)  # row 0's padding; 6, 7 are row 1
    assert recording.tensors["x_ptr"].row_length == 6


def test_run_interpreted_leaves_triton_as_it_found_it():
    """Every name of triton.language keeps its object. Triton's interpreter rewrites a function
    once per process and runs the rewrite in the function's own module, to which it first adds
    its own globals where missing, and in GPU mode a first run imports libdevice: the first run
    in a process may add those, and nothing else; a second run adds nothing."""
    x = torch.randn(5, 5)
    for first in (True, False):
        before = _triton_state()
        y = torch.empty_like(x)
        trace.run_interpreted(_tile_kernel, (2, 2), x, y, 5, 5, 5, BLOCK_R=4, BLOCK_C=4)
        torch.testing.assert_close(y, 3 * x, rtol=0, atol=0)
        _assert_same_state(before, _triton_state(), first_run=first)


def test_draw_refuses_pictures_too_large_to_read():
    pytest.importorskip("matplotlib")
    x = torch.zeros(30_000)
    recording = trace.record(_masked_copy_kernel, (1,), x, x.clone(), 30_000, BLOCK=16)
    with pytest.raises(ValueError, match="cells to draw"):
        trace.draw(recording)
