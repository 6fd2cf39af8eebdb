"""Every bad input to ``causal_product`` gets a clear error that names the argument and the limit.

The errors must come from the validation in ``ttx_tutorial._validation``, before any
implementation runs: a Triton compiler traceback is not a clear error. The
``implementations_unreachable`` fixture turns any call that gets past validation into a
test failure, so these tests hold for the Triton methods without running a kernel. (Each
kernel file's own checks give the same messages: tests/test_reliability.py.)
"""

import dataclasses
import re

import pytest
import torch

import ttx_tutorial
from ttx_tutorial import MAX_HEAD_DIM, METHODS, api, causal_product

TRITON_METHODS = tuple(name for name in METHODS if api.method_info(name).is_triton)

pytestmark = pytest.mark.usefixtures("implementations_unreachable")


@pytest.fixture
def implementations_unreachable(monkeypatch):
    for name, method in api._REGISTRY.items():
        def unreachable(*args, name=name):
            pytest.fail(f"bad input to {name!r} got past validation to its implementation")

        monkeypatch.setitem(api._REGISTRY, name, dataclasses.replace(method, function=unreachable))


def make_inputs(B=2, H=3, T=5, D=4, E=6, dtype=torch.float32, device=None):
    """Valid q, k, v and initial state; each test spoils one of them."""
    device = ttx_tutorial.DEVICE if device is None else device
    q = torch.randn(B, H, T, D, dtype=dtype, device=device)
    k = torch.randn(B, H, T, D, dtype=dtype, device=device)
    v = torch.randn(B, H, T, E, dtype=dtype, device=device)
    s0 = torch.zeros(B, H, D, E, device=device)
    return q, k, v, s0


def raises(error_type, *fragments):
    """pytest.raises that also requires each fragment, literally, in the message."""
    pattern = "".join(f"(?=.*{re.escape(fragment)})" for fragment in fragments)
    return pytest.raises(error_type, match=re.compile(pattern, re.DOTALL))


@pytest.fixture(params=METHODS)
def method(request):
    return request.param


@pytest.mark.parametrize("position", [0, 1, 2], ids=["q", "k", "v"])
@pytest.mark.parametrize("bad", [[[1.0]], None, 3.0], ids=["list", "None", "float"])
def test_non_tensor_input(method, position, bad):
    args = list(make_inputs()[:3])
    args[position] = bad
    name = "qkv"[position]
    with raises(TypeError, f"{name} must be a torch.Tensor", type(bad).__name__):
        causal_product(*args, method)


@pytest.mark.parametrize("position, shape", [
    (0, (3, 5, 4)),          # q without a head axis
    (1, (2, 3, 5, 4, 1)),    # k with one axis too many
    (2, (2, 3, 30)),         # v with T and E flattened together
], ids=["q-3d", "k-5d", "v-3d"])
def test_wrong_rank(method, position, shape):
    args = list(make_inputs()[:3])
    args[position] = torch.randn(*shape)
    name = "qkv"[position]
    with raises(ValueError, f"{name} must have 4 dimensions", str(shape)):
        causal_product(*args, method)


@pytest.mark.parametrize("k_shape", [(1, 3, 5, 4), (2, 2, 5, 4), (2, 3, 4, 4), (2, 3, 5, 3)],
                         ids=["B", "H", "T", "D"])
def test_q_and_k_shapes_differ(method, k_shape):
    q, _, v, _ = make_inputs()
    k = torch.randn(*k_shape, device=q.device)
    with raises(ValueError, "q and k must have the same shape", str(tuple(q.shape)), str(k_shape)):
        causal_product(q, k, v, method)


@pytest.mark.parametrize("v_shape", [(1, 3, 5, 6), (2, 1, 5, 6), (2, 3, 6, 6)], ids=["B", "H", "T"])
def test_v_does_not_share_batch_heads_or_length(method, v_shape):
    q, k, _, _ = make_inputs()
    v = torch.randn(*v_shape, device=q.device)
    with raises(ValueError, "v must share B, H and T with q", str(v_shape)):
        causal_product(q, k, v, method)


@pytest.mark.parametrize("position", [0, 1, 2], ids=["q", "k", "v"])
def test_mixed_dtypes(method, position):
    args = list(make_inputs()[:3])
    args[position] = args[position].half()
    with raises(TypeError, "same dtype", f"{'qkv'[position]} torch.float16", "torch.float32"):
        causal_product(*args, method)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64], ids=str)
def test_non_floating_dtype(method, dtype):
    q, k, v, _ = (x.to(dtype) for x in make_inputs())
    with raises(TypeError, f"method {method!r} supports dtypes", "float32, float16, bfloat16",
                f"q, k, v are {dtype}"):
        causal_product(q, k, v, method)


@pytest.mark.parametrize("triton_method", TRITON_METHODS)
def test_float64_is_for_the_references_only(triton_method):
    q, k, v, _ = make_inputs(dtype=torch.float64)
    with raises(TypeError, f"method {triton_method!r} supports dtypes float32, float16, bfloat16;",
                "q, k, v are torch.float64"):
        causal_product(q, k, v, triton_method)


@pytest.mark.parametrize("position", [0, 1, 2], ids=["q", "k", "v"])
def test_mixed_devices(method, position):
    args = list(make_inputs()[:3])
    args[position] = args[position].to("meta")  # stands in for a second device on any machine
    with raises(ValueError, "same device", f"{'qkv'[position]} on meta", str(ttx_tutorial.DEVICE.type)):
        causal_product(*args, method)


