"""method="auto", the default of causal_product: which kernel it picks, and that it is checked."""

import functools

import pytest
import torch

import ttx_tutorial
from ttx_tutorial import api
from ttx_tutorial.kernels import chunked
from ttx_tutorial.testing import assert_close, poisoned_allocations, random_inputs, reference


def test_default_method_is_auto_and_correct():
    q, k, v, s0 = random_inputs(1, 2, 37, 12, 20, initial_state=True)
    with poisoned_allocations():
        o, state = ttx_tutorial.causal_product(q, k, v, initial_state=s0, return_state=True)
    ref_o, ref_state = reference(q, k, v, s0)
    assert_close(o, ref_o, torch.float32, "o")
    assert_close(state, ref_state, torch.float32, "final state")


def test_auto_picks_a_triton_kernel():
    q, k, v = random_inputs(1, 1, 4, 8)
    assert api.method_info(ttx_tutorial.choose_method(q, v)).is_triton


@pytest.mark.skipif(ttx_tutorial.on_gpu(), reason="the interpreter's choice")
def test_auto_under_the_interpreter_is_chunked():
    q, k, v = random_inputs(1, 1, 4, 8)
    assert ttx_tutorial.choose_method(q, v) == "chunked"


@pytest.mark.gpu
def test_auto_spreads_few_long_sequences_over_the_gpu():
    few_long = random_inputs(1, 2, 16384, 64, device="cuda", dtype=torch.bfloat16)
    many_short = random_inputs(16, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)
    # 64 programs on 132 SMs (the H200's): scan; 128: chunked (see api.py).
    under_half = random_inputs(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)
    full = random_inputs(4, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)
    assert ttx_tutorial.choose_method(few_long[0], few_long[2]) == "scan"
    assert ttx_tutorial.choose_method(many_short[0], many_short[2]) == "chunked"
    expected = "scan" if torch.cuda.get_device_properties(0).multi_processor_count > 128 else "chunked"
    assert ttx_tutorial.choose_method(under_half[0], under_half[2]) == expected
    assert ttx_tutorial.choose_method(full[0], full[2]) == "chunked"


