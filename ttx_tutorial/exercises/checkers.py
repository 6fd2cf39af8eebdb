"""One checker per exercise: run the student's kernel on fresh random inputs, say what is wrong.

Each checker launches the kernel itself (the exercise fixes its arguments), case by case from the
easiest shape to the awkward ones (a tail that is not a multiple of the block, D != E, T = 1,
transposed inputs, 16-bit inputs on long sequences), and stops at the first wrong case with a
diagnosis in plain words (see ``_harness``). It prints one line and returns a ``CheckResult``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import torch
import triton
from triton.compiler.errors import CompilationError

from .. import _device
from ..course.compiler import compile_for_target
from ..testing import TOLERANCES, random_inputs, relative_error
from .grading import EXERCISE_NAMES
from ._harness import (BF16_DOT_NOTE, UNWRITTEN, Case, CheckResult, Failure, blank_in, blank_message, check_output,
                       dtype_name, error_chain_text, guarded, guarded_copy, interpreter_bf16_dot_ok,
                       launch_error,
                       next_power_of_2, precision_failure, report, require_arguments,
                       sixteen_bit_error_bound, success, LOADS, watched_loads)

COMPILE_TARGETS = ("sm_80", "sm_90")


# --------------------------------------------------------------------------- float64 specs

def causal_product64(q, k, v, *, mask="causal"):
    """o_t = sum over s of (q_t . k_s) v_s, for s <= t ("causal"), s < t ("strict"), s <= t + 1
    ("one_ahead"), every s ("none") or s = t alone ("own"); inputs (BH, T, D), (BH, T, D),
    (BH, T, E) in float64."""
    scores = q @ k.transpose(-1, -2)
    T = q.shape[-2]
    if mask == "own":
        return (scores * torch.eye(T, dtype=scores.dtype, device=q.device)) @ v
    offset = {"causal": 0, "strict": -1, "one_ahead": 1, "none": T}[mask]
    keep = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(offset)
    return (scores * keep) @ v


def state_rows_summed64(q, k, v):
    """What a recurrent kernel computes that sums its state S_t (D x E) over the value axis
    instead of the key axis: o_t[d] = q_t[d] sum_e S_t[d, e], a (BH, T, D) result, comparable with
    the right one where D = E (None otherwise); float64."""
    if q.shape[-1] != v.shape[-1]:
        return None
    states = torch.cumsum(k[..., :, None] * v[..., None, :], dim=-3)
    return q * states.sum(-1)


def chunk_mistake64(q, k, v, *, chunk, intra_mask=True, state_first=False, intra=True, scores_kq=False):
    """What a chunked kernel with chunks of ``chunk`` tokens computes when it leaves out the causal
    mask inside a chunk (``intra_mask=False``: o_t sees its whole chunk), adds the chunk's kᵀ v to
    the state before q reads it (``state_first``: the chunk counted once more, whole), loses the
    chunk's own term (``intra=False``: only q S, as when `o =` replaces what `o +=` adds to) or
    takes the chunk's scores as k qᵀ (``scores_kq``: row t holds k_t . q_s); float64."""
    T = q.shape[-2]
    t = torch.arange(T, device=q.device)
    chunk_start, chunk_end = (t // chunk * chunk)[:, None], ((t // chunk + 1) * chunk)[:, None]
    s = t[None, :]
    earlier = (s < chunk_start).double()  # the state: every earlier chunk
    inside = ((s >= chunk_start) & (s <= t[:, None] if intra_mask else s < chunk_end)).double() * intra
    if state_first:
        inside += ((s >= chunk_start) & (s < chunk_end)).double()
    scores = q @ k.transpose(-1, -2)
    inside_scores = (k @ q.transpose(-1, -2)) if scores_kq else scores
    return (scores * earlier.to(q.device) + inside_scores * inside.to(q.device)) @ v


def dq64(do, k, v, *, mask="causal"):
    """dQ of o = causal_product(q, k, v) for the upstream gradient do: dq_t = sum_{s<=t} (do_t . v_s) k_s,
    itself a causal product with do, v, k in the roles of q, k, v. ``mask="reverse"``: s >= t."""
    if mask == "reverse":
        return causal_product64(do.flip(-2), v.flip(-2), k.flip(-2)).flip(-2)
    return causal_product64(do, v, k, mask=mask)


def _do_across_columns64(do, k, v):
    """What a dQ kernel computes that multiplies its state P_t (E x D) by do_t along the columns
    and sums down the rows: dq_t[d] = do_t[d] sum_e P_t[e, d], a (BH, T, D) result, comparable
    with the right one where D = E (None otherwise); float64."""
    if k.shape[-1] != v.shape[-1]:
        return None
    return do * torch.cumsum(v.sum(-1, keepdim=True) * k, dim=-2)


def feature_map64(x):
    """phi(x) = elu(x) + 1, the positive feature map of "Transformers are RNNs"."""
    return torch.nn.functional.elu(x) + 1


def exclusive_scan64(states):
    """The state entering each segment: the sum of the segments before it (states (BH, S, D, E))."""
    return torch.cumsum(states, dim=1) - states


# --------------------------------------------------------------------------- shared machinery

def _stride_args(*tensors):
    return [stride for tensor in tensors for stride in tensor.stride()]


def _strides_names(*prefixes, dims):
    return [f"stride_{prefix}{dim}" for prefix, dim_names in zip(prefixes, dims) for dim in dim_names]


def _layout_first(case, passed, failure) -> str:
    """A failure on transposed tensors whose contiguous twin (same sizes and dtype) passed is a
    kernel that assumes a layout, whatever it looked like; else the failure as it was."""
    twin = any(c.sizes == case.sizes and c.dtype == case.dtype and not c.any_transposed for c in passed)
    if case.any_transposed and twin and "contiguous tensors pass" not in str(failure):
        return (f"contiguous tensors pass but transposed ones do not ({case.describe()}): the kernel assumes a "
                f"memory layout somewhere; address every tensor with its own stride arguments. (What the "
                f"checker saw: {failure})")
    return str(failure)


#: Why a Python ``if``/``else`` on a block is wrong, for the hints that meet it.
_PYTHON_IF_ON_A_BLOCK = ("A Python `if`/`else` on a block does not choose lane by lane (the interpreter takes any "
                         "block as true, a GPU compiler refuses it)")
#: What to do about a tl.dot that sums in 16 bits (``out_dtype=``), refused at compile or read from the IR.
_SIXTEEN_BIT_SUM_FIX = ("A tl.dot on 16-bit blocks must still accumulate in float32, its default: leave out "
                        "`out_dtype` and convert the result afterwards if needed")


def _raised_hint(error) -> str:
    """What a student can do about an error Triton raised (in the interpreter or the GPU compiler),
    looked for in every error of the chain, as ``_refusal`` does."""
    raised = error_chain_text(error)
    if "Expected dtype ['fp32', 'fp64']" in raised:
        return (" tl.exp and the other math functions take float32 or float64: convert the loaded "
                "block with `.to(tl.float32)` first.")
    if "object has no attribute 'fn'" in raised:
        return (" A function that a kernel calls, such as the combine function of `tl.associative_scan`, must "
                "itself be a `@triton.jit` function (a plain `def` or a lambda is not).")
    if "arange's arguments must be of type tl.constexpr" in raised:
        return (" A block's size must be known when the kernel compiles: take it from a BLOCK_ argument (a "
                "tl.constexpr power of two), not from a size such as T or D, and mask the lanes past the size "
                "(`offs < n`).")
    if "incompatible dimensions" in raised:
        return (" Two blocks of different shapes met in one operation: a mask, an offset or a value "
                "built for another dimension (check which mask goes with which load and store).")
    if "Both operands must be same dtype" in raised:
        return (" tl.dot takes two blocks of one dtype: a float32 result (scores, a state) meeting a block as "
                "loaded needs `.to(other.dtype)` first, such as `tl.dot(scores.to(v.dtype), v)`.")
    if "error encountered during parsing" in raised:
        # The GPU compiler's own diagnostic goes to stderr, not into the error: name the usual cause.
        return (" The GPU compiler could not build the kernel; its diagnostic, printed above, names the line. "
                f"The usual cause: {_PYTHON_IF_ON_A_BLOCK}, and the same for `and`, `or`, `not`; use "
                "`tl.where(condition, a, b)` and `&`, `|`, `~`.")
    return ""


def _run_cases(exercise, cases, run_case, *, note=""):
    """Run each case; the first Failure (or a launch that raises) becomes the printed diagnosis."""
    passed = []
    for case in cases:
        LOADS.take()  # counts of an earlier case's diagnosis runs
        try:
            with watched_loads():
                run_case(case, passed)
        except Failure as failure:
            return report(exercise, False, f"✗ {exercise}: {_layout_first(case, passed, failure)}", passed)
        except NotImplementedError:
            return report(exercise, False, f"✗ {exercise}: a blank is still `raise NotImplementedError()`: "
                                           f"fill it in and run its cell again.", passed)
        except CompilationError as error:  # GPU mode: the launch compiles for the device first
            return report(exercise, False, f"✗ {exercise}: {_refusal(f'({case.describe()})', error)}"
                                           f"{_raised_hint(error)}", passed)
        except Exception as error:  # the student's kernel raised: say where, do not crash the notebook
            if _device.INTERPRETED and "outside of the scope of a kernel" in str(error):
                return report(exercise, False, f"✗ {exercise}: Triton was imported before ttx_tutorial, so its own "
                                               f"functions (tl.sum, tl.zeros, ...) cannot run in the interpreter. "
                                               f"Restart the kernel and import ttx_tutorial first.", passed)
            return report(exercise, False, f"✗ {exercise}: the kernel raised {launch_error(error)} "
                                           f"({case.describe()}).{_raised_hint(error)}", passed)
        passed.append(case)
    return report(exercise, True, success(exercise, passed, note), passed)


def _guarded_output(shape, dtype, transposed):
    return guarded(shape, dtype, fill=UNWRITTEN, transposed=transposed)


#: What changing the later rows of a sequence kernel's inputs and seeing earlier outputs change means.
FUTURE_LEAK = ("changing tokens {cut}..{last} changed outputs before token {cut}: a future token leaks into the "
               "past ({case}). Check the causal mask, the order of reading and updating the state, the "
               "transposes in the products, and that each load reads its own token's row (its stride "
               "arguments).")


def _sequence_diagnosis(case, out, inputs, spec, variants, rerun, passed, *, error, tol, leak=FUTURE_LEAK,
                        row_block=None):
    """Why a sequence kernel's output is wrong: a known wrong variant, a future token leaking,
    wrong strides, 16-bit sums; else the error itself."""
    if case.any_transposed and any(c.dtype == case.dtype and not c.any_transposed for c in passed):
        raise Failure(f"contiguous tensors pass but transposed ones do not ({case.describe()}): the kernel "
                      f"assumes a memory layout somewhere; address every tensor with its own stride arguments.")
    inputs64 = {name: tensor.double().cpu() for name, tensor in inputs.items()}
    right = spec(**inputs64)
    if out.shape[0] > 1:  # every program read the first sequence: its offset is missing on the loads
        first = spec(**{name: tensor[:1] for name, tensor in inputs64.items()}).expand_as(right)
        if relative_error(first, right) > 2 * tol and relative_error(out, first) <= 2 * tol:
            raise Failure(f"every sequence got the first sequence's result ({case.describe()}): each program "
                          f"must add its own offset (its program id times the sequence stride) to the pointers "
                          f"it loads from.")
        # Some loads add the offset and others do not: name the inputs every program read from sequence 0.
        names = list(inputs64)
        for size in range(1, len(names)):
            for first_only in itertools.combinations(names, size):
                mixed = spec(**{name: tensor[:1].expand_as(tensor) if name in first_only else tensor
                                for name, tensor in inputs64.items()})
                if relative_error(mixed, right) > 2 * tol and relative_error(out, mixed) <= 2 * tol:
                    which = " and ".join(first_only)
                    raise Failure(f"every program read {which} of the first sequence ({case.describe()}): the "
                                  f"load{'s' if size > 1 else ''} of {which} must add the program's offset too "
                                  f"(its program id times that tensor's sequence stride), as the other loads do.")
    for variant, message in variants:
        wrong = variant(**inputs64)  # None where the variant has no meaning for this case's shapes
        # A variant that equals the spec on this case (one token ahead of a one-token sequence)
        # cannot explain the error.
        if wrong is None:
            continue
        if relative_error(wrong, right) > 2 * tol and relative_error(out, wrong) <= 2 * tol:
            raise Failure(f"{message} ({case.describe()}).")
    _swapped_strides_diagnosis(case, out, inputs64, spec, right, tol)
    T = out.shape[1]
    # In the middle (off the chunk boundaries, so a leak inside the first chunks shows too) and
    # near the end (a leak inside the last chunk, which the first cut may not reach).
    for cut in sorted({(T - 1) // 2, T - 2}) if T > 2 else ():
        changed_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        for tensor in changed_inputs.values():
            tensor[:, cut:] = torch.randn_like(tensor[:, cut:], dtype=torch.float32).to(tensor.dtype)
        again = rerun(changed_inputs)
        if not torch.equal(again[:, :cut], out[:, :cut]):
            raise Failure(leak.format(cut=cut, last=T - 1, case=case.describe()))
    reason = precision_failure(case, error, passed)
    if reason:
        raise Failure(reason)
    if row_block is not None and T > row_block:
        first = relative_error(out[:, :row_block], right[:, :row_block])
        if first <= tol:
            raise Failure(f"the first {row_block} tokens are right, later ones wrong ({case.describe()}): what reaches "
                          f"a chunk from the chunks before it (the state, and its product with q) is missing or "
                          f"wrong. The state after a chunk must hold every earlier token's k_s v_sᵀ."
                          f"{_sixteen_bit_hint(case, error)}")
    raise Failure(f"wrong values: relative error {error:.2e}, tolerance {tol:.0e} ({case.describe()})."
                  f"{_wrong_values_hint(case, error, passed)}")


def _read_with_strides_swapped(x):
    """What a load that multiplies the token index by the feature stride, and the feature index
    by the token stride, reads from a contiguous (sequences, tokens, features) tensor: element
    (t, i) of each sequence's flat t + i * features. None where that would leave the sequence."""
    sequences, tokens, features = x.shape
    index = torch.arange(tokens)[:, None] + torch.arange(features)[None, :] * features
    if index.max() >= tokens * features:
        return None
    return x.reshape(sequences, tokens * features)[:, index]


def _swapped_strides_diagnosis(case, out, inputs64, spec, right, tol):
    """A load or store whose token index is multiplied by the feature stride and the other way
    round, on a contiguous case of (sequence, token, feature) tensors: each input read that way
    is tried in turn, and an output that is exactly the transpose of the right one (square
    tensors) is named as written that way."""
    if case.any_transposed:
        return
    for name, tensor in inputs64.items():
        swapped = _read_with_strides_swapped(tensor) if tensor.dim() == 3 else None
        if swapped is None:
            continue
        wrong = spec(**{n: swapped if n == name else t for n, t in inputs64.items()})
        if relative_error(wrong, right) > 2 * tol and relative_error(out, wrong) <= 2 * tol:
            raise Failure(f"{name} is read with its two stride arguments swapped ({case.describe()}): element "
                          f"(t, i) of {name} lies at t times its token stride plus i times its feature stride.")
    if out.dim() == 3 and out.shape[1] == out.shape[2]:
        written = out.double().cpu().transpose(-1, -2)
        if relative_error(written, right) <= 2 * tol:
            raise Failure(f"{case.output_name} is written with its two stride arguments swapped "
                          f"({case.describe()}): element (t, i) of {case.output_name} lies at t times its token "
                          f"stride plus i times its feature stride.")


def _sixteen_bit_hint(case, error) -> str:
    if case.dtype == torch.float32 and 1e-4 < error < 2e-2:
        return (" An error of this size in float32 usually means a value held in 16 bits somewhere: the state, "
                "or a load or product converted to float16 or bfloat16.")
    return ""


def _wrong_values_hint(case, error, passed) -> str:
    """What a wrong value's size, or the cases passed before it, say about where to look."""
    hint = _sixteen_bit_hint(case, error)
    if hint:
        return hint
    sizes = case.sizes
    if "D" in sizes and "E" in sizes and sizes["D"] != sizes["E"] and any(
            c.sizes.get("D") == c.sizes.get("E") and c.dtype == case.dtype and not c.any_transposed for c in passed):
        return (f" The case with D = E passed and this one has D = {sizes['D']}, E = {sizes['E']}: somewhere a size, "
                f"mask, offset or stride that belongs to a tensor with the last dimension D is used for one with "
                f"E, or the other way round.")
    return ""


def _check_sequence_case(case, passed, *, make_inputs, spec, out_shape, launch, variants, row_block,
                         uses_dot, row_name="tokens", dim_names=("sequence", None, None), leak=FUTURE_LEAK,
                         first_row_hint=None):
    inputs = make_inputs(case)

    def guarded_inputs(values):
        # every other input transposed, so a kernel that uses one tensor's strides for another fails too
        return {name: guarded_copy(t, transposed=case.input_transposed(index), name=f"{name}_ptr")
                for index, (name, t) in enumerate(values.items())}

    def rerun(new_inputs):
        out, _ = _guarded_output(out_shape(case), case.dtype, case.out_transposed)
        launch(guarded_inputs(new_inputs), out, case)
        return out

    out, allocation = _guarded_output(out_shape(case), case.dtype, case.out_transposed)
    launch(guarded_inputs(inputs), out, case)
    ref = spec(**{name: t.double().cpu() for name, t in inputs.items()})
    error = check_output(out, allocation, ref, case, row_dim=1, row_name=row_name, block=row_block,
                         dim_names=dim_names, passed=passed, first_row_hint=first_row_hint)
    tol = TOLERANCES[case.dtype]
    long_16bit = case.dtype != torch.float32 and out.shape[1] >= 256
    limit = min(tol, sixteen_bit_error_bound(ref, case.dtype)) if long_16bit else tol
    if error <= limit:
        return
    if uses_dot and case.dtype == torch.float32 and not _device.INTERPRETED and error < 1e-2:
        raise Failure(f"relative error {error:.1e} in float32 ({case.describe()}): on NVIDIA GPUs tl.dot rounds "
                      f"float32 operands to TF32 unless told `input_precision=\"ieee\"`. If every float32 tl.dot "
                      f"has it, a value held in 16 bits somewhere: the state, or a load or product converted to "
                      f"float16 or bfloat16.")
    _sequence_diagnosis(case, out, inputs, spec, variants, rerun, passed, error=error, tol=tol, leak=leak,
                        row_block=row_block)


def _qkv(case):
    s = case.sizes
    q, k, v = random_inputs(1, s["BH"], s["T"], s["D"], s["E"], dtype=case.dtype)
    return {"q": q[0], "k": k[0], "v": v[0]}


def _causal_variants(own_token="o_t must include k_t v_tᵀ: add it to the state first, then compute o_t from the "
                                "state"):
    return [
        (lambda q, k, v: causal_product64(q, k, v, mask="strict"),
         f"each token's own contribution is missing: {own_token}"),
        (lambda q, k, v: causal_product64(q, k, v, mask="one_ahead"),
         "the next token leaks in: o_t may use tokens up to t only (off by one in the causal mask)"),
        (lambda q, k, v: causal_product64(q, k, v, mask="none"),
         "every token sees the whole sequence: the causal mask is missing"),
        (lambda q, k, v: causal_product64(q, q, v),
         "o_t sums (q_t . q_s) v_s: k was loaded from q; k's load must use `k_ptr` and the `stride_k...` "
         "arguments"),
        (lambda q, k, v: causal_product64(k, k, v),
         "o_t sums (k_t . k_s) v_s: q was loaded from k; q's load must use `q_ptr` and the `stride_q...` "
         "arguments"),
    ]


def _sequence_cases(*, short_T, tail_T, long_T=512, small_D=12, small_E=20, names=("q", "k", "v"), output="o"):
    cases = [
        Case({"BH": 2, "T": short_T, "D": 16, "E": 16}),
        Case({"BH": 2, "T": tail_T, "D": small_D, "E": small_E}),
        # Several sequences: one token's q.k can nearly cancel, and one such sequence alone would
        # make a right float32 answer look wrong relative to its tiny norm.
        Case({"BH": 4, "T": 1, "D": 8, "E": 8}),
        # Inputs and output transposed unlike one another, both ways round: a kernel that addresses
        # a tensor with another's strides, or assumes a layout, fails one of the two.
        Case({"BH": 2, "T": tail_T, "D": small_D, "E": small_E}, transposed=True, output_transposed=False),
        Case({"BH": 2, "T": tail_T, "D": small_D, "E": small_E}, transposed=True, output_transposed=True,
             odd_inputs=True),
        Case({"BH": 1, "T": long_T, "D": 16, "E": 16}, dtype=torch.float16),
        Case({"BH": 2, "T": min(long_T, 48), "D": 16, "E": 16}, dtype=torch.bfloat16),
    ]
    return [dataclasses.replace(case, names=names, output_name=output) for case in cases]


def _without_blank(exercise, **functions):
    for name, function in functions.items():
        where = blank_in(function)
        if where:
            return report(exercise, False, blank_message(exercise, name, where))
    return None


def _precheck(exercise, kernel, expected, **functions):
    """The printed result when a blank is left or the kernel's arguments are not the spec's, else None."""
    blank = _without_blank(exercise, kernel=kernel, **functions)
    if blank is not None:
        return blank
    try:
        require_arguments(kernel, expected, exercise)
    except Failure as failure:
        return report(exercise, False, f"✗ {exercise}: {failure}")
    return None


def _refusal(where, error_or_message, culprits="") -> str:
    """A GPU compiler's refusal in plain words, with the fix when it is about tl.dot's sizes
    (``culprits``: which blocks are the too-short inner dimensions, when the caller knows)."""
    message = error_or_message if isinstance(error_or_message, str) else launch_error(error_or_message)
    # On a GPU the launch raises the error nested in others: its cause may be in any of them.
    full = message if isinstance(error_or_message, str) else error_chain_text(error_or_message)
    hint = (" The inner dimension K of a tl.dot (the columns of its first block, the rows of its second) must "
            f"be at least 16 for these operands{culprits}; M and N may be smaller. Pad such blocks to 16 and "
            "mask the loads." if ">= 16" in full else "")
    if "out_dtype=" in full and "unsupported" in full:
        hint = f" {_SIXTEEN_BIT_SUM_FIX}. `out_dtype=tl.float16` would sum in 16 bits too."
    if "Loop-carried variable" in full:
        hint = (" A value carried from one iteration of a loop to the next must keep its dtype and shape, which "
                "the interpreter does not enforce: start it as the block it becomes, such as a float32 state "
                "`tl.zeros((rows, columns), dtype=tl.float32)`.")
    return f"the GPU compiler refuses the kernel {where}: \"{message.splitlines()[0]}\".{hint}"


def _one_tf32_product(ttir: str) -> bool:
    """Whether a float32 ``tt.dot`` of the kernel's Triton IR takes one TF32 product (not 3xTF32)."""
    return any("tt.dot" in line and re.search(r"inputPrecision = tf32\b", line) and "xf32> *" in line
               for line in ttir.splitlines())


def _float32_products(ttir: str) -> tuple[int, int]:
    """(products on float32 operands, all products): the ``tt.dot`` lines of the kernel's Triton IR."""
    dots = [line for line in ttir.splitlines() if "tt.dot" in line and " * " in line]
    return sum("xf32> *" in line for line in dots), len(dots)


def _sixteen_bit_sums(ttir: str) -> int:
    """How many ``tt.dot`` of the kernel's Triton IR return (so accumulate in) float16 or bfloat16."""
    return sum(bool(re.search(r"-> tensor<[0-9x]*x(f16|bf16)>", line))
               for line in ttir.splitlines() if "tt.dot" in line and " * " in line)


def _compile_failure(kernel, arg_names, constexpr_sets, pointer_dtypes, inner_dimensions=None, *,
                     tensor_cores=False):
    """Compile for sm_80 and sm_90 with each set of constexprs and pointer dtype; the first
    refusal as a Failure. The interpreter runs any tl.dot shape, the GPU compiler does not.
    ``inner_dimensions``: {block name: the product it is the inner dimension K of}, to name the
    culprit of a refused size. Float32 pointers must not compile to one TF32 product (a GPU's
    default for float32 ``tl.dot``; 3xTF32 is near float32's accuracy and passes); with
    ``tensor_cores``, 16-bit ones must compile to 16-bit tensor-core products, which is what the
    blocks of at least 16 are for."""
    for constexprs in constexpr_sets:
        for dtype in pointer_dtypes:
            signature = {name: ("constexpr" if name in constexprs else
                                f"*{dtype_name(dtype)}" if name.endswith("_ptr") else "i32")
                         for name in arg_names}
            for target in COMPILE_TARGETS:
                result = compile_for_target(kernel, signature, constexprs, target=target)
                if not result.ok:
                    blocks = ", ".join(f"{k}={v}" for k, v in constexprs.items())
                    short = [f"{name}={constexprs[name]} in {product}" for name, product in (inner_dimensions or {}).items()
                             if constexprs.get(name, 16) < 16]
                    culprits = f" (here {' and '.join(short)})" if short else ""
                    raise Failure(_refusal(f"for {target} with {blocks}, {dtype_name(dtype)} inputs", result.message,
                                           culprits))
                products = result.tensor_core_instructions()
                if dtype == torch.float32 and _one_tf32_product(result.asm.get("ttir", "")):
                    raise Failure(f"compiled for {target} with float32 inputs, a tl.dot runs as one TF32 product "
                                  f"on tensor cores (about 1e-3 off; a GPU's default for float32 operands): give "
                                  f"every float32 tl.dot `input_precision=\"ieee\"`.")
                ptx_type = {torch.float16: ".f16", torch.bfloat16: ".bf16"}.get(dtype)
                if tensor_cores and ptx_type and not any(ptx_type in product for product in products):
                    raise Failure(f"compiled for {target} with {dtype_name(dtype)} inputs, the products use no "
                                  f"{dtype_name(dtype)} tensor-core instruction: tl.dot must take the 16-bit "
                                  f"blocks as they are loaded (no `.to(tl.float32)` before it), padded to at "
                                  f"least 16, which is what tensor cores take.")
                wide, total = _float32_products(result.asm.get("ttir", ""))
                narrow = _sixteen_bit_sums(result.asm.get("ttir", ""))
                if ptx_type and narrow:
                    raise Failure(f"compiled for {target} with {dtype_name(dtype)} inputs, {narrow} of the kernel's "
                                  f"{total} tl.dot products sum in {dtype_name(dtype)} (`out_dtype=` a 16-bit "
                                  f"type). {_SIXTEEN_BIT_SUM_FIX}.")
                if tensor_cores and ptx_type and wide:
                    raise Failure(f"compiled for {target} with {dtype_name(dtype)} inputs, {wide} of the kernel's "
                                  f"{total} tl.dot products take float32 operands, so they do not run as "
                                  f"{dtype_name(dtype)} tensor-core products: give every tl.dot its 16-bit blocks "
                                  f"as they are loaded (no `.to(tl.float32)` before it; cast a float32 block such "
                                  f"as the scores to the input dtype first).")


# --------------------------------------------------------------------------- 1. feature map

FEATURE_MAP_ARGS = ["x_ptr", "out_ptr", "T", "D", "stride_xt", "stride_xd", "stride_ot", "stride_od",
                    "BLOCK_T", "BLOCK_D"]
FEATURE_MAP_BLOCK_T = 16


def _feature_map_addressing(x_in, out, allocation, case) -> str | None:
    """The usual addressing mistake that gives exactly the output allocation the kernel left
    (strides swapped in the load or the store, a program's rows starting at its id, 1-D offsets
    where a tile needs 2-D ones), else None: each is replayed on the checker's buffers, program
    after program."""
    T, D, block = case.sizes["T"], case.sizes["D"], FEATURE_MAP_BLOCK_T
    source = torch.as_strided(x_in, (x_in.untyped_storage().nbytes() // x_in.element_size(),), (1,), 0)
    source, got = source.double().cpu(), allocation.double().cpu()
    (xt, xd), (ot, od) = x_in.stride(), out.stride()
    # (load strides, store strides, a program's first row per program id, 2-D offsets), message
    mistakes = [(((xd, xt), (ot, od), block, True), "x is read with its two strides swapped: element (t, d) of x is "
                                                    "at `t * stride_xt + d * stride_xd`"),
                (((xt, xd), (od, ot), block, True), "out is written with its two strides swapped: element (t, d) of "
                                                    "out is at `t * stride_ot + d * stride_od`"),
                (((xt, xd), (ot, od), 1, True), f"the programs' rows overlap: each starts at its program id, so later "
                                                f"rows are never written; a program's first row is its program id "
                                                f"times BLOCK_T (`pid * BLOCK_T`, here {block})")]
    if next_power_of_2(D) == block:  # 1-D offsets of rows and columns only run when both blocks are as long
        mistakes.append((((xt, xd), (ot, od), block, False),
                         "only one element of each row was written, on a diagonal: the offsets are 1-D, so lane i "
                         "of the rows meets lane i of the columns alone. A tile needs 2-D offsets, rows down and "
                         "columns across (`offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd`), and a mask "
                         "built the same way"))
    for ((load_t, load_d), (store_t, store_d), step, tile), message in mistakes:
        # Every store the mistake makes, as (element, value). Where several lanes or programs
        # store to one element, a GPU runs them in no fixed order: any of their values may stay.
        stores = []
        for pid in range(triton.cdiv(T, block)):
            t, d = pid * step + torch.arange(block), torch.arange(next_power_of_2(D))
            if tile:
                t, d = t[:, None], d[None, :]
            mask = (t < T) & (d < D)
            src = (x_in.storage_offset() + t * load_t + d * load_d)[mask]
            dst = (out.storage_offset() + t * store_t + d * store_d)[mask]
            if src.numel() and (src.min() < 0 or src.max() >= source.numel() or dst.min() < 0
                                or dst.max() >= got.numel()):
                break
            stores.append((dst, feature_map64(source[src]).to(case.dtype).double()))
        else:
            if _replay_matches(stores, got, TOLERANCES[case.dtype]):
                return message
    return None


def _replay_matches(stores, got, tolerance) -> bool:
    """Whether an allocation ``got`` is what the replayed ``stores`` (element indices and values,
    in any order) leave: every stored element holds one of the values stored there, every other
    one still holds the poison."""
    elements = torch.cat([dst for dst, _ in stores]) if stores else torch.zeros(0, dtype=torch.long)
    values = torch.cat([value for _, value in stores]) if stores else torch.zeros(0, dtype=got.dtype)
    close = torch.isclose(values, got[elements], rtol=2 * tolerance, atol=1e-6, equal_nan=True)
    matched = torch.zeros(got.numel(), dtype=torch.long).index_add_(0, elements, close.long())
    stored = torch.zeros(got.numel(), dtype=torch.bool)
    stored[elements] = True
    return bool((matched[stored] > 0).all() and (got[~stored] == UNWRITTEN).all())


def _feature_map_formula(x, out, ref, case) -> str | None:
    """Which part of elu(x) + 1 a wrong output gets wrong, when it is one formula's mistake."""
    x64, got = x.double().cpu(), out.double().cpu()
    tol = TOLERANCES[case.dtype]

    def matches(values):
        return bool(torch.isclose(got, values.to(case.dtype).double(), rtol=2 * tol, atol=1e-6).all())

    positive = x64 > 0
    right = torch.isclose(got, ref, rtol=2 * tol, atol=1e-6)
    if matches(torch.exp(x64)) or matches(x64 + 1):
        formula = "exp(x)" if matches(torch.exp(x64)) else "x + 1"
        return (f"every element got {formula}, whatever its sign: is there a `tl.where`? "
                f"{_PYTHON_IF_ON_A_BLOCK}: `tl.where(x > 0, x + 1.0, tl.exp(x))`")
    if matches(x64):
        return "the output is x itself: store φ, not the loaded block"
    if matches(torch.where(positive, torch.exp(x64), x64 + 1)):
        return ("the two formulas are swapped: `tl.where(condition, a, b)` takes a where the condition holds, so "
                "`tl.where(x > 0, x + 1.0, tl.exp(x))`")
    if right[positive].all() and not right[~positive].all():
        return "right where x > 0, wrong where x <= 0: there elu(x) = exp(x) - 1, so φ(x) = exp(x)"
    if right[~positive].all() and not right[positive].all():
        return "right where x <= 0, wrong where x > 0: there elu(x) = x, so φ(x) = x + 1"
    if case.dtype == torch.float32:
        for dtype in (torch.float16, torch.bfloat16):
            for rounded, where in ((ref.to(dtype).double(), "the result was rounded to {} before the store: "
                                    "convert it to the output's dtype, `.to(out_ptr.dtype.element_ty)`, not to a "
                                    "fixed 16-bit type"),
                                   (feature_map64(x64.to(dtype).double()), "x was rounded to {} before φ: compute "
                                    "in float32 (`.to(tl.float32)`)")):
                if relative_error(got, rounded) < relative_error(rounded, ref) / 4:
                    return "float32 inputs, but " + where.format(dtype_name(dtype))
    return None


def check_feature_map(kernel) -> CheckResult:
    """Exercise 1: ``out = elu(x) + 1`` for x (T, D), one program per block of BLOCK_T rows."""
    exercise = EXERCISE_NAMES["check_feature_map"]
    early = _precheck(exercise, kernel, FEATURE_MAP_ARGS)
    if early is not None:
        return early

    def run_case(case, passed):
        T, D = case.sizes["T"], case.sizes["D"]
        x = torch.randn(T, D, dtype=torch.float64).to(case.dtype).to(_device.DEVICE)
        x_in = guarded_copy(x, transposed=case.transposed, name="x_ptr")
        out, allocation = _guarded_output((T, D), case.dtype, case.out_transposed)
        grid = (triton.cdiv(T, FEATURE_MAP_BLOCK_T),)
        kernel[grid](x_in, out, T, D, *_stride_args(x_in, out),
                     BLOCK_T=FEATURE_MAP_BLOCK_T, BLOCK_D=next_power_of_2(D))
        ref = feature_map64(x.double().cpu())
        try:
            error = check_output(out.unsqueeze(0), allocation, ref.unsqueeze(0), case, row_dim=1, row_name="rows",
                                 block=FEATURE_MAP_BLOCK_T, passed=passed)
        except Failure:
            mistake = _feature_map_addressing(x_in, out, allocation, case)
            if mistake:
                raise Failure(f"{mistake} ({case.describe()}).") from None
            raise
        if error <= TOLERANCES[case.dtype]:
            return
        mistake = _feature_map_addressing(x_in, out, allocation, case) or _feature_map_formula(x, out, ref, case)
        if mistake:
            raise Failure(f"{mistake} ({case.describe()}).")
        if case.any_transposed and any(not c.any_transposed for c in passed):
            raise Failure(f"contiguous tensors pass but transposed ones do not ({case.describe()}): use the "
                          f"stride arguments (stride_xt, stride_xd, ...) for every address.")
        if torch.allclose(out.double().cpu(), torch.nn.functional.elu(x.double().cpu()),
                          rtol=2 * TOLERANCES[case.dtype], atol=1e-6):
            raise Failure(f"this is elu(x); the feature map is elu(x) + 1, positive everywhere ({case.describe()}).")
        raise Failure(f"wrong values: relative error {error:.2e}, tolerance {TOLERANCES[case.dtype]:.0e} "
                      f"({case.describe()}).")

    cases = [Case({"T": 32, "D": 16}), Case({"T": 37, "D": 16}), Case({"T": 1, "D": 5}),
             Case({"T": 50, "D": 24}),
             # x and the output transposed in turn: an elementwise kernel that addressed both as
             # contiguous would pass a case where both are transposed alike
             Case({"T": 37, "D": 16}, transposed=True, output_transposed=False, names=("x",)),
             Case({"T": 37, "D": 16}, output_transposed=True, names=("x",)),
             Case({"T": 37, "D": 16}, dtype=torch.float16), Case({"T": 37, "D": 16}, dtype=torch.bfloat16)]
    return _run_cases(exercise, cases, run_case)


# --------------------------------------------------------------------------- 2. recurrent

QKVO_STRIDES = _strides_names("q", "k", "v", "o", dims=["htd", "htd", "hte", "hte"])
RECURRENT_ARGS = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "T", "D", "E", *QKVO_STRIDES, "BLOCK_D", "BLOCK_E"]


def _launch_per_sequence(kernel, extra_constexprs=None):
    def launch(inputs, out, case):
        s = case.sizes
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        constexprs = {"BLOCK_D": next_power_of_2(s["D"]), "BLOCK_E": next_power_of_2(s["E"])}
        constexprs.update(extra_constexprs(case) if extra_constexprs else {})
        kernel[(s["BH"],)](q, k, v, out, s["T"], s["D"], s["E"], *_stride_args(q, k, v, out), **constexprs)
    return launch


def check_recurrent(kernel) -> CheckResult:
    """Exercise 2: the per-token recurrent kernel, one program per sequence of (BH, T, D) inputs."""
    exercise = EXERCISE_NAMES["check_recurrent"]
    early = _precheck(exercise, kernel, RECURRENT_ARGS)
    if early is not None:
        return early
    variants = _causal_variants() + [
        (lambda q, k, v: causal_product64(q, k, v, mask="own"),
         "each output holds only its own token's (q_t . k_t) v_t: the state must keep the sum of every token so "
         "far, so start it once, before the loop over tokens, and add to it (`state += ...`), never replace it"),
        (state_rows_summed64,
         "the state is summed over the wrong axis: S is D x E (a row per key dimension), and o_t = sum over d of "
         "q_t[d] S[d, :], a sum down the rows (`axis=0` of `state * q[:, None]`)"),
        (lambda q, k, v: causal_product64(q, v, k) if q.shape[-1] == v.shape[-1] else None,
         "o_t comes out as S q_t instead of Sᵀ q_t: either k and v are swapped in the outer product (the state "
         "adds k_t v_tᵀ, k down the rows and v along the columns: `k[:, None] * v[None, :]`), or the readout "
         "multiplies q along the columns and sums across them (it is `tl.sum(state * q[:, None], axis=0)`)"),
    ]
    options = dict(make_inputs=_qkv, spec=causal_product64, variants=variants, row_block=None,
                   out_shape=lambda c: (c.sizes["BH"], c.sizes["T"], c.sizes["E"]),
                   launch=_launch_per_sequence(kernel), uses_dot=False)
    cases = _sequence_cases(short_T=16, tail_T=13)

    def run_case(case, passed):
        _check_sequence_case(case, passed, **options)
        if case is cases[-1]:  # the interpreter accepts what a GPU compiler refuses (a state's dtype changing)
            _compile_failure(kernel, RECURRENT_ARGS, [{"BLOCK_D": 16, "BLOCK_E": 16}], (torch.float16,))

    return _run_cases(exercise, cases, run_case, note="; compiles for " + " and ".join(COMPILE_TARGETS))


# --------------------------------------------------------------------------- 3. small blocks

ONE_CHUNK_ARGS = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "T", "D", "E", *QKVO_STRIDES,
                  "BLOCK_T", "BLOCK_D", "BLOCK_E"]
ONE_CHUNK_MAX = 16


def check_small_dot(kernel, block_sizes) -> CheckResult:
    """Exercise 3: one chunk of at most 16 tokens as ((Q Kᵀ) ⊙ M) V with tl.dot, on blocks chosen by
    ``block_sizes(T, D, E) -> (BLOCK_T, BLOCK_D, BLOCK_E)``; right values in the interpreter and a
    kernel the GPU compiler accepts for sm_80 and sm_90."""
    exercise = EXERCISE_NAMES["check_small_dot"]
    early = _precheck(exercise, kernel, ONE_CHUNK_ARGS, block_sizes=block_sizes)
    if early is not None:
        return early
    chosen = {}

    def blocks(case):
        s = case.sizes
        sizes = tuple(block_sizes(s["T"], s["D"], s["E"]))
        for name, size, n in zip(("BLOCK_T", "BLOCK_D", "BLOCK_E"), sizes, (s["T"], s["D"], s["E"])):
            if size < n or size & (size - 1):
                raise Failure(f"block_sizes({s['T']}, {s['D']}, {s['E']}) gives {name}={size}: a block must be a "
                              f"power of two covering {n}.")
        chosen[sizes] = dict(zip(("BLOCK_T", "BLOCK_D", "BLOCK_E"), sizes))
        return chosen[sizes]

    bf16_ok = interpreter_bf16_dot_ok()
    cases = [c for c in _sequence_cases(short_T=8, tail_T=5, long_T=16, small_D=4, small_E=12)
             if bf16_ok or c.dtype != torch.bfloat16]
    cases[0] = dataclasses.replace(cases[0], sizes={"BH": 2, "T": 8, "D": 8, "E": 8})
    own_token = "o_t must include k_t v_tᵀ: keep the diagonal of the causal mask (`>=`, s <= t)"
    options = dict(make_inputs=_qkv, spec=causal_product64, variants=_causal_variants(own_token), row_block=None,
                   out_shape=lambda c: (c.sizes["BH"], c.sizes["T"], c.sizes["E"]),
                   launch=_launch_per_sequence(kernel, blocks), uses_dot=True)

    def run_case(case, passed):
        _check_sequence_case(case, passed, **options)
        if case is cases[-1]:
            _compile_failure(kernel, ONE_CHUNK_ARGS, list(chosen.values()), (torch.float16, torch.float32),
                             {"BLOCK_D": "q @ kᵀ", "BLOCK_T": "scores @ v"}, tensor_cores=True)

    return _run_cases(exercise, cases, run_case, note=_compile_note(bf16_ok))


def _compile_note(bf16_ok):
    note = "; compiles for " + " and ".join(COMPILE_TARGETS)
    return note if bf16_ok else note + ";" + BF16_DOT_NOTE


# --------------------------------------------------------------------------- 4. chunked

CHUNKED_ARGS = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "T", "D", "E", *QKVO_STRIDES,
                "CHUNK", "BLOCK_D", "BLOCK_E"]
CHUNK = 16


def _chunk_blocks(case):
    return {"CHUNK": CHUNK, "BLOCK_D": max(16, next_power_of_2(case.sizes["D"])),
            "BLOCK_E": max(16, next_power_of_2(case.sizes["E"]))}


def check_chunked(kernel) -> CheckResult:
    """Exercise 4: chunks of 16 tokens, intra-chunk scores with the causal mask and the state
    carried across chunks; one program per sequence."""
    exercise = EXERCISE_NAMES["check_chunked"]
    early = _precheck(exercise, kernel, CHUNKED_ARGS)
    if early is not None:
        return early
    bf16_ok = interpreter_bf16_dot_ok()
    cases = [c for c in _sequence_cases(short_T=32, tail_T=37, long_T=2048) if bf16_ok or c.dtype != torch.bfloat16]
    own_token = ("o_t must include k_t v_tᵀ: keep the diagonal of the chunk's causal mask (`>=`, s <= t); the "
                 "state carries the earlier chunks only, so it is read before the chunk's update")
    read_before_update = ("q @ S must see the earlier chunks only: read the state before adding this chunk's "
                          "kᵀ v to it, since the masked scores already count the chunk's tokens")
    chunk_variants = [
        (lambda q, k, v: chunk_mistake64(q, k, v, chunk=CHUNK, intra_mask=False),
         "within a chunk, token t also sees the chunk's later tokens: the scores q kᵀ need the causal mask "
         "(s <= t) before they multiply v"),
        (lambda q, k, v: chunk_mistake64(q, k, v, chunk=CHUNK, state_first=True),
         f"the chunk's own tokens are counted twice and its later tokens leak in: {read_before_update}"),
        (lambda q, k, v: chunk_mistake64(q, k, v, chunk=CHUNK, intra_mask=False, state_first=True),
         f"the causal mask inside the chunk is missing, and the state already holds the chunk: the scores q kᵀ "
         f"need the mask (s <= t), and {read_before_update}"),
        (lambda q, k, v: chunk_mistake64(q, k, v, chunk=CHUNK, intra=False),
         "only the earlier chunks reach the output (q S): the chunk's own masked scores times v are lost. "
         "The output is the sum of both terms: `o = ...` for one, `o += ...` for the other"),
        (lambda q, k, v: chunk_mistake64(q, k, v, chunk=CHUNK, scores_kq=True),
         "the chunk's scores are k qᵀ, transposed: row t must hold q_t . k_s, `tl.dot(q, tl.trans(k))`"),
    ]
    options = dict(make_inputs=_qkv, spec=causal_product64, variants=_causal_variants(own_token) + chunk_variants,
                   row_block=CHUNK,
                   out_shape=lambda c: (c.sizes["BH"], c.sizes["T"], c.sizes["E"]),
                   launch=_launch_per_sequence(kernel, _chunk_blocks), uses_dot=True)

    def run_case(case, passed):
        _check_sequence_case(case, passed, **options)
        if case is cases[-1]:
            _compile_failure(kernel, CHUNKED_ARGS, [_chunk_blocks(cases[0])], (torch.float16, torch.float32),
                             {"BLOCK_D": "q @ kᵀ and q @ S", "CHUNK": "scores @ v and kᵀ @ v"})

    return _run_cases(exercise, cases, run_case, note=_compile_note(bf16_ok))


# --------------------------------------------------------------------------- 5. scan step

SCAN_ARGS = ["states_ptr", "out_ptr", "S", "E", *_strides_names("s", "o", dims=["hsde", "hsde"]),
             "BLOCK_S", "BLOCK_E"]


def check_scan(kernel) -> CheckResult:
    """Exercise 5: the state entering each segment, an exclusive prefix sum over segments of
    states (BH, S, D, E) float32; one program per (sequence, row d of the state)."""
    exercise = EXERCISE_NAMES["check_scan"]
    early = _precheck(exercise, kernel, SCAN_ARGS)
    if early is not None:
        return early
    variants = [(lambda states: torch.cumsum(states, dim=1),
                 "each segment's own state is included (an inclusive scan): the state entering segment s is "
                 "the sum of segments 0..s-1 only; subtract the segment's own state, or shift by one"),
                (lambda states: torch.cumsum(states, dim=3) - states,
                 "the sums run along E, not along the segments: scan over axis 0 of the [BLOCK_S, BLOCK_E] block"),
                # row 0 of every program's sequence: the load leaves out the program's row
                (lambda states: exclusive_scan64(states[:, :, :1].expand_as(states)),
                 "every row d of the output holds row 0's entering states: the load must add the program's row "
                 "too (`row * stride_sd`), as the store adds it (`row * stride_od`)"),
                # a shifted load masked from row 2 on (`offs_s > 1`): segment 0 never enters the sum
                (lambda states: exclusive_scan64(states) - states[:, :1] * (torch.arange(states.shape[1]) >= 1)
                 .to(states)[None, :, None, None],
                 "the states entering segments 1, 2, ... all lack segment 0's state: every sum starts at segment 0. "
                 "With a shifted load, row s holds segment s - 1 for every s >= 1 (`offs_s >= 1`, not `> 1`)")]

    def make_inputs(case):
        s = case.sizes
        return {"states": torch.randn(s["BH"], s["S"], s["D"], s["E"], dtype=torch.float64)
                .float().to(_device.DEVICE)}

    def launch(inputs, out, case):
        s = case.sizes
        states = inputs["states"]
        kernel[(s["BH"], s["D"])](states, out, s["S"], s["E"], *_stride_args(states, out),
                                  BLOCK_S=next_power_of_2(s["S"]), BLOCK_E=next_power_of_2(s["E"]))

    leak = ("changing segments {cut}..{last} changed the states entering earlier segments ({case}): the sum "
            "runs the wrong way, or along another axis than the segments. The state entering segment s sums "
            "segments 0..s-1 only: scan from segment 0 up, along the segments (`offs_s` with `stride_ss`; the "
            "program's row d with `stride_sd`).")
    options = dict(make_inputs=make_inputs, spec=exclusive_scan64, variants=variants, row_block=None,
                   out_shape=lambda c: (c.sizes["BH"], c.sizes["S"], c.sizes["D"], c.sizes["E"]),
                   launch=launch, uses_dot=False, row_name="segments", leak=leak,
                   # segments left unwritten are named by check_output's rows, with the first-row hint
                   dim_names=("sequence", None, "row d", "column e"),
                   first_row_hint=(" That is the first segment: the state entering it is zero, and it is an "
                                   "output like the others, so store it too (a store shifted by one segment, or "
                                   "a walk that starts at segment 1, leaves it out)."))
    cases = [Case({"BH": 2, "S": 8, "D": 4, "E": 16}), Case({"BH": 2, "S": 5, "D": 3, "E": 20}),
             Case({"BH": 1, "S": 1, "D": 2, "E": 8}),
             # the states and the output transposed in turn: out addressed with the states' strides fails
             Case({"BH": 2, "S": 5, "D": 3, "E": 20}, transposed=True, output_transposed=False),
             Case({"BH": 2, "S": 5, "D": 3, "E": 20}, output_transposed=True)]
    cases = [dataclasses.replace(case, names=("states",)) for case in cases]
    return _run_cases(exercise, cases, lambda case, passed: _check_sequence_case(case, passed, **options))


# --------------------------------------------------------------------------- 6. backward: dQ

DQ_ARGS = ["do_ptr", "k_ptr", "v_ptr", "dq_ptr", "T", "D", "E",
           *_strides_names("do", "k", "v", "dq", dims=["hte", "htd", "hte", "htd"]), "BLOCK_D", "BLOCK_E"]


def check_dq(kernel) -> CheckResult:
    """Exercise 6: dQ of the causal product for an upstream gradient dO, one program per sequence."""
    exercise = EXERCISE_NAMES["check_dq"]
    early = _precheck(exercise, kernel, DQ_ARGS)
    if early is not None:
        return early

    def make_inputs(case):
        s = case.sizes
        do, _, _ = random_inputs(1, s["BH"], s["T"], s["E"], dtype=case.dtype)
        _, key, value = random_inputs(1, s["BH"], s["T"], s["D"], s["E"], dtype=case.dtype)
        # do and v (T, E) and k and dq (T, D) in alternate positions: the transposed cases then lay
        # out each pair of same-shaped tensors unlike one another
        return {"do": do[0], "v": value[0], "k": key[0]}

    def launch(inputs, out, case):
        s = case.sizes
        do, k, v = inputs["do"], inputs["k"], inputs["v"]
        kernel[(s["BH"],)](do, k, v, out, s["T"], s["D"], s["E"], *_stride_args(do, k, v, out),
                           BLOCK_D=next_power_of_2(s["D"]), BLOCK_E=next_power_of_2(s["E"]))

    variants = [(lambda do, k, v: dq64(do, k, v, mask="strict"),
                 "token t's own term (do_t . v_t) k_t is missing: add k_t and v_t to the state before using it"),
                (lambda do, k, v: dq64(do, k, v, mask="reverse"),
                 "this sums the tokens after t (the dK and dV recurrence, which walks backwards): dq_t sums "
                 "s <= t, walking forwards like the forward pass"),
                (lambda do, k, v: dq64(do, k, v, mask="none"),
                 "every token sees the whole sequence: the causal mask is missing"),
                (lambda do, k, v: dq64(do, k, v, mask="own"),
                 "each dq_t holds only its own token's (do_t . v_t) k_t: the state must keep the sum of every "
                 "token so far, so start it once, before the loop over tokens, and add to it (`state += ...`), "
                 "never replace it"),
                # the forward's roles kept, dO in q's place: a (T, E) result, comparable where D = E
                (lambda do, k, v: causal_product64(do, k, v) if k.shape[-1] == v.shape[-1] else None,
                 "this is the forward's product with dO in q's place, sum of (do_t . k_s) v_s: dq_t sums "
                 "(do_t . v_s) k_s, so the state pairs them the other way, v_s k_sᵀ (E x D)"),
                (lambda do, k, v: state_rows_summed64(do, v, k),
                 "the state is summed over the wrong axis: P is E x D (a row per value dimension), and dq_t = sum "
                 "over e of do_t[e] P[e, :], a sum down the rows (`axis=0` of `state * do[:, None]`)"),
                (_do_across_columns64,
                 "do_t multiplies the state along its columns (`state * do[None, :]`): P is E x D, and do_t has "
                 "one entry per row e, so it runs down the rows, `state * do[:, None]`"),
                # do, v and k in other roles of the causal product than (do, v, k)
                (lambda do, k, v: causal_product64(v, do, k),
                 "do and v are swapped: this sums (v_t . do_s) k_s. The state adds v_s k_sᵀ, and do_t reads it "
                 "(dq_t = sum over s <= t of (do_t . v_s) k_s)"),
                (lambda do, k, v: causal_product64(k, v, do) if k.shape[-1] == v.shape[-1] else None,
                 "do and k are swapped: this sums (k_t . v_s) do_s. The state adds v_s k_sᵀ (E x D), from the "
                 "tokens' k and v, and do_t reads it (dq_t = sum over s <= t of (do_t . v_s) k_s)")]
    options = dict(make_inputs=make_inputs, spec=dq64, variants=variants, row_block=None,
                   out_shape=lambda c: (c.sizes["BH"], c.sizes["T"], c.sizes["D"]),
                   launch=launch, uses_dot=False)
    cases = _sequence_cases(short_T=16, tail_T=13, names=("do", "v", "k"), output="dq")

    def run_case(case, passed):
        _check_sequence_case(case, passed, **options)
        if case is cases[-1]:  # the interpreter accepts what a GPU compiler refuses (a state's dtype changing)
            _compile_failure(kernel, DQ_ARGS, [{"BLOCK_D": 16, "BLOCK_E": 16}], (torch.float16,))

    return _run_cases(exercise, cases, run_case, note="; compiles for " + " and ".join(COMPILE_TARGETS))