@pytest.mark.parametrize("triton_method", TRITON_METHODS)
def test_triton_method_on_a_device_it_does_not_run_on(triton_method):
    q, k, v, _ = make_inputs(device="meta")
    with raises(ValueError, f"method {triton_method!r} runs on", repr(ttx_tutorial.DEVICE.type),
                "they are on meta", f".to({ttx_tutorial.DEVICE.type!r})"):
        causal_product(q, k, v, triton_method)


@pytest.mark.parametrize("unknown", ["Loop", "flash", ""])
def test_unknown_method_lists_every_method(unknown):
    q, k, v, _ = make_inputs()
    with raises(ValueError, f"unknown method {unknown!r}", *METHODS):
        causal_product(q, k, v, unknown)
    with raises(ValueError, f"unknown method {unknown!r}", *METHODS):
        ttx_tutorial.method_info(unknown)


@pytest.mark.parametrize("not_a_name", [None, 0, ("loop",)], ids=["None", "int", "tuple"])
def test_method_must_be_a_string(not_a_name):
    q, k, v, _ = make_inputs()
    with raises(TypeError, "method must be a string", type(not_a_name).__name__, *METHODS, "'auto'"):
        causal_product(q, k, v, not_a_name)


@pytest.mark.parametrize("state_shape", [(2, 3, 6, 4), (2, 3, 4), (1, 3, 4, 6), (2, 3, 4, 7)],
                         ids=["D-and-E-swapped", "3d", "B", "E"])
def test_initial_state_wrong_shape(method, state_shape):
    q, k, v, _ = make_inputs()
    s0 = torch.zeros(*state_shape, device=q.device)
    with raises(ValueError, "initial_state must have shape (B, H, D, E) = (2, 3, 4, 6)",
                str(state_shape)):
        causal_product(q, k, v, method, initial_state=s0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool], ids=str)
def test_initial_state_not_floating_point(method, dtype):
    q, k, v, s0 = make_inputs()
    with raises(TypeError, "initial_state must be a floating-point tensor", str(dtype)):
        causal_product(q, k, v, method, initial_state=s0.to(dtype))


@pytest.mark.parametrize("bad", [0.0, [[0.0]]], ids=["float", "list"])
def test_initial_state_not_a_tensor(method, bad):
    q, k, v, _ = make_inputs()
    with raises(TypeError, "initial_state must be a torch.Tensor or None", type(bad).__name__):
        causal_product(q, k, v, method, initial_state=bad)


def test_initial_state_on_another_device(method):
    q, k, v, s0 = make_inputs()
    with raises(ValueError, "initial_state must be on the same device as q", str(q.device), "meta"):
        causal_product(q, k, v, method, initial_state=s0.to("meta"))


@pytest.mark.parametrize("D, E", [(0, 4), (4, 0)], ids=["D=0", "E=0"])
def test_empty_head_dimension(method, D, E):
    q, k, v, _ = make_inputs(D=D, E=E)
    with raises(ValueError, "D and E must be at least 1", f"D={D}", f"E={E}"):
        causal_product(q, k, v, method)


@pytest.mark.parametrize("triton_method", TRITON_METHODS)
@pytest.mark.parametrize("D, E", [(MAX_HEAD_DIM + 1, 8), (8, MAX_HEAD_DIM + 1)], ids=["D", "E"])
def test_head_dimension_above_the_kernel_limit(triton_method, D, E):
    q, k, v, _ = make_inputs(B=1, H=1, T=2, D=D, E=E)
    with raises(ValueError, f"method {triton_method!r} supports D and E up to {MAX_HEAD_DIM}",
                f"D={D}", f"E={E}"):
        causal_product(q, k, v, triton_method)


def _bad_calls():
    """One call of each kind above, as (args, kwargs) after ``q, k, v``'s positions: the kernel
    files' own checks must refuse each with the API's message (tests/test_reliability.py)."""
    q, k, v, s0 = make_inputs()
    return {
        "mixed_dtypes": ((q, k.half(), v), {}),
        "int32_inputs": (tuple(x.to(torch.int32) for x in (q, k, v)), {}),
        "int64_inputs": (tuple(x.to(torch.int64) for x in (q, k, v)), {}),
        "float64_inputs": (tuple(x.double() for x in (q, k, v)), {}),
        "k_with_another_D": ((q, k[..., :3], v), {}),
        "v_with_another_T": ((q, k, v[:, :, :4]), {}),
        "q_with_three_dimensions": ((q[0], k, v), {}),
        "D_above_maximum": (make_inputs(B=1, H=1, T=2, D=MAX_HEAD_DIM + 1)[:3], {}),
        "E_above_maximum": (make_inputs(B=1, H=1, T=2, E=MAX_HEAD_DIM + 1)[:3], {}),
        "D_zero": (make_inputs(D=0)[:3], {}),
        "initial_state_of_wrong_shape": ((q, k, v), {"initial_state": s0.mT}),
        "integer_initial_state": ((q, k, v), {"initial_state": s0.to(torch.int32)}),
        "initial_state_not_a_tensor": ((q, k, v), {"initial_state": s0.tolist()}),
        "initial_state_on_another_device": ((q, k, v), {"initial_state": s0.to("meta")}),
        "q_not_a_tensor": ((q.tolist(), k, v), {}),
        "k_on_another_device": ((q, k.to("meta"), v), {}),
        "inputs_on_a_device_the_method_does_not_use": (make_inputs(device="meta")[:3], {}),
    }


BAD_CALLS = _bad_calls()


def test_the_triton_methods_are_registered():
    # Guards the parametrisations above: with no Triton method they would test nothing.
    assert {"recurrent", "chunked", "scan"} <= set(TRITON_METHODS)
