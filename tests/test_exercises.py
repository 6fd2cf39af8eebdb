"""The classroom exercises: checkers accept the solutions and name the mistakes, the student
notebooks are what the generator makes, and the grader isolates each submission.

Each exercise's kernel comes from its solution notebook (notebooks/exercises/solutions/), so
these tests check what students see. A wrong attempt is the solution with one plausible mistake
written in (a text replacement that must apply); the blank is the student version's cell.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

import ttx_tutorial
from ttx_tutorial import exercises
from ttx_tutorial.exercises import grading
from ttx_tutorial.exercises.sources import code_cells, notebook_text, run_cells, student_version
from ttx_tutorial.testing import run_python

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "notebooks" / "exercises" / "solutions"
STUDENTS = ROOT / "notebooks" / "exercises"
CHECK_CALL = "result = check_"


def exercise_namespace(stem, replacements=(), *, student=False):
    """Run an exercise notebook's code cells up to its check call, after ``replacements``
    (pairs of old, new text, each of which must occur in the kernel cell)."""
    notebook = json.loads((SOLUTIONS / f"{stem}.ipynb").read_text(encoding="utf-8"))
    if student:
        notebook = student_version(notebook)
    cells = [c for c in code_cells(notebook) if CHECK_CALL not in c and "result.passed" not in c]
    for old, new in replacements:
        matching = [i for i, cell in enumerate(cells) if old in cell]
        assert len(matching) == 1, f"{old!r} must occur in exactly one cell of {stem}"
        cells[matching[0]] = cells[matching[0]].replace(old, new)
    return run_cells(cells, {"__name__": "__main__"}, name=stem)


STORE_16_BIT = [("dtype=tl.float32)", "dtype=k_ptr.dtype.element_ty)"), (".to(tl.float32)", "")]

#: exercise: (notebook, checker call, [(name, replacements, expected words of the diagnosis)]); the
#: words are a string, a tuple of alternatives (CPU mode and a GPU diagnose some mistakes at different
#: stages), or None for a change that is no mistake.
EXERCISES = {
    "feature_map": ("ex1_masked_kernel", lambda ns: exercises.check_feature_map(ns["feature_map_kernel"]), [
        ("store_without_mask", [("phi.to(out_ptr.dtype.element_ty), mask=mask)", "phi.to(out_ptr.dtype.element_ty))")],
         "outside the output"),
        ("contiguous_rows_assumed",
         [("offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd", "offs_t[:, None] * D + offs_d[None, :]")],
         "transposed ones do not"),
        ("elu_without_plus_one", [("x + 1.0, tl.exp(x))", "x, tl.exp(x) - 1.0)")], "this is elu(x)"),
        ("both_tensors_addressed_as_contiguous",
         [("offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd", "offs_t[:, None] * D + offs_d[None, :]"),
          ("offs_t[:, None] * stride_ot + offs_d[None, :] * stride_od", "offs_t[:, None] * D + offs_d[None, :]")],
         "contiguous tensors pass but transposed ones do not"),
        ("store_with_the_input_s_strides",
         [("offs_t[:, None] * stride_ot + offs_d[None, :] * stride_od", "offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd")],
         "contiguous tensors pass but transposed ones do not"),
        ("column_stride_taken_as_one",
         [("offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd", "offs_t[:, None] * stride_xt + offs_d[None, :]")],
         "contiguous tensors pass but transposed ones do not"),
        ("row_mask_off_by_one", [("mask = (offs_t[:, None] < T)", "mask = (offs_t[:, None] <= T)")], "written `<=`"),
        ("exp_of_a_16_bit_block", [("    x = x.to(tl.float32)\n", "")], "convert the loaded block with `.to(tl.float32)`"),
        ("program_offset_left_out", [("offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)", "offs_t = tl.arange(0, BLOCK_T)")],
         "its own offset (its program id times 16)"),
        ("column_mask_left_out", [("mask = (offs_t[:, None] < T) & (offs_d[None, :] < D)", "mask = offs_t[:, None] < T")],
         "the store's other dimension overruns"),
        ("load_strides_swapped", [("offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd", "offs_t[:, None] * stride_xd + offs_d[None, :] * stride_xt")],
         "x is read with its two strides swapped"),
        ("store_strides_swapped", [("offs_t[:, None] * stride_ot + offs_d[None, :] * stride_od", "offs_t[:, None] * stride_od + offs_d[None, :] * stride_ot")],
         "out is written with its two strides swapped"),
        ("program_offset_without_the_block", [("offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)", "offs_t = pid + tl.arange(0, BLOCK_T)")],
         "a program's first row is its program id times BLOCK_T"),
        ("plus_one_on_both_branches", [("x + 1.0, tl.exp(x))", "x + 1.0, tl.exp(x) + 1.0)")], "wrong where x <= 0"),
        ("plus_one_left_out_where_positive", [("x + 1.0, tl.exp(x))", "x, tl.exp(x))")], "wrong where x > 0"),
        ("branches_swapped", [("tl.where(x > 0, x + 1.0, tl.exp(x))", "tl.where(x > 0, tl.exp(x), x + 1.0)")], "the two formulas are swapped"),
        ("python_if_on_a_block", [("phi = tl.where(x > 0, x + 1.0, tl.exp(x))", "phi = x + 1.0 if x > 0 else tl.exp(x)")],
         "does not choose lane by lane"),
        ("loaded_block_stored", [("phi.to(out_ptr.dtype.element_ty), mask=mask)", "x.to(out_ptr.dtype.element_ty), mask=mask)")],
         "the output is x itself"),
        ("row_mask_stops_one_row_early", [("mask = (offs_t[:, None] < T)", "mask = (offs_t[:, None] < T - 1)")],
         "That is the last row: does the loop over the rows (or the mask on them) cover every one"),
        ("block_of_runtime_size", [("offs_d = tl.arange(0, BLOCK_D)", "offs_d = tl.arange(0, D)")], "take it from a BLOCK_ argument"),
        ("column_mask_stops_one_column_early", [("(offs_d[None, :] < D)", "(offs_d[None, :] < D - 1)")],
         "column 15 of every row still holds the checker's poison. That is the last column"),
        # runs only where BLOCK_D = BLOCK_T (D = 16): each program writes the diagonal of its tile
        ("offsets_in_one_dimension", [("mask = (offs_t[:, None] < T) & (offs_d[None, :] < D)", "mask = (offs_t < T) & (offs_d < D)"),
                                      ("offs_t[:, None] * stride_xt + offs_d[None, :] * stride_xd", "offs_t * stride_xt + offs_d * stride_xd"),
                                      ("offs_t[:, None] * stride_ot + offs_d[None, :] * stride_od", "offs_t * stride_ot + offs_d * stride_od")],
         "on a diagonal: the offsets are 1-D"),
        ("stored_as_float16", [("phi.to(out_ptr.dtype.element_ty)", "phi.to(tl.float16)")], "rounded to fp16 before the store"),
        # off by ten times float32's tolerance only: the checker's tolerance is the dtype's, not a looser one
        ("slightly_off", [("phi = tl.where(x > 0, x + 1.0, tl.exp(x))", "phi = tl.where(x > 0, x + 1.0, tl.exp(x)) * 1.0001")],
         "wrong values: relative error 1.00e-04"),
    ]),
    "recurrent": ("ex2_recurrent_kernel", lambda ns: exercises.check_recurrent(ns["recurrent_kernel"]), [
        ("output_before_update", [("state += k[:, None] * v[None, :]\n        o = tl.sum(state * q[:, None], axis=0)",
                                   "o = tl.sum(state * q[:, None], axis=0)\n        state += k[:, None] * v[None, :]")],
         "own contribution is missing: o_t must include k_t v_tᵀ: add it to the state first"),
        ("state_in_16_bits", STORE_16_BIT, "16 bits"),
        ("k_read_with_q_strides", [("k_ptr + t * stride_kt + offs_d * stride_kd", "k_ptr + t * stride_qt + offs_d * stride_qd")],
         "transposed ones do not"),
        ("k_read_with_swapped_strides", [("k_ptr + t * stride_kt + offs_d * stride_kd", "k_ptr + t * stride_kd + offs_d * stride_kt")],
         "k is read with its two stride arguments swapped"),
        ("output_written_with_swapped_strides", [("o_ptr + t * stride_ot + offs_e * stride_oe", "o_ptr + t * stride_oe + offs_e * stride_ot")],
         "o is written with its two stride arguments swapped"),
        ("value_tail_unmasked", [("mask=mask_e, other=0.0)", ")"), (", mask=mask_e)", ")")], "outside the output"),
        ("output_columns_unmasked", [("o.to(o_ptr.dtype.element_ty), mask=mask_e)", "o.to(o_ptr.dtype.element_ty))")],
         "`offs_e < E`"),
        ("readout_sums_across_the_columns", [("o = tl.sum(state * q[:, None], axis=0)", "o = tl.sum(state * q[None, :], axis=1)")],
         "S q_t instead of Sᵀ q_t"),
        ("output_stored_with_the_values_strides", [("o_ptr + t * stride_ot + offs_e * stride_oe", "o_ptr + t * stride_vt + offs_e * stride_ve")],
         "contiguous tensors pass but transposed ones do not"),
        ("state_replaced_not_accumulated", [("state += k[:, None] * v[None, :]", "state = k[:, None] * v[None, :]")],
         "add to it (`state += ...`), never replace it"),
        ("state_summed_over_the_value_axis", [("o = tl.sum(state * q[:, None], axis=0)", "o = tl.sum(state * q[:, None], axis=1)")],
         "summed over the wrong axis"),
        ("k_and_v_swapped", [("state += k[:, None] * v[None, :]", "state += v[:, None] * k[None, :]")],
         "k and v are swapped"),
        ("store_masked_for_the_keys", [(", o.to(o_ptr.dtype.element_ty), mask=mask_e)", ", o.to(o_ptr.dtype.element_ty), mask=mask_d)")],
         "Two blocks of different shapes met"),
        ("state_started_in_float16", [("state = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)",
                                       "state = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float16)")], "GPU compiler refuses"),
        ("loop_stops_one_token_early", [("    for t in range(T):\n        k = tl.load", "    for t in range(T - 1):\n        k = tl.load")],
         "That is the last token: does the loop over the tokens"),
        ("value_mask_stops_one_column_early", [("mask_e = offs_e < E", "mask_e = offs_e < E - 1")],
         "of every token still holds the checker's poison. That is the last column"),
        ("loop_one_token_too_many", [("    for t in range(T):\n        k = tl.load", "    for t in range(T + 1):\n        k = tl.load")],
         "run one step too many"),
    ]),
    "small_dot": ("ex3_small_dot_blocks",
                  lambda ns: exercises.check_small_dot(ns["one_chunk_kernel"], ns["block_sizes"]), [
        ("blocks_below_16", [("max(16, triton.next_power_of_2(n))", "triton.next_power_of_2(n)")],
         "GPU compiler refuses"),
        ("k_read_with_swapped_strides", [("offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd",
                                          "offs_t[:, None] * stride_kd + offs_d[None, :] * stride_kt")],
         "k is read with its two stride arguments swapped"),
        ("output_written_with_swapped_strides", [("offs_t[:, None] * stride_ot + offs_e[None, :] * stride_oe",
                                                  "offs_t[:, None] * stride_oe + offs_e[None, :] * stride_ot")],
         "o is written with its two stride arguments swapped"),
        ("loads_without_masks", [(",\n                mask=mask_td, other=0.0)", ")"),
                                 (",\n                mask=mask_te, other=0.0)", ")")], "NaN"),
        ("diagonal_masked_out", [("offs_t[:, None] >= offs_t[None, :], scores", "offs_t[:, None] > offs_t[None, :], scores")],
         "own contribution is missing: o_t must include k_t v_tᵀ: keep the diagonal of the causal mask"),
        ("float32_products_on_small_blocks", [("                mask=mask_td, other=0.0)\n    k", "                mask=mask_td, other=0.0).to(tl.float32)\n    k"),
                                              ("                mask=mask_td, other=0.0)\n    v", "                mask=mask_td, other=0.0).to(tl.float32)\n    v"),
                                              ("                mask=mask_te, other=0.0)\n", "                mask=mask_te, other=0.0).to(tl.float32)\n"),
                                              ("max(16, triton.next_power_of_2(n))", "max(8, triton.next_power_of_2(n))")],
         ("no fp16 tensor-core instruction", "Pad such blocks to 16")),  # the interpreter; a GPU's compiler
        ("one_product_in_float32", [("                mask=mask_td, other=0.0)\n    k", "                mask=mask_td, other=0.0).to(tl.float32)\n    k"),
                                    ("                mask=mask_td, other=0.0)\n    v", "                mask=mask_td, other=0.0).to(tl.float32)\n    v")],
         "1 of the kernel's 2 tl.dot products take float32 operands"),
        # right in the interpreter (T <= 16 keeps the sums short), but not the float32 sums tensor cores give
        ("scores_summed_in_16_bits", [('scores = tl.dot(q, tl.trans(k), input_precision="ieee")',
                                       'scores = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=q.dtype)')],
         # A GPU's Triton 3.6 refuses out_dtype=bfloat16 at compile; the float16 case is read from the IR.
         "must still accumulate in float32, its default"),
        ("sequence_offset_left_out", [("q_ptr + seq * stride_qh + ", "q_ptr + "), ("k_ptr + seq * stride_kh + ", "k_ptr + "),
                                      ("v_ptr + seq * stride_vh + ", "v_ptr + ")], "the first sequence's result"),
        ("sequence_offset_left_out_of_v", [("v_ptr + seq * stride_vh + ", "v_ptr + ")], "every program read v of the first sequence"),
        ("sequence_offset_on_q_only", [("k_ptr + seq * stride_kh + ", "k_ptr + "), ("v_ptr + seq * stride_vh + ", "v_ptr + ")],
         "every program read k and v of the first sequence"),
        ("k_loaded_from_q", [("k = tl.load(k_ptr + seq * stride_kh + offs_t[:, None] * stride_kt + offs_d[None, :] * stride_kd",
                              "k = tl.load(q_ptr + seq * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :] * stride_qd")],
         "k was loaded from q"),
    ]),
    "chunked": ("ex4_chunked_kernel", lambda ns: exercises.check_chunked(ns["chunked_kernel"]), [
        ("scores_not_cast_for_the_product", [("o = tl.dot(scores.to(v.dtype), v,", "o = tl.dot(scores, v,")],
         "tl.dot takes two blocks of one dtype"),
        # T = 32 tokens of 16 features: the swapped read is no transpose, and is named all the same
        ("v_read_with_swapped_strides", [("rows[:, None] * stride_vt + offs_e[None, :] * stride_ve",
                                          "rows[:, None] * stride_ve + offs_e[None, :] * stride_vt")],
         "v is read with its two stride arguments swapped"),
        ("diagonal_masked_out", [("causal = offs_c[:, None] >= offs_c[None, :]", "causal = offs_c[:, None] > offs_c[None, :]")],
         "own contribution is missing"),
        ("state_updated_before_use",
         [("        o += tl.dot(q, state.to(q.dtype), input_precision=\"ieee\")\n"
           "        state += tl.dot(tl.trans(k), v, input_precision=\"ieee\")\n",
           "        state += tl.dot(tl.trans(k), v, input_precision=\"ieee\")\n"
           "        o += tl.dot(q, state.to(q.dtype), input_precision=\"ieee\")\n")],
         "counted twice"),
        ("mask_left_out_inside_the_chunk", [("        scores = tl.where(causal, scores, 0.0)\n", "")],
         "need the causal mask"),
        ("mask_left_out_and_state_updated_before_use",
         [("        scores = tl.where(causal, scores, 0.0)\n", ""),
          ("        o += tl.dot(q, state.to(q.dtype), input_precision=\"ieee\")\n"
           "        state += tl.dot(tl.trans(k), v, input_precision=\"ieee\")\n",
           "        state += tl.dot(tl.trans(k), v, input_precision=\"ieee\")\n"
           "        o += tl.dot(q, state.to(q.dtype), input_precision=\"ieee\")\n")],
         "mask inside the chunk is missing, and the state already holds"),
        ("key_load_unmasked", [("stride_kd,\n                    mask=mask_td, other=0.0)", "stride_kd)")], "NaN"),
        ("earlier_chunks_left_out", [("        o += tl.dot(q, state.to(q.dtype), input_precision=\"ieee\")\n", "")],
         "the first 16 tokens are right"),
        ("diagonal_masked_out_keeps_order", [("causal = offs_c[:, None] >= offs_c[None, :]",
                                              "causal = offs_c[:, None] > offs_c[None, :]")], "`>=`"),
        ("store_mask_off_by_one", [("        mask_te = (rows[:, None] < T) & (offs_e[None, :] < E)",
                                    "        mask_te = (rows[:, None] <= T) & (offs_e[None, :] < E)")], "written `<=`"),
        ("float32_products_left_to_tf32", [(', input_precision="ieee")', ")")],
         ("runs as one TF32 product", "rounds float32 operands to TF32")),  # compiled in CPU mode; run on a GPU
        ("float32_products_in_3xtf32", [(', input_precision="ieee")', ', input_precision="tf32x3")')], None),
        ("state_rounded_to_16_bits", [("state += tl.dot(tl.trans(k), v, input_precision=\"ieee\")",
                                       "state = (state + tl.dot(tl.trans(k), v, input_precision=\"ieee\"))"
                                       ".to(q.dtype).to(tl.float32)")], "16 bits"),
        # softmax attention's habit: infinities, not unwritten elements
        ("masked_scores_set_to_minus_inf", [("scores = tl.where(causal, scores, 0.0)", "scores = tl.where(causal, scores, float(\"-inf\"))")],
         "a masked-off score is 0.0"),
        # the mask compares a token's place in the sequence with a key's place in the chunk: right in the
        # first chunk only, a leak inside the later ones
        ("mask_on_absolute_rows", [("scores = tl.where(causal, scores, 0.0)", "scores = tl.where(rows[:, None] >= offs_c[None, :], scores, 0.0)")],
         "a future token leaks into the past"),
        ("chunk_term_replaced_by_the_state_term", [("o += tl.dot(q, state.to(q.dtype)", "o = tl.dot(q, state.to(q.dtype)")],
         "the chunk's own masked scores times v are lost"),
        ("scores_transposed", [("scores = tl.dot(q, tl.trans(k), input_precision=\"ieee\")", "scores = tl.dot(k, tl.trans(q), input_precision=\"ieee\")")],
         "the chunk's scores are k qᵀ"),
        ("state_held_in_float16", [("state = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)", "state = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float16)"),
                                   ("state += tl.dot(tl.trans(k), v, input_precision=\"ieee\")",
                                    "state += tl.dot(tl.trans(k), v, input_precision=\"ieee\").to(tl.float16)")],
         "a value held in 16 bits"),
    ]),
    "scan": ("ex5_scan_step", lambda ns: exercises.check_scan(ns["exclusive_scan_kernel"]), [
        ("inclusive_scan", [("tl.cumsum(block, axis=0) - block", "tl.cumsum(block, axis=0)")], "inclusive scan"),
        ("scan_along_e", [("tl.cumsum(block, axis=0) - block", "tl.cumsum(block, axis=1) - block")], "along E"),
        ("store_without_mask", [("entering, mask=mask)", "entering)")], "outside the output"),
        ("output_addressed_with_the_states_strides",
         [("out_ptr + seq * stride_oh + row * stride_od + offs_s[:, None] * stride_os + offs_e[None, :] * stride_oe",
           "out_ptr + seq * stride_sh + row * stride_sd + offs_s[:, None] * stride_ss + offs_e[None, :] * stride_se")],
         "contiguous tensors pass but transposed ones do not"),
        ("segments_addressed_with_the_row_stride", [("offs_s[:, None] * stride_ss", "offs_s[:, None] * stride_sd"),
                                                    ("row * stride_sd\n", "row * stride_ss\n")],
         "or along another axis than the segments"),
        ("program_ids_swapped", [("    seq = tl.program_id(0)\n    row = tl.program_id(1)\n",
                                  "    seq = tl.program_id(1)\n    row = tl.program_id(0)\n")], "wrong axis of the grid"),
        # the store adds the program's row, the load does not: every row scans row 0
        ("row_left_out_of_the_load", [("seq * stride_sh + row * stride_sd\n", "seq * stride_sh\n")],
         "holds row 0's entering states"),
        # the exact form of the hint, its mask off by one: row 1 loses segment 0, and so does every later sum
        ("shifted_load_masked_from_row_2", [("+ offs_s[:, None] * stride_ss + offs_e[None, :] * stride_se, mask=mask,",
                                             "+ (offs_s[:, None] - 1) * stride_ss + offs_e[None, :] * stride_se,\n"
                                             "                    mask=mask & (offs_s[:, None] > 1),"),
                                            ("tl.cumsum(block, axis=0) - block", "tl.cumsum(block, axis=0)")],
         "lack segment 0's state"),
        # the inclusive sums stored one segment on: segment 0's entering state, zero, is never stored
        ("stored_one_segment_on", [("tl.cumsum(block, axis=0) - block", "tl.cumsum(block, axis=0)"),
                                   ("offs_s[:, None] * stride_os + offs_e[None, :] * stride_oe,\n             entering, mask=mask)",
                                    "(offs_s[:, None] + 1) * stride_os + offs_e[None, :] * stride_oe,\n"
                                    "             entering, mask=mask & (offs_s[:, None] + 1 < S))")],
         "the state entering it is zero"),
    ]),
    "dq": ("ex6_backward_dq", lambda ns: exercises.check_dq(ns["dq_kernel"]), [
        ("output_before_update", [("state += v[:, None] * k[None, :]\n        dq = tl.sum(state * do[:, None], axis=0)",
                                   "dq = tl.sum(state * do[:, None], axis=0)\n        state += v[:, None] * k[None, :]")],
         "own term"),
        ("walks_backwards", [("    for t in range(T):\n", "    for step in range(T):\n        t = T - 1 - step\n")],
         "tokens after t"),
        ("state_in_16_bits", STORE_16_BIT, "16 bits"),
        ("k_read_with_swapped_strides", [("k_ptr + t * stride_kt + offs_d * stride_kd", "k_ptr + t * stride_kd + offs_d * stride_kt")],
         "k is read with its two stride arguments swapped"),
        ("sequence_offset_left_out", [("    dq_ptr += seq * stride_dqh\n", "")], "sequence 1: every element of it still holds"),
        ("dq_stored_with_the_keys_strides", [("dq_ptr + t * stride_dqt + offs_d * stride_dqd", "dq_ptr + t * stride_kt + offs_d * stride_kd")],
         "contiguous tensors pass but transposed ones do not"),
        ("v_read_with_the_output_gradient_s_strides", [("v_ptr + t * stride_vt + offs_e * stride_ve", "v_ptr + t * stride_dot + offs_e * stride_doe")],
         "contiguous tensors pass but transposed ones do not"),
        ("state_replaced_not_accumulated", [("state += v[:, None] * k[None, :]", "state = v[:, None] * k[None, :]")],
         "add to it (`state += ...`), never replace it"),
        ("forward_roles_kept", [("state = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)", "state = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)"),
                                ("state += v[:, None] * k[None, :]", "state += k[:, None] * v[None, :]")],
         "dO in q's place"),
        # the interpreter lets the loop change the state's dtype; a GPU compiler refuses the kernel
        ("state_started_in_float16", [("state = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)",
                                       "state = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float16)")], "must keep its dtype and shape"),
        ("state_started_as_a_python_float", [("state = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)", "state = 0.0")],
         "GPU compiler refuses"),
        ("state_summed_over_the_value_axis", [("dq = tl.sum(state * do[:, None], axis=0)", "dq = tl.sum(state * do[:, None], axis=1)")],
         "summed over the wrong axis"),
        ("output_gradient_read_with_the_keys_strides", [("do_ptr + t * stride_dot + offs_e * stride_doe", "do_ptr + t * stride_kt + offs_e * stride_kd")],
         "The case with D = E passed"),
        ("loop_starts_one_token_late", [("    for t in range(T):\n", "    for t in range(1, T):\n")], "That is the first token"),
        ("output_gradient_and_values_swapped", [("state += v[:, None] * k[None, :]", "state += do[:, None] * k[None, :]"),
                                                ("dq = tl.sum(state * do[:, None], axis=0)", "dq = tl.sum(state * v[:, None], axis=0)")],
         "do and v are swapped"),
        # an E x E state: fails to run where D != E, after the first case (D = E) has diagnosed it
        ("output_gradient_and_keys_swapped", [("state = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)",
                                               "state = tl.zeros((BLOCK_E, BLOCK_E), dtype=tl.float32)"),
                                              ("state += v[:, None] * k[None, :]", "state += v[:, None] * do[None, :]"),
                                              ("dq = tl.sum(state * do[:, None], axis=0)", "dq = tl.sum(state * k[:, None], axis=0)")],
         "do and k are swapped"),
        ("output_gradient_across_the_state_s_columns", [("dq = tl.sum(state * do[:, None], axis=0)",
                                                         "dq = tl.sum(state * do[None, :], axis=0)")],
         "along its columns"),
    ]),
}

WRONG_ATTEMPTS = [pytest.param(name, attempt, replacements, words, id=f"{name}-{attempt}")
                  for name, (_, _, attempts) in EXERCISES.items() for attempt, replacements, words in attempts]


@pytest.mark.parametrize("name", EXERCISES)
def test_solution_passes(name, capsys):
    stem, check, _ = EXERCISES[name]
    result = check(exercise_namespace(stem))
    assert result.passed, result.message
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("✓"), "success is one printed line"


@pytest.mark.parametrize("name", EXERCISES)
def test_blank_is_reported(name, capsys):
    stem, check, _ = EXERCISES[name]
    result = check(exercise_namespace(stem, student=True))
    assert not result.passed
    assert "still has the blank" in result.message
    assert capsys.readouterr().out.count("✗") == 1, "one diagnosis, printed once"


@pytest.mark.parametrize("name, attempt, replacements, words", WRONG_ATTEMPTS)
def test_wrong_attempt_gets_its_diagnosis(name, attempt, replacements, words):
    """``words`` None: not a mistake after all, which the checker must accept."""
    stem, check, _ = EXERCISES[name]
    result = check(exercise_namespace(stem, replacements))
    if words is None:
        assert result.passed, result.message
        return
    assert not result.passed
    assert any(w in result.message for w in ((words,) if isinstance(words, str) else words)), result.message



def test_a_compiler_error_raised_at_launch_is_named_by_its_own_message():
    """On a GPU the launch compiles the kernel, and Triton's code generator wraps what it refuses
    in a CompilationError whose text starts "at LINE:COLUMN:" and ends with the reason: the
    diagnosis quotes the reason and gives its hint, as it does for the CPU's compile for a target."""
    import ast

    from triton.compiler.errors import CompilationError

    from ttx_tutorial.exercises import checkers
    from ttx_tutorial.exercises._harness import launch_error

    src = "def kernel():\n    for t in range(T):\n        state += x\n"
    reason = AssertionError("Loop-carried variable state has initial type <['16', '16'], fp16> but is "
                            "re-assigned to <['16', '16'], fp32> in loop! Please make sure that the type stays consistent.")
    try:
        try:
            raise reason
        except AssertionError as e:  # as triton/compiler/code_generator.py wraps it
            raise CompilationError(src, ast.parse(src).body[0].body[0], repr(e)) from None
    except CompilationError as error:
        assert str(error).startswith("at 2:4:")
        assert "Loop-carried variable state" in launch_error(error)
        assert "must keep its dtype and shape" in checkers._refusal("(a case)", error)


