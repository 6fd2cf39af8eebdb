"""Packed variable-length batches: ``causal_product(..., cu_seqlens=...)``.

Every method against a float64 loop run on each sequence alone (outputs, final states and the
gradients of q, k, v and the initial states), with outputs allocated NaN-filled so that a token
or a state no program writes fails. The lengths put boundaries inside chunks and segments, and
include empty and one-token sequences and sequences longer than one scan segment.
"""

import numpy as np
import pytest
import torch

import ttx_tutorial
from ttx_tutorial import ops, references
from ttx_tutorial.kernels import chunked, recurrent, scan
from ttx_tutorial.testing import assert_close, poisoned_allocations, reference_gradients

TRITON_METHODS = ("recurrent", "chunked", "scan")
KERNEL_FILES = {"recurrent": recurrent.recurrent_causal_product, "chunked": chunked.chunked_causal_product,
                "scan": scan.scan_causal_product}

#: Lengths, in order: a boundary inside the first 16-token chunk, an empty sequence, one token,
#: a sequence over several chunks and scan segments, empties at the end.
MIXED = (5, 0, 1, 83, 17, 0)
CASES = {"mixed": MIXED, "one sequence": (41,), "all empty": (0, 0), "one token each": (1, 1, 1)}


def for_method(method, lengths):
    """Recurrent walks one token per step, slow under the interpreter: its sequences are cut
    to 23 tokens (still past one 16-token block)."""
    return tuple(min(n, 23) for n in lengths) if method == "recurrent" else lengths


def packed_inputs(lengths, H, D, E, dtype, *, generator, offsets_dtype=torch.int32):
    """Fresh q, k (1, H, total_T, D), v (1, H, total_T, E), initial states (N, H, D, E) and
    cu_seqlens for sequences of ``lengths`` tokens."""
    T = sum(lengths)

    def draw(*shape, scale=1.0, to=dtype):
        x = torch.randn(*shape, generator=generator, dtype=torch.float64) * scale
        return x.to(to).to(ttx_tutorial.DEVICE).requires_grad_()

    q, k = draw(1, H, T, D, scale=D ** -0.5), draw(1, H, T, D, scale=D ** -0.5)
    v = draw(1, H, T, E)
    s0 = draw(len(lengths), H, D, E, to=torch.float32)
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return q, k, v, s0, offsets.to(offsets_dtype).to(ttx_tutorial.DEVICE)


def per_sequence_loop(q, k, v, s0, cu_seqlens, grad_o, grad_state):
    """The float64 oracle: ``references.loop`` on each sequence alone, and the gradients of
    <o, grad_o> + <S, grad_state>: (o, states, {name: gradient})."""
    leaves = {name: x.detach().cpu().double().requires_grad_()
              for name, x in (("q", q), ("k", k), ("v", v), ("initial_state", s0))}
    offsets = cu_seqlens.tolist()
    outputs, states = [], []
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        o, state = references.loop(*(leaves[name][:, :, start:end] for name in "qkv"),
                                   leaves["initial_state"][n:n + 1])
        outputs.append(o)
        states.append(state)
    o, states = torch.cat(outputs, dim=2), torch.cat(states, dim=0)
    torch.autograd.backward((o, states), (grad_o.cpu().double(), grad_state.cpu().double()))
    gradients = {name: torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for name, leaf in leaves.items()}
    return o.detach(), states.detach(), gradients


def check_against_loop(run, lengths, dtype, *, H=2, D=8, E=5, seed=0, offsets_dtype=torch.int32, tolerance=None):
    """``run(q, k, v, s0, cu_seqlens) -> (o, states)`` against the per-sequence loop, forward and
    backward, with every output of the run allocated NaN-filled, within the tolerance of
    ``tolerance`` (a dtype; None: ``dtype``'s)."""
    tolerance = tolerance or dtype
    generator = torch.Generator().manual_seed(seed)
    q, k, v, s0, cu_seqlens = packed_inputs(lengths, H, D, E, dtype, generator=generator,
                                            offsets_dtype=offsets_dtype)
    with poisoned_allocations():
        o, states = run(q, k, v, s0, cu_seqlens)
        grad_o = torch.randn(o.shape, generator=generator).to(o)
        grad_state = torch.randn(states.shape, generator=generator).to(states)
        grads = torch.autograd.grad((o, states), (q, k, v, s0), (grad_o, grad_state), allow_unused=True)
    expected_o, expected_states, expected_grads = per_sequence_loop(q, k, v, s0, cu_seqlens, grad_o, grad_state)
    assert o.shape == (1, H, sum(lengths), E) and states.shape == (len(lengths), H, D, E)
    assert_close(o, expected_o, tolerance, "o")
    assert_close(states, expected_states, torch.float32 if tolerance == torch.float32 else tolerance, "final states")
    for name, x, grad in zip(("q", "k", "v", "initial_state"), (q, k, v, s0), grads):
        if grad is None:  # autograd's answer for an input that no output depends on
            assert x.numel() == 0, f"d{name} is missing"
            continue
        assert_close(grad, expected_grads[name], tolerance, f"d{name}")