def test_the_rule_takes_scan_from_8192_tokens_below_half_a_program_a_multiprocessor():
    """The rule's two thresholds, exactly: scan from T = 8192 on (not 8191), and only while chunked
    would run fewer than half a program a multiprocessor (65 programs of 132, not 66)."""
    E = 64
    heads_a_program = -(-E // api._chunked_value_block(64, E, torch.bfloat16, None))
    below, at_half = 65 // heads_a_program, 66 // heads_a_program  # one batch of H heads
    assert below * heads_a_program == 65 and at_half * heads_a_program == 66, "a value block per head assumed"
    rule = functools.partial(api._rule, D=64, E=E, dtype=torch.bfloat16, multiprocessors=_H200_MULTIPROCESSORS,
                             float32_precision=None)
    assert rule(1, below, 8192) == "scan"
    assert rule(1, below, 8191) == "chunked"
    assert rule(1, at_half, 8192) == "chunked"


def test_packed_sequences_count_as_their_number_of_mean_length():
    """16 sequences packed into 16384 tokens are counted as 16 of 1024, whatever their lengths."""
    q = torch.empty(1, 8, 16384, 64)
    v = torch.empty(1, 8, 16384, 32)
    cu_seqlens = torch.arange(17, dtype=torch.int32)  # the values are not read
    assert api._counted_shape(q, v, cu_seqlens) == (16, 8, 1024, 64, 32)
    assert api._counted_shape(q, v) == (1, 8, 16384, 64, 32)


def test_auto_validates_like_the_kernels():
    q, k, v = random_inputs(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        ttx_tutorial.causal_product(q, k, v)
    q, k, v = random_inputs(1, 1, 4, 300)
    with pytest.raises(ValueError, match="256"):
        ttx_tutorial.causal_product(q, k, v)


#: The recorded data's dtype names.
_RECORDED_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: An H200's multiprocessors: the GPU of the recorded data.
_H200_MULTIPROCESSORS = 132
#: A call slower than this many times its GPU time waits on the host.
_HOST_BOUND = 1.2


def test_auto_is_within_5_percent_of_the_fastest_kernel_at_every_recorded_point():
    """At each point (shape, dtype, forward or forward+backward) where one recording of the
    benchmark timed all three kernels, the rule, applied for an H200 (float32 with the products
    chunked's and scan's rows name: "highest"'s split, or 3xTF32 in rows recorded before the
    split), picks a kernel within 5 % of the fastest there: in GPU time (a CUDA-graph replay)
    where the rows have it, and per call, as ``auto`` serves calls, wherever no kernel's call
    waits on the host (per call within 1.2x its GPU time; rows without GPU time always). A call
    that waits on the host measures the host's pace on that boot, which moves between boots of
    one machine more than the kernels differ (benchmarks/NOTES.md). The recorded data keeps the
    newest row of each point (``ttx_tutorial.bench.record``): a new recording that the rule does
    not fit fails here."""
    from ttx_tutorial.course.figures import load_recorded

    points, products = {}, {}
    for row in load_recorded()["rows"]:
        if (row.get("part") == "shapes" and row["impl"] in ("recurrent", "chunked", "scan")
                and row.get("ms") is not None and row.get("config") is None):
            key = (tuple(row["shape"]), row["dtype"], row["mode"], row["recording"])
            points.setdefault(key, {})[row["impl"]] = (row["ms"], row.get("gpu_ms"))
            if row["impl"] in ("chunked", "scan"):
                # float32 rows recorded before the bench named their products were 3xTF32's (the
                # rule reads the products for float32 only); chunked's and scan's may differ.
                products.setdefault(key, {})[row["impl"]] = row.get("float32_products", "tf32x3")
    checked = set()
    for (shape, dtype, mode, name), times in points.items():
        if len(times) < 3:
            continue
        B, H, T, D, E = shape
        key = (shape, dtype, mode, name)
        choice = api._rule(B, H, T, D, E, _RECORDED_DTYPES[dtype], _H200_MULTIPROCESSORS,
                           products[key]["chunked"], gradients=(mode == "fwd+bwd"),
                           scan_float32_precision=products[key]["scan"])
        gpu = {method: gpu_ms for method, (_, gpu_ms) in times.items()}
        host_bound = any(gpu_ms is not None and ms > _HOST_BOUND * gpu_ms for ms, gpu_ms in times.values())
        if None not in gpu.values():
            assert gpu[choice] <= 1.05 * min(gpu.values()), (name, shape, dtype, mode, choice, "GPU", times)
        if not host_bound:
            per_call = {method: ms for method, (ms, _) in times.items()}
            assert per_call[choice] <= 1.05 * min(per_call.values()), (name, shape, dtype, mode, choice, times)
        checked.add((shape, dtype, mode))
    # float32 at the four reference shapes, bfloat16 at three, forward and forward+backward.
    assert len({point for point in checked if point[1] == "fp32"}) >= 8, checked
    assert len({point for point in checked if point[1] == "bf16"}) >= 6, checked


@pytest.mark.parametrize("gradients", [False, True])
def test_auto_counts_the_transposed_loops_narrowed_blocks_but_not_for_the_normalised_forward(gradients):
    """Under TF32 at (2, 16, 16384, 128) chunked's transposed loop on narrowed 32-column blocks
    beats scan (``_HIGH_TRANSPOSED_H100``), so the plain product counts its programs after
    narrowing and takes chunked. The normalised attention's forward keeps the untransposed loop,
    whose 32-column tiles were slower than scan there (1.831 against 1.103 ms on an H100), so its
    programs count before narrowing and it takes scan."""
    shape = (2, 16, 16384, 128, 128)
    assert api._rule(*shape, torch.float32, _H200_MULTIPROCESSORS, "tf32", gradients, "tf32") == "chunked"
    assert api._rule(*shape, torch.float32, _H200_MULTIPROCESSORS, "tf32", gradients, "tf32",
                     normalized=True) == "scan"


def test_the_normalised_attention_asks_auto_for_its_own_forward(monkeypatch):
    """``causal_linear_attention(method="auto")`` tells ``choose_method`` that the normalised forward
    runs (``normalized=True``); packed sequences, which chunked normalises through a ones column of
    the plain product, do not."""
    from ttx_tutorial import attention
    asked = []

    def spy(q, v, cu_seqlens=None, *, gradients=None, normalized=False):
        asked.append(normalized)
        return "chunked"

    monkeypatch.setattr(attention, "choose_method", spy)
    q, k, v = random_inputs(1, 2, 20, 8, seed=1)
    ttx_tutorial.causal_linear_attention(q, k, v, method="auto")
    assert asked == [True]
    asked.clear()
    packed = random_inputs(1, 2, 20, 8, seed=2)
    offsets = torch.tensor([0, 7, 20], device=packed[0].device)
    ttx_tutorial.causal_linear_attention(*packed, method="auto", cu_seqlens=offsets)
    assert asked and not any(asked)


def test_auto_takes_recurrent_for_wide_float32_heads_only_under_3xtf32():
    """float32 past D = 64: 3xTF32 makes chunked and scan slower than recurrent, the split into
    bfloat16 parts ("highest") does not; up to it scan's float32 tiles lead forward+backward from
    T = 4096 on under either. TF32 alone ("high") leaves the choice to the programs' count, as
    for 16-bit inputs."""
    wide = (8, 16, 4096, 128, 128)
    assert api._rule(*wide, torch.float32, _H200_MULTIPROCESSORS, "tf32x3") == "recurrent"
    assert api._rule(*wide, torch.float32, _H200_MULTIPROCESSORS, "bf16x3_manual") == "chunked"
    assert api._rule(*wide, torch.float32, _H200_MULTIPROCESSORS, "bf16x3_manual", gradients=True) == "chunked"
    assert api._rule(*wide, torch.float32, _H200_MULTIPROCESSORS, "tf32") == "chunked"
    assert api._rule(*wide, torch.bfloat16, _H200_MULTIPROCESSORS, None) == "chunked"
    assert api._rule(8, 16, 4096, 64, 64, torch.float32, _H200_MULTIPROCESSORS, "tf32x3", gradients=True) == "scan"
    assert api._rule(8, 16, 1024, 64, 64, torch.float32, _H200_MULTIPROCESSORS, "tf32x3",
                     gradients=True) == "chunked"


#: float32 under "high" (TF32 products), ms a call forward / forward+backward of the rules'
#: configs on an H200 (2026-12-04, torch 2.11, Triton 3.6, one process of ``python
#: benchmarks/float32_sweep.py --shapes '8,16,4096,128;1,8,65536,64;2,16,16384,128;8,16,4096,64'
#: --settings high --max-seconds 200 --candidates ... --scan-candidates ...``, the rules' rows):
#: not in the recorded data, which holds the default precision. Its rows at D = 128 timed
#: chunked's untransposed loop and are left out (see ``_HIGH_TRANSPOSED_H100``).
_TF32_SWEEP = {
    (8, 16, 4096, 64, 64): {"chunked": (0.268, 1.048), "scan": (0.356, 1.162), "recurrent": (0.998, 3.982)},
    (1, 8, 65536, 64, 64): {"chunked": (2.782, 11.050), "scan": (0.417, 1.282), "recurrent": (2.242, 9.075)},
}


#: float32 under "highest" with every product split into bfloat16 parts, ms a call forward /
#: forward+backward of the rules' configs on an H200 (2026-12-05, torch 2.11, Triton 3.6, one
#: process of ``python benchmarks/float32_sweep.py --shapes '8,16,4096,64;8,16,4096,128;...'
#: --settings highest --products tf32x3,bf16x3_manual --no-peers --max-seconds 75``, which
#: reached these two shapes; their tiles are ones the split runs on).
_SPLIT_SWEEP = {
    (8, 16, 4096, 64, 64): {"chunked": (0.286, 1.134), "scan": (0.305, 1.017), "recurrent": (0.996, 3.977)},
    (8, 16, 4096, 128, 128): {"chunked": (1.420, 5.696), "scan": (2.009, 8.030), "recurrent": (3.431, 13.439)},
}


#: float32 under "highest" as the kernel files take it by default, chunked's products split into
#: bfloat16 parts and scan's 3xTF32, ms a call forward / forward+backward on an H200 with torch
#: 2.11 and Triton 3.6: chunked and recurrent from ``python -m ttx_tutorial.bench --shapes
#: '8,16,4096,64;8,16,4096,128;1,8,65536,64;2,16,16384,128' --sweep '' --dtypes
#: float32,bfloat16 --methods recurrent,chunked,scan --peers fast_transformers_cuda``
#: (2026-12-05), scan from the same command with ``--dtypes float32`` (2026-12-04, 3xTF32).
_HIGHEST_SWEEP = {
    (8, 16, 4096, 64, 64): {"chunked": (0.288, 1.143), "scan": (0.519, 1.823), "recurrent": (0.997, 3.974)},
    (8, 16, 4096, 128, 128): {"chunked": (1.432, 5.722), "scan": (5.268, 22.40), "recurrent": (3.433, 13.44)},
    (1, 8, 65536, 64, 64): {"chunked": (4.592, 17.95), "scan": (0.540, 1.868), "recurrent": (2.243, 9.086)},
    (2, 16, 16384, 128, 128): {"chunked": (3.053, 12.66), "scan": (5.556, 22.36), "recurrent": (4.966, 18.78)},
}


#: The same defaults in one process on an H100 (132 multiprocessors, as the H200; torch 2.11,
#: Triton 3.6, 2026-12-06), beside the peers: ``python -m ttx_tutorial.bench --shapes
#: '8,16,4096,64;8,16,4096,128;1,8,65536,64;2,16,16384,128' --sweep '' --dtypes
#: float32,bfloat16 --methods recurrent,chunked,scan --peers
#: fast_transformers_cuda,fla_chunk,fla_fused_chunk --float32-settings high``
#: (docs/perf/2026-12-06-h100/bench.json).
_HIGHEST_H100_RUN = {
    (8, 16, 4096, 64, 64): {"chunked": (0.292, 1.154), "scan": (0.531, 1.892), "recurrent": (0.989, 3.809)},
    (8, 16, 4096, 128, 128): {"chunked": (1.424, 5.683), "scan": (6.516, 27.65), "recurrent": (1.754, 7.272)},
    (1, 8, 65536, 64, 64): {"chunked": (4.504, 17.44), "scan": (0.545, 1.911), "recurrent": (2.278, 8.996)},
    (2, 16, 16384, 128, 128): {"chunked": (3.006, 12.38), "scan": (6.400, 26.21), "recurrent": (3.375, 13.30)},
}

#: The same run's rows under "high" (``chunked@high`` and ``scan@high``: TF32 products);
#: recurrent has no matrix products, so its rows are the ones above. Its rows at D = 128 timed
#: chunked's untransposed loop and are left out.
_HIGH_H100_RUN = {shape: {**tf32, "recurrent": _HIGHEST_H100_RUN[shape]["recurrent"]} for shape, tf32 in {
    (8, 16, 4096, 64, 64): {"chunked": (0.286, 1.121), "scan": (0.365, 1.201)},
    (1, 8, 65536, 64, 64): {"chunked": (2.741, 10.63), "scan": (0.433, 1.323)},
}.items()}

#: float32 under "high" with chunked's transposed TF32 loop at D = 128, ms a call forward /
#: forward+backward in one process on an H100 (torch 2.11, Triton 3.6, 2026-12-07): ``python -m
#: ttx_tutorial.bench --shapes '8,16,4096,64;8,16,4096,128;1,8,65536,64;2,16,16384,128' --sweep
#: '' --dtypes float32 --methods recurrent,chunked,scan --peers fla_chunk,fla_fused_chunk
#: --float32-settings high`` (docs/perf/2026-12-07-h100-float32-high/bench.json; recurrent, which
#: has no matrix products, from its "highest" rows).
_HIGH_TRANSPOSED_H100 = {
    (8, 16, 4096, 64, 64): {"chunked": (0.234, 1.069), "scan": (0.365, 1.204), "recurrent": (0.996, 3.973)},
    (8, 16, 4096, 128, 128): {"chunked": (0.563, 2.239), "scan": (1.095, 3.652), "recurrent": (1.738, 7.173)},
    (1, 8, 65536, 64, 64): {"chunked": (2.402, 9.710), "scan": (0.429, 1.320), "recurrent": (2.276, 9.222)},
    (2, 16, 16384, 128, 128): {"chunked": (0.657, 2.823), "scan": (1.111, 3.632), "recurrent": (3.381, 13.523)},
}


#: The float32 sweeps: (chunked's products, scan's products, ms by shape and method).
_SWEEPS = {"split": ("bf16x3_manual", "bf16x3_manual", _SPLIT_SWEEP), "tf32": ("tf32", "tf32", _TF32_SWEEP),
           "highest": ("bf16x3_manual", "tf32x3", _HIGHEST_SWEEP),
           "highest-h100": ("bf16x3_manual", "tf32x3", _HIGHEST_H100_RUN),
           "high-h100": ("tf32", "tf32", _HIGH_H100_RUN),
           "high-transposed-h100": ("tf32", "tf32", _HIGH_TRANSPOSED_H100)}


@pytest.mark.parametrize("sweep, shape", [(name, shape) for name, (_, _, times) in _SWEEPS.items()
                                          for shape in times])
def test_auto_under_each_float32_sweep_is_within_5_percent_of_the_fastest_kernel(sweep, shape):
    """float32 with both kernels' products split into bfloat16 parts, under TF32 ("high"), and
    with "highest"'s defaults (chunked's split, scan's 3xTF32): at each point of the sweep,
    forward and forward+backward, the rule's kernel within 5 % of the fastest."""
    chunked_products, scan_products, table = _SWEEPS[sweep]
    times = table[shape]
    for mode in (0, 1):
        choice = api._rule(*shape, torch.float32, _H200_MULTIPROCESSORS, chunked_products, gradients=bool(mode),
                           scan_float32_precision=scan_products)
        fastest = min(time[mode] for time in times.values())
        assert times[choice][mode] <= 1.05 * fastest, (shape, mode, choice, times)


def test_auto_at_full_float32_precision_asks_whether_gradients_follow():
    """Up to D = 64 from T = 4096 on, 3xTF32: chunked's forward is the faster, scan's
    forward+backward; below T = 4096 chunked either way; 16-bit inputs do not ask."""
    shape = (8, 16, 4096, 64, 64)
    assert api._rule(*shape, torch.float32, _H200_MULTIPROCESSORS, "tf32x3", gradients=False) == "chunked"
    assert api._rule(*shape, torch.float32, _H200_MULTIPROCESSORS, "tf32x3", gradients=True) == "scan"
    short = (8, 16, 1024, 64, 64)
    assert api._rule(*short, torch.float32, _H200_MULTIPROCESSORS, "tf32x3", gradients=True) == "chunked"
    for gradients in (False, True):
        assert api._rule(*shape, torch.bfloat16, _H200_MULTIPROCESSORS, None, gradients=gradients) == "chunked"


@pytest.mark.gpu
def test_auto_reads_from_autograd_whether_gradients_follow(matmul_highest, monkeypatch):
    """Both kernel files at 3xTF32, where a backward decides (the rule's table above)."""
    monkeypatch.setitem(chunked.FLOAT32_PRECISIONS, "highest", "tf32x3")
    q, k, v = random_inputs(8, 16, 4096, 64, device="cuda")
    assert ttx_tutorial.choose_method(q, v) == "chunked"
    assert ttx_tutorial.choose_method(q.requires_grad_(), v) == "scan"
    with torch.no_grad():
        assert ttx_tutorial.choose_method(q, v) == "chunked"
    assert ttx_tutorial.choose_method(q, v, gradients=False) == "chunked"


@pytest.fixture
def matmul_highest():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.gpu
def test_auto_follows_pytorchs_float32_precision(monkeypatch):
    """With a backward to follow: at (2, 16, 16384, 128) "highest" takes chunked (its split into
    bfloat16 parts, where scan's 3xTF32 tiles spill), and so does "high" (TF32 in both: chunked's
    transposed loop on narrowed blocks); at (8, 16, 4096, 64) with both files at 3xTF32,
    "highest" takes scan and "high" chunked."""
    wide = random_inputs(2, 16, 16384, 128, device="cuda")
    q, k, v = random_inputs(8, 16, 4096, 64, device="cuda")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert ttx_tutorial.choose_method(wide[0], wide[2], gradients=True) == "chunked"
        monkeypatch.setitem(chunked.FLOAT32_PRECISIONS, "highest", "tf32x3")
        assert ttx_tutorial.choose_method(q, v, gradients=True) == "scan"
        torch.set_float32_matmul_precision("high")
        assert ttx_tutorial.choose_method(wide[0], wide[2], gradients=True) == "chunked"
        assert ttx_tutorial.choose_method(q, v, gradients=True) == "chunked"
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("needs", ["none", "q", "k", "v", "initial_state", "no_grad"])
def test_causal_product_tells_auto_whether_a_backward_follows(needs, monkeypatch):
    """``causal_product`` passes ``gradients`` to the rule: True when grad mode is on and any of
    q, k, v or the initial state requires a gradient (k alone too, which choose_method's own
    default, reading q and v, would miss)."""
    seen = []

    def spy(q, v, cu_seqlens=None, *, gradients=None):
        seen.append(gradients)
        return "chunked"

    monkeypatch.setattr(api, "choose_method", spy)
    q, k, v, s0 = random_inputs(1, 1, 5, 8, initial_state=True)
    inputs = {"q": q, "k": k, "v": v, "initial_state": s0}
    if needs in inputs:
        inputs[needs].requires_grad_(True)
    if needs == "no_grad":
        q.requires_grad_(True)
        with torch.no_grad():
            ttx_tutorial.causal_product(q, k, v, initial_state=s0)
    else:
        ttx_tutorial.causal_product(q, k, v, initial_state=s0)
    assert seen == [needs in inputs], (needs, seen)
