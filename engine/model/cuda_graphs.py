"""Captured passes (CUDA graphs): a model's decode, verify and draft steps recorded once per
(batch bucket, key bucket) at load and replayed from static buffers, eager where no bucket fits.

The static-buffer discipline: a captured pass reads its inputs only from static tensors (token
ids, positions, the KV rows it writes and reads, an EAGLE-3 head's hidden state) that a replay
copies the step's values into, in place, and writes its outputs into static tensors. A step of B
sequences of T tokens over L keys takes the smallest bucket with at least B rows, T tokens and L
keys: padded rows and tokens write to the pool's scratch row at position 0 and are sliced away.
Every captured pass masks keys by position (no host value reaches it: no lengths, no groups,
no `.item()`), except a tree kind's, which reads its mask (kv/tree_view.py) from a static buffer.
The capture mechanism is injected: on CUDA `torch.cuda.CUDAGraph` with one memory pool shared by
every graph; on CPU (tests, `cuda_graphs: "on"`) a replay runs the captured callable
again over the same static buffers. At load each graph's replay is checked against eager on a
probe; a capture that raises or a replay that differs leaves that model eager, with a warning.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kv import CachePool
from engine.kv.protocol import KVView, aligned_key_len
from engine.model.passes import pass_inputs
from engine.model.transformer import Transformer

log = logging.getLogger(__name__)

MIN_KEY_BUCKET = 256  # the shortest key bucket: shorter contexts pad their keys (masked) to it
# every-position outputs [B, T, ...] of a pass: ids, positions [B, T], its view, a per-token input [B, T, X] or None
PassFn = Callable[[torch.Tensor, torch.Tensor, KVView, torch.Tensor | None], tuple[torch.Tensor, ...]]


def graphs_on(setting: str, device: str) -> bool:
    """EngineConfig.cuda_graphs: "auto" captures on CUDA only; "on" also on CPU (the emulation)."""
    return setting == "on" or (setting == "auto" and device.startswith("cuda"))


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, and max_batch itself."""
    buckets = [b for b in (1 << i for i in range(max_batch.bit_length())) if b < max_batch]
    return buckets + [max_batch]


def key_buckets(max_seq_len: int) -> list[int]:
    """Key lengths a graph gathers: powers of two from MIN_KEY_BUCKET below the longest aligned
    sequence, and it (a step pays for the keys of its bucket, at most twice its own)."""
    longest = aligned_key_len(max_seq_len)
    buckets = [n for n in (MIN_KEY_BUCKET << i for i in range(32)) if n < longest]
    return buckets + [longest]


class Capture(Protocol):
    """Records `body` (after running it once as a warm-up); returns its replay."""

    def __call__(self, body: Callable[[], None]) -> Callable[[], None]: ...