@pytest.mark.parametrize("method", TRITON_METHODS + ("auto", "loop", "cumsum", "quadratic"))
@pytest.mark.parametrize("case", CASES)
def test_api_matches_per_sequence_loop(method, case):
    def run(q, k, v, s0, cu_seqlens):
        return ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=cu_seqlens, initial_state=s0,
                                           return_state=True)
    check_against_loop(run, for_method(method, CASES[case]), torch.float32)


@pytest.mark.parametrize("method", ("chunked", "scan"))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_inputs_that_take_the_fused_backward(method, dtype):
    """Heads up to 64 wide, 16-bit or float32 under TF32 ("high"): chunked's and scan's
    one-launch backward kernels. TF32 keeps float16's significand: on a GPU, its tolerance."""
    precision = "tf32" if dtype == torch.float32 else None
    assert {"chunked": chunked, "scan": scan}[method].fused_backward_config(16, 16, dtype, precision=precision)

    def run(q, k, v, s0, cu_seqlens):
        return ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=cu_seqlens, initial_state=s0,
                                           return_state=True)
    tf32 = dtype == torch.float32 and not ttx_tutorial.INTERPRETED
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        check_against_loop(run, MIXED, dtype, D=16, E=16, offsets_dtype=torch.int64,
                           tolerance=torch.float16 if tf32 else None)
    finally:
        torch.set_float32_matmul_precision(before)


#: Chunks of 16 tokens; scan segments of one and two chunks, so that the 83-token sequence spans
#: several segments and its last segment is partial.
SMALL_CONFIGS = {
    "chunked": [{"CHUNK": 16}],
    "scan": [{"CHUNK": 16, "SEGMENT_LEN": 16}, {"CHUNK": 16, "SEGMENT_LEN": 32}],
    # D split in two; the tokens walk, which the interpreter's rule does not take, in small steps
    "recurrent": [{"WALK": "blocks", "BLOCK_D": 4, "BLOCK_E": 4, "BLOCK_T": 4},
                  {"WALK": "tokens", "BLOCK_E": 4, "COLS": 2, "HALVES": 1, "UNROLL": 4}],
}


@pytest.mark.parametrize("method, config", [(m, c) for m, cs in SMALL_CONFIGS.items() for c in cs],
                         ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()))
def test_kernel_files_with_small_chunks_and_segments(method, config):
    """Each kernel file's own entry, with chunks and segments smaller than the sequences."""
    def run(q, k, v, s0, cu_seqlens):
        return KERNEL_FILES[method](q, k, v, s0, config=config, cu_seqlens=cu_seqlens)
    check_against_loop(run, for_method(method, MIXED), torch.float32)


def test_recurrent_key_rows_in_two_tiles_on_packed_sequences():
    """recurrent's HALVES = 2 (the state's key rows in two tiles) on packed sequences, with D and
    E past one tile's 16 rows, so that both tiles hold rows in every walk of the backward too."""
    def run(q, k, v, s0, cu_seqlens):
        return KERNEL_FILES["recurrent"](q, k, v, s0, config={"WALK": "tokens", "BLOCK_E": 8, "COLS": 4, "HALVES": 2,
                                                              "UNROLL": 4}, cu_seqlens=cu_seqlens)
    check_against_loop(run, for_method("recurrent", MIXED), torch.float32, D=24, E=20)


