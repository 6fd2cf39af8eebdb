"""Context parallelism (``ttx_tutorial.distributed``): a sequence split across 2 and 3 processes
gives what one process gives for the whole sequence, checked against float64.

The tests start one process per rank: this file run as a script, gloo over a ``file://``
rendezvous (NCCL on two GPUs in the GPU test). Every rank draws the same whole-sequence inputs
from a seed chosen afresh for each test run, keeps its slice (uneven slices, one of them empty),
runs every case, measures outputs, final state and gradients against float64 autograd on the
whole sequence, counts its communication, provokes the errors, and writes what it saw to JSON.
The tests below read those files and judge.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

#: (B, H, D, E) and the tokens on each rank, in rank order: uneven slices, and one rank with none.
#: Small for the interpreter; on GPUs, slices across many chunks and scan segments.
SIZES = {("gloo", 2): ((1, 2, 6, 5), (7, 12)),
         ("gloo", 3): ((1, 2, 6, 5), (5, 0, 9)),
         ("nccl", 2): ((2, 3, 64, 48), (1500, 2596))}
#: (name, method, dtype, initial state on rank 0, return_state, gradients into S_0 alone)
CASES = [
    ("recurrent-float32", "recurrent", "float32", True, True, False),
    ("recurrent-bfloat16", "recurrent", "bfloat16", True, True, False),
    ("chunked-float32", "chunked", "float32", True, True, False),
    ("chunked-bfloat16", "chunked", "bfloat16", False, False, False),
    ("quadratic-float32", "quadratic", "float32", True, False, False),
    # Only S_0 is trained: the other ranks' outputs still carry its gradient back to rank 0.
    ("chunked-float32-state-only", "chunked", "float32", True, False, True),
]
GPU_CASES = CASES + [("scan-bfloat16", "scan", "bfloat16", True, True, False)]
#: Misuse on one rank, or ranks that disagree: every rank must raise (what, in the test below).
REFUSALS = ["mismatched-D", "mismatched-dtype", "initial-state-on-rank-1", "unknown-method-on-rank-0",
            "no-gradients-on-the-last-rank"]


# ---------------------------------------------------------------- the worker: one rank

def _my_part(sizes, rank):
    _, splits = sizes
    start = sum(splits[:rank])
    return slice(start, start + splits[rank])


def _case_inputs(sizes, seed, dtype, device):
    """The whole sequence's inputs and output gradients, the same on every rank."""
    from ttx_tutorial.testing import random_inputs

    (B, H, D, E), splits = sizes
    world_size, T = len(splits), sum(splits)
    q, k, v, s0 = random_inputs(B, H, T, D, E, dtype=dtype, device=device, seed=seed, initial_state=True)
    generator = torch.Generator().manual_seed(seed + 1)
    grad_o = torch.randn(B, H, T, E, generator=generator).to(device, dtype)
    # One gradient of the final state per rank: the whole sequence's is their sum.
    grad_final = [torch.randn(B, H, D, E, generator=generator).to(device) for _ in range(world_size)]
    return q, k, v, s0, grad_o, grad_final


def _float64_gradients(q, k, v, s0, grad_o, grad_final):
    """o, S_T and d(q, k, v, S_0) of sum(o * grad_o) + sum(S_T * grad_final), float64 autograd."""
    from ttx_tutorial.references import quadratic

    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, s0)]
    o, final_state = quadratic(*leaves)
    torch.autograd.backward((o, final_state), (grad_o.double(), grad_final.double()))
    return o.detach(), final_state.detach(), [x.grad for x in leaves]


_ELEMENT_SIZES = {"float": 4, "double": 8, "long int": 8}


def _profiled_all_gathers(profile, world_size):
    """(count, bytes this rank sent, dtypes) of the all_gathers the profiler saw, from each one's
    input; bytes and dtypes None when the profiler does not give the dtypes (torch 2.11's events
    have no ``input_dtypes``), bytes None when a dtype's name is not known here."""
    seen = [event for event in profile.events() if event.name.endswith(":all_gather") and event.input_shapes]
    if not all(hasattr(event, "input_dtypes") for event in seen):
        return len(seen), None, None
    dtypes = [event.input_dtypes[0] for event in seen]
    if not all(name in _ELEMENT_SIZES for name in dtypes):
        return len(seen), None, dtypes
    sent = sum((world_size - 1) * math.prod(event.input_shapes[0]) * _ELEMENT_SIZES[name]
               for event, name in zip(seen, dtypes))
    return len(seen), sent, dtypes