class CudaCapture:
    """One torch.cuda.CUDAGraph per body, every graph in one shared memory pool (capture the
    largest first: the smaller ones reuse its memory)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []  # kept alive while their replays are in use

    def __call__(self, body: Callable[[], None]) -> Callable[[], None]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture: lazy initialisations (cuBLAS handles) happen here
            body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        self.graphs.append(graph)
        return graph.replay


class EmulatedCapture:
    """CPU: a replay runs the body again; it reads and writes the same static buffers a CUDA graph would."""

    def __call__(self, body: Callable[[], None]) -> Callable[[], None]:
        body()
        return body


def default_capture(device: torch.device) -> Capture:
    return CudaCapture(device) if device.type == "cuda" else EmulatedCapture()


@dataclass(frozen=True)
class PassKind:
    """Passes one set of graphs takes: up to `width` tokens a sequence, and a per-token input of
    `extra` values beside the ids (an EAGLE-3 head's state or features; None: none); `tree`: passes
    over token trees, their mask a static input."""

    width: int
    extra: int | None = None
    tree: bool = False


@dataclass
class _Static:
    """A kind's static buffers, sized for its largest bucket; each graph reads leading slices."""

    ids: torch.Tensor  # [max_batch, width]
    positions: torch.Tensor  # [max_batch, width]
    write_rows: torch.Tensor  # [max_batch, width] storage row of each new token
    read_rows: torch.Tensor  # [max_batch, max_keys] storage row of each key
    extra: torch.Tensor | None  # [max_batch, width, extra]
    mask: torch.Tensor | None  # [max_batch, 1, width, max_keys] a tree kind's attention mask (True = attend)
    outputs: tuple[torch.Tensor, ...] = ()  # each [max_batch, width, ...]
    replays: dict[tuple[int, int], Callable[[], None]] = field(default_factory=dict)  # (batch, keys) -> replay


class CapturedPasses:
    """A model's captured passes over one pool's storage."""

    def __init__(self, fn: PassFn, storage: torch.Tensor, kinds: list[PassKind], max_batch: int, max_seq_len: int,
                 extra_dtype: torch.dtype, layers: tuple[int, ...] = ()):
        self.fn = fn
        self.storage = storage  # [layers, 2, kv_heads, rows + 1, head_dim]: the pool the graphs write and read
        self.layers = layers  # target layers whose inputs the outputs' second tensor holds (EAGLE-3 features)
        self.batches = batch_buckets(max_batch)
        self.keys = key_buckets(max_seq_len)
        self.kinds = sorted(kinds, key=lambda k: k.width)
        self.extra_dtype = extra_dtype
        self._static: dict[PassKind, _Static] = {}
        self.replays = 0  # steps that ran a graph (tests, stats)
        self.tree_replays = 0  # of which over token trees

    def capture(self, capture: Capture) -> int:
        """Records every (kind, batch, keys) graph, largest first; how many."""
        device, scratch = self.storage.device, self.storage.shape[3] - 1
        B, L = self.batches[-1], self.keys[-1]
        with torch.inference_mode():
            for kind in self.kinds:
                long = dict(dtype=torch.long, device=device)
                s = _Static(torch.zeros(B, kind.width, **long), torch.zeros(B, kind.width, **long),
                            torch.full((B, kind.width), scratch, **long), torch.full((B, L), scratch, **long),
                            None if kind.extra is None else torch.zeros(B, kind.width, kind.extra,
                                                                        dtype=self.extra_dtype, device=device),
                            _first_key_only(torch.empty(B, 1, kind.width, L, dtype=torch.bool, device=device))
                            if kind.tree else None)
                s.outputs = tuple(torch.empty_like(o) for o in self._body(s, B, L)())  # shapes from one eager run
                self._static[kind] = s
                for b in reversed(self.batches):
                    for n in reversed(self.keys):
                        s.replays[b, n] = capture(self._body(s, b, n, store=True))
        return sum(len(s.replays) for s in self._static.values())

    def _body(self, s: _Static, b: int, n: int, store: bool = False) -> Callable:
        """The captured pass over the first b rows and n keys of the static buffers."""
        def body():
            view = KVView(self.storage, s.write_rows[:b].reshape(-1), s.read_rows[:b, :n], None, n, needs_mask=True)
            if s.mask is not None:
                view.mask_override = s.mask[:b, :, :, :n]
            outs = self.fn(s.ids[:b], s.positions[:b], view, None if s.extra is None else s.extra[:b])
            if not store:
                return outs
            for out, value in zip(s.outputs, outs):
                out[:b].copy_(value)
        return body

    def bucket(self, batch: int, width: int, keys: int, extra: int | None,
               tree: bool = False) -> tuple[PassKind, int, int] | None:
        """The kind and (batch, keys) bucket a pass fits, or None (it runs eager)."""
        kind = next((k for k in self.kinds if k.width >= width and k.extra == extra and k.tree == tree), None)
        b = next((x for x in self.batches if x >= batch), None)
        n = next((x for x in self.keys if x >= keys), None)
        return None if kind is None or b is None or n is None else (kind, b, n)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, view: KVView, extra: torch.Tensor | None = None,
            keys: int | None = None) -> tuple[torch.Tensor, ...] | None:
        """The pass's every-position outputs [B, T, ...] from a replay (copies: the static outputs
        are the next replay's); None where no graph fits or the view is another pool's. keys:
        force a key bucket (the load-time check replays each)."""
        B, T = ids.shape
        tree = view.mask_override is not None
        fit = self.bucket(B, T, max(view.key_len, keys or 0), None if extra is None else extra.shape[-1], tree) \
            if view.storage is self.storage else None
        if fit is None:
            return None
        kind, b, n = fit
        s, scratch = self._static[kind], self.storage.shape[3] - 1
        with torch.inference_mode():
            s.ids[:b].zero_()
            s.ids[:B, :T].copy_(ids)
            s.positions[:b].zero_()
            s.positions[:B, :T].copy_(positions)
            s.write_rows[:b].fill_(scratch)
            s.write_rows[:B, :T].copy_(view.write_rows.view(B, -1)[:, :T])
            s.read_rows[:b, :n].fill_(scratch)
            if view.read_rows is not None:
                s.read_rows[:B, :view.key_len].copy_(view.read_rows)
            else:  # one sequence over consecutive rows
                torch.arange(view.read_slice.start, view.read_slice.stop, out=s.read_rows[0, :view.key_len])
            if s.extra is not None:
                s.extra[:b].zero_()
                s.extra[:B, :T].copy_(extra)
            if tree:  # padded rows and keys: the first key alone (a softmax over no key would be NaN)
                _first_key_only(s.mask[:b, :, :, :n])
                s.mask[:B, :, :T, :view.key_len].copy_(view.mask_override)
            s.replays[b, n]()
            self.replays += 1
            self.tree_replays += tree
            return tuple(out[:B, :T].clone() for out in s.outputs)