#: Boundaries on scan's 16-token segment edges (16, 32, 64), empty sequences sitting on them and
#: at the end, a sequence of exactly two segments and one that ends inside the last.
ON_SEGMENT_EDGES = (16, 0, 16, 32, 0, 7, 25, 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)  # three passes; the fused backward
@pytest.mark.parametrize("lengths", (ON_SEGMENT_EDGES, MIXED), ids=("on segment edges", "mixed"))
def test_scan_segments_straddle_boundaries(lengths, dtype):
    """scan cuts the packed row into 16-token segments whatever the boundaries, walks the pieces
    of sequences inside each, and restarts pass 2 where no sequence spans the segment before:
    forward, and backward through the three passes (float32) and the fused kernel (bfloat16)."""
    def run(q, k, v, s0, cu_seqlens):
        return scan.scan_causal_product(q, k, v, s0, config={"CHUNK": 16, "SEGMENT_LEN": 16}, cu_seqlens=cu_seqlens)
    check_against_loop(run, lengths, dtype, D=16, E=16)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_no_initial_state_and_only_the_states_used(method):
    """Without initial states every sequence starts from zeros; a loss on the final states alone
    reaches only the tokens of their own sequences."""
    generator = torch.Generator().manual_seed(1)
    lengths = for_method(method, MIXED)
    q, k, v, _, cu_seqlens = packed_inputs(lengths, 2, 8, 5, torch.float32, generator=generator)
    with poisoned_allocations():
        o, states = ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=cu_seqlens, return_state=True)
        grads = torch.autograd.grad(states.sum(), (q, k, v))
    zeros = torch.zeros(len(lengths), 2, 8, 5)
    _, expected_states, expected = per_sequence_loop(q, k, v, zeros, cu_seqlens, torch.zeros(o.shape), torch.ones(states.shape))
    assert_close(states, expected_states, torch.float32, "final states")
    for name, grad in zip("qkv", grads):
        assert_close(grad, expected[name], torch.float32, f"d{name}")


def test_packed_equals_separate_calls():
    """The same result as calling the method once per sequence with a batch of one."""
    generator = torch.Generator().manual_seed(2)
    q, k, v, s0, cu_seqlens = packed_inputs((7, 30, 0, 12), 2, 8, 8, torch.float32, generator=generator)
    o, states = ttx_tutorial.causal_product(q, k, v, "chunked", cu_seqlens=cu_seqlens, initial_state=s0,
                                            return_state=True)
    offsets = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        o_n, state_n = ttx_tutorial.causal_product(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end],
                                                   "chunked", initial_state=s0[n:n + 1], return_state=True)
        assert_close(o[:, :, start:end], o_n, torch.float32, f"o of sequence {n}")
        assert_close(states[n:n + 1], state_n, torch.float32, f"state of sequence {n}")


def _inputs_for_errors(lengths=(3, 4)):
    generator = torch.Generator().manual_seed(3)
    return packed_inputs(lengths, 2, 4, 4, torch.float32, generator=generator)


def _bad_offsets():
    """(description, cu_seqlens or a function of q, error type, words the message must hold) for
    q of 7 tokens in a batch of one."""
    device = ttx_tutorial.DEVICE
    return [
        ("a list", [0, 3, 7], TypeError, "cu_seqlens must be a torch.Tensor"),
        ("float", torch.tensor([0.0, 3.0, 7.0], device=device), TypeError, "int32 or int64"),
        ("int16", torch.tensor([0, 3, 7], dtype=torch.int16, device=device), TypeError, "int32 or int64"),
        ("2-D", torch.tensor([[0, 3, 7]], device=device), ValueError, "1-D with N + 1 >= 2"),
        ("one offset", torch.tensor([0], device=device), ValueError, "1-D with N + 1 >= 2"),
        ("not from 0", torch.tensor([1, 3, 7], device=device), ValueError, "must start at 0, got 1"),
        ("decreasing", torch.tensor([0, 5, 3, 7], device=device), ValueError, "must be non-decreasing"),
        ("short of T", torch.tensor([0, 3, 6], device=device), ValueError, "must end at total_T = 7"),
        ("past T", torch.tensor([0, 3, 9], device=device), ValueError, "must end at total_T = 7"),
        ("on meta", torch.tensor([0, 3, 7], device="meta"), ValueError, "cu_seqlens must be on the inputs' device"),
    ]


@pytest.mark.parametrize("entry, method", [("api", m) for m in TRITON_METHODS + ("loop",)]
                         + [("kernel file", m) for m in TRITON_METHODS])