def _run_case(case, sizes, rank, seed, device):
    import ttx_tutorial
    from ttx_tutorial import distributed
    from ttx_tutorial.testing import poisoned_allocations, relative_error

    name, method, dtype_name, with_s0, return_state, state_only = case
    dtype = getattr(torch, dtype_name)
    q, k, v, s0, grad_o, grad_final = _case_inputs(sizes, seed, dtype, device)
    world_size, part = len(sizes[1]), _my_part(sizes, rank)
    # Views of the whole sequence: strided slices, as a caller would pass them.
    mine = [x[:, :, part].detach().requires_grad_(not state_only) for x in (q, k, v)]
    my_s0 = s0.clone().requires_grad_() if with_s0 and rank == 0 else None
    with torch.profiler.profile(record_shapes=True) as profile, \
            distributed.count_communication() as traffic, poisoned_allocations():
        out = distributed.causal_product(*mine, initial_state=my_s0, return_state=return_state,
                                         method=method)
        o, final_state = out if return_state else (out, None)
        outputs, grads = [o], [grad_o[:, :, part]]
        if return_state:
            outputs.append(final_state)
            grads.append(grad_final[rank])
        torch.autograd.backward(outputs, grads)

    whole_grad_final = sum(grad_final) if return_state else torch.zeros_like(grad_final[0])
    ref_o, ref_state, ref_grads = _float64_gradients(
        q, k, v, s0 if with_s0 else torch.zeros_like(s0), grad_o, whole_grad_final)
    errors = {"o": relative_error(o, ref_o[:, :, part])}
    if return_state:
        errors["final state"] = relative_error(final_state, ref_state)
    for label, x, ref in zip(("dq", "dk", "dv"), mine, ref_grads):
        if not state_only:
            errors[label] = relative_error(x.grad, ref[:, :, part])
    if my_s0 is not None:
        errors["d initial state"] = relative_error(my_s0.grad, ref_grads[3])

    single = {}
    if rank == 0:  # the single-process result on the whole sequence, judged the same way
        whole = [x.detach().requires_grad_(not state_only) for x in (q, k, v)]
        whole_s0 = s0.clone().requires_grad_() if with_s0 else None
        o_all, state_all = ttx_tutorial.causal_product(*whole, method, initial_state=whole_s0,
                                                       return_state=True)
        torch.autograd.backward((o_all, state_all), (grad_o, whole_grad_final))
        single = {"o": relative_error(o_all, ref_o), "final state": relative_error(state_all, ref_state)}
        for label, x, ref in zip(("dq", "dk", "dv"), whole, ref_grads):
            if not state_only:
                single[label] = relative_error(x.grad, ref)
        if with_s0:
            single["d initial state"] = relative_error(whole_s0.grad, ref_grads[3])
    profiled_collectives, profiled_bytes, profiled_dtypes = _profiled_all_gathers(profile, world_size)
    return {"errors": errors, "single_process": single, "bytes_sent": traffic.bytes_sent,
            "collectives": traffic.collectives, "profiled_collectives": profiled_collectives,
            "profiled_bytes": profiled_bytes, "profiled_dtypes": profiled_dtypes}


def _provoke(refusal, sizes, rank, seed, device):
    """Call with misuse on one rank (or disagreement between ranks); report what was raised."""
    from ttx_tutorial import distributed

    world_size = len(sizes[1])
    q, k, v, s0, _, _ = _case_inputs(sizes, seed, torch.float32, device)
    part = slice(0, 3)
    q, k, v = (x[:, :, part] for x in (q, k, v))
    kwargs = {"method": "quadratic"}
    if refusal == "mismatched-D" and rank == 1:
        q, k = q[..., :-1], k[..., :-1]
    elif refusal == "mismatched-dtype" and rank == world_size - 1:
        q, k, v = q.double(), k.double(), v.double()
    elif refusal == "initial-state-on-rank-1" and rank == 1:
        kwargs["initial_state"] = s0
    elif refusal == "unknown-method-on-rank-0" and rank == 0:
        kwargs["method"] = "fastest"
    if refusal == "no-gradients-on-the-last-rank":
        k = k.detach().requires_grad_(rank == 0)
    try:
        with torch.set_grad_enabled(not (refusal == "no-gradients-on-the-last-rank" and rank == world_size - 1)):
            distributed.causal_product(q, k, v, **kwargs)
    except (TypeError, ValueError) as error:
        return [type(error).__name__, str(error)]
    return None


