"""Counter-based uniforms: a request's random draws are a pure function of its seed and of how
many it has drawn before, so they depend neither on the batch it runs in, nor its row there, nor
the device; and a whole batch's draws take the same few kernel launches at any batch size.

Draw number c of a stream is splitmix64's output at position c: the finaliser `mix64` of
key + (c + 1) * GAMMA (mod 2**64), where the key is the splitmix64 output of the seed itself
(hashed once, on the host, so neighbouring seeds give unrelated streams). Its top 24 bits times
2**-24 are a float32 in [0, 1) exactly, bit-identical on every device. On the device the hash is
int64 arithmetic: multiplication and addition wrap mod 2**64, and `>>` sign-extends, so each
shift is masked to a logical one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import host_sync

MASK64 = 2**64 - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
FLOAT_BITS = 24  # a float32 holds 24 significant bits: k / 2**24 is exact


def mix64(x: int) -> int:
    """splitmix64's finaliser on a host integer in [0, 2**64)."""
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def _as_int64(x: int) -> int:
    """x in [0, 2**64) as the int64 with the same bits."""
    return x - 2**64 if x >= 2**63 else x


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bits: `>>` sign-extends, so the copied sign bits are masked off."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64_top_bits(x: torch.Tensor) -> torch.Tensor:
    """The top FLOAT_BITS bits of mix64(x) for int64 x (wrapping bits), as int64 in [0, 2**24).
    mix64's last step, x ^ (x >> 31), leaves bits 33..63 as they are, so it is skipped."""
    x = (x ^ _shift_right(x, 30)) * _as_int64(MIX1)
    x = (x ^ _shift_right(x, 27)) * _as_int64(MIX2)
    return _shift_right(x, 64 - FLOAT_BITS)


@dataclass
class RandomStream:
    """One request's source of uniforms: its seed and how many draws it has made (host integers)."""

    seed: int
    counter: int = 0
    key: int = field(init=False, repr=False)  # mix64 of the seed's first splitmix64 state, as int64

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MASK64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if isinstance(self.counter, bool) or not isinstance(self.counter, int) or self.counter < 0:
            raise ValueError(f"counter must be a non-negative integer, got {self.counter!r}")
        self.key = _as_int64(mix64((self.seed + GAMMA) & MASK64))


def draw_uniforms(streams: list[RandomStream], n: int, device: torch.device | str,
                  counts: list[int] | None = None) -> torch.Tensor:
    """[N, n] float32 uniforms in [0, 1) on `device`: row i holds the next n draws of streams[i].
    Each stream advances by counts[i] (default n, at most n): columns from counts[i] on are the
    draws it will make next, for the caller to ignore. One upload and a fixed number of kernels."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    counts = [n] * len(streams) if counts is None else counts
    if len(counts) != len(streams) or any(not 0 <= c <= n for c in counts):
        raise ValueError(f"counts must give each of the {len(streams)} streams a count in [0, {n}], got {counts}")
    if not streams:
        return torch.empty(0, n, device=device)
    key_counter = host_sync.upload([[s.key, s.counter] for s in streams], device, torch.int64)  # [N, 2]
    for s, c in zip(streams, counts):
        s.counter += c
    position = key_counter[:, 1:] + torch.arange(1, n + 1, device=device)  # [N, n]: counter + 1 + column
    state = key_counter[:, :1] + position * _as_int64(GAMMA)  # [N, n], mod 2**64
    return mix64_top_bits(state).to(torch.float32) * 2.0 ** -FLOAT_BITS  # [N, n]
