"""float32 inputs follow ``torch.get_float32_matmul_precision()``: which product precision and
which configuration the chunked and scan kernels launch with under each setting, and that the
results stay within float32's tolerance under every setting.

The interpreter multiplies float32 exactly whatever ``input_precision`` says, so on the CPU
these tests check the rule (the constexpr and the configuration each launch receives) and the
new tiles' arithmetic; the tests marked ``gpu`` check the tensor cores' accuracy, and those under
``emulated_tensor_cores`` check TF32's in either mode (the interpreter then multiplies as tensor
cores do).
"""

import contextlib
import json
import math

import pytest
import torch

import ttx_tutorial
from ttx_tutorial.course.figures import load_recorded, rows_of_one_recording
from ttx_tutorial.kernels import chunked, scan
from ttx_tutorial.references import cumsum, quadratic
from ttx_tutorial.testing import (TOLERANCES, assert_close, emulated_tensor_cores, poisoned_allocations,
                                  random_inputs, reference, reference_gradients, relative_error, tensor_core_dot)

SETTINGS = ("highest", "high", "medium")
EXPECTED_PRECISION = {"highest": "bf16x3_manual", "high": "tf32", "medium": "tf32"}
#: scan's: 3xTF32 for "highest" (its split is an opt-in, see the kernel file).
SCAN_EXPECTED_PRECISION = {"highest": "tf32x3", "high": "tf32", "medium": "tf32"}


def expected_precision(family, setting):
    return (SCAN_EXPECTED_PRECISION if family is scan else EXPECTED_PRECISION)[setting]


def expected_products(setting, block_d, block_e, chunk, shape=(1, 2, 64, 64, 64), normalized=False):
    """The products a float32 launch takes under ``setting`` on a tile: the split into bfloat16
    parts for "highest", except on tiles not measured right on a GPU, for outputs of fewer than
    1024 elements (B, H, T, D, E = ``shape``) and in the normalised attention (3xTF32 there)."""
    products = EXPECTED_PRECISION[setting]
    B, H, T, D, E = shape
    small = H * min(B * T * min(D, E), B * D * E) < 1024
    if products == "bf16x3_manual" and (normalized or small or (block_d, block_e, chunk) not in chunked.SPLIT_TILES):
        return "tf32x3"
    return products
#: TF32 keeps float16's 10 significand bits, so it gets float16's tolerance.
TF32_TOLERANCE = TOLERANCES[torch.float16]