def _worker(args):
    import torch.distributed as dist

    import ttx_tutorial

    # NCCL: one GPU a rank. gloo: the package's device (the CPU interpreter, or one GPU for all).
    device = torch.device("cuda", args.rank) if args.backend == "nccl" else ttx_tutorial.DEVICE
    if args.backend == "nccl":
        torch.cuda.set_device(device)
    from datetime import timedelta
    dist.init_process_group(args.backend, init_method=f"file://{args.rendezvous}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=120))
    cases = GPU_CASES if args.backend == "nccl" else CASES
    sizes = SIZES[(args.backend, args.world_size)]
    report = {"cases": {}, "refusals": {}}
    for number, case in enumerate(cases):
        report["cases"][case[0]] = _run_case(case, sizes, args.rank, args.seed + 10 * number, device)
    for refusal in REFUSALS:
        report["refusals"][refusal] = _provoke(refusal, sizes, args.rank, args.seed, device)
    # After every refusal the ranks are still in step: a plain call goes through.
    from ttx_tutorial import distributed
    from ttx_tutorial.testing import relative_error, reference
    q, k, v, _, _, _ = _case_inputs(sizes, args.seed, torch.float32, device)
    part = _my_part(sizes, args.rank)
    o = distributed.causal_product(q[:, :, part], k[:, :, part], v[:, :, part], method="quadratic")
    report["after_refusals"] = relative_error(o, reference(q, k, v)[0][:, :, part])
    dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(report))


# ---------------------------------------------------------------- the tests

def _launch(backend, world_size, tmp_path):
    seed = random.SystemRandom().randrange(2**30)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    processes = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--world-size", str(world_size),
                          "--backend", backend, "--rendezvous", str(tmp_path / "rendezvous"),
                          "--seed", str(seed), "--out", str(tmp_path / f"rank{rank}.json")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world_size)]
    failures = []
    for rank, process in enumerate(processes):
        try:
            output, _ = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            output = "timed out (a rank waiting in a collective?)"
        if process.returncode != 0:
            failures.append(f"rank {rank} (seed {seed}):\n{output[-4000:]}")
    assert not failures, "\n".join(failures)
    return seed, [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]


