"""The generation step kernel (ttx_tutorial/kernels/step.py) and linear_attention_step on it.

Every output is checked against a float64 step written here, on fresh random inputs, with the
outputs allocated NaN-filled; generation is checked against the parallel forward.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import ttx_tutorial
from ttx_tutorial.kernels import step
from ttx_tutorial.testing import assert_close, poisoned_allocations, random_inputs

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: feature map as passed -> its float64 version
FEATURES = {
    "elu": lambda x: F.elu(x) + 1,
    "relu": F.relu,
    "identity": lambda x: x,
    "softplus": F.softplus,  # a callable: PyTorch maps q and k, the kernel takes them as they are
}


def as_argument(feature):
    return F.softplus if feature == "softplus" else feature


def step64(q, k, v, state, phi, normalize, eps):
    """(out, new state) in float64 from the given tensors, none of them modified."""
    q, k, v, state = (x.detach().to("cpu", torch.float64) for x in (q, k, v, state))
    pq, pk = phi(q), phi(k)
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if normalize else v
    state = state + pk[..., :, None] * values[..., None, :]
    product = torch.einsum("bhd,bhde->bhe", pq, state)
    out = product[..., :-1] / (product[..., -1:] + eps) if normalize else product
    return out, state


def token_inputs(B, H, D, E, dtype, normalize, *, positive=False, seed=None):
    """q, k (B, H, D), v (B, H, E) in ``dtype`` and a float32 state of a few earlier tokens."""
    q, k, v = (x[:, :, 0] for x in random_inputs(B, H, 1, D, E, dtype=dtype, seed=seed))
    if positive:  # a normalised identity map needs positive features
        q, k = q.abs(), k.abs()
    generator = torch.Generator().manual_seed(0 if seed is None else seed)
    state = torch.randn(B, H, D, E + normalize, generator=generator).to(ttx_tutorial.DEVICE)
    if normalize:  # z of earlier tokens: positive sums of positive features
        state[..., -1] = state[..., -1].abs() + 1
    return q, k, v, state


def check_step(feature, normalize, dtype, B=2, H=3, D=20, E=37, eps=1e-6, seed=None):
    q, k, v, state = token_inputs(B, H, D, E, dtype, normalize, positive=feature == "identity", seed=seed)
    expected_out, expected_state = step64(q, k, v, state, FEATURES[feature], normalize, eps)
    pointer = state.data_ptr()
    with torch.no_grad(), poisoned_allocations():
        out = ttx_tutorial.linear_attention_step(q, k, v, state, feature_map=as_argument(feature),
                                                 normalize=normalize, eps=eps)
    assert out.dtype == dtype and out.shape == (B, H, E)
    assert state.data_ptr() == pointer, "the state was replaced, not updated in place"
    # The kernel maps the (exact) inputs in float32, so its state is float32-accurate whatever
    # their dtype; a callable map runs in PyTorch first and rounds phi to the inputs' dtype.
    state_dtype = dtype if feature == "softplus" else torch.float32
    assert_close(state, expected_state, state_dtype, f"{feature} state")
    assert_close(out, expected_out, dtype, f"{feature} output")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature", FEATURES)
def test_step_matches_float64(feature, normalize, dtype):
    check_step(feature, normalize, dtype)


@pytest.mark.parametrize("D, E", [(1, 1), (16, 16), (3, 256), (256, 5), (100, 130), (256, 256)])
@pytest.mark.parametrize("normalize", [True, False])
def test_head_dims_up_to_the_limit(D, E, normalize):
    check_step("elu", normalize, torch.float32, B=1, H=2, D=D, E=E)


def test_bfloat16_at_the_generation_shape():
    check_step("elu", True, torch.bfloat16, B=8, H=16, D=64, E=64)


@pytest.mark.parametrize("D, E, programs_a_head", [(20, 16, 1), (20, 37, 1), (64, 64, 1), (100, 37, 3),
                                                   (20, 256, 16)])
def test_the_last_program_of_a_head_writes_z_and_resets_its_count(D, E, programs_a_head):
    """When normalising, each value block's program reads the old z and the head's last one to
    finish writes the new z (D = 20, and 64 x 64, a head of exactly one tile: its only program
    writes z, no count; D = 100: three blocks of 16 columns for E = 37, sixteen for E = 256):
    token after token, z and the outputs stay right (the state must not gain phi(k) twice or lose it), and
    the counts are back at zero after every launch."""
    assert step._launch_plan(2, 3, D, E, True)[0] == (2 * 3 * programs_a_head,)
    q, k, v, state = token_inputs(2, 3, D, E, torch.float32, True, seed=E)
    expected_state = state
    with torch.no_grad():
        for token in range(3):
            q, k, v, _ = token_inputs(2, 3, D, E, torch.float32, True, seed=E + token + 1)
            expected_out, expected_state = step64(q, k, v, expected_state, FEATURES["elu"], True, 1e-6)
            with poisoned_allocations():
                out = ttx_tutorial.linear_attention_step(q, k, v, state)
            assert_close(state, expected_state, torch.float32, f"state after token {token}")
            assert_close(out, expected_out, torch.float32, f"output of token {token}")
            counts = step._arrivals(state, 2 * 3)
            assert counts.dtype == torch.int32 and torch.equal(counts, torch.zeros_like(counts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "pytorch_path"])
def test_eps_enters_the_denominator(dtype):
    # relu of a negative query is zero: the denominator is eps alone, and out = 0 / eps (0 / 0,
    # NaN, without eps). float64 takes the PyTorch path.
    q, k, v, state = token_inputs(1, 2, 8, 4, torch.float32, True)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    with torch.no_grad():
        out = ttx_tutorial.linear_attention_step(-q.abs() - 1, k, v, state, feature_map="relu", eps=0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_a_large_eps_matches_float64():
    check_step("elu", True, torch.float32, eps=3.0)


def test_state_update_equals_the_pytorch_path():
    """float32 inputs through the kernel, their float64 copies through the PyTorch path: the same
    float32 state afterwards, token after token."""
    kernel_state = token_inputs(2, 3, 24, 24, torch.float32, True)[3]
    torch_state = kernel_state.clone()
    with torch.no_grad():
        for seed in range(4):
            q, k, v, _ = token_inputs(2, 3, 24, 24, torch.float32, True, seed=seed + 1)
            out = ttx_tutorial.linear_attention_step(q, k, v, kernel_state)
            expected = ttx_tutorial.linear_attention_step(q.double(), k.double(), v.double(), torch_state)
            assert expected.dtype == torch.float64  # the PyTorch path ran
            assert_close(kernel_state, torch_state, torch.float32, f"state after token {seed}")
            assert_close(out, expected, torch.float32, f"output of token {seed}")


@pytest.mark.parametrize("dtype, prompt", [(torch.float32, 16), (torch.float32, 13),
                                           (torch.bfloat16, 64), (torch.bfloat16, 50)])
@pytest.mark.parametrize("normalize", [True, False])
def test_generation_equals_the_parallel_forward(dtype, prompt, normalize):
    """Prefill with the chunked kernel (16-token chunks in float32, 64 in 16-bit), then steps."""
    q, k, v = random_inputs(1, 2, prompt + 6, 16, 12, dtype=dtype)
    options = {"normalize": normalize, "method": "chunked"}
    with torch.no_grad():
        whole = ttx_tutorial.causal_linear_attention(q, k, v, **options)
        first, state = ttx_tutorial.causal_linear_attention(q[:, :, :prompt], k[:, :, :prompt],
                                                            v[:, :, :prompt], return_state=True, **options)
        steps = [ttx_tutorial.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, normalize=normalize)
                 for t in range(prompt, q.shape[2])]
    generated = torch.cat([first, torch.stack(steps, dim=2)], dim=2)
    assert_close(generated, whole, dtype, "generated")
    expected = whole.new_empty(whole.shape, dtype=torch.float64, device="cpu")
    running = torch.zeros(1, 2, 16, 12 + normalize, dtype=torch.float64)
    for t in range(q.shape[2]):
        expected[:, :, t], running = step64(q[:, :, t], k[:, :, t], v[:, :, t], running, FEATURES["elu"],
                                            normalize, 1e-6)
    assert_close(generated, expected, dtype, "against float64")


def test_strided_inputs_and_an_empty_batch():
    q, k, v, state = token_inputs(2, 4, 16, 8, torch.float32, True)
    wide = torch.randn(4, 2, 40, device=ttx_tutorial.DEVICE)
    q_view = wide[..., :16].transpose(0, 1)  # (2, 4, 16), strides in every dimension
    k_view = (torch.randn(2, 4, 32, device=ttx_tutorial.DEVICE) / 4)[..., ::2]  # every other element
    v_view = torch.randn(2, 4, 24, device=ttx_tutorial.DEVICE)[..., 1::3]
    expected_out, expected_state = step64(q_view, k_view, v_view, state, FEATURES["elu"], True, 1e-6)
    with torch.no_grad():
        out = ttx_tutorial.linear_attention_step(q_view, k_view, v_view, state)
        empty = ttx_tutorial.linear_attention_step(q[:0], k[:0], v[:0], state[:0])
    assert_close(out, expected_out, torch.float32)
    assert_close(state, expected_state, torch.float32, "state")
    assert empty.shape == (0, 4, 8)


# --------------------------------------------------------------------------- refusals

def bad_inputs():
    q, k, v, state = token_inputs(2, 3, 8, 4, torch.float32, True)
    return {"q": q, "k": k, "v": v, "state": state}


BAD = [
    ({"q": "query"}, TypeError, "q must be a torch.Tensor"),
    ({"q": torch.zeros(2, 3, 1, 8)}, ValueError, r"q must have 3 dimensions \(B, H, D\)"),
    ({"k": torch.zeros(2, 3, 9)}, ValueError, "q and k must have the same shape"),
    ({"v": torch.zeros(2, 4, 4)}, ValueError, "v must share B and H with q"),
    ({"v": torch.zeros(2, 3, 4, dtype=torch.bfloat16)}, TypeError, "must have the same dtype"),
    ({"state": torch.zeros(2, 3, 8, 4)}, ValueError, r"state must have shape \(B, H, D, E \+ 1\)"),
    ({"state": torch.zeros(2, 3, 8, 5, dtype=torch.float64)}, TypeError, "state must be float32"),
    ({"state": torch.zeros(2, 3, 5, 8).mT}, ValueError, "state must be contiguous"),
    ({"feature_map": "tanh"}, ValueError, "feature_map must be one of"),
    ({"feature_map": 3}, ValueError, "feature_map must be one of"),
    ({"normalize": 1}, TypeError, "normalize must be a bool"),
    ({"eps": float("nan")}, ValueError, "eps must be finite"),
    ({"eps": -1.0}, ValueError, "eps must be finite and >= 0, got -1.0"),
    ({"eps": float("inf")}, ValueError, "eps must be finite and >= 0, got inf"),
    ({"eps": "small"}, TypeError, "eps must be a Python float"),
]


@pytest.mark.parametrize("change, error, words", BAD, ids=[words for _, _, words in BAD])
def test_bad_inputs_are_named(change, error, words):
    arguments = {**bad_inputs(), **{name: (value.to(ttx_tutorial.DEVICE) if isinstance(value, torch.Tensor)
                                           else value) for name, value in change.items()}}
    with torch.no_grad(), pytest.raises(error, match=words):
        ttx_tutorial.linear_attention_step(**arguments)
    if "feature_map" not in change:  # the kernel file's own entry says the same
        with torch.no_grad(), pytest.raises(error, match=words):
            step.step_update(**arguments)


def test_heads_wider_than_the_kernel_take_the_pytorch_path():
    """D = 300: the kernel file refuses it by name; ``linear_attention_step`` (and so the layer's
    step, whatever its parallel method) computes it with PyTorch, against float64."""
    q, k, v, state = token_inputs(2, 3, 300, 4, torch.float32, True)
    with torch.no_grad(), pytest.raises(ValueError, match="D and E up to 256"):
        step.step_update(q, k, v, state.clone())
    expected_out, expected_state = step64(q, k, v, state, FEATURES["elu"], True, 1e-6)
    with torch.no_grad():
        out = ttx_tutorial.linear_attention_step(q, k, v, state)
    assert_close(out, expected_out, torch.float32)
    assert_close(state, expected_state, torch.float32, "state")


def test_a_device_the_interpreter_does_not_run_on_is_named():
    if ttx_tutorial.on_gpu():
        pytest.skip("in GPU mode CPU tensors take the PyTorch path")
    arguments = bad_inputs()
    with torch.no_grad(), pytest.raises(ValueError, match="state must be on the same device as q"):
        step.step_update(**{**arguments, "state": arguments["state"].to("meta")})


def test_training_is_refused_with_a_pointer_to_the_parallel_forward():
    arguments = bad_inputs()
    leaf = arguments["q"].clone().requires_grad_()
    for function in (ttx_tutorial.linear_attention_step, step.step_update):
        with pytest.raises(RuntimeError, match="inference only.*causal_linear_attention"):
            function(**{**arguments, "q": leaf})
    with pytest.raises(RuntimeError, match="inference only"):  # the PyTorch path too
        ttx_tutorial.linear_attention_step(**{**{n: x.double() for n, x in arguments.items() if n != "state"},
                                              "q": leaf.double(), "state": arguments["state"]})
    layer = ttx_tutorial.CausalLinearAttention(16, 2).to(ttx_tutorial.DEVICE)
    with pytest.raises(RuntimeError, match="inference only"):  # its weights require grad
        layer.step(torch.randn(2, 16, device=ttx_tutorial.DEVICE), layer.initial_state(2))
    with torch.no_grad():  # the same calls without autograd run
        ttx_tutorial.linear_attention_step(**{**arguments, "q": leaf})
        layer.step(torch.randn(2, 16, device=ttx_tutorial.DEVICE), layer.initial_state(2))


def test_checks_skipped_for_a_known_signature_still_see_what_changes():
    """The second call of a signature skips the full checks, not contiguity or autograd."""
    arguments = bad_inputs()
    with torch.no_grad():
        ttx_tutorial.linear_attention_step(**arguments)
        strided = torch.zeros(2, 3, 5, 8, device=ttx_tutorial.DEVICE).mT
        assert strided.shape == arguments["state"].shape
        with pytest.raises(ValueError, match="state must be contiguous"):
            ttx_tutorial.linear_attention_step(**{**arguments, "state": strided})
    with pytest.raises(RuntimeError, match="inference only"):
        ttx_tutorial.linear_attention_step(**{**arguments, "v": arguments["v"].clone().requires_grad_()})


def test_a_known_signature_does_not_let_an_int_pass_for_a_bool():
    """1 == True: the cached signature holds the options' types too, so normalize=1 stays refused
    after a call with normalize=True, and eps=True after eps=1."""
    arguments = bad_inputs()
    with torch.no_grad():
        ttx_tutorial.linear_attention_step(**arguments, normalize=True)
        with pytest.raises(TypeError, match="normalize must be a bool"):
            ttx_tutorial.linear_attention_step(**arguments, normalize=1)
        ttx_tutorial.linear_attention_step(**arguments, eps=1)
        with pytest.raises(TypeError, match="eps must be a Python float"):
            ttx_tutorial.linear_attention_step(**arguments, eps=True)


@pytest.mark.parametrize("change, error, words", [
    ({"state": torch.zeros(2, 3, 8, 4)}, ValueError, r"state must be float32 \(B, H, D, E \+ 1\)"),
    ({"state": torch.zeros(2, 3, 8, 5, dtype=torch.float64)}, ValueError, "state must be float32"),
    ({"state": None}, TypeError, "state must be a torch.Tensor"),
    ({"k": torch.zeros(2, 3, 8)}, TypeError, "same dtype"),
    ({"v": torch.zeros(2, 4, 4, dtype=torch.float64)}, ValueError, r"v \(B, H, E\) with the same B, H"),
], ids=["state_shape", "state_dtype", "no_state", "mixed_dtypes", "v_heads"])
def test_the_pytorch_path_names_bad_inputs_as_the_kernel_does(change, error, words):
    """float64 takes the PyTorch path, which checks its inputs too (it used to fail inside einsum)."""
    arguments = {name: (x.double() if name != "state" else x) for name, x in bad_inputs().items()}
    arguments = {name: (x.to(ttx_tutorial.DEVICE) if isinstance(x, torch.Tensor) else x)
                 for name, x in {**arguments, **change}.items()}
    with torch.no_grad(), pytest.raises(error, match=words):
        ttx_tutorial.linear_attention_step(**arguments)


def test_the_layer_names_bad_arguments_when_built_and_called():
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        ttx_tutorial.CausalLinearAttention(32, 2, method="fast")
    with pytest.raises(ValueError, match="head_dim must be at most 256 for method 'auto'"):
        ttx_tutorial.CausalLinearAttention(32, 2, head_dim=300)
    ttx_tutorial.CausalLinearAttention(32, 2, head_dim=300, method="loop")  # the references have no limit
    layer = ttx_tutorial.CausalLinearAttention(32, 2).to(ttx_tutorial.DEVICE)
    x = torch.randn(2, 5, 32, device=ttx_tutorial.DEVICE)
    with torch.no_grad():
        with pytest.raises(TypeError, match="return_state must be True or False"):
            layer(x, return_state=1)
        with pytest.raises(TypeError, match="state must be a torch.Tensor"):
            layer.step(x[:, 0], None)


# --------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("D, E", [(128, 256), (256, 256), (64, 64)])
def test_gpu_every_thread_reads_the_state_before_any_writes_it(D, E):
    """The threads of a program that hold copies of one state element must all read it before
    one of them stores the update: without that, a late reader adds k twice to z, which leaves
    the state right and the output wrong, on some launches only. So many launches are checked."""
    for seed in range(50):
        check_step("elu", True, torch.float32, B=4, H=8, D=D, E=E, seed=seed)

@pytest.mark.gpu
def test_gpu_step_replays_from_a_cuda_graph_at_the_generation_shape():
    q, k, v, state = token_inputs(8, 16, 64, 64, torch.bfloat16, True)
    eager_state = state.clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles and warms up outside the capture
            ttx_tutorial.linear_attention_step(q, k, v, state.clone())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step; runs nothing
            out = ttx_tutorial.linear_attention_step(q, k, v, state)
        for token in range(3):  # each replay advances the captured state by one token
            expected_out, expected_state = step64(q, k, v, eager_state, FEATURES["elu"], True, 1e-6)
            graph.replay()
            eager_out = ttx_tutorial.linear_attention_step(q, k, v, eager_state)
            assert torch.equal(out, eager_out), f"replay {token} differs from the eager call"
            assert torch.equal(state, eager_state), f"state after replay {token}"
            assert_close(out, expected_out, torch.bfloat16, f"replay {token}")
            assert_close(state, expected_state, torch.float32, f"state after replay {token}")


@pytest.mark.gpu
@pytest.mark.parametrize("E", [64, 128])  # one program a head; two, which count their arrivals
def test_gpu_a_launch_seen_before_skips_the_jit_path_and_stays_correct(E, monkeypatch):
    """The first call of a key goes through Triton's JIT path and keeps the compiled kernel;
    later calls launch it directly. Inputs of a new key (a pointer off 16-byte alignment, other
    strides, among them a stride of 2 that Triton compiles differently from 1) take the JIT path
    once, and every call stays right."""
    monkeypatch.setattr(step, "_KEPT_LAUNCHES", {})
    jit_calls = 0
    jit_run = step.step_kernel.run

    def counted_run(*args, **kwargs):
        nonlocal jit_calls
        jit_calls += 1
        return jit_run(*args, **kwargs)

    monkeypatch.setattr(step.step_kernel, "run", counted_run)
    q, k, v, state = token_inputs(8, 16, 64, E, torch.bfloat16, True, seed=5)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    transposed = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device).transpose(0, 1)
    every_other = torch.empty(*q.shape[:2], 2 * q.shape[2], dtype=q.dtype, device=q.device)[..., ::2]
    assert shifted.data_ptr() % 16 and every_other.stride(-1) == 2
    for queries in (q, shifted, transposed.copy_(q), every_other.copy_(q)):
        calls_before = jit_calls
        for token in range(3):
            expected_out, expected_state = step64(queries, k, v, state, FEATURES["elu"], True, 1e-6)
            with torch.no_grad(), poisoned_allocations():
                out = ttx_tutorial.linear_attention_step(queries, k, v, state)
            assert_close(out, expected_out, torch.bfloat16, f"token {token}, strides {queries.stride()}")
            assert_close(state, expected_state, torch.float32, f"state after token {token}")
        assert jit_calls == calls_before + 1, "a known launch took the JIT path, or a new one did not"
    assert len(step._KEPT_LAUNCHES) == 4