def _first_key_only(mask: torch.Tensor) -> torch.Tensor:
    """mask [b, 1, T, n] set, in place, to attend to key 0 only."""
    mask.fill_(False)
    mask[..., 0] = True
    return mask


def target_pass(model: Transformer, layers: tuple[int, ...]) -> PassFn:
    """The target's pass: logits [B, T, V] (and the inputs of `layers` [B, T, F] when given)."""
    def fn(ids, positions, view, extra):
        logits, features = model._run(ids, positions, view, None, layers)
        return (logits,) if features is None else (logits, features)
    return fn


def head_pass(head) -> PassFn:
    """An EAGLE-3 head's step: logits over the target vocabulary [B, T, V] and its state [B, T, hidden]."""
    return lambda ids, positions, view, extra: head.step(ids, positions, view, extra, None)


@dataclass
class CaptureReport:
    """What capture did for one model: graphs kept (0: eager), seconds, device bytes, why eager."""

    graphs: int = 0
    seconds: float = 0.0
    bytes: int = 0
    fallback: str | None = None
    traceback: str | None = None  # where a capture that raised raised


def capture_checked(name: str, model: Transformer, pool: CachePool, fn: PassFn, kinds: list[PassKind],
                    max_batch: int, max_seq_len: int, capture: Capture, layers: tuple[int, ...] = (),
                    extra_dtype: torch.dtype | None = None) -> tuple[CapturedPasses | None, CaptureReport]:
    """Captures `model`'s passes over `pool` and checks every graph's replay against eager on a
    probe; None (eager, with a warning) where capture raises or a replay differs."""
    device = model.device
    report = CaptureReport()
    t0, before = time.perf_counter(), _device_bytes(device)
    graphs = CapturedPasses(fn, pool.storage, kinds, max_batch, max_seq_len, extra_dtype or model.dtype, layers)
    try:
        report.graphs = graphs.capture(capture)
        problem = self_check(graphs, model, pool)
    except Exception as e:  # any failure to capture or replay: this model stays eager
        problem = f"capture failed: {type(e).__name__}: {e}"
        report.traceback = traceback.format_exc()[-3000:]
        log.warning("cuda_graphs: capturing the %s raised:\n%s", name, report.traceback)
    report.seconds, report.bytes = time.perf_counter() - t0, _device_bytes(device) - before
    if problem is not None:
        log.warning("cuda_graphs: the %s runs eager: %s", name, problem)
        report.graphs, report.fallback = 0, problem
        return None, report
    log.info("cuda_graphs: %s: %d graphs in %.1f s", name, report.graphs, report.seconds)
    return graphs, report


