"""ModelRunner: the target's passes over a scheduled batch (prefill chunks, plain decode steps,
speculative verify passes) and the sampling that follows them."""

from __future__ import annotations

import time

import torch

from engine import host_sync
from engine.grammar import mask_rows
from engine.kv import KVManager
from engine.logprobs import log_distribution, most_wanted, row_logprob, table
from engine.model.passes import forward_chunks, forward_chunks_features, put_rows, take_rows, width_groups
from engine.model.transformer import Transformer
from engine.request import DecodeResult, DecodeStats, Request
from engine.sampling import greedy_or_sample
from engine.token_tree import TokenTree


class ModelRunner:
    def __init__(self, model: Transformer, kv: KVManager, logprobs_mode: str = "raw"):
        self.model = model
        self.kv = kv
        self.logprobs_mode = logprobs_mode  # EngineConfig.logprobs_mode: which distribution logprobs report
        self.capture: tuple[int, ...] = ()  # layers whose inputs go to kv.features (an EAGLE-3 head reads them)

    def prefill(self, chunks: list[tuple[Request, int]]) -> list[tuple[Request, list[int]]]:
        """Computes each request's next `n` prompt tokens; a request whose prompt is then
        complete gets its first token. Where none completes, nothing is read back: it waits for
        the device, so the passes' time is the prefill's, not the next timed phase's."""
        reqs = [r for r, _ in chunks]
        starts = [self.kv.computed(r) for r in reqs]
        token_chunks = [r.all_token_ids[s:s + n] for (r, n), s in zip(chunks, starts)]
        logits = torch.empty(len(reqs), self.model.shape.vocab_size, device=self.model.device)  # [B, vocab]
        scored = False  # prompt logprobs read back this step
        for rows in width_groups([len(c) for c in token_chunks]):
            group = [reqs[b] for b in rows]
            group_chunks, group_starts = [token_chunks[b] for b in rows], [starts[b] for b in rows]
            if not any(r.prompt_logprobs is not None and not r.output_token_ids for r in group):
                put_rows(rows, (logits, self._pass(group, group_chunks, group_starts, all_logits=False)))
                continue
            every = self._pass(group, group_chunks, group_starts, all_logits=True)  # [b, T, vocab]
            last = host_sync.upload([len(c) - 1 for c in group_chunks], every.device, torch.long)  # [b]
            put_rows(rows, (logits, every[torch.arange(len(group), device=every.device), last]))
            self._score_prompts(group, group_chunks, group_starts, every)
            scored = True
        done = []
        for b, r in enumerate(reqs):
            self.kv.register_prefix(r)
            if not r.output_token_ids and self.kv.computed(r) == r.num_prefill_tokens:
                done.append(b)  # prompt fully in KV: its last logits give the first token
        if not done:
            if not scored:
                host_sync.wait(self.model.device)
            return []
        sampled = [b for b in done if reqs[b].params.max_tokens > 0]  # max_tokens 0: the prompt scored, no token
        sampled_reqs = [reqs[b] for b in sampled]
        tokens = _sample(take_rows(logits, sampled), sampled_reqs, self.logprobs_mode) if sampled else []
        return [(r, [t]) for r, t in zip(sampled_reqs, tokens)] + \
            [(reqs[b], []) for b in done if reqs[b].params.max_tokens == 0]

    def _score_prompts(self, reqs: list[Request], chunks: list[list[int]], starts: list[int],
                       logits: torch.Tensor) -> None:
        """Prompt logprobs of the requests that ask for them, from a pass's every-position logits
        [b, T, vocab]: position p's distribution scores prompt token p + 1 (raw: there is no
        sampling state for a prompt)."""
        wanted = [i for i, r in enumerate(reqs) if r.prompt_logprobs is not None and not r.output_token_ids]
        k = most_wanted([reqs[i].params.prompt_logprobs for i in wanted])
        rows, positions, targets = [], [], []
        for i in wanted:
            prompt = reqs[i].prompt_token_ids
            for j in range(len(chunks[i])):
                if starts[i] + j + 1 < len(prompt):
                    rows.append(i)
                    positions.append(j)
                    targets.append(prompt[starts[i] + j + 1])
        if not rows:
            return
        index = host_sync.upload([rows, positions, targets], logits.device, torch.long)  # [3, M]
        values = host_sync.read(table(logits[index[0], index[1]].float().log_softmax(dim=-1), index[2], k))
        for i, j, v in zip(rows, positions, values):
            reqs[i].prompt_logprobs[starts[i] + j + 1] = row_logprob(v, k, reqs[i].params.prompt_logprobs)

    def decode(self, reqs: list[Request], reason: str = "disabled") -> DecodeResult:
        """One plain decode step: each request's last token in, one new token out."""
        t0 = time.perf_counter()
        logits = self.forward(reqs, [[r.output_token_ids[-1]] for r in reqs])  # [B, vocab]
        tokens = _sample(logits, reqs, self.logprobs_mode)
        stats = DecodeStats(batch_size=len(reqs), reason=reason, num_tokens=len(reqs))
        return DecodeResult([(r, [t]) for r, t in zip(reqs, tokens)], stats, target_seconds=time.perf_counter() - t0)

    def forward(self, reqs: list[Request], chunks: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Appends chunks[i] to reqs[i]'s target KV: logits [B, vocab] of each chunk's last token,
        or [B, T, vocab] of every position (a verify pass)."""
        return self._pass(reqs, chunks, [self.kv.computed(r) for r in reqs], all_logits)

    def verify(self, reqs: list[Request], chunks: list[list[int]], groups: list[list[int]]) -> torch.Tensor:
        """Appends chunks[i] to reqs[i]'s target KV in one pass per group of row indices: logits
        [B, T, vocab] of every position (T the longest chunk; a row's positions past its chunk
        are padding, zeros where its group's pass was narrower)."""
        if len(groups) == 1:
            return self.forward(reqs, chunks, all_logits=True)
        parts = [self.forward([reqs[i] for i in rows], [chunks[i] for i in rows], all_logits=True)
                 for rows in groups]  # each [b, t, V]
        logits = parts[0].new_zeros(len(reqs), max(len(c) for c in chunks), parts[0].shape[-1])  # [B, T, V]
        index = host_sync.upload([i for rows in groups for i in rows], logits.device, torch.long)  # group after group
        first = 0
        for rows, part in zip(groups, parts):
            logits[:, :part.shape[1]].index_copy_(0, index[first:first + len(rows)], part)
            first += len(rows)
        return logits

    def verify_trees(self, reqs: list[Request], chunks: list[list[int]], trees: list[TokenTree | None]
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """verify's one pass where chunks[i] is trees[i]'s root and nodes (None: a chain): logits
        [B, T, vocab], node j's at j + 1; and while a head reads features, the pass's [B, T, F]
        (a tree's are per path: only the accepted path's are kept, KVManager.keep_paths)."""
        slots, starts = [self.kv.target_slot(r) for r in reqs], [self.kv.computed(r) for r in reqs]
        if not self.capture:
            return forward_chunks(self.model, self.kv.target, slots, chunks, starts, all_logits=True, trees=trees), None
        return forward_chunks_features(self.model, self.kv.target, slots, chunks, starts, self.capture,
                                       all_logits=True, trees=trees)

    def _pass(self, reqs: list[Request], chunks: list[list[int]], starts: list[int], all_logits: bool) -> torch.Tensor:
        slots = [self.kv.target_slot(r) for r in reqs]
        if not self.capture:
            return forward_chunks(self.model, self.kv.target, slots, chunks, starts, all_logits=all_logits)
        logits, features = forward_chunks_features(self.model, self.kv.target, slots, chunks, starts, self.capture,
                                                   all_logits=all_logits)  # features [B, T, F]
        self.kv.keep_features(reqs, starts, features, [len(c) for c in chunks])
        return logits


def _sample(logits: torch.Tensor, reqs: list[Request], logprobs_mode: str = "raw") -> list[int]:
    """Token ids for each row, read back to the host in one transfer (with the logprobs of the rows
    that ask for them, which go to each request's pending_logprobs)."""
    raw = logits
    logits = mask_rows(logits, [r.grammar for r in reqs])
    k = most_wanted([r.params.logprobs for r in reqs])
    params = [r.params for r in reqs]
    tokens, probs = greedy_or_sample(logits, params, [r.all_token_ids for r in reqs], [r.random_stream for r in reqs],
                                     [r.output_token_ids for r in reqs], keep_probs=k is not None
                                     and logprobs_mode == "processed")
    if k is None:
        return host_sync.read(tokens)
    values = host_sync.read(table(log_distribution(raw, probs, logprobs_mode), tokens, k))  # [N, 2 + 2k]
    for r, v in zip(reqs, values):
        if r.params.logprobs is not None:
            r.pending_logprobs = [row_logprob(v, k, r.params.logprobs)]
    return [int(v[0]) for v in values]
