"""Kernels compile when the GPU's launcher turns integer arguments into constants.

On a GPU, Triton's launcher specialises every integer argument equal to 1 (a length-1
sequence, a single head, a unit stride, a flag that is on) into a compile-time constant. Code
that treats such an argument as a tensor, e.g. ``(reverse * (T - 1)).to(tl.int64)``, then fails
to compile, but only on the GPU: the interpreter and the generic signatures of
``launch_variants()`` never see the constant. Here the first variant of each kernel of each
family is compiled for sm_90 with every integer argument set to the constant 1, the most
constant-folded launch there is, in a child process with the interpreter off.
"""

from __future__ import annotations

import json

import pytest

import ttx_tutorial
from ttx_tutorial.testing import run_python

TRITON_METHODS = tuple(m for m in ttx_tutorial.METHODS if ttx_tutorial.method_info(m).is_triton)

_CHILD = r"""
import inspect, json, sys
import ttx_tutorial
from ttx_tutorial.course import compiler
module = inspect.getmodule(ttx_tutorial.method_info(sys.argv[1]).function)
seen, results = set(), []
for variant in module.launch_variants():
    name = variant["kernel"].fn.__name__ if hasattr(variant["kernel"], "fn") else variant["kernel"].__name__
    if name in seen:
        continue
    seen.add(name)
    signature, constexprs = dict(variant["signature"]), dict(variant["constexprs"])
    for arg, kind in variant["signature"].items():
        if kind == "i32":
            signature[arg], constexprs[arg] = "constexpr", 1
    result = compiler.compile_for_target(variant["kernel"], signature, constexprs, target="sm_90",
                                         num_warps=variant["num_warps"], num_stages=variant["num_stages"])
    results.append({"kernel": name, "ok": result.ok, "message": result.message})
print(json.dumps(results))
"""


@pytest.mark.parametrize("method", TRITON_METHODS)
def test_every_kernel_compiles_with_its_integers_as_constants(method):
    child = run_python(_CHILD, method)
    assert child.returncode == 0, child.stderr[-4000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    assert results, f"{method}: launch_variants() listed no kernel"
    failures = [f"{r['kernel']}: {r['message']}" for r in results if not r["ok"]]
    assert not failures, f"{method}: refused with constant integer arguments:\n" + "\n".join(failures)
