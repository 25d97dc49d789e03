"""Row-count invariance (EngineConfig.batch_invariant): each row's bits independent of how many rows
and tokens share its pass, so a verify pass computes exactly what one-token decode steps compute
and speculation never changes a greedy token (docs/speculative/exactness.md).

In bf16 on CPU two things break it, both measured (docs/speculative/exactness.md):
- oneDNN's reordered-weight matmul takes another kernel for one row than for two or more at some
  widths (a gemv whose k-sums run in another order, at some of the row's alignments only, so the
  probe tries the row at many); from two rows on, a row's bits never depend on M (nor on the
  alignment). So a one-row linear of such a width runs as two copies of the row
  (linears.at_least_rows), the widths probed at load.
- SDPA's CPU kernel blocks keys by the query count. The invariant rule sends every pass to
  fixed-order attention (kernels/fixed_order_attention.c, bf16 K/V read as they are; faster than
  SDPA at one sequence, about level at 16), or where the kernels cannot build to the grouped
  matmuls, whose bf16 rows do not depend on the pass either (attention.py "cpu_invariant").

In float32 oneDNN's rows differ too, and the batched matmuls block the attention's key sums by the
key count; so every pass takes the column-block kernel (each output one chain of multiply-adds
over k in order, whatever the row count) and fixed-order attention (kernels/fixed_order_attention.c).

On CUDA cuBLAS picks its kernel and split-K by the row count and SDPA's kernels split the keys by
the batch; the CUDA rule (triton_rule) runs dense linears and attention on kernels/invariant.py's
fixed-tile, fixed-order Triton kernels, beside the fused kernels' per-row norms and RoPE, and auto
keeps it where its measured cost is at most CUDA_AUTO_COST.

`linear_rows_rule` probes a model's weights at load; `check_passes` is the harness: a multi-token
pass against the same tokens decoded one at a time, bitwise on logits and the K/V written.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from engine.model.kernels import one_sequence
from engine.model.passes import fill_slots, forward_chunks, pool_for, time_pass
from engine.model.plan import write_cached

log = logging.getLogger(__name__)

PROBE_ROWS = (2, 3, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 192)  # row counts a linear is probed at
# a one-row pass is probed at every ONE_ROW_STRIDE-th element offset over ONE_ROW_SPAN elements (a page
# in bf16). oneDNN's bf16 one-row kernel (AMD EPYC Zen 4) differed from two rows at 7-14% of the 2048
# offsets for every width measured above 1024 (1152-5632), clustered by address so a scan can miss
# them, and at none up to 1024: wider one-row passes are padded without a probe
ONE_ROW_SPAN, ONE_ROW_STRIDE = 2048, 7
ONE_ROW_SAFE_WIDTH = 1024
PLAIN_SHAPES = ((1, 1), (16, 1))  # a plain-only engine's decode passes (sequences, tokens each), as plan.py's
PLAIN_CONTEXT = 128  # keys each timed decode pass attends to
# a speculative engine's decode and verify passes (K = 4), and a prefill chunk (the CUDA rule's linears take
# 16-row tiles at any width, so a wide pass is where it may cost most)
SPECULATIVE_SHAPES = ((1, 1), (16, 1), (1, 5), (16, 5), (1, 256))
CUDA_AUTO_COST = 1.05  # auto keeps the CUDA rule where its passes cost at most this many times the plan's


def linear_rows_rule(linear: Callable, weights: list, in_features: list[int], dtype: torch.dtype,
                     device: torch.device) -> tuple[frozenset[int] | None, str]:
    """The input widths whose one-row passes must run as two rows for every row's bits to be
    independent of the row count (one weight of each matmul probed), or None where rows differ
    between two row counts of two or more; and what was seen."""
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for weight, k in zip(weights, in_features):
        x = torch.randn(max(PROBE_ROWS) + 8, k, generator=generator).to(dtype=dtype, device=device)
        wide = linear(x, weight)  # [200, out]: the reference rows
        for m in PROBE_ROWS:
            for r in (0, 1, 3):  # rows that start off the allocation's alignment too
                if not torch.equal(linear(x[r:r + m], weight), wide[r:r + m]):
                    return None, f"a {k}-wide linear's rows differ between {m} and {len(x)} rows"
        if not isinstance(weight, torch.Tensor):  # a quantized linear (torch's kernels, which may want aligned rows)
            if not all(torch.equal(linear(x[r:r + 1], weight), wide[r:r + 1]) for r in range(8)):
                seen.add(k)
            continue
        if dtype == torch.bfloat16 and k > ONE_ROW_SAFE_WIDTH:  # measured to differ at some alignments: always padded
            seen.add(k)
            continue
        flat = torch.randn(k + ONE_ROW_SPAN, generator=generator).to(dtype=dtype, device=device)
        for at in range(0, ONE_ROW_SPAN, ONE_ROW_STRIDE):  # one row at many alignments: the kernel moves with it
            row = flat[at:at + k].view(1, k)
            if not torch.equal(linear(row, weight), linear(row.expand(2, k).contiguous(), weight)[:1]):
                seen.add(k)
                break
    return frozenset(seen), (f"one row takes another kernel at width {', '.join(map(str, sorted(seen)))}" if seen
                  else "every row count agrees")


def choose_invariance(model, setting: str, speculative: bool = True, cache: Path | None = None) -> str:
    """Puts the target `model` on the invariant rule where `setting` asks for it and this device
    can (auto: in a speculative engine, where the harness then passes at batch 1 and 2 over a pool
    of its own, and on CUDA where its passes also cost at most CUDA_AUTO_COST the plan's, else back
    off; in a plain-only engine, only where its decode passes are also measured faster on the rule:
    plain_only_rule); a measured ratio is kept in `cache` (the plan's key). "on" or "off: why"."""
    if setting == "off":
        return "off: batch_invariant is off"
    if setting == "auto" and not speculative:
        return plain_only_rule(model, cache)
    problem = _rule_checked(model)
    if problem is None:
        if model.dtype != torch.float32 and model.plan.one_sequence_kernel:  # the bf16 rule: oneDNN for every pass
            log.warning("batch_invariant: the bf16 rule runs every pass on oneDNN, so forward_plan one_sequence_kernel "
                        "takes no pass (batch_invariant off keeps it)")
        if setting == "auto" and model.device.type != "cpu":
            return _within_cost(model, cache, SPECULATIVE_SHAPES, CUDA_AUTO_COST)
        return "on"
    if setting == "on":
        log.warning("batch_invariant on, but rows would differ with their pass (%s): %s", problem,
                    "left on" if model.row_invariant else "left off")
        return "on" if model.row_invariant else f"off: {problem}"
    model.make_row_invariant(None)
    return f"off: {problem}"


def _rule_checked(model) -> str | None:
    """Puts `model` on its dtype's rule and runs the harness at batch 1 and 2 over a pool of its own;
    what stops it (the rule left as applied unless a pass raised), or None."""
    problem = _apply_rule(model)
    if problem is not None:
        return problem
    pool = pool_for(model, 4, min(64, model.cos.shape[0]))  # its own: the server's may have one slot
    try:
        return check_passes(model, pool, context=40, tokens=5, batch=1) or \
            check_passes(model, pool, context=9, tokens=5, batch=2)
    except (RuntimeError, ValueError) as e:  # a pass the rule's kernels do not take: off, even under "on"
        model.make_row_invariant(None)
        return f"the harness failed: {type(e).__name__}: {e}"


def plain_only_rule(model, cache: Path | None = None) -> str:
    """batch_invariant auto in a plain-only engine: the rule where the harness passes and the
    engine's decode passes (PLAIN_SHAPES) run faster on it than on the plan's paths, timed here
    interleaved; its bits then equal a speculative engine's as a bonus. Considered where the rule
    adds no copy of the weights: bf16 with the kernels built (fixed-order attention, oneDNN's own
    weights), float32 where the plan took the one-sequence kernel, whose column-block weights the
    rule reuses, and CUDA (its dense weights as they are); elsewhere the plan's paths. The ratio is
    read from `cache` where an earlier start left it (the plan's key: host, torch, kernels, model),
    so a restart keeps its verdict and its bits. "on" or "off: why"."""
    cuda = model.device.type != "cpu"
    kernels = cuda or one_sequence.load() is not None
    adds_none = cuda or model.dtype == torch.bfloat16 or model.dtype == torch.float32 and model.plan.one_sequence_kernel
    if not (kernels and adds_none):
        return "off: a plain-only engine keeps its plan's paths (batch_invariant on matches a speculative engine's bits)"
    problem = _rule_checked(model)
    if problem is not None:
        model.make_row_invariant(None)
        return f"off: {problem}"
    return _within_cost(model, cache, PLAIN_SHAPES, None)


def _within_cost(model, cache: Path | None, shapes: tuple, most: float | None) -> str:
    """Keeps `model` on its rule where its passes at `shapes` take at most `most` times the plan's
    time (None: less than the plan's), the ratio read from `cache` or measured (decode_cost_ratio)
    and written there; "on" or "off: why"."""
    ratio, source = _cached_ratio(cache), "cached"
    if ratio is None:
        ratio, source = decode_cost_ratio(model, shapes=shapes), "measured"
        if cache is not None:
            write_cached(cache, {"ratio": ratio}, "the invariant rule's measurement")
    on = ratio < 1 if most is None else ratio <= most
    log.info("batch_invariant auto: this engine's passes take %.3fx the time on the rule (%s; %s)",
             ratio, source, "on" if on else "off")
    if on:
        return "on"
    model.make_row_invariant(None)
    bar = "a plain-only engine's decode passes" if most is None else f"auto allows {most:.2f}x; its passes"
    return f"off: {bar} took {ratio:.2f}x the time on the rule"


def _cached_ratio(cache: Path | None) -> float | None:
    try:
        return float(json.loads(cache.read_text())["ratio"]) if cache is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def decode_cost_ratio(model, repeats: int = 5, shapes: tuple = PLAIN_SHAPES) -> float:
    """Geometric mean over `shapes` (sequences, tokens each) of the median pass's seconds on the rule ÷ on the
    plan's paths (the rule applied first where it is not on), interleaved over a pool of its own;
    the model is left on the rule."""
    if model.invariant_rule is None and (problem := _apply_rule(model)) is not None:
        raise ValueError(f"no rule to time: {problem}")
    rule = model.invariant_rule
    widest = max(t for _, t in shapes)
    context = max(1, min(PLAIN_CONTEXT, model.cos.shape[0] - widest - 2))
    rows = max(b for b, _ in shapes)
    pool = pool_for(model, rows, context + widest + 1)
    slots = fill_slots(model, pool, rows, context)
    ratios = []
    try:
        for batch, tokens in shapes:
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(repeats + 1):
                for on in (True, False) if r % 2 else (False, True):
                    model.make_row_invariant(*rule) if on else model.make_row_invariant(None)
                    seconds = time_pass(model, pool, slots[:batch], tokens, context, tokens > 1)
                    if r:  # the first of each: untimed
                        times[on].append(seconds)
            ratios.append(statistics.median(times[True]) / statistics.median(times[False]))
    finally:
        model.make_row_invariant(*rule)
        for s in slots:
            pool.free_slot(s)
    return statistics.geometric_mean(ratios)


def _apply_rule(model) -> str | None:
    """Puts `model` on its device's and dtype's rule (CUDA: triton_rule; float32 on CPU: every pass
    on the column-block kernel, which sums each output in one order whatever the row count, and
    fixed-order attention; bf16 on CPU: oneDNN with the probed one-row widths padded, fixed-order
    or grouped attention); why it cannot, or None."""
    if model.device.type != "cpu":
        return triton_rule(model)
    if model.dtype == torch.float32:
        if model.quantized or any(lw.mlp.weights() for lw in model.layers):
            return ("float32 takes the column-block kernel, which runs the layers' own dense weights only (not "
                    "quantized, nor an MLP holding weights of its own such as experts)")
        if model.shape.head_dim % 8:
            return f"float32's fixed-order attention takes head_dim a multiple of 8, not {model.shape.head_dim}"
        try:
            model.make_row_invariant(frozenset(), "columns")
        except ValueError as e:  # the kernels do not build or run here
            return str(e)
        return None
    rows, seen = linear_rows_rule(*model.linear_probe(), model.dtype, model.device)
    if rows is None:
        return seen
    model.make_row_invariant(rows)
    return None


def triton_rule(model) -> str | None:
    """Puts `model` on the CUDA rule: its dense linears and attention on kernels/invariant.py's
    fixed-tile, fixed-order kernels, its norms, RoPE and K/V write on the fused kernels (one program
    a row or a head), quantized linears on their own kernels (K splits fixed by the weight, never
    the rows); why it cannot, or None. Runs on CPU under Triton's interpreter (tests)."""
    if not model.fused:
        return ("the CUDA rule's norms, RoPE and K/V write are the fused kernels' (one program a row): "
                "fused_kernels is off for this model")
    D = model.shape.head_dim
    if D & (D - 1) or D < 16:
        return f"the CUDA rule's attention takes head_dim a power of two from 16, not {D}"
    try:
        model.make_row_invariant(frozenset(), "triton")
    except ValueError as e:
        return str(e)
    return None


def check_passes(model, pool, context: int = 40, tokens: int = 5, batch: int = 2) -> str | None:
    """The harness at one shape: `batch` sequences (ragged contexts from `context`) each take
    `tokens` tokens in one pass, and the same tokens one step at a time in a second slot set;
    what differs (logits or the K/V written), or None. Slots are freed after."""
    vocab = model.shape.vocab_size
    generator = torch.Generator().manual_seed(1)
    lengths = [min(context + 7 * r, pool.max_seq_len - tokens - 1) for r in range(batch)]
    seqs = [torch.randint(3, vocab, (n + tokens,), generator=generator).tolist() for n in lengths]
    slots = [[pool.allocate_slot([])[0] for _ in seqs] for _ in range(2)]
    try:
        for s in slots:
            forward_chunks(model, pool, s, [q[:n] for q, n in zip(seqs, lengths)], [0] * batch)
        wide = forward_chunks(model, pool, slots[0], [q[n:] for q, n in zip(seqs, lengths)], lengths,
                              all_logits=True)  # [batch, tokens, vocab]
        steps = torch.stack([forward_chunks(model, pool, slots[1], [[q[n + t]] for q, n in zip(seqs, lengths)],
                                            [n + t for n in lengths]) for t in range(tokens)], 1)
        for r, n in enumerate(lengths):
            for t in range(tokens):
                if not torch.equal(wide[r, t], steps[r, t]):
                    return (f"logits differ at token {t} of {tokens} (batch {batch}, context {n}) by "
                            f"{(wide[r, t] - steps[r, t]).abs().max().item():.3g}")
            if not torch.equal(_slot_kv(pool, slots[0][r], n + tokens), _slot_kv(pool, slots[1][r], n + tokens)):
                return f"the K/V written differ (batch {batch}, context {n})"
    finally:
        for s in slots:
            for slot in s:
                pool.free_slot(slot)
    return None


def _slot_kv(pool, slot: int, n: int) -> torch.Tensor:
    """The K/V of a slot's first n positions, every layer [layers, 2, kv_heads, n, head_dim]."""
    view = pool.view([slot], [0])
    layers = view.storage.shape[0]
    return torch.stack([torch.stack(view.read(i, view.read_rows)) for i in range(layers)])[..., 0, :n, :]