def test_gpu_only_refusals_get_their_hints():
    """Two refusals only a GPU run raises, each with the hint its wrong attempt's test expects there:
    a Python if/else on a block fails the GPU compiler's IR check, whose diagnostic goes to stderr
    and leaves only "error encountered during parsing" in the error (Triton 3.6), and
    `out_dtype=tl.bfloat16` is refused at compile by Triton 3.6, where 3.9 compiles it."""
    from ttx_tutorial.exercises import checkers

    parsing = RuntimeError("error encountered during parsing")
    assert "does not choose lane by lane" in checkers._raised_hint(parsing)
    refused = ValueError("out_dtype=bfloat16 is unsupported. Please use out_dtype=float32/float16 and cast with "
                         "`.to(tl.bfloat16)`")
    assert "must still accumulate in float32, its default" in checkers._refusal("(a case)", refused)
    assert checkers._raised_hint(RuntimeError("something else")) == ""


def test_swapped_store_strides_are_named_whichever_program_wrote_last():
    """Out's strides swapped make the two programs of a (32, 16) case store to some of the same
    elements. The interpreter runs the programs in order, a GPU in none: on an H100 the diagnosis,
    replayed in the interpreter's order, did not match. Here the stores are made last program
    first, as a GPU may leave them; the replay must accept either writer's value, and still
    refuse a value nobody stored or an overwritten poison."""
    import math

    import torch

    from ttx_tutorial.exercises import checkers
    from ttx_tutorial.exercises._harness import Case

    case = Case({"T": 32, "D": 16})
    x_in = checkers.guarded_copy(torch.randn(32, 16), transposed=False, name="x_ptr")
    out, allocation = checkers._guarded_output((32, 16), torch.float32, False)
    source = torch.as_strided(x_in, (x_in.untyped_storage().nbytes() // 4,), (1,), 0)
    written = torch.as_strided(out, (out.untyped_storage().nbytes() // 4,), (1,), 0)
    (xt, xd), (ot, od) = x_in.stride(), out.stride()
    for pid in (1, 0):
        t, d = (pid * 16 + torch.arange(16))[:, None], torch.arange(16)[None, :]
        written[(out.storage_offset() + t * od + d * ot).flatten()] = checkers.feature_map64(
            source[(x_in.storage_offset() + t * xt + d * xd).flatten()].double()).float()
    assert "out is written with its two strides swapped" in checkers._feature_map_addressing(
        x_in, out, allocation, case)

    stores = [(torch.tensor([0, 1, 2]), torch.tensor([10.0, 11.0, 12.0])),
              (torch.tensor([2, 3]), torch.tensor([22.0, 23.0]))]
    for shared in (12.0, 22.0):
        assert checkers._replay_matches(stores, torch.tensor([10.0, 11.0, shared, 23.0, math.inf]), 1e-6)
    assert not checkers._replay_matches(stores, torch.tensor([10.0, 11.0, 17.0, 23.0, math.inf]), 1e-6)
    assert not checkers._replay_matches(stores, torch.tensor([10.0, 11.0, 12.0, 23.0, 0.0]), 1e-6)


#: Mistakes that only the interpreter's watched loads reveal (on a GPU, reads past an edge may fault
#: or pass, and switched-off lanes may hold zeros): (exercise, attempt, replacements, words).
WATCHED_LOAD_ATTEMPTS = [
    ("small_dot", "loads_without_other", [(",\n                mask=mask_td, other=0.0)", ", mask=mask_td)"),
                                          (",\n                mask=mask_te, other=0.0)", ", mask=mask_te)")],
     "without `other=`"),
    ("small_dot", "masks_on_tokens_only", [("mask_td = (offs_t[:, None] < T) & (offs_d[None, :] < D)",
                                            "mask_td = offs_t[:, None] < T")], "k_ptr: 8 past its last element"),
    ("small_dot", "token_masks_with_le", [("mask_td = (offs_t[:, None] < T)", "mask_td = (offs_t[:, None] <= T)"),
                                           ("mask_te = (offs_t[:, None] < T)", "mask_te = (offs_t[:, None] <= T)")],
     "a mask written `<=` where it needs `<`"),
    ("scan", "load_unmasked", [(", mask=mask, other=0.0)", ")")], "edge of an input (states_ptr: 300 past its last"),
    ("scan", "previous_segment_loaded_at_segment_0", [("+ offs_s[:, None] * stride_ss + offs_e", "+ (offs_s[:, None] - 1) * stride_ss + offs_e"),
                                                      ("tl.cumsum(block, axis=0) - block", "tl.cumsum(block, axis=0)")],
     "states_ptr: 64 before its first element"),
    ("scan", "rows_not_offset", [("seq * stride_sh + row * stride_sd\n", "seq * stride_sh\n"), ("row * stride_od + ", "")], "row d 1, 2, 3"),
    ("scan", "suffix_sums", [("tl.cumsum(block, axis=0) - block", "tl.sum(block, axis=0)[None, :] - tl.cumsum(block, axis=0)")],
     "runs the wrong way"),
    ("feature_map", "bfloat16_arithmetic", [("    x = x.to(tl.float32)\n    phi = tl.where(x > 0, x + 1.0, tl.exp(x))",
                                             "    phi = tl.where(x > 0, x + 1, tl.exp(x.to(tl.float32)).to(x.dtype))")],
     "arithmetic on bfloat16 values wrong"),
    ("scan", "combine_function_not_jitted", [("tl.cumsum(block, axis=0) - block", "tl.associative_scan(block, 0, lambda a, b: a + b) - block")],
     "must itself be a `@triton.jit` function"),
    ("dq", "bfloat16_loads", [(", mask=mask_d, other=0.0).to(tl.float32)", ", mask=mask_d, other=0.0)"),
                              (", mask=mask_e, other=0.0).to(tl.float32)\n        do", ", mask=mask_e, other=0.0)\n        do"),
                              ("offs_e * stride_doe, mask=mask_e, other=0.0).to(tl.float32)", "offs_e * stride_doe, mask=mask_e, other=0.0)")],
     "arithmetic on bfloat16 values wrong"),
]

#: Attempts whose mistake only the interpreter shows (its watched loads, its bfloat16 arithmetic).
INTERPRETER_ONLY = ("loads_without_other", "masks_on_tokens_only", "token_masks_with_le", "load_unmasked", "previous_segment_loaded_at_segment_0",
                    "bfloat16_arithmetic", "bfloat16_loads", "combine_function_not_jitted")


@pytest.mark.parametrize("name, attempt, replacements, words", [pytest.param(*a, id=f"{a[0]}-{a[1]}")
                                                                 for a in WATCHED_LOAD_ATTEMPTS])
def test_interpreter_watches_loads_and_names_the_slices(name, attempt, replacements, words):
    if attempt in INTERPRETER_ONLY and not ttx_tutorial.INTERPRETED:
        pytest.skip("the interpreter's own behaviour")
    stem, check, _ = EXERCISES[name]
    result = check(exercise_namespace(stem, replacements))
    assert not result.passed
    assert words in result.message, result.message


def test_kernel_with_other_arguments_is_named(capsys):
    namespace = exercise_namespace("ex1_masked_kernel", [("stride_ot, stride_od,", "stride_o,")])
    result = exercises.check_feature_map(namespace["feature_map_kernel"])
    assert not result.passed and "arguments must be exactly" in result.message


def test_bf16_dot_on_cpu_is_not_blamed_on_the_student():
    if ttx_tutorial.on_gpu():
        pytest.skip("the interpreter's bfloat16 tl.dot only matters in CPU mode")
    from ttx_tutorial.exercises._probe import bf16_dot_error

    result = exercises.check_chunked(exercise_namespace("ex4_chunked_kernel")["chunked_kernel"])
    if bf16_dot_error() < 1e-2:
        assert "bfloat16" in result.message and "skipped" not in result.message
    else:
        assert result.passed and "bfloat16 skipped: this interpreter's bfloat16 tl.dot is wrong" in result.message


# --------------------------------------------------------------------------- one source, two versions

@pytest.mark.parametrize("source", sorted(SOLUTIONS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_committed_student_version_is_generated(source):
    expected = notebook_text(student_version(json.loads(source.read_text(encoding="utf-8")), name=source.name))
    committed = STUDENTS / source.name
    assert committed.exists(), f"run: python -m ttx_tutorial.exercises generate"
    assert committed.read_text(encoding="utf-8") == expected, \
        f"{committed} differs from its generated version: run python -m ttx_tutorial.exercises generate"


def test_every_student_notebook_has_a_source():
    assert {p.name for p in STUDENTS.glob("*.ipynb")} == {p.name for p in SOLUTIONS.glob("*.ipynb")}
    assert len(list(SOLUTIONS.glob("*.ipynb"))) >= 6


SOLUTION_CELL = {"nbgrader": {"grade": False, "grade_id": "answer", "locked": False, "schema_version": 3,
                               "solution": True, "task": False}}
GRADE_CELL = {"nbgrader": {"grade": True, "grade_id": "check", "locked": True, "points": 1, "schema_version": 3,
                           "solution": False, "task": False}}


def _notebook(*cells):
    """A notebook of (kind, source) or (kind, source, metadata) cells."""
    return {"cells": [{"cell_type": kind, "metadata": dict(rest[0]) if rest else {}, "source": text,
                       **({"outputs": [{"output_type": "stream", "name": "stdout", "text": "42"}],
                           "execution_count": 3} if kind == "code" else {})} for kind, text, *rest in cells],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_student_version_follows_nbgrader():
    notebook = _notebook(
        ("code", "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n", SOLUTION_CELL),
        ("markdown", "Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION\n", SOLUTION_CELL),
        ("code", "### BEGIN HIDDEN TESTS\nassert f(1) == 2\n### END HIDDEN TESTS\n", GRADE_CELL),
        ("code", "print(f(1))\n### BEGIN HIDDEN TESTS\nassert f(2) == 3\n### END HIDDEN TESTS\n", GRADE_CELL),
    )
    student = student_version(notebook)
    sources = ["".join(cell["source"]) for cell in student["cells"]]
    assert sources == ["def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\n",
                       "Why?\nYOUR ANSWER HERE\n", "", "print(f(1))\n"]
    solution_locks = {**SOLUTION_CELL, "deletable": False}
    grade_locks = {**GRADE_CELL, "editable": False, "deletable": False}
    assert [cell["metadata"] for cell in student["cells"]] == [solution_locks, solution_locks, grade_locks, grade_locks], \
        "the grade cells stay, with their ids, for nbgrader's autograde to fill, locked as nbgrader locks them"
    assert all(cell["outputs"] == [] and cell["execution_count"] is None
               for cell in student["cells"] if cell["cell_type"] == "code")
    assert "Because" in notebook["cells"][1]["source"], "the source notebook is left as it was"
    assert "editable" not in notebook["cells"][2]["metadata"]


def test_locked_cells_are_read_only_in_the_student_version():
    """A locked cell that is neither solution nor grade (the check call) can be neither edited nor
    deleted in JupyterLab, as nbgrader's generate_assignment leaves it; an unmarked cell stays free."""
    locked = {"nbgrader": {"grade": False, "grade_id": "check_call", "locked": True, "schema_version": 3,
                           "solution": False, "task": False}}
    student = student_version(_notebook(("code", "check(kernel)\n", locked), ("code", "x = 1\n")))
    assert student["cells"][0]["metadata"] == {**locked, "editable": False, "deletable": False}
    assert "editable" not in student["cells"][1]["metadata"] and "deletable" not in student["cells"][1]["metadata"]
    committed = [cell for path in sorted(STUDENTS.glob("*.ipynb"))
                 for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]
                 if cell["metadata"].get("nbgrader", {}).get("locked")]
    assert committed and all(cell["metadata"].get("editable") is False for cell in committed)


@pytest.mark.parametrize("text", ["### BEGIN SOLUTION\nx = 1\n", "x = 1\n### END SOLUTION\n",
                                  "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n",
                                  "### BEGIN HIDDEN TESTS\nassert True\n"])
def test_unbalanced_markers_are_refused(text):
    marks = {"nbgrader": {**SOLUTION_CELL["nbgrader"], "grade": True, "points": 1}}
    with pytest.raises(ValueError, match="cell 0"):
        student_version(_notebook(("code", text, marks)))


@pytest.mark.parametrize("text, marks, words", [
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", {}, "not marked as a solution cell"),
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", GRADE_CELL, "not marked as a solution cell"),
    ("### BEGIN HIDDEN TESTS\nassert True\n### END HIDDEN TESTS\n", SOLUTION_CELL, "not marked as a grade cell"),
    ("### BEGIN HIDDEN TESTS\nassert True\n### END HIDDEN TESTS\n",
     {"nbgrader": {key: value for key, value in GRADE_CELL["nbgrader"].items() if key != "points"}},
     "not marked as a grade cell with its points"),
])
def test_regions_outside_their_kind_of_cell_are_refused_as_nbgrader_does(text, marks, words):
    with pytest.raises(ValueError, match=words):
        student_version(_notebook(("code", text, marks)))


def test_solution_sources_carry_nbgrader_metadata():
    """What nbgrader checks of a source notebook's cells (its CheckCellMetadata), on every exercise:
    the solution and the hidden check are marked, grade ids are unique and well formed."""
    grade_ids = []
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        marked = [cell["metadata"]["nbgrader"] for cell in notebook["cells"] if "nbgrader" in cell["metadata"]]
        assert sum(m["solution"] for m in marked) == 1 and sum(m["grade"] for m in marked) == 1, path.name
        for marks in marked:
            assert marks["schema_version"] == 3 and re.fullmatch(r"[a-zA-Z0-9_\-]+", marks["grade_id"]), marks
            assert not marks["grade"] or (marks["points"] > 0 and marks["locked"]), marks
            grade_ids.append(marks["grade_id"])
    assert len(grade_ids) == len(set(grade_ids)), grade_ids


def test_student_version_refuses_what_is_not_a_notebook():
    with pytest.raises(TypeError, match="notebook"):
        student_version(["cells"])


# --------------------------------------------------------------------------- grading

def _tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.skipif(sys.platform != "linux", reason="the grader's limits are Linux resource limits")
def test_grade_reports_each_submission_and_touches_nothing(tmp_path):
    submitted = tmp_path / "submitted"
    submitted.mkdir()
    grader_file = tmp_path / "gradebook.csv"
    grader_file.write_text("the grader's own file\n")
    solution = (SOLUTIONS / "ex1_masked_kernel.ipynb").read_text(encoding="utf-8")
    # Solved, with IPython's own lines as a student might leave them: a magic and display().
    notebook = json.loads(solution)
    notebook["cells"].insert(4, {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                                 "source": ["%time feature_map_reference(torch.randn(4, 4))\n", "display(1 + 1)\n"]})
    (submitted / "ana_solved.ipynb").write_text(json.dumps(notebook), encoding="utf-8")
    (submitted / "ben_blank.ipynb").write_text((STUDENTS / "ex1_masked_kernel.ipynb").read_text(encoding="utf-8"),
                                               encoding="utf-8")
    wrong = "\n\n".join(c for c in code_cells(json.loads(solution)) if "result.passed" not in c)
    (submitted / "cem_wrong.py").write_text(wrong.replace(", mask=mask)", ")"), encoding="utf-8")
    (submitted / "dia_endless.py").write_text("while True:\n    pass\n", encoding="utf-8")
    (submitted / "eli_misbehaves.py").write_text(
        f"try:\n    open({str(grader_file)!r}, 'w').write('overwritten')\nexcept PermissionError as error:\n"
        f"    print(error)\nwhile True:\n    print('x' * 1000)\n", encoding="utf-8")
    before = _tree_digest(tmp_path)

    rows = grading.grade([submitted], time_limit_s=20)

    assert _tree_digest(tmp_path) == before, "the grader's files and the submissions are untouched"
    # A submission can add a second row (its run also stopped badly, e.g. past the CPU-time
    # limit on a loaded machine); each must have the row that says what is wrong with it.
    by_file = {}
    for row in rows:
        by_file.setdefault(row.student_file, []).append(row)
    assert list(by_file) == ["ana_solved.ipynb", "ben_blank.ipynb", "cem_wrong.py", "dia_endless.py",
                             "eli_misbehaves.py"]

    def failed_with(name, words):
        return any(not row.passed and words in row.diagnosis for row in by_file[name])

    assert [(row.exercise, row.passed) for row in by_file["ana_solved.ipynb"]] == [("feature map", True)]
    assert failed_with("ben_blank.ipynb", "still has the blank")
    assert failed_with("cem_wrong.py", "outside the output")
    assert failed_with("dia_endless.py", "time limit")
    assert failed_with("eli_misbehaves.py", "output passed the limit")
    text = grading.format_table(rows)
    assert text.splitlines()[0].split() == ["student", "file", "exercise", "result", "diagnosis"]
    csv_lines = grading.format_csv(rows).splitlines()
    assert csv_lines[0] == "student_file,exercise,passed,diagnosis" and len(csv_lines) == len(rows) + 1


def test_grade_refuses_what_it_cannot_grade(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt"):
        grading.submissions([tmp_path / "notes.txt"])
    with pytest.raises(ValueError, match="no .ipynb or .py files in .*sub-folders"):
        grading.submissions([tmp_path])


def test_submissions_in_student_folders_keep_their_folder_in_the_label(tmp_path):
    """nbgrader's submitted/<student>/<assignment>/ layout and one copy of the exercises per
    student both give every student the same file names: the label keeps the folders, and
    Jupyter's hidden checkpoints are not graded."""
    for folder in ("submitted/ana/week1", "submitted/ben/week1", "submitted/ben/.ipynb_checkpoints", "other/ana/week1"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "ex1_masked_kernel.ipynb").write_text("{}")
    found = grading.submissions([tmp_path / "submitted"])
    assert [label for _, label in found] == ["ana/week1/ex1_masked_kernel.ipynb", "ben/week1/ex1_masked_kernel.ipynb"]
    # Two folders with the same students: each label keeps its folder's name too.
    found = grading.submissions([tmp_path / "submitted", tmp_path / "other"])
    assert [label for _, label in found] == ["submitted/ana/week1/ex1_masked_kernel.ipynb",
                                             "submitted/ben/week1/ex1_masked_kernel.ipynb",
                                             "other/ana/week1/ex1_masked_kernel.ipynb"]
    # One assignment of every student (``submitted/*/week1``): the folders are cousins, and each label
    # keeps its student's folder.
    found = grading.submissions([tmp_path / "submitted" / "ana" / "week1", tmp_path / "submitted" / "ben" / "week1"])
    assert [label for _, label in found] == ["ana/week1/ex1_masked_kernel.ipynb", "ben/week1/ex1_masked_kernel.ipynb"]
    named = tmp_path / "submitted" / "ana" / "week1" / "ex1_masked_kernel.ipynb"
    assert grading.submissions([named]) == [(named, str(named))]


def _report(*entries):
    return [json.dumps(entry) for entry in entries]


def test_the_check_cell_counts_and_scratch_checks_do_not():
    """One row per exercise: the result of the notebook's read-only check cell (nbgrader's), else
    the exercise's last check; a run that stops badly afterwards adds a row of its own."""
    wrong = {"exercise": "feature map", "passed": False, "message": "✗ feature map: wrong"}
    right = {"exercise": "feature map", "passed": True, "message": "✓ feature map: right"}
    scratch_after = _report({"cell": 3, "graded": False}, wrong, {"cell": 4, "graded": True}, right,
                            {"cell": 5, "graded": False}, wrong)
    rows = grading.rows_from_report("ana.ipynb", scratch_after, None)
    assert [(r.exercise, r.passed) for r in rows] == [("feature map", True)]
    # A .py file has no check cell: the last call counts.
    rows = grading.rows_from_report("ben.py", _report(right, wrong), None)
    assert [(r.exercise, r.passed, r.diagnosis) for r in rows] == [("feature map", False, "✗ feature map: wrong")]
    rows = grading.rows_from_report("cem.ipynb", _report({"cell": 4, "graded": True}, right),
                                    "stopped with an error: code cell 9 raised ZeroDivisionError: division by zero")
    assert [(r.exercise, r.passed) for r in rows] == [("feature map", True), ("(run)", False)]
    assert rows[1].diagnosis.startswith("after its checks, stopped with an error: code cell 9")
    # Stopped before any check: the exercises its check cells call fail, by name.
    rows = grading.rows_from_report("dia.ipynb", _report({"cell": 2, "graded": False}), "stopped after 120 s",
                                    ["check_recurrent", "check_dq"])
    assert [(r.exercise, r.passed) for r in rows] == [("recurrent", False), ("backward dQ", False)]
    assert [r.exercise for r in grading.rows_from_report("eli.py", [], "crashed", [])] == ["?"]


def test_every_checker_has_its_exercise_name():
    assert set(grading.EXERCISE_NAMES) == {name for name in exercises.__all__ if name.startswith("check_")}


@pytest.mark.skipif(sys.platform != "linux", reason="the grader's limits are Linux resource limits")
def test_grade_command_line_prints_csv_alone_with_dash(tmp_path, capsys):
    from ttx_tutorial.exercises.__main__ import main

    script = tmp_path / "no_check.py"
    script.write_text("x = 1\n")
    assert main(["grade", str(script), "--csv", "-", "--time-limit", "60"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "student_file,exercise,passed,diagnosis"
    assert "no checker was called" in captured.out and "student file" in captured.err


def test_generate_outside_the_repository_root_says_what_to_do(tmp_path, monkeypatch, capsys):
    from ttx_tutorial.exercises.__main__ import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["generate"])
    assert "run this from the repository's root" in capsys.readouterr().err


def test_generate_makes_the_students_folder(tmp_path):
    """An assignment prepared into a release folder of its own: the folder is made, not a traceback."""
    from ttx_tutorial.exercises.__main__ import main

    release = tmp_path / "release" / "week1"
    assert main(["generate", "--solutions", str(SOLUTIONS), "--students", str(release)]) == 0
    assert sorted(p.name for p in release.glob("*.ipynb")) == sorted(p.name for p in SOLUTIONS.glob("*.ipynb"))
    assert (release / "ex2_recurrent_kernel.ipynb").read_text(encoding="utf-8") == \
        (STUDENTS / "ex2_recurrent_kernel.ipynb").read_text(encoding="utf-8")


def test_grade_command_line_refuses_bad_limits(capsys):
    from ttx_tutorial.exercises.__main__ import main

    with pytest.raises(SystemExit):
        main(["grade", str(SOLUTIONS), "--time-limit", "0"])
    assert "--time-limit must be at least 1" in capsys.readouterr().err



def test_triton_imported_first_is_explained(tmp_path):
    if ttx_tutorial.on_gpu():
        pytest.skip("the import order only matters for the CPU interpreter")
    script = tmp_path / "triton_first.py"
    script.write_text(
        "import triton\nimport triton.language as tl\nimport ttx_tutorial\n"
        "from ttx_tutorial.exercises import check_scan\n"
        "@triton.jit\ndef exclusive_scan_kernel(states_ptr, out_ptr, S, E, stride_sh, stride_ss, stride_sd,\n"
        "        stride_se, stride_oh, stride_os, stride_od, stride_oe, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):\n"
        "    tl.cumsum(tl.zeros((BLOCK_S, BLOCK_E), dtype=tl.float32), axis=0)\n"
        "check_scan(exclusive_scan_kernel)\n")
    completed = run_python(script, timeout=300, TTX_TUTORIAL_DEVICE="cpu")
    assert "import ttx_tutorial first" in completed.stdout, completed.stdout + completed.stderr