def _device_bytes(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def tolerance(dtype: torch.dtype) -> float:
    """Largest difference from eager, relative to the largest eager value, a replay may show: padded
    rows change the matmuls' shapes, so their rounding order (half precision: a few ulps of bf16)."""
    return 1e-4 if dtype == torch.float32 else 3e-2


def self_check(graphs: CapturedPasses, model: Transformer, pool: CachePool, context: int = 5) -> str | None:
    """Replays every graph on a probe (each batch bucket nearly full, so rows pad; each key bucket)
    and compares it with the eager pass on the same inputs, bitwise where the model is row-invariant
    (engine/model/invariance.py), else within `tolerance`; what differs, or None."""
    vocab = model.shape.vocab_size
    widest = max(k.width for k in graphs.kinds)
    context = max(1, min(context, pool.max_seq_len - widest))
    slots = [pool.allocate_slot([])[0] for _ in range(graphs.batches[-1])]
    generator = torch.Generator().manual_seed(0)

    def extra(kind: PassKind, n: int, t: int) -> torch.Tensor | None:  # [n, t, kind.extra]
        return None if kind.extra is None else torch.randn(n, t, kind.extra, generator=generator).to(
            device=model.device, dtype=graphs.extra_dtype)
    try:
        x = pass_inputs(model, pool, slots, [[(3 * i + 1) % vocab] * context for i in range(len(slots))],
                        [0] * len(slots))
        with torch.inference_mode():  # the probe's context, eager
            graphs.fn(x.ids, x.positions, x.view, extra(graphs.kinds[0], len(slots), context))
        for kind in graphs.kinds:
            for prev, b in zip([0] + graphs.batches, graphs.batches):
                rows = slots[:max(prev + 1, b - b // 4)]  # fills bucket b, with padded rows where it can
                chunks = [[(5 * i + 7 * j + 2) % vocab for j in range(kind.width)] for i in range(len(rows))]
                more = extra(kind, len(rows), kind.width)
                x = _probe_inputs(model, pool, rows, chunks, context, kind)
                with torch.inference_mode():
                    want = graphs.fn(x.ids, x.positions, x.view, more)
                _roll_back(pool, rows, context)
                for n in graphs.keys:
                    x = _probe_inputs(model, pool, rows, chunks, context, kind)
                    got = graphs.run(x.ids, x.positions, x.view, more, keys=n)
                    _roll_back(pool, rows, context)
                    if got is None:
                        return f"no graph took a pass of {len(rows)} x {kind.width} tokens"
                    for w, g in zip(want, got, strict=True):
                        w, g = w.float(), g.float()  # equal infinities (logits outside a draft vocabulary) agree
                        worst = torch.where(w == g, 0.0, (w - g).abs()).nan_to_num(float("inf")).max().item()
                        scale = w[w.isfinite()].abs().max().item()
                        # under row-count invariance a padded replay computes each row's own bits
                        allowed = 0.0 if model.row_invariant else tolerance(model.dtype) * max(scale, 1.0)
                        if not worst <= allowed:
                            return (f"replay differs from eager by {worst:.3g} (scale {scale:.3g}) at batch "
                                    f"{len(rows)} (bucket {b}), {kind.width} tokens, {n} keys")
    finally:
        for s in slots:
            pool.free_slot(s)
    graphs.replays = graphs.tree_replays = 0
    return None


def _probe_inputs(model: Transformer, pool: CachePool, rows: list[int], chunks: list[list[int]], context: int,
                  kind: PassKind):
    """The probe's pass; for a tree kind under a tree's mask: every odd token skips the token
    before it (two chains interleaved, each token seeing the context and its own ancestors)."""
    x = pass_inputs(model, pool, rows, chunks, [context] * len(rows))
    if kind.tree:
        L, T = x.view.key_len, x.ids.shape[1]
        mask = (torch.arange(L, device=x.positions.device) <= x.positions[:, :, None]).unsqueeze(1)  # [B, 1, T, L]
        odd = torch.arange(1, T, 2, device=mask.device)
        mask[:, :, odd, context + odd - 1] = False
        x.view.mask_override = mask
    return x


def _roll_back(pool: CachePool, slots: list[int], length: int) -> None:
    for s in slots:
        pool.truncate_to(s, length, keep_storage=True)