_TWO_GPUS = [pytest.mark.gpu,
             pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")]


@pytest.fixture(scope="module", params=[
    ("gloo", 2), ("gloo", 3), pytest.param(("nccl", 2), marks=_TWO_GPUS)], ids=lambda p: f"{p[0]}-{p[1]}")
def ranks(request, tmp_path_factory):
    backend, world_size = request.param
    seed, reports = _launch(backend, world_size, tmp_path_factory.mktemp(f"{backend}{world_size}"))
    return backend, world_size, seed, reports


def _cases(ranks):
    return GPU_CASES if ranks[0] == "nccl" else CASES


def test_every_rank_matches_float64_as_one_process_does(ranks):
    """Outputs, final state and gradients of q, k, v and S_0 on each rank's slice, and the
    single-process run on the whole sequence, within the dtype's tolerance of float64."""
    from ttx_tutorial.testing import TOLERANCES

    _, world_size, seed, reports = ranks
    for name, method, dtype_name, with_s0, return_state, state_only in _cases(ranks):
        tolerance = TOLERANCES[getattr(torch, dtype_name)]
        for rank, report in enumerate(reports):
            errors = report["cases"][name]["errors"]
            expected = {"o"} | (set() if state_only else {"dq", "dk", "dv"}) | (
                {"final state"} if return_state else set()) | (
                {"d initial state"} if with_s0 and rank == 0 else set())
            assert set(errors) == expected, (name, rank)
            bad = {key: error for key, error in errors.items() if not error <= tolerance}
            assert not bad, f"{name}, rank {rank} of {world_size}, seed {seed}: {bad} above {tolerance:.0e}"
        single = reports[0]["cases"][name]["single_process"]
        assert single and all(error <= tolerance for error in single.values()), (name, seed, single)


def test_communication_matches_the_formula(ranks):
    """Counted bytes, and the bytes of the all_gathers the profiler saw, equal the formula:
    independent of each rank's number of tokens (one rank has none)."""
    from ttx_tutorial.distributed import communication_bytes

    backend, world_size, _, reports = ranks
    (B, H, D, E), _ = SIZES[(backend, world_size)]
    for name, _, dtype_name, _, return_state, _ in _cases(ranks):
        expected = communication_bytes(B, H, D, E, world_size, dtype=getattr(torch, dtype_name),
                                       return_state=return_state, backward=True)
        for rank, report in enumerate(reports):
            case = report["cases"][name]
            assert case["bytes_sent"] == expected, (name, rank)
            assert case["collectives"] == 3, (name, rank)  # the ranks' summaries, forward, backward
            profiled = (case["profiled_collectives"], case["profiled_bytes"])
            # gloo's collectives show their inputs to the profiler (with their dtypes from torch
            # 2.12 on); NCCL's may not, on some versions.
            if (backend == "gloo" and case["profiled_dtypes"] is not None) or (profiled[0] and profiled[1] is not None):
                assert profiled == (3, expected), (name, rank, profiled, case["profiled_dtypes"])
    assert communication_bytes(B, H, D, E, world_size) == (world_size - 1) * (B * H * D * E * 4 + 9 * 8)
    assert communication_bytes(B, H, D, E, world_size, return_state=True, backward=True,
                               check_ranks=False) == (world_size - 1) * B * H * D * E * 4 * 3


@pytest.mark.parametrize("refusal", REFUSALS)
def test_misuse_raises_on_every_rank(ranks, refusal):
    """Misuse on one rank, or ranks that disagree, raise on every rank: none is left waiting."""
    _, world_size, _, reports = ranks
    raised = [report["refusals"][refusal] for report in reports]
    assert all(raised), raised
    others = ("ValueError", "refused their inputs")
    expected = {
        "mismatched-D": {rank: ("ValueError", "disagree on (B, H, D, E)") for rank in range(world_size)},
        "mismatched-dtype": {rank: ("TypeError", "disagree on the dtype") for rank in range(world_size)},
        "initial-state-on-rank-1": {1: ("ValueError", "pass it on rank 0 and None on the others")},
        "unknown-method-on-rank-0": {0: ("ValueError", "unknown method 'fastest'")},
        "no-gradients-on-the-last-rank": {rank: ("ValueError", "run without gradients")
                                          for rank in range(world_size)},
    }[refusal]
    for rank, (kind, message) in enumerate(raised):
        want_kind, want_message = expected.get(rank, others)
        assert kind == want_kind and want_message in message, (rank, kind, message)


def test_ranks_stay_in_step_after_refusals(ranks):
    from ttx_tutorial.testing import TOLERANCES

    assert all(report["after_refusals"] <= TOLERANCES[torch.float32] for report in ranks[3])


def test_without_a_process_group_the_error_says_what_to_call():
    import torch.distributed as dist

    from ttx_tutorial import distributed
    from ttx_tutorial.testing import random_inputs

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="call torch.distributed.init_process_group first"):
        distributed.causal_product(*random_inputs(1, 1, 4, 2))


def test_a_slice_state_summed_chunk_by_chunk(monkeypatch):
    """L = K^T V over chunks of 3 tokens (upcast a chunk at a time): the value against float64,
    and its gradients by float64 gradcheck; the empty slice gives zeros."""
    from ttx_tutorial import distributed
    from ttx_tutorial.testing import assert_close, random_inputs

    monkeypatch.setattr(distributed, "_UPCAST_ELEMENTS", 2 * 3 * 7 * 3)
    _, k, v = random_inputs(2, 3, 10, 7, 5, dtype=torch.bfloat16)
    assert len(distributed._token_chunks(k, v)) == 4
    state = distributed._SliceState.apply(k, v, torch.float32)
    assert_close(state, k.double().transpose(-2, -1) @ v.double(), torch.float32, "state")
    _, k, v = random_inputs(2, 3, 10, 7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda k, v: distributed._SliceState.apply(k, v, torch.float64), (k, v))
    empty = distributed._SliceState.apply(k[:, :, :0], v[:, :, :0], torch.float64)
    assert empty.shape == (2, 3, 7, 5) and not empty.any()


def test_the_package_loads_the_module_on_first_use():
    code = ("import sys, ttx_tutorial; assert 'ttx_tutorial.distributed' not in sys.modules; "
            "assert callable(ttx_tutorial.distributed.causal_product)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one rank of tests/test_distributed.py")
    for option, kind in (("--rank", int), ("--world-size", int), ("--backend", str),
                         ("--rendezvous", str), ("--seed", int), ("--out", str)):
        parser.add_argument(option, type=kind, required=True)
    _worker(parser.parse_args())