@pytest.mark.parametrize("bad", _bad_offsets(), ids=lambda bad: bad[0])
def test_bad_offsets_get_clear_errors(bad, method, entry):
    _, offsets, error, words = bad
    q, k, v, _, _ = _inputs_for_errors()
    call = (KERNEL_FILES[method] if entry == "kernel file"
            else lambda *args, **kw: ttx_tutorial.causal_product(*args, method, **kw))
    with pytest.raises(error, match=words.replace("(", r"\(").replace("+", r"\+")):
        call(q, k, v, cu_seqlens=offsets)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_batch_and_state_shapes_are_checked(method):
    q, k, v, s0, cu_seqlens = _inputs_for_errors()
    batch_of_two = [x.detach().expand(2, *x.shape[1:]) for x in (q, k, v)]
    for call in (KERNEL_FILES[method], lambda *a, **kw: ttx_tutorial.causal_product(*a, method, **kw)):
        with pytest.raises(ValueError, match="batch of one.*got B=2"):
            call(*batch_of_two, cu_seqlens=cu_seqlens)
        with pytest.raises(ValueError, match=r"initial_state must have shape \(N, H, D, E\) with cu_seqlens = "
                                             r"\(2, 2, 4, 4\), got \(1, 2, 4, 4\)"):
            call(q, k, v, initial_state=s0[:1], cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("method", ("chunked",))
def test_opcheck_with_cu_seqlens(method):
    """The operator behind torch.compile: schema, fake implementation ((N, H, D, E) states),
    autograd registration."""
    q, k, v, s0, cu_seqlens = packed_inputs((4, 0, 9), 2, 8, 4, torch.float32, generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(ops.causal_product_op, (q, k, v, s0, method, cu_seqlens))


def test_compiled_call_with_cu_seqlens():
    """Under torch.compile the call goes through the operator, which checks the offsets' values
    when it runs (the traced call cannot read them)."""
    q, k, v, s0, cu_seqlens = packed_inputs((4, 0, 9), 2, 8, 4, torch.float32, generator=torch.Generator().manual_seed(5))

    def product(q, k, v, s0, cu_seqlens):
        return ttx_tutorial.causal_product(q, k, v, "chunked", cu_seqlens=cu_seqlens, initial_state=s0,
                                           return_state=True)

    compiled = torch.compile(product, backend="aot_eager", fullgraph=True)
    o, states = compiled(q, k, v, s0, cu_seqlens)
    expected_o, expected_states = product(q, k, v, s0, cu_seqlens)
    assert_close(o, expected_o, torch.float32, "o")
    assert_close(states, expected_states, torch.float32, "final states")
    with pytest.raises(ValueError, match="must be non-decreasing"):
        compiled(q, k, v, s0, torch.tensor([0, 9, 4, 13], dtype=torch.int32, device=q.device))


# --------------------------------------------------------------------------- GPU sizes

@pytest.mark.gpu
@pytest.mark.parametrize("method", TRITON_METHODS + ("auto",))
def test_gpu_packed_batch_at_realistic_size(method):
    """About 13000 tokens in sequences of 0 to 2500 tokens, 4 heads of 64, bfloat16: outputs,
    states and every gradient against float64, each sequence alone."""
    generator = torch.Generator().manual_seed(6)
    lengths = [1, 0, 2500, 640, 63, 2047, *torch.randint(100, 2500, (6,), generator=generator).tolist()]
    q, k, v, s0, cu_seqlens = packed_inputs(lengths, 4, 64, 64, torch.bfloat16, generator=generator)
    with poisoned_allocations():
        o, states = ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=cu_seqlens, initial_state=s0,
                                                return_state=True)
        grad_o, grad_state = torch.randn_like(o), torch.randn_like(states)
        grads = torch.autograd.grad((o, states), (q, k, v, s0), (grad_o, grad_state))
    offsets = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        part = slice(start, end)
        expected_o, expected_state, expected = reference_gradients(
            q[:, :, part], k[:, :, part], v[:, :, part], s0[n:n + 1], grad_o[:, :, part], grad_state[n:n + 1])
        where = f"sequence {n} ({end - start} tokens)"
        assert_close(o[:, :, part], expected_o, torch.bfloat16, f"o of {where}")
        assert_close(states[n:n + 1], expected_state, torch.bfloat16, f"state of {where}")
        for name, grad in zip(("q", "k", "v"), grads[:3]):
            assert_close(grad[:, :, part], expected[name], torch.bfloat16, f"d{name} of {where}")
        assert_close(grads[3][n:n + 1], expected["initial_state"], torch.bfloat16, f"dS0 of {where}")


def test_scan_segment_table_matches_a_torch_construction():
    """``scan_segments_kernel`` (one launch, no read back) against the same table built with
    searchsorted: more sequences than one step of the kernel reads, more segments than one
    program writes, empty sequences (in front, between, at the end), segment lengths from 1
    token on."""
    generator = torch.Generator().manual_seed(7)
    for trial in range(8):
        n_sequences = int(torch.randint(1, 150, (), generator=generator))
        lengths = torch.randint(0, 100, (n_sequences,), generator=generator)
        lengths[torch.rand(n_sequences, generator=generator) < 0.2] = 0
        lengths[0] = 0 if trial % 3 == 0 else lengths[0]
        lengths[-1] = 0 if trial % 4 == 1 else lengths[-1]
        if int(lengths.sum()) == 0:
            lengths[n_sequences // 2] = 1
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        segment_len, T = int(torch.randint(1, 70, (), generator=generator)), int(offsets[-1])
        segment_first = torch.arange(-(-T // segment_len)) * segment_len
        ends = offsets[1:]
        first = torch.searchsorted(ends, segment_first, right=True)
        first[0] = 0
        ended_within = torch.searchsorted(ends, segment_first + segment_len, right=True)
        goes_on = (ended_within < n_sequences) & (offsets[ended_within] < segment_first + segment_len)
        last = torch.where(goes_on, ended_within, ended_within - 1)
        flags = ((offsets[first] >= segment_first).long() + 2 * (~goes_on).long()
                 + 4 * (offsets[first] >= segment_first - segment_len).long()
                 + 8 * (offsets[last + 1] <= segment_first + 2 * segment_len).long())
        expected = torch.cat([first, last, flags, offsets])
        offsets_dtype = (torch.int32, torch.int64)[trial % 2]
        table = scan._segment_table(offsets.to(offsets_dtype).to(ttx_tutorial.DEVICE), segment_len, T)
        where = f"trial {trial}: {n_sequences} sequences, L={segment_len}"
        assert torch.equal(table.cpu().long(), expected), where
        # every token in exactly one piece: the pieces of each segment tile it
        for s, (a, b) in enumerate(zip(first.tolist(), last.tolist())):
            pieces = [(max(int(offsets[j]), int(segment_first[s])),
                       min(int(offsets[j + 1]), int(segment_first[s]) + segment_len)) for j in range(a, b + 1)]
            covered = sum(max(e - f, 0) for f, e in pieces)
            assert covered == min(segment_len, T - int(segment_first[s])), f"{where}: segment {s}"
        # every sequence ends in exactly one segment
        ending = torch.zeros(n_sequences, dtype=torch.long)
        for s, (a, b) in enumerate(zip(first.tolist(), last.tolist())):
            ending[a:b] += 1
            ending[b] += (int(flags[s]) >> 1) & 1
        assert torch.equal(ending, torch.ones(n_sequences, dtype=torch.long)), where


def test_offsets_are_read_back_once_per_tensor_and_version(monkeypatch):
    """A model's layers share one batch's offsets: on a GPU, where a read back stalls the host, the
    API reads them back once, and again only after they change in place (or for another tensor,
    or another total_T). Here the CPU's offsets are taken for a GPU's."""
    from ttx_tutorial import _validation

    reads = []
    check = _validation.check_offsets
    monkeypatch.setattr(_validation, "check_offsets", lambda *args: reads.append(args) or check(*args))
    monkeypatch.setattr(_validation, "_read_back_stalls", lambda cu_seqlens: True)
    q, k, v, _, cu_seqlens = _inputs_for_errors()
    for _ in range(3):
        ttx_tutorial.causal_product(q.detach(), k.detach(), v.detach(), "chunked", cu_seqlens=cu_seqlens)
    assert len(reads) == 1
    cu_seqlens[1] = 9  # in place: now past total_T
    with pytest.raises(ValueError, match="must be non-decreasing"):
        ttx_tutorial.causal_product(q.detach(), k.detach(), v.detach(), "chunked", cu_seqlens=cu_seqlens)
    assert len(reads) == 2


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_offsets_on_the_cpu_are_checked_at_every_call(method):
    """A write that PyTorch's version counter does not record (through a NumPy view of the same
    memory, as a data loader reusing one buffer makes) is still refused at the next call, where
    the offsets live on the CPU: the kernels never walk past total_T."""
    if ttx_tutorial.DEVICE.type != "cpu":
        pytest.skip("offsets on the CPU go with inputs on the CPU")
    q, k, v, _, _ = _inputs_for_errors()
    buffer = np.array([0, 3, 7], dtype=np.int64)
    cu_seqlens = torch.from_numpy(buffer)
    with torch.no_grad():
        ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=cu_seqlens)
        buffer[2] = 100_000  # unseen by cu_seqlens._version
        with pytest.raises(ValueError, match="must end at total_T"):
            ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_strided_offsets(method):
    """Offsets given as a strided view (every other element of a longer tensor)."""
    every_other = torch.tensor([0, -1, 5, -1, 5, -1, 12], dtype=torch.int32, device=ttx_tutorial.DEVICE)

    def run(q, k, v, s0, cu_seqlens):
        assert torch.equal(every_other[::2], cu_seqlens)
        return ttx_tutorial.causal_product(q, k, v, method, cu_seqlens=every_other[::2], initial_state=s0,
                                           return_state=True)
    check_against_loop(run, (5, 0, 7), torch.float32)
