"""Choosing K (tokens to propose) each step: the K that maximises expected tokens per second,
sum_i E_i(min(K, cap_i)) / t_step(B, K), from measured costs (costs.py) and each request's
acceptance rates by draft position (E_i(K) = 1 + h_1 + h_1 h_2 + ...). K falls to 0 by itself as
verify passes stop being free; the model, probes and hysteresis: docs/performance-notes.md#adaptive-policy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from engine.speculative.policy.corrections import Corrections
from engine.speculative.policy.costs import MeasuredCosts
from engine.speculative.policy.fits import interpolated
from engine.speculative.proposers.base import CatchUp

Reason = Literal["policy", "probe", "plain_probe", "k_probe", "fixed", "disabled_batch_size", "length_guard"]


Acceptance = float | Sequence[float]  # one per-token rate, or rates by draft position h_1, h_2, ...


class AcceptanceByPosition:
    """Counts, at each draft position j, of proposals judged (all before j were accepted) and
    accepted; `rates` turns them into h_j shrunk towards a prior. A round of k proposals with
    a accepted judged positions 1..min(a + 1, k) and accepted 1..a. `age` scales the counts by
    `decay` (< 1: older rounds count less)."""

    def __init__(self, decay: float = 1.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.judged: list[float] = []  # judged[j]: proposals judged at position j + 1
        self.accepted: list[float] = []  # accepted[j]: of those, accepted

    def update(self, num_accepted: int, num_proposed: int) -> None:
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"num_accepted must be in [0, {num_proposed}], got {num_accepted}")
        judged = min(num_accepted + 1, num_proposed)
        while len(self.judged) < judged:
            self.judged.append(0.0)
            self.accepted.append(0.0)
        for j in range(judged):
            self.judged[j] += 1
            self.accepted[j] += int(j < num_accepted)

    def age(self, steps: int = 1) -> None:
        factor = self.decay ** steps
        self.judged = [n * factor for n in self.judged]
        self.accepted = [n * factor for n in self.accepted]

    def rates(self, prior: Sequence[float], weight: float, positions: int) -> tuple[float, ...]:
        """h_1..h_positions: (accepted + weight * prior) / (judged + weight) at each position.
        Positions past the end of `prior` are shrunk towards the rate just before them, so a
        position never tried borrows the last one's rate instead of falling back to the prior."""
        if not prior:
            raise ValueError("prior needs at least one rate")
        out: list[float] = []
        for j in range(positions):
            p = prior[j] if j < len(prior) else out[-1]
            judged = self.judged[j] if j < len(self.judged) else 0.0
            accepted = self.accepted[j] if j < len(self.accepted) else 0.0
            out.append(p if judged + weight == 0 else (accepted + weight * p) / (judged + weight))
        return tuple(out)


AcceptanceKey = tuple[str, bool]  # (the proposer a row's proposals come from, whether the row samples)


