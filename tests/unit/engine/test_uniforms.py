"""Counter-based uniforms (engine/uniforms.py): splitmix64 bit for bit, uniform and independent
across draws and neighbouring seeds (chi-square, with teeth: broken hashes fail the same check),
the same for a stream alone or among other rows, and a fixed launch count at any batch size.

Every check here is deterministic (fixed seeds, fixed hash): it passes or fails the same way on
every run. Thresholds: p < 1e-4 per chi-square test, |correlation| < 5 standard errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch.utils._python_dispatch import TorchDispatchMode

import engine.uniforms as uniforms_module
from engine import host_sync
from engine.uniforms import RandomStream, draw_uniforms

MASK64 = 2**64 - 1


def splitmix64(state: int, count: int) -> list[int]:
    """The reference generator (Steele, Lea, Flood 2014), written out apart from the engine's."""
    out = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        out.append(z ^ (z >> 31))
    return out


def test_draws_are_the_top_24_bits_of_splitmix64_seeded_with_the_seeds_first_output():
    assert splitmix64(0, 1) == [0xE220A8397B1DCDAF]  # the published first output for seed 0
    for seed, counter in [(0, 0), (1, 0), (2**63 - 1, 5), (123456789, 1000)]:
        key = splitmix64(seed, 1)[0]
        expected = [z >> 40 for z in splitmix64(key, counter + 6)[counter:]]
        got = draw_uniforms([RandomStream(seed, counter)], 6, "cpu")[0] * 2**24  # [6]
        assert got.long().tolist() == expected


def consecutive_seed_draws(streams: int = 64, draws: int = 4096) -> torch.Tensor:
    """[streams, draws]: the first draws of seeds 0..streams-1 (requests are often seeded so)."""
    return draw_uniforms([RandomStream(s) for s in range(streams)], draws, "cpu")


def uniformity_failures(u: torch.Tensor, bins: int = 256, grid: int = 16) -> list[str]:
    """What is wrong with u [S, n] as independent uniforms: 1-D bins over all values, 2-D bins of
    neighbouring draws of a stream and of the same draw of neighbouring streams, correlations."""
    x = u.double().numpy()
    failures = []

    def check(name: str, counts: np.ndarray) -> None:
        p = chisquare(counts).pvalue
        if p < 1e-4:
            failures.append(f"{name}: chi-square p = {p:.2g}")

    check("values", np.bincount((x * bins).astype(int).ravel(), minlength=bins))
    cell = (x * grid).astype(int)
    check("(u_i, u_i+1)", np.bincount((cell[:, :-1] * grid + cell[:, 1:]).ravel(), minlength=grid * grid))
    check("(seed, seed + 1)", np.bincount((cell[:-1] * grid + cell[1:]).ravel(), minlength=grid * grid))
    for name, a, b in [("counter", x[:, :-1], x[:, 1:]), ("seed", x[:-1], x[1:])]:
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        if abs(r) > 5 / np.sqrt(a.size):
            failures.append(f"correlation of neighbouring {name}s: {r:.3g}")
    return failures


def test_draws_are_uniform_and_independent_across_counters_and_neighbouring_seeds():
    u = consecutive_seed_draws()
    assert uniformity_failures(u) == []
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert torch.equal(u * 2**24, (u * 2**24).floor())  # k / 2**24 exactly


@pytest.mark.parametrize("broken", [
    lambda state: uniforms_module._shift_right(state, 40),  # the mix dropped: a Weyl sequence's top bits
    lambda state: state & 0xFFFFFF,  # the low bits of the unmixed counter state
], ids=["no_mix", "low_counter_bits"])
def test_teeth_a_broken_hash_fails_the_same_check(monkeypatch, broken):
    monkeypatch.setattr(uniforms_module, "mix64_top_bits", broken)
    assert uniformity_failures(consecutive_seed_draws()) != []


def test_a_stream_draws_the_same_alone_among_other_rows_and_in_pieces():
    alone = draw_uniforms([RandomStream(7)], 5, "cpu")[0]
    batch = [RandomStream(1), RandomStream(7), RandomStream(3, counter=100)]
    assert torch.equal(draw_uniforms(batch, 5, "cpu")[1], alone)
    assert [s.counter for s in batch] == [5, 5, 105]
    pieces = RandomStream(7)
    assert torch.equal(torch.cat([draw_uniforms([pieces], n, "cpu")[0] for n in (2, 0, 3)]), alone)


def test_counts_advance_each_stream_by_its_own_count():
    """Columns past a row's count are the draws its stream makes next."""
    streams = [RandomStream(7), RandomStream(8)]
    first = draw_uniforms(streams, 4, "cpu", counts=[1, 4])  # [2, 4]
    assert [s.counter for s in streams] == [1, 4]
    assert torch.equal(draw_uniforms(streams[:1], 3, "cpu")[0], first[0, 1:])
    assert torch.equal(first, draw_uniforms([RandomStream(7), RandomStream(8)], 4, "cpu"))


def test_bad_input_names_the_field():
    for kwargs, field in [(dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(seed=1.5), "seed"),
                          (dict(seed=0, counter=-1), "counter")]:
        with pytest.raises(ValueError, match=field):
            RandomStream(**kwargs)
    with pytest.raises(ValueError, match="^n "):
        draw_uniforms([RandomStream(0)], -1, "cpu")
    with pytest.raises(ValueError, match="counts"):
        draw_uniforms([RandomStream(0)], 2, "cpu", counts=[3])
    assert draw_uniforms([], 3, "cpu").shape == (0, 3)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_batch_of_any_size_takes_one_upload_and_the_same_kernels(monkeypatch):
    uploads = []
    monkeypatch.setattr(host_sync, "upload", lambda *a, **kw: uploads.append(a) or torch.tensor(a[0], dtype=a[2]))
    counted = []
    for n_streams in (1, 64):
        with _CountOps() as mode:
            draw_uniforms([RandomStream(s) for s in range(n_streams)], 3, "cpu")
        counted.append(mode.ops)
    assert len(uploads) == 2 and counted[0] == counted[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_are_bit_identical_to_cpu_draws():
    make = lambda: [RandomStream(s, counter=3 * s) for s in range(300)]  # noqa: E731
    assert torch.equal(draw_uniforms(make(), 257, "cuda").cpu(), draw_uniforms(make(), 257, "cpu"))