@pytest.fixture
def matmul_precision():
    """Sets PyTorch's float32 matmul precision for one test and restores it afterwards."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def recorded_launches(module):
    """Every launch of the module's ``*_kernel`` functions, run as usual and recorded as
    (kernel name, keyword arguments): the constexprs, num_warps and num_stages."""
    kernels = {name: obj for name, obj in vars(module).items()
               if name.endswith("_kernel") and hasattr(obj, "run")}
    launches = []

    def recorder(name, kernel):
        original = type(kernel).run

        def run(*args, **kwargs):
            launches.append((name, kwargs))
            return original(kernel, *args, **kwargs)
        return run

    for name, kernel in kernels.items():
        kernel.run = recorder(name, kernel)
    try:
        yield launches
    finally:
        for kernel in kernels.values():
            del kernel.run


def test_every_setting_of_pytorch_has_a_precision():
    assert chunked.FLOAT32_PRECISIONS == EXPECTED_PRECISION
    assert scan.FLOAT32_PRECISIONS == SCAN_EXPECTED_PRECISION


@pytest.mark.parametrize("family", [chunked, scan], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_launches_follow_the_setting_at_each_call(family, matmul_precision, device):
    """One process, the setting changed between calls: each float32 launch, forward and backward,
    gets the precision of the setting at its call; 16-bit launches always get "tf32"."""
    q, k, v = random_inputs(1, 2, 40, 32, 24, device=device, seed=3, requires_grad=True)
    half = [x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    for setting in (*SETTINGS, "highest"):
        matmul_precision(setting)
        for inputs, expected in ((q, k, v), expected_precision(family, setting)), (half, "tf32"):
            with recorded_launches(family) as launches:
                o, _ = family._run_validated(*inputs)
                o.sum().backward()
            assert launches, "no launch was recorded"
            assert {kwargs["FLOAT32_PRECISION"] for _, kwargs in launches
                    if "FLOAT32_PRECISION" in kwargs} == {expected}, (setting, inputs[0].dtype)


@pytest.mark.parametrize("family", [chunked, scan], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("normalized", [False, True], ids=["plain", "normalized"])
def test_float32_backward_is_fused_under_tf32_only(family, normalized, matmul_precision, device):
    """float32 heads up to 64 wide: under "high" and "medium" (one TF32 product) the backward is
    the one fused launch, under "highest" the passes, which keep the split or 3xTF32."""
    q, k, v, s0 = random_inputs(1, 2, 40, 32, 24, device=device, seed=4, initial_state=True, requires_grad=True)
    if normalized:
        q, k = (x.detach().abs().requires_grad_() for x in (q, k))
        s0 = torch.cat([s0.detach(), torch.rand(1, 2, 32, 1, device=device)], dim=-1).requires_grad_()
    run = family._run_normalized_validated if normalized else family._run_validated
    name = family.__name__.rsplit(".", 1)[-1]
    for setting in (*SETTINGS, "high"):
        matmul_precision(setting)
        with recorded_launches(family) as launches:
            o, state = run(q, k, v, s0, *((1e-6,) if normalized else ()))
            torch.autograd.backward((o, state), (torch.ones_like(o), torch.ones_like(state)))
        names = [launched for launched, _ in launches]
        assert names.count(f"{name}_backward_kernel") == (setting != "highest"), (setting, names)
        if family is chunked:  # the forward, and without the fused launch the three passes
            assert names.count("chunked_kernel") == (4 if setting == "highest" else 1), (setting, names)


def test_chunked_float32_configs_are_tensor_core_tiles():
    """Tensor-core precisions need tensor-core tiles: chunks and value blocks of at least 32 up to
    D = 128, as the 16-bit configs, within the nominal shared memory; one rule serves 3xTF32
    and TF32."""
    for D, E in ((16, 16), (64, 64), (128, 128), (100, 200), (256, 256)):
        for precision in ("tf32x3", "tf32"):
            config = chunked.default_config(D, E, torch.float32, precision=precision)
            assert config["CHUNK"] >= 32 or D > 128, (D, E, config)
            assert config["BLOCK_E"] >= 32, (D, E, config)
            assert chunked._shared_memory_estimate(chunked._block(D), config, torch.float32) \
                <= chunked._NOMINAL_LIMITS[1]


def test_scan_under_tf32_takes_whole_value_heads_past_d_64():
    """scan's TF32 tiles from D = 65 to 128: up to 128 value columns; chunks of 16 on 4 warps
    where E is as wide, else chunks of 32 (8 warps past 8192 state entries)."""
    assert scan._default_blocks(128, 128, torch.float32, "tf32") == {
        "CHUNK": 16, "BLOCK_E": 128, "num_warps": 4, "num_stages": 2}
    assert scan._default_blocks(128, 64, torch.float32, "tf32")["num_warps"] == 4
    assert scan._default_blocks(64, 128, torch.float32, "tf32")["CHUNK"] == 32
    assert scan._default_blocks(128, 128, torch.float32, "tf32x3")["BLOCK_E"] == 32


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scan_rule_cuts_the_same_chunks_for_d_by_e_and_e_by_d(dtype, precision):
    """The backward runs scan's products with D and E swapped over the forward's segments, so
    the rule must give (D, E) and (E, D) the same CHUNK."""
    sizes = (1, 16, 33, 64, 65, 100, 128, 129, 200, 256)
    mismatched = [(D, E) for D in sizes for E in sizes
                  if scan._default_blocks(D, E, dtype, precision)["CHUNK"]
                  != scan._default_blocks(E, D, dtype, precision)["CHUNK"]]
    assert not mismatched, f"CHUNK differs between (D, E) and (E, D) at {mismatched}"


def test_tf32_takes_whole_value_heads_past_d_64_and_3xtf32_does_not():
    """TF32 tiles hold half of 3xTF32's registers: from D = 65 to 128 a program takes up to 128
    value columns (q and k read once per head), on 8 warps once the state passes 64 registers a
    thread; 3xTF32 keeps 64 columns there. Few heads still narrow the blocks to fill the GPU."""
    assert chunked.default_config(128, 128, torch.float32, precision="tf32")["BLOCK_E"] == 128
    assert chunked.default_config(128, 128, torch.float32, precision="tf32")["num_warps"] == 8
    assert chunked.default_config(128, 64, torch.float32, precision="tf32")["num_warps"] == 4
    assert chunked.default_config(128, 128, torch.float32, precision="tf32x3")["BLOCK_E"] == 64
    assert chunked.default_config(64, 128, torch.float32, precision="tf32")["BLOCK_E"] == 64
    assert chunked.default_config(128, 128, torch.float32, heads=32, multiprocessors=132,
                                  precision="tf32")["BLOCK_E"] == 32


@pytest.mark.parametrize("setting", SETTINGS)
def test_chunked_launches_the_rule_of_the_setting(setting, matmul_precision, device):
    matmul_precision(setting)
    B, H, T, D, E = 1, 2, 70, 64, 64
    q, k, v = random_inputs(B, H, T, D, E, device=device, seed=4)
    with recorded_launches(chunked) as launches:
        chunked._run_validated(q, k, v)
    ((_, kwargs),) = launches
    multiprocessors, shared_memory = chunked._device_limits(q.device)
    rule = chunked.default_config(D, E, torch.float32, heads=B * H,
                                  multiprocessors=None if ttx_tutorial.INTERPRETED else multiprocessors,
                                  shared_memory=shared_memory, precision=EXPECTED_PRECISION[setting])
    assert {key: kwargs[key] for key in rule} == rule
    assert kwargs["FLOAT32_PRECISION"] == expected_products(setting, 64, rule["BLOCK_E"], rule["CHUNK"],
                                                            (B, H, T, D, E))


@pytest.mark.parametrize("family", [chunked, scan], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_highest_splits_where_the_tile_is_right_and_keeps_3xtf32_elsewhere(family, matmul_precision, monkeypatch,
                                                                          device):
    """Under "highest" with the split (chunked's default, scan's opt-in) a plain product's float32
    launches, forward and backward, take the split into bfloat16 parts on a 64 x 64 tile and
    3xTF32 on the 64-row, 32-column tile of 64-token chunks (where Triton 3.6 compiles the split
    wrong for sm_90); the normalised attention keeps 3xTF32 on both. Both within float32's
    tolerance."""
    matmul_precision("highest")
    monkeypatch.setitem(family.FLOAT32_PRECISIONS, "highest", "bf16x3_manual")
    q, k, v = random_inputs(1, 2, 150, 64, 64, device=device, seed=6, requires_grad=True)
    grad_o = torch.randn_like(v)
    _, _, ref_grads = reference_gradients(q, k, v, None, grad_o, torch.zeros(1, 2, 64, 64))
    for block_e, expected in ((64, "bf16x3_manual"), (32, "tf32x3")):
        config = {"BLOCK_E": block_e, "CHUNK": 64}
        if family is scan:
            config["SEGMENT_LEN"] = 64
        for normalized in (False, True):
            entry = family._run_normalized_validated if normalized else family._run_validated
            for x in (q, k, v):
                x.grad = None
            with recorded_launches(family) as launches:
                o, _ = entry(q, k, v, None, *((1e-6,) if normalized else ()), config)
                o.backward(grad_o)
            products = {kwargs["FLOAT32_PRECISION"] for _, kwargs in launches if "FLOAT32_PRECISION" in kwargs}
            assert products == {"tf32x3" if normalized else expected}, (block_e, normalized, products)
            if not normalized:
                for name, x in (("q", q), ("k", k), ("v", v)):
                    assert_close(x.grad, ref_grads[name], torch.float32, f"d{name} at BLOCK_E {block_e}")


def test_both_files_split_on_the_same_measured_tiles_and_not_where_triton_is_wrong():
    """The split's tiles are data measured on a GPU, the same in both files (their kernels failed
    alike); the 64-row tiles of 16 and 32 columns at 64 tokens, wrong under Triton 3.6, are not
    among them."""
    assert chunked.SPLIT_TILES == scan.SPLIT_TILES
    assert chunked.SPLIT_MIN_ELEMENTS == scan.SPLIT_MIN_ELEMENTS
    for tile in ((64, 32, 64), (64, 16, 64)):
        assert not chunked.split_is_right(*tile) and not scan.split_is_right(*tile)
    assert chunked.split_is_right(64, 64, 64) and scan.split_is_right(128, 32, 32)


@pytest.mark.parametrize("family", [chunked, scan], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_highest_keeps_3xtf32_for_outputs_too_small_for_the_split(family, matmul_precision, monkeypatch, device):
    """The split's error, about 6e-6 an element, can pass 1e-5 in the norm over a few dozen
    elements: under "highest" with the split (chunked's default, scan's opt-in) a call whose
    smallest output (here the states, 2 x 16 x 24 = 768 elements, or dq's) has fewer than 1024
    elements takes 3xTF32 in every launch; one with 32-wide heads (1024 and more) takes the
    split. The decision is the forward's and the backward's alike."""
    matmul_precision("highest")
    monkeypatch.setitem(family.FLOAT32_PRECISIONS, "highest", "bf16x3_manual")
    for D, expected in ((16, "tf32x3"), (32, "bf16x3_manual")):
        q, k, v = random_inputs(1, 2, 80, D, 24, device=device, seed=7, requires_grad=True)
        with recorded_launches(family) as launches:
            o, _ = family._run_validated(q, k, v)
            o.sum().backward()
        products = {kwargs["FLOAT32_PRECISION"] for _, kwargs in launches if "FLOAT32_PRECISION" in kwargs}
        assert products == {expected}, (D, products)
    assert family.split_is_accurate(torch.empty(1, 2, 1, 5), torch.empty(1, 2, 1, 7), 1) is False


def float32_products(launches):
    return {kwargs["FLOAT32_PRECISION"] for _, kwargs in launches if "FLOAT32_PRECISION" in kwargs}


@pytest.mark.parametrize("seed", [0, 1])
def test_a_product_divided_by_its_ones_column_keeps_3xtf32(seed, matmul_precision, device):
    """causal_linear_attention normalises packed sequences through chunked by a column of ones
    appended to v, and PyTorch divides by the product's last column: its dq cancels as the
    kernels' normalised launches' does (under the split 5.3e-5 and 5.5e-5 against float64 on
    these two draws). So every float32 launch of that call, forward and backward, takes 3xTF32 and
    dq, dk, dv stay within float32's tolerance; the same call unnormalised takes the split."""
    matmul_precision("highest")
    offsets = torch.tensor([0, 100, 230], device=device)
    q, k, v = random_inputs(1, 2, 230, 32, 32, device=device, seed=seed, requires_grad=True)
    grad_out = torch.randn_like(v)
    for normalize, expected in ((True, {"tf32x3"}), (False, {"bf16x3_manual"})):
        for x in (q, k, v):
            x.grad = None
        with recorded_launches(chunked) as launches, poisoned_allocations():
            out = ttx_tutorial.causal_linear_attention(q, k, v, method="chunked", normalize=normalize,
                                                       cu_seqlens=offsets)
            out.backward(grad_out)
        assert float32_products(launches) == expected, normalize
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected_out = ttx_tutorial.causal_linear_attention(*leaves, method="quadratic", cu_seqlens=offsets)
    expected_out.backward(grad_out.double())
    out = ttx_tutorial.causal_linear_attention(q, k, v, method="chunked", cu_seqlens=offsets)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_close(out, expected_out, torch.float32, "out")
    for name, grad, leaf in zip("qkv", grads, leaves):
        assert_close(grad, leaf.grad, torch.float32, f"d{name}")


@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_the_operator_keeps_3xtf32_for_a_product_it_is_told_is_divided(method, matmul_precision, monkeypatch,
                                                                       device):
    """Under torch.compile the product with a ones column is ``ttx_tutorial::causal_product``
    with ``normalized=True``: its forward and its backward operator launch 3xTF32, where the
    same operator unmarked takes the split (scan's opt-in: under the interpreter only, since a
    GPU stopped on it here, see scan's kernel file)."""
    matmul_precision("highest")
    module = {"chunked": chunked, "scan": scan}[method]
    if module is scan:
        if not ttx_tutorial.INTERPRETED:
            pytest.skip("scan's split is an opt-in that stopped on an illegal memory access on a GPU")
        monkeypatch.setitem(scan.FLOAT32_PRECISIONS, "highest", "bf16x3_manual")
    q, k, v = random_inputs(1, 2, 96, 32, 32, device=device, seed=9, requires_grad=True)
    for normalized, expected in ((True, {"tf32x3"}), (False, {"bf16x3_manual"})):
        with recorded_launches(module) as launches:
            o, _ = ttx_tutorial.ops.causal_product_op(q, k, v, None, method, None, normalized)
            o.sum().backward()
        assert float32_products(launches) == expected, normalized


@pytest.mark.parametrize("setting", SETTINGS)
def test_scan_launches_the_rule_of_the_setting(setting, matmul_precision, device):
    matmul_precision(setting)
    B, H, T, D, E = 1, 1, 300, 64, 64
    q, k, v = random_inputs(B, H, T, D, E, device=device, seed=5)
    with recorded_launches(scan) as launches:
        scan._run_validated(q, k, v, config={"SEGMENT_LEN": 128})
    rule = scan._default_blocks(D, E, torch.float32, SCAN_EXPECTED_PRECISION[setting])
    assert [name for name, _ in launches] == ["scan_summaries_kernel", "scan_outputs_kernel"]
    for _, kwargs in launches:
        assert kwargs["CHUNK"] == rule["CHUNK"] and kwargs["BLOCK_E"] == rule["BLOCK_E"]
        assert kwargs["num_warps"] == rule["num_warps"] and kwargs["num_stages"] == rule["num_stages"]


# (B, H, T, D, E, with initial state): several 64- and 32-token chunks with a partial last one;
# D and E across the 64 and 128 boundaries of the rules (the last: TF32's whole value heads).
SHAPES = [(1, 2, 150, 64, 64, True), (2, 1, 75, 100, 40, False), (1, 1, 70, 120, 100, True)]


@pytest.mark.parametrize("method", ["chunked", "scan"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + ("-S0" if s[5] else ""))
def test_results_within_float32_tolerance_under_every_setting(shape, setting, method, matmul_precision,
                                                              device):
    """The wrapper's own rule (the new float32 tiles), forward and every gradient, against
    float64, with NaN-poisoned outputs. Under the interpreter float32 products are exact for
    every setting, so float32's tolerance holds for all three."""
    matmul_precision(setting)
    B, H, T, D, E, with_state = shape
    q, k, v, s0 = random_inputs(B, H, T, D, E, device=device, seed=10 * SHAPES.index(shape) + SETTINGS.index(setting),
                                initial_state=True, requires_grad=True)
    s0 = s0 if with_state else None
    grad_o = torch.randn(B, H, T, E, device=device)
    grad_state = torch.randn(B, H, D, E, device=device)
    with poisoned_allocations():
        o, state = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)
        torch.autograd.backward((o, state), (grad_o, grad_state))
    ref_o, ref_state, ref_grads = reference_gradients(q, k, v, s0, grad_o, grad_state)
    tolerance = TOLERANCES[torch.float32] if ttx_tutorial.INTERPRETED or setting == "highest" else TF32_TOLERANCE
    for name, value, expected in (("o", o, ref_o), ("S_T", state, ref_state),
                                  *((name, x.grad, ref_grads[name]) for name, x in
                                    (("q", q), ("k", k), ("v", v), ("initial_state", s0)) if x is not None)):
        error = relative_error(value, expected)
        assert error <= tolerance, f"{method} {setting} {name}: relative error {error:.2e} above {tolerance:.0e}"


# Why 3xTF32 adds each chunk's state product in rounded float32: ``tensor_core_dot`` emulates
# the tensor cores' float32 arithmetic in float64 (see ttx_tutorial/testing.py). It reproduces
# the 1.5e-3 error of fla's TF32 chunk at the benchmark's head size.

def _emulated_chunked(q, k, v, chunk, precision, rounded_state):
    T, D = q.shape
    E = v.shape[1]
    state, o = torch.zeros(D, E), torch.empty(T, E)
    visible = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    for start in range(0, T, chunk):
        q_c, k_t, v_c = q[start:start + chunk], k[start:start + chunk].T.contiguous(), v[start:start + chunk]
        scores = torch.where(visible, tensor_core_dot(q_c, k_t, torch.zeros(chunk, chunk), precision), 0.0)
        o_c = tensor_core_dot(q_c, state, torch.zeros(chunk, E), precision)
        o[start:start + chunk] = tensor_core_dot(scores, v_c, o_c, precision)
        if rounded_state:
            state = state + tensor_core_dot(k_t, v_c, torch.zeros(D, E), precision)
        else:
            state = tensor_core_dot(k_t, v_c, state, precision)
    return o


def test_emulated_3xtf32_needs_the_state_added_in_rounded_float32():
    """32 chunks of 64 tokens at D = E = 64: accumulated inside the tensor core, 3xTF32's three
    truncating additions a chunk bias the state past float32's tolerance; added in rounded
    float32, the error stays far below it. TF32 alone errs near 1e-3."""
    T, D, chunk = 2048, 64, 64
    q, k, v = random_inputs(1, 1, T, D, seed=21, device="cpu")  # an emulation: CPU arithmetic
    q, k, v = q[0, 0], k[0, 0], v[0, 0]
    expected = (q.double() @ k.double().T).tril() @ v.double()
    errors = {(precision, rounded): relative_error(_emulated_chunked(q, k, v, chunk, precision, rounded), expected)
              for precision, rounded in (("tf32x3", True), ("tf32x3", False), ("tf32", False))}
    assert errors["tf32x3", True] <= TOLERANCES[torch.float32] / 5, errors
    # The truncation bias is systematic (it grows with the additions, not with the seed).
    assert errors["tf32x3", False] > max(TOLERANCES[torch.float32], 5 * errors["tf32x3", True]), errors
    assert 1e-4 < errors["tf32", False] <= TF32_TOLERANCE, errors


#: 3xTF32's own error on the kernels' outputs (about 1e-6 for o, 3e-7 for S_T at 64 chunks of
#: 64 tokens), well inside float32's 1e-5: a quarter of that tolerance.
TF32X3_KERNEL_TOLERANCE = 2.5e-6


@pytest.mark.parametrize("family", [chunked, scan], ids=["chunked", "scan"])
def test_3xtf32_kernels_add_each_chunks_state_product_in_rounded_float32(family, matmul_precision, monkeypatch,
                                                                          device):
    """The kernels themselves, on tensor cores (in CPU mode emulated), under 3xTF32 over 4096
    tokens of one head, D = E = 64: o and S_T within ``TF32X3_KERNEL_TOLERANCE``. With the
    states accumulated inside the tensor core instead (``_add_product`` without its rounded
    addition), the emulation gives chunked 2.7e-5 / 3.8e-5 and scan 4.3e-6 / 5.8e-6."""
    matmul_precision("highest")
    monkeypatch.setitem(family.FLOAT32_PRECISIONS, "highest", "tf32x3")
    q, k, v = random_inputs(1, 1, 4096, 64, 64, device=device, seed=21)
    expected_o, expected_state = reference(q, k, v, device=device)
    with poisoned_allocations(), emulated_tensor_cores():
        o, state = ttx_tutorial.causal_product(q, k, v, family.__name__.rsplit(".", 1)[-1], return_state=True)
    for name, value, expected in (("o", o, expected_o), ("S_T", state, expected_state)):
        error = relative_error(value, expected)
        assert error <= TF32X3_KERNEL_TOLERANCE, f"{name}: relative error {error:.2e}"


def test_emulated_bfloat16_split_is_within_float32_tolerance_but_coarser_than_3xtf32():
    """Triton's other split, ``input_precision="bf16x3"`` (two bfloat16 parts of 8 significand
    bits each, three products at twice TF32's rate): its 16 bits leave an error several times
    3xTF32's (21 + 11 bits), within float32's tolerance at the same chunks. (The kernels keep
    3xTF32 for "highest": Triton 3.6 compiled some bfloat16-split tiles wrongly on an H200,
    see benchmarks/NOTES.md.)"""
    T, D, chunk = 2048, 64, 64
    q, k, v = random_inputs(1, 1, T, D, seed=21, device="cpu")
    q, k, v = q[0, 0], k[0, 0], v[0, 0]
    expected = (q.double() @ k.double().T).tril() @ v.double()
    split = relative_error(_emulated_chunked(q, k, v, chunk, "bf16x3", True), expected)
    three_tf32 = relative_error(_emulated_chunked(q, k, v, chunk, "tf32x3", True), expected)
    assert 3 * three_tf32 < split <= TOLERANCES[torch.float32], (split, three_tf32)


@pytest.mark.parametrize("family", ["chunked", "scan"])
def test_bfloat16_split_by_hand_is_within_float32_tolerance_and_splits(family, monkeypatch, device):
    """``BF16X3_MANUAL``, the kernel files' own split of float32 operands into two bfloat16 parts
    ("highest"'s products, and a kind benchmarks/float32_sweep.py times): every launch receives
    it, and the forward, the final state and every gradient are within float32's tolerance
    against float64, yet coarser than 3xTF32 on the same inputs (16 significand bits against
    3xTF32's 21 + 11): a kernel that ignored the split, or kept one bfloat16 part, fails. scan
    takes 64-token segments, so that its pass over the segments' summaries has programs;
    chunked 64-column value blocks, which a GPU would narrow for 2 heads to a tile where the
    split gives way to 3xTF32."""
    module = {"chunked": chunked, "scan": scan}[family]
    config = {"SEGMENT_LEN": 64} if family == "scan" else {"BLOCK_E": 64}
    entry = getattr(module, f"{family}_causal_product")
    q, k, v, s0 = random_inputs(1, 2, 165, 64, device=device, seed=13, initial_state=True, requires_grad=True)
    grad_o, grad_state = torch.randn_like(v), torch.randn_like(s0)
    _, _, ref_grads = reference_gradients(q, k, v, s0, grad_o, grad_state)
    ref_o, ref_state = reference(q, k, v, s0, device=device)
    errors = {}
    for products in ("tf32x3", "bf16x3_manual"):
        monkeypatch.setitem(module.FLOAT32_PRECISIONS, "highest", products)
        for x in (q, k, v, s0):
            x.grad = None
        with poisoned_allocations(), recorded_launches(module) as launches:
            o, state = entry(q, k, v, s0, config=config)
            torch.autograd.backward((o, state), (grad_o, grad_state))
        assert {kw["FLOAT32_PRECISION"] for _, kw in launches if "FLOAT32_PRECISION" in kw} == {products}
        errors[products] = {"o": relative_error(o, ref_o), "S_T": relative_error(state, ref_state),
                            **{name: relative_error(x.grad, ref_grads[name])
                               for name, x in (("q", q), ("k", k), ("v", v), ("initial_state", s0))}}
    for name, error in errors["bf16x3_manual"].items():
        assert 3 * errors["tf32x3"][name] < error <= TOLERANCES[torch.float32], (name, errors)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_emulated_tensor_cores_compute_tl_dot_as_a_gpu(precision, device, benchmark_script):
    """Notebook 04's float32 product, 64 x 64 x 64 standard normals, through the kernel that
    recorded the H200's figures (benchmarks/gpu_check.py): under the interpreter with
    ``emulated_tensor_cores`` tl.dot gives ``tensor_core_dot``'s result to the bit, with the error
    an H200 recorded for the same product on its own draw (TF32 7.6e-4 against 7.5e-4 to 8.0e-4
    over 20 draws here, where operands rounded instead of cut would give 3e-4; 3xTF32 1.9e-7
    against 2.2e-7 to 2.4e-7), and outside the block plain float32 again. On a GPU, the tensor
    cores' own result against the emulation of the same inputs."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=generator), torch.randn(64, 64, generator=generator)
    emulated = tensor_core_dot(a, b, torch.zeros(64, 64), precision)
    expected = a.double() @ b.double()
    c = torch.full((64, 64), math.nan, device=device)
    dot_kernel = benchmark_script("gpu_check")._dot_kernel
    with emulated_tensor_cores():
        dot_kernel[(1,)](a.to(device), b.to(device), c, 64, 64, 64, precision)
    if not ttx_tutorial.INTERPRETED:
        # within float32's rounding of the sums; TF32 operands rounded instead of cut differ by 8e-4
        assert relative_error(c, emulated) <= 1e-6, relative_error(c, emulated)
        return
    assert torch.equal(c, emulated)
    _, rows = rows_of_one_recording(load_recorded("h200"), part="precision")
    recorded = {row["impl"]: row["rel_err"] for row in rows}[f"dot_precision_{precision}"]
    error = relative_error(c, expected)
    assert (0.9 * recorded <= error <= 1.1 * recorded) if precision == "tf32" else \
        (recorded / 1.5 <= error <= 1.5 * recorded), (error, recorded)
    dot_kernel[(1,)](a, b, c, 64, 64, 64, precision)
    assert relative_error(c, expected) < 2e-7


#: The normalised attention's dq under TF32 products: its two terms cancel, which magnifies the
#: operands' error. At (1, 2, 200, 64) over 20 draws with emulated tensor cores it erred by 7.7e-3
#: at the median and 9.1e-3 at worst (chunked; scan 8.0e-3 and 1.0e-2), o, dk and dv by at
#: most 1.3e-3. float16's normalised launches take the same TF32 products.
TF32_NORMALISED_DQ_TOLERANCE = 2e-2


@pytest.mark.parametrize("normalized", [False, True], ids=["plain", "normalised"])
@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_high_stays_within_tf32_tolerance_on_tensor_cores(method, normalized, matmul_precision, device):
    """float32 under "high" against float64, forward and every gradient, with TF32 products: on a
    GPU's tensor cores, or under the interpreter emulating them. Above 1e-4, so the products
    really are TF32's; within ``TF32_TOLERANCE``, except the normalised dq (see
    ``TF32_NORMALISED_DQ_TOLERANCE``). NaN-poisoned outputs."""
    matmul_precision("high")
    q, k, v = random_inputs(1, 2, 200, 64, 64, device=device, seed=31 + normalized, requires_grad=True)[:3]
    grad_o = torch.randn_like(v)
    with poisoned_allocations(), emulated_tensor_cores():
        if normalized:
            o = ttx_tutorial.causal_linear_attention(q, k, v, method=method)
        else:
            o = ttx_tutorial.causal_product(q, k, v, method)
        o.backward(grad_o)
    expected_leaves = [x.detach().to("cpu", torch.float64).requires_grad_() for x in (q, k, v)]
    if normalized:
        expected = ttx_tutorial.causal_linear_attention(*expected_leaves, method="quadratic")
    else:
        expected = ttx_tutorial.causal_product(*expected_leaves, "quadratic")
    expected.backward(grad_o.cpu().double())
    for name, value, reference_value in (("o", o, expected),
                                         *((f"d{name}", x.grad, y.grad) for name, x, y in
                                           zip("qkv", (q, k, v), expected_leaves))):
        error = relative_error(value, reference_value)
        limit = TF32_NORMALISED_DQ_TOLERANCE if normalized and name == "dq" else TF32_TOLERANCE
        assert 1e-4 < error <= limit, f"{method} {name}: relative error {error:.2e}, expected in (1e-4, {limit:.0e}]"


# On the GPU: tensor cores really round. (B, H, T, D): the main benchmark's head sizes, and a
# long sequence (1024 chunks of 64 tokens) where a truncating accumulation of the state would
# show as a bias that grows with T.
GPU_SHAPES = [(2, 4, 4096, 64), (1, 4, 4096, 128), (1, 2, 65536, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["chunked", "scan"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_highest_keeps_float32_accuracy_and_high_takes_tf32(shape, method, matmul_precision):
    q, k, v = random_inputs(*shape, device="cuda", seed=11)
    ref_o, ref_state = reference(q, k, v, device="cuda")
    errors = {}
    for setting in ("highest", "high"):
        matmul_precision(setting)
        with poisoned_allocations():
            o, state = ttx_tutorial.causal_product(q, k, v, method, return_state=True)
        errors[setting] = relative_error(o, ref_o), relative_error(state, ref_state)
    assert max(errors["highest"]) <= TOLERANCES[torch.float32], errors
    assert max(errors["high"]) <= TF32_TOLERANCE, errors


#: (D, E) pairs whose tiles cover what the float32 rules give chunked and scan: 16 to 256 state
#: rows, 16 to 128 value columns, chunks of 32 and 64, forward and (D and E swapped) backward.
SPLIT_TILE_SHAPES = [(16, 16), (16, 64), (32, 32), (40, 72), (64, 16), (64, 32), (64, 64), (64, 128),
                     (128, 64), (100, 100), (200, 64)]


@pytest.mark.parametrize("value_block", [None, 64], ids=["rule", "BLOCK_E64"])
@pytest.mark.parametrize("method", ["chunked", "scan"])
@pytest.mark.parametrize("shape", SPLIT_TILE_SHAPES, ids=lambda s: f"D{s[0]}-E{s[1]}")
def test_highest_is_within_float32_tolerance_on_every_tile(shape, method, value_block, matmul_precision, device):
    """Under "highest" every chunked launch takes the split into bfloat16 parts unless
    ``split_is_right`` or ``split_is_accurate`` says no, and the compiler gets some tiles wrong
    (errors near 1 or inf on 64 x 32 tiles of 64-token chunks with Triton 3.6); scan takes
    3xTF32: forward, final state and every gradient within float32's tolerance on tiles of both
    rules, with 2 heads (chunked's value blocks narrowed to fill the GPU) and with chunked's
    64-column blocks (as with many heads). In CPU mode, with the tensor cores emulated, the same
    checks the arithmetic (the split's truncating sums included), not the compiler."""
    if method == "scan" and value_block is not None:
        pytest.skip("scan's rule does not narrow its blocks")
    matmul_precision("highest")
    D, E = shape
    module = {"chunked": chunked, "scan": scan}[method]
    config = {"BLOCK_E": value_block} if value_block else {}
    if method == "scan":
        config["SEGMENT_LEN"] = 128 if max(D, E) <= 64 else 64
    q, k, v, s0 = random_inputs(1, 2, 160, D, E, device=device, seed=D + E, initial_state=True, requires_grad=True)
    grad_o, grad_state = torch.randn_like(v), torch.randn_like(s0)
    with poisoned_allocations(), emulated_tensor_cores():
        o, state = getattr(module, f"{method}_causal_product")(q, k, v, s0, config=config)
        torch.autograd.backward((o, state), (grad_o, grad_state))
    ref_o, ref_state, ref_grads = reference_gradients(q, k, v, s0, grad_o, grad_state)
    for name, value, expected in (("o", o, ref_o), ("S_T", state, ref_state),
                                  *((name, x.grad, ref_grads[name]) for name, x in
                                    (("q", q), ("k", k), ("v", v), ("initial_state", s0)))):
        assert_close(value.cpu(), expected, torch.float32, f"{method} D={D} E={E} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_highest_gradients_keep_float32_accuracy(method, matmul_precision):
    matmul_precision("highest")
    q, k, v, s0 = random_inputs(2, 2, 2048, 64, device="cuda", seed=12, initial_state=True, requires_grad=True)
    grad_o = torch.randn_like(v)
    grad_state = torch.randn_like(s0)
    o, state = ttx_tutorial.causal_product(q, k, v, method, initial_state=s0, return_state=True)
    torch.autograd.backward((o, state), (grad_o, grad_state))
    _, _, ref_grads = reference_gradients(q, k, v, s0, grad_o, grad_state)
    for name, x in (("q", q), ("k", k), ("v", v), ("initial_state", s0)):
        assert_close(x.grad.cpu(), ref_grads[name], torch.float32, f"d{name}")



def test_float32_sweep_runs_on_a_tiny_shape(tmp_path, benchmark_script):
    """benchmarks/float32_sweep.py on one tiny shape under "highest": every rule's row timed, and
    every candidate's unless the wrapper refuses its config by name (on a GPU, 8 warps of a 16 x 16
    tile), each timed row with its error (forward, or the gradients) within float32's tolerance;
    the JSON written."""
    sweep = benchmark_script("float32_sweep")
    out = tmp_path / "sweep.json"
    assert sweep.main(["--shapes", "1,1,17,16", "--settings", "highest", "--out", str(out)]) == 0
    ours = [row for row in json.loads(out.read_text())["rows"] if row["setting"] == "highest"]
    assert {(row["impl"], row["mode"]) for row in ours} == {
        (impl, mode) for impl in ("chunked", "scan", "recurrent") for mode in ("fwd", "fwd+bwd")}
    assert any(isinstance(row["config"], dict) and row["ms"] is not None for row in ours), \
        "no candidate config was timed"
    for row in ours:
        if row["config"] != "rule" and row["ms"] is None:
            assert row["note"].startswith("failed: ValueError: config "), row
            continue
        assert row["ms"] is not None and row["rel_err"] <= TOLERANCES[torch.float32], row


def test_float32_sweep_times_the_candidates_it_is_given(tmp_path, benchmark_script):
    """``--candidates`` replaces the built-in chunked configs: exactly the given one is timed,
    within float32's tolerance; a list with a missing key is refused by name."""
    sweep = benchmark_script("float32_sweep")
    given = {"BLOCK_E": 16, "CHUNK": 16, "num_warps": 2, "num_stages": 1}
    out = tmp_path / "sweep.json"
    assert sweep.main(["--shapes", "1,1,17,16", "--settings", "highest", "--candidates", json.dumps([given]),
                       "--out", str(out)]) == 0
    configs = [row["config"] for row in json.loads(out.read_text())["rows"]
               if row["impl"] == "chunked" and isinstance(row["config"], dict)]
    assert configs == [given, given], configs  # forward and forward+backward
    for row in json.loads(out.read_text())["rows"]:
        if row["config"] == given:
            assert row["ms"] is not None and row["rel_err"] <= TOLERANCES[torch.float32], row
    with pytest.raises(SystemExit):
        sweep.main(["--shapes", "1,1,17,16", "--candidates", '[{"BLOCK_E": 16}]'])


def test_float32_sweep_times_the_bfloat16_split_by_hand(tmp_path, benchmark_script):
    """``--products bf16x3_manual`` times the kernel files' own bfloat16 split under "highest",
    under the interpreter too: chunked's and scan's rows say so and stay within float32's
    tolerance; Triton's own splits, lowered on a GPU only, are refused by name there."""
    sweep = benchmark_script("float32_sweep")
    out = tmp_path / "sweep.json"
    # 32-wide heads: the smallest output (the state, 32 x 32) is large enough for the split, and
    # the candidate's tile (32 x 32, 64 tokens) is one it takes.
    assert sweep.main(["--shapes", "1,1,80,32", "--settings", "highest", "--products", "tf32x3,bf16x3_manual",
                       "--candidates", json.dumps([{"BLOCK_E": 32, "CHUNK": 64, "num_warps": 4, "num_stages": 2}]),
                       "--scan-candidates", json.dumps([{"num_warps": 4}]), "--no-peers", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    split = {(row["impl"], row["mode"], json.dumps(row["config"])): row for row in rows
             if row["products"] == "bf16x3_manual" and row["impl"] != "recurrent"}
    assert {key[:2] for key in split} == {(impl, mode) for impl in ("chunked", "scan") for mode in ("fwd", "fwd+bwd")}
    three_tf32 = {(row["impl"], row["mode"], json.dumps(row["config"])): row["rel_err"] for row in rows
                  if row["products"] == "tf32x3"}
    for key, row in split.items():
        # The split's 16 significand bits err more than 3xTF32's on the same inputs: the rows were
        # made by the split, not by the kernels' default products.
        assert row["ms"] is not None and 3 * three_tf32[key] < row["rel_err"] <= TOLERANCES[torch.float32], row
    if ttx_tutorial.INTERPRETED:
        with pytest.raises(SystemExit):
            sweep.main(["--shapes", "1,1,17,16", "--products", "bf16x3"])


# chunked's transposed TF32 loop (``TRANSPOSED``): float32 under one TF32 product on 128-wide
# key blocks. The interpreter tests below take it on 32-wide keys (``TRANSPOSED_KEY_BLOCKS``
# patched), where its tiles are small enough to run quickly; a spy on ``chunked._transposed``
# makes each test fail if the loop was not taken.

@pytest.fixture
def transposed_on(monkeypatch, matmul_precision):
    """float32 under "high", with the transposed loop on the key blocks given (a frozenset), and a
    list that records every plan's decision (True: the transposed loop)."""
    matmul_precision("high")
    decisions = []
    decide = chunked._transposed

    def spy(*args, **kwargs):
        decisions.append(decide(*args, **kwargs))
        return decisions[-1]

    def switch(blocks):
        monkeypatch.setattr(chunked, "TRANSPOSED_KEY_BLOCKS", frozenset(blocks))
        chunked._launch_plan.cache_clear()  # plans made before hold the blocks they were made with
        return decisions

    monkeypatch.setattr(chunked, "_transposed", spy)
    yield switch
    chunked._launch_plan.cache_clear()


def _plan_keywords(B, H, T, D, E, precision="tf32", normalize=False, dtype=torch.float32, interpreted=False):
    return chunked._launch_plan(B, H, T, D, E, dtype, chunked._NOMINAL_LIMITS, interpreted, precision, (), normalize)[1]


def test_the_transposed_loop_is_taken_for_float32_tf32_on_128_wide_keys_only():
    """Plain launches of float32 under one TF32 product with key blocks of 128; never under 3xTF32
    or the split, for 16-bit inputs, at 64 or 256 (where it ran slower or its products would
    have 32 rows), nor in the normalised forward."""
    assert chunked.TRANSPOSED_KEY_BLOCKS == frozenset({128})
    assert _plan_keywords(8, 16, 4096, 128, 128)["TRANSPOSED"]
    assert _plan_keywords(2, 3, 70, 100, 40)["TRANSPOSED"]
    assert not _plan_keywords(8, 16, 4096, 128, 128, precision="tf32x3")["TRANSPOSED"]
    assert not _plan_keywords(8, 16, 4096, 128, 128, precision="bf16x3_manual")["TRANSPOSED"]
    assert not _plan_keywords(8, 16, 4096, 128, 128, dtype=torch.bfloat16)["TRANSPOSED"]
    assert not _plan_keywords(8, 16, 4096, 64, 64)["TRANSPOSED"]
    assert not _plan_keywords(8, 16, 4096, 256, 256)["TRANSPOSED"]
    assert not _plan_keywords(8, 16, 4096, 128, 128, normalize=True)["TRANSPOSED"]


def test_transposed_value_blocks_of_32_take_64_token_chunks():
    """Few heads narrow the value blocks to 32 columns; with its state in registers the transposed
    loop then takes 64-token chunks (2.9x faster than 32 at (2, 16, 16384, 128) on an H100), on
    4 warps and 3 stages, within the shared memory. Whole heads keep 32-token chunks on 8 warps,
    and a normalising plan, which walks the untransposed loop, keeps 32-token chunks."""
    few_heads = _plan_keywords(2, 16, 16384, 128, 128)
    assert {key: few_heads[key] for key in chunked.CONFIG_KEYS} == {
        "BLOCK_E": 32, "CHUNK": 64, "num_warps": 4, "num_stages": 3}
    many_heads = _plan_keywords(8, 16, 4096, 128, 128)
    assert {key: many_heads[key] for key in chunked.CONFIG_KEYS} == {
        "BLOCK_E": 128, "CHUNK": 32, "num_warps": 8, "num_stages": 3}
    normalizing = _plan_keywords(2, 16, 16384, 128, 128, normalize=True)
    assert (normalizing["BLOCK_E"], normalizing["CHUNK"]) == (32, 32)
    for heads in (1, 32, 128):
        config = chunked.default_config(128, 128, torch.float32, heads=heads, multiprocessors=132, precision="tf32",
                                        transposed=True)
        assert chunked._shared_memory_estimate(128, config, torch.float32, transposed=True) \
            <= chunked._NOMINAL_LIMITS[1]


@pytest.mark.parametrize("case", ["views", "zeros", "packed", "empty"])
def test_the_transposed_loop_matches_float64(case, transposed_on, device):
    """The transposed loop, forward and every gradient (its three backward passes walk it too,
    two in reverse), against float64, with NaN-poisoned outputs: q and v (B, T, H, D) buffers seen
    as (B, H, T, D), from an initial state, with value blocks of 16 columns (two a head); from zeros;
    on packed sequences with an empty one; on sequences of no tokens."""
    decisions = transposed_on({32})
    B, H, T, D, E = (1, 2, 0, 24, 20) if case == "empty" else (2, 2, 83, 24, 20)
    config, cu_seqlens = None, None
    if case == "packed":
        B, cu_seqlens = 1, torch.tensor([0, 30, 30, 2 * T], device=device)
        T = 2 * T
    q, k, v, s0 = random_inputs(B, H, T, D, E, device=device, seed=len(case), initial_state=True)
    if case == "views":
        q, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, v))  # k stays contiguous
        config = {"BLOCK_E": 16}
    if cu_seqlens is not None:
        s0 = torch.randn(3, H, D, E, generator=torch.Generator().manual_seed(5)).to(device)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0)]
    if case == "zeros":
        leaves[3] = None
    grad_o, grad_state = torch.randn_like(v), torch.randn_like(s0)
    with poisoned_allocations():
        o, state = chunked.chunked_causal_product(*leaves, config=config, cu_seqlens=cu_seqlens)
        torch.autograd.backward((o, state), (grad_o, grad_state))
    assert decisions and all(decisions), decisions

    expected = [None if x is None else x.detach().to("cpu", torch.float64).requires_grad_() for x in leaves]
    ref_o, ref_state = quadratic(*expected, cu_seqlens=None if cu_seqlens is None else cu_seqlens.cpu())
    torch.autograd.backward((ref_o, ref_state), (grad_o.cpu().double(), grad_state.cpu().double()))
    tolerance = TOLERANCES[torch.float32] if ttx_tutorial.INTERPRETED else TF32_TOLERANCE
    results = [("o", o, ref_o), ("S_T", state, ref_state),
               *((f"d{name}", x.grad, y.grad) for name, x, y in zip(("q", "k", "v", "S_0"), leaves, expected)
                 if x is not None)]
    for name, value, reference_value in results:
        error = relative_error(value, reference_value)
        assert error <= tolerance, f"{case} {name}: relative error {error:.2e} above {tolerance:.0e}"


def test_the_transposed_loop_sums_the_state_with_a_carry(transposed_on, monkeypatch, device):
    """Past ``COMPENSATED_FROM_CHUNKS`` chunks the transposed loop adds each chunk's V^T K with a
    Kahan carry, as the untransposed one does. Here from the first chunk on: a state of 2**24,
    whose float32 unit in the last place is 2, gets 1 from every chunk (k = 1, v = 1 / CHUNK,
    exact in TF32), which a plain float32 sum rounds away every time (2**24 + 1 is a tie, rounded
    to even); with the carry the final state holds every one."""
    decisions = transposed_on({16})
    monkeypatch.setattr(chunked, "COMPENSATED_FROM_CHUNKS", 0)
    chunks, chunk, D, E = 12, 16, 16, 16
    k = torch.ones(1, 1, chunks * chunk, D, device=device)
    v = torch.full((1, 1, chunks * chunk, E), 1 / chunk, device=device)
    s0 = torch.full((1, 1, D, E), 2.0 ** 24, device=device)
    _, final_state = chunked.chunked_causal_product(k, k, v, s0, config={"CHUNK": chunk, "BLOCK_E": 16})
    assert decisions and all(decisions), decisions
    assert torch.equal(final_state - 2.0 ** 24, torch.full_like(final_state, float(chunks)))


@pytest.mark.parametrize("where", ["v", "k", "S_0"])
def test_the_transposed_loop_keeps_non_finite_values_causal(where, transposed_on, device):
    """An inf late in a chunk of v or k (token 60 of the first 64): the transposed loop, like the
    untransposed one, sees it in its chunk products and redoes the program's tokens one by one, so
    the outputs before it stay finite and exact; value blocks of 16 columns, two a head. An inf in
    S_0 stays inf in every output and in S_T where the recurrence puts it."""
    decisions = transposed_on({32})
    B, H, T, D, E = 1, 2, 100, 24, 20
    q, k, v, s0 = (x.clone() for x in random_inputs(B, H, T, D, E, device=device, seed=7, initial_state=True))
    {"v": v, "k": k, "S_0": s0}[where][0, 1, 60 if where != "S_0" else 3, 5] = math.inf
    with poisoned_allocations():
        o, state = chunked.chunked_causal_product(q, k, v, s0, config={"BLOCK_E": 16})
    assert decisions and all(decisions), decisions
    ref_o, ref_state = cumsum(*(x.cpu().double() for x in (q, k, v, s0)))
    tolerance = TOLERANCES[torch.float32] if ttx_tutorial.INTERPRETED else TF32_TOLERANCE
    for name, value, expected in (("o", o, ref_o), ("S_T", state, ref_state)):
        value = value.cpu().double()
        assert torch.equal(value.isfinite(), expected.isfinite()), f"{where} {name}: non-finite elsewhere than float64"
        assert torch.equal(value.isnan(), expected.isnan()), f"{where} {name}: NaN elsewhere than float64"
        finite = expected.isfinite()
        assert finite.any() and relative_error(value[finite], expected[finite]) <= tolerance, (where, name)