class AcceptanceEstimates:
    """Each request's acceptance rates by draft position, per proposer it takes proposals from
    (hybrid: its lookup's and its model's apart), shrunk towards the rates of recent rounds of
    the same key (AcceptanceKey: proposer, sampled or greedy), those towards all recent rounds',
    and those towards a prior rate. The recent pools decay per step, not per round (a batch's last
    step must not outweigh the steps before it), plain steps included: a plain stretch's
    verdict rests on evidence that fades as it would while speculating. A plain step's ageing
    waits until the estimates are next read or updated (`version` stays, so a plain verdict can
    be reused: plain_steps.py)."""

    PRIOR_RATE = 0.6  # acceptance assumed before any round was judged
    RECENT_WEIGHT = 2.0  # rounds' worth of evidence the prior is worth against recent rounds (and they against a key's)
    REQUEST_WEIGHT = 16.0  # ... and recent rounds of the request's key against a request's own
    DECAY = 0.98  # the recent pools' ageing a step
    ANY: AcceptanceKey = ("any", False)  # the key of a caller that names none

    def __init__(self):
        self._by_request: dict[str, dict[str, AcceptanceByPosition]] = {}  # request id -> proposer -> counts
        self._all = AcceptanceByPosition(decay=self.DECAY)
        self._pools: dict[AcceptanceKey, AcceptanceByPosition] = {}
        self._unaged = 0  # plain steps whose ageing is still to apply
        self.version = 0  # changes whenever any estimate may have

    def rates(self, request_ids: list[str], positions: int,
              keys: Sequence[AcceptanceKey] | None = None) -> list[tuple[float, ...]]:
        """h_1..h_positions for each request, keys[i] naming where its proposals will come from
        (None: ANY for every request)."""
        self._catch_up_ageing()
        keys = [self.ANY] * len(request_ids) if keys is None else keys
        mixed = self._all.rates((self.PRIOR_RATE,), self.RECENT_WEIGHT, positions)
        pooled = {key: self._pools[key].rates(mixed, self.RECENT_WEIGHT, positions) if key in self._pools else mixed
                  for key in set(keys)}
        fresh = AcceptanceByPosition()
        return [self._by_request.get(rid, {}).get(key[0], fresh).rates(pooled[key], self.REQUEST_WEIGHT, positions)
                for rid, key in zip(request_ids, keys, strict=True)]

    def update(self, request_id: str, num_accepted: int, num_proposed: int, key: AcceptanceKey = ANY) -> None:
        self._catch_up_ageing()
        own = self._by_request.setdefault(request_id, {})
        own.setdefault(key[0], AcceptanceByPosition()).update(num_accepted, num_proposed)
        self._pools.setdefault(key, AcceptanceByPosition(decay=self.DECAY)).update(num_accepted, num_proposed)
        self._all.update(num_accepted, num_proposed)
        self.version += 1

    def tried(self, request_ids: list[str], rounds: int = 1) -> list[int]:
        """How many leading draft positions each request has had judged in at least `rounds`
        rounds (over all its proposers)."""
        out = []
        for rid in request_ids:
            judged: list[float] = []
            for counts in self._by_request.get(rid, {}).values():
                judged = [a + b for a, b in itertools.zip_longest(judged, counts.judged, fillvalue=0.0)]
            out.append(next((j for j, n in enumerate(judged) if n < rounds), len(judged)))
        return out

    def forget(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def end_step(self, plain: bool = False) -> None:
        """A decode step ended: the recent pools age (a plain step's when next read)."""
        if plain:
            self._unaged += 1
            return
        self._catch_up_ageing()
        self._age(1)
        self.version += 1

    def _catch_up_ageing(self) -> None:
        if self._unaged:
            self._age(self._unaged)
            self._unaged = 0

    def _age(self, steps: int) -> None:
        for pool in (self._all, *self._pools.values()):
            pool.age(steps)


def expected_tokens(acceptance: Acceptance, k: int) -> float:
    """E[tokens per round] with k proposals, the final token included: 1 + h_1 + h_1 h_2 + ...
    (positions past the rates' end reuse the last; one rate a gives (1 - a^(k+1)) / (1 - a))."""
    k = max(k, 0)
    return expected_tokens_table([acceptance], [k], k)[0][k]


def _rates(acceptance: Acceptance, k_max: int) -> Sequence[float]:
    """h_1..h_k_max of one request (a single rate repeated; past its rates, its last)."""
    if isinstance(acceptance, (int, float)):
        return [float(acceptance)] * k_max
    if len(acceptance) >= k_max:  # the engine's case: rates for spec_length positions
        return acceptance[:k_max]
    return [*acceptance, *[acceptance[-1]] * (k_max - len(acceptance))]


# Plain Python over lists, not numpy: between model passes each numpy call's fixed cost (paid with
# cold caches) exceeded this arithmetic up to batch 32 (docs/performance-notes.md, "The policy's
# arithmetic in plain Python").


def expected_tokens_table(alphas: Sequence[Acceptance], caps: Sequence[int], k_max: int) -> list[list[float]]:
    """[B][k_max + 1]: row i is E_i(0), ..., E_i(k_max) for request i, held at E_i(cap_i) past its cap."""
    table = []
    for acceptance, cap in zip(alphas, caps, strict=True):
        row, expected, all_accepted = [1.0], 1.0, 1.0
        for t, h in enumerate(_rates(acceptance, k_max), 1):
            if t <= cap:  # nothing past a request's cap
                all_accepted *= h  # chance the first t proposals are all accepted
                expected += all_accepted
            row.append(expected)
        table.append(row)
    return table


def first_pass_widths(table: list[list[float]], caps: Sequence[int], catch_up: CatchUp) -> list[float]:
    """Expected width (tokens of its longest row) of a round's first draft pass after rounds at
    K = 0..k_max, from the requests' expected_tokens_table [B][k_max + 1] (E(t) - E(t - 1) is the
    chance a request accepts at least t; 0 past its cap). "round": a + 1 tokens a row, so the
    longest is at least t + 1 unless no row accepts t or more; "own": 2 tokens where a row
    accepted all it proposed (min(K, its cap))."""
    k_max = len(table[0]) - 1 if table else 0
    widths = [1.0]
    for k in range(1, k_max + 1):
        none = 1.0  # "round": chance no row accepts k or more; "own": no row accepts all it proposed
        for row, cap in zip(table, caps, strict=True):
            t = k if catch_up == "round" else min(k, cap)
            if t > 0:
                none *= 1.0 - (row[t] - row[t - 1])
        widths.append(widths[-1] + 1.0 - none if catch_up == "round" else 2.0 - none)
    return widths


@dataclass(frozen=True)
class Choice:
    k: int
    reason: Reason
    goodput: dict[int, float]  # estimated tokens/s for each K considered (empty if not adaptive)


class SpecPolicy:
    """Probes run both ways: after `probe_every` adaptive choices of plain decoding in a row, one
    step speculates ("probe": plain steps bring no evidence about the proposer); after as many
    choices of K > 0, one step decodes plainly ("plain_probe": speculative steps never measure
    the plain pass). Each probe that leaves the verdict as it was doubles its direction's wait,
    up to MAX_PROBE_BACKOFF times; a step chosen the other way on its merits resets it.

    While speculating, every `k_probe_every`-th choice takes another K instead ("k_probe"): one and
    two above and below in turn, and every FAR_PROBE_EVERY-th time one further away. Only the K in
    use is measured otherwise, so the verify line at every other K (and the acceptance past K)
    stays as calibrated, and a policy whose first rounds favoured a worse K would keep it (a stale
    line's slope bends towards the K it holds); the far probes find a better K that the costs
    near the one in use do not point to (a pass's cost per token falls as it widens, on CPU)."""

    MAX_PROBE_BACKOFF = 8
    K_PROBE_STEPS = (1, -1, 2, -2)  # the neighbours probed in turn, as offsets from the policy's K
    FAR_PROBE_EVERY = 4  # every 4th K probe takes a K further away instead

    def __init__(self, costs: MeasuredCosts, spec_length: int, mode: Literal["fixed", "adaptive"],
                 disable_batch_size: int | None = None, hysteresis: float = 0.03,
                 probe_every: int = 32, k_probe_every: int = 8, corrections: Corrections | None = None):
        """corrections: what the self-check found, scaling each priced component (None: none)."""
        self.costs, self.hysteresis, self.probe_every = costs, hysteresis, probe_every
        self.corrections = corrections
        self.k_probe_every = k_probe_every  # 0: never
        self.configure(spec_length, mode, disable_batch_size)

    def configure(self, spec_length: int, mode: Literal["fixed", "adaptive"], disable_batch_size: int | None) -> None:
        """New settings; the adaptive choice starts afresh (no streak, probe waits reset)."""
        self.spec_length, self.mode, self.disable_batch_size = spec_length, mode, disable_batch_size
        self._last_k = spec_length
        self._streak = 0  # consecutive adaptive verdicts on _last_k's side (plain, or K > 0)
        self._wait = {True: self.probe_every, False: self.probe_every}  # by "the streak is plain": before a probe
        self._since_k_probe, self._k_probe_turn = 0, 0  # speculative choices since a K probe; the next neighbour
        self._k_probes, self._far_next = 0, 1  # K probes so far; the far K probed next (or the first above it)

    def _step_seconds(self, k_max: int, batch: int, draft_rows: int | None, widths: list[float],
                      fix: dict[str, list[float]] | None) -> list[float]:
        """A step's time at K = 0..k_max: its draft passes (the first at the expected width
        widths[k]), its verify pass and the rest, each scaled by its correction (fix: Corrections.factors)."""
        verify, other = self.costs.verify_times(batch, k_max), self.costs.other_times(batch, k_max)
        draft_rows = batch if draft_rows is None else draft_rows
        draft = [0.0] * (k_max + 1)
        if draft_rows:
            first, further = self.costs.draft_times(draft_rows, k_max)  # first[w - 1]: at width w; further[n]: n steps
            draft = [0.0] + [interpolated(first, widths[k] - 1) + further[k - 1] for k in range(1, k_max + 1)]
        if fix is None:
            return [d + v + o for d, v, o in zip(draft, verify, other)]
        return [fd * d + fv * v + fo * o
                for d, v, o, fd, fv, fo in zip(draft, verify, other, fix["draft"], fix["verify"], fix["other"])]

    def _goodput(self, k: int, tokens: float, seconds: float, catch_up_tokens: int, round_tokens_left: int) -> float:
        """Expected tokens/s with K = k for a step of `seconds` yielding `tokens` (the batch's E(k);
        plain: B), plus its share of catching up on `catch_up_tokens` (spread over the steps the
        batch has left: round_tokens_left, the requests' caps + 1, at `tokens` a step)."""
        if k and catch_up_tokens:
            steps_left = max(1.0, round_tokens_left / tokens)
            seconds += self.costs.catch_up_time(catch_up_tokens) / steps_left
        return tokens / seconds

    def settled(self, batch: int, k_caps: list[int]) -> Choice | None:
        """The choice where no estimate enters (the batch disables speculation, no request has
        room, fixed mode); None: the adaptive choice decides."""
        if self.disable_batch_size is not None and batch >= self.disable_batch_size:
            return Choice(0, "disabled_batch_size", {})
        if self.k_max(k_caps) <= 0:
            return Choice(0, "length_guard", {})
        if self.mode == "fixed":
            return Choice(self.k_max(k_caps), "fixed", {})
        return None

    def k_max(self, k_caps: Sequence[int]) -> int:
        """The largest K the batch may take: spec_length, clipped by the largest cap (here only)."""
        return min(self.spec_length, max(k_caps, default=0))

    def choose(self, alphas: Sequence[Acceptance], k_caps: list[int], draft_rows: int | None = None,
               catch_up_tokens: int = 0, catch_up: CatchUp = "own") -> Choice:
        """alphas: estimated acceptance per request (a rate, or rates by position); k_caps: most
        each may propose; draft_rows: how many a model drafts (None = all, 0 = a lookup);
        catch_up_tokens: tokens the draft must feed in long catch-ups before it can propose;
        catch_up: what the model proposer's first pass feeds (proposer.CatchUp)."""
        settled = self.settled(len(alphas), k_caps)
        if settled is not None:
            return settled
        batch, k_max = len(alphas), self.k_max(k_caps)
        table = expected_tokens_table(alphas, k_caps, k_max)  # [B][k_max + 1]
        fix = self.corrections.factors(batch, k_max) if self.corrections is not None else None
        seconds = self._step_seconds(k_max, batch, draft_rows, first_pass_widths(table, k_caps, catch_up), fix)
        tokens = [sum(column) for column in zip(*table)]  # the batch's expected tokens at K = 0..k_max
        if fix is not None:  # the tokens gained over plain, as the self-check found them
            tokens = [batch + (t - batch) * g for t, g in zip(tokens, fix["gain"])]
        left = sum(k_caps) + batch
        scores = {k: self._goodput(k, tokens[k], seconds[k], catch_up_tokens, left) for k in range(k_max + 1)}
        best = max(scores, key=scores.get)
        last = min(self._last_k, k_max)
        # a margin between plain and speculation (estimates wobble, a switch is not free); between
        # two K > 0 the best is taken
        if (best == 0) != (last == 0) and scores[last] >= (1.0 - self.hysteresis) * scores[best]:
            best = last
        plain, was_plain = best == 0, self._last_k == 0
        self._last_k = best
        if plain != was_plain:  # the other side won on its merits
            self._streak, self._wait[was_plain] = 0, self.probe_every
        self._streak += 1
        if self._streak < self._wait[plain]:
            return self._k_probe(best, k_max, scores) or Choice(best, "policy", scores)
        self._streak = 0
        self._wait[plain] = min(2 * self._wait[plain], self.MAX_PROBE_BACKOFF * self.probe_every)
        if plain:
            return Choice(max(range(1, k_max + 1), key=scores.get), "probe", scores)
        return Choice(0, "plain_probe", scores)

    def count_reused_plain(self) -> bool:
        """Counts a reused all-plain verdict in the probe schedule as the plain choice it stands
        for; False (nothing counted) where that choice would be a probe."""
        if self._streak + 1 >= self._wait[True]:
            return False
        self._streak += 1
        return True

    def _k_probe(self, best: int, k_max: int, scores: dict[int, float]) -> Choice | None:
        """Every k_probe_every-th speculative choice: a K near `best` (K_PROBE_STEPS in turn, the
        next one in 1..k_max), and every FAR_PROBE_EVERY-th of those one further away (the K more
        than two from `best` in turn); the policy's K stays `best`. None otherwise."""
        if best == 0 or not self.k_probe_every or k_max < 2:
            return None
        self._since_k_probe += 1
        if self._since_k_probe < self.k_probe_every:
            return None
        self._since_k_probe = 0
        self._k_probes += 1
        far = [k for k in range(1, k_max + 1) if abs(k - best) > max(self.K_PROBE_STEPS)]
        if far and self._k_probes % self.FAR_PROBE_EVERY == 0:
            k = next((k for k in far if k >= self._far_next), far[0])
            self._far_next = k + 1
            return Choice(k, "k_probe", scores)
        steps = self.K_PROBE_STEPS
        for i in range(len(steps)):
            step = steps[(self._k_probe_turn + i) % len(steps)]
            if 1 <= best + step <= k_max:
                self._k_probe_turn = (self._k_probe_turn + i + 1) % len(steps)
                return Choice(best + step, "k_probe", scores)
        return None
