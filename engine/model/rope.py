"""Rotary position embeddings: the scaling variants checkpoints configure (none, `linear`, `llama3`,
`yarn`) and the cos/sin tables the forward reads. Anything else is a ValueError at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Rope:
    theta: float
    head_dim: int
    max_position_embeddings: int
    scaling: dict | None = None  # the checkpoint's rope_scaling / rope_parameters; None: plain RoPE

    @classmethod
    def from_hf_config(cls, cfg: dict, head_dim: int) -> Rope:
        params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor other than 1.0 is not supported")
        return cls(float(theta), head_dim, int(cfg.get("max_position_embeddings", 2048)),
                   None if kind == "default" else {**params, "rope_type": kind})

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies [head_dim // 2] (float32), scaled as configured."""
        dim = self.head_dim
        plain = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        s = self.scaling or {"rope_type": "default"}
        if s["rope_type"] == "linear":
            return plain / s["factor"]
        if s["rope_type"] == "llama3":
            return self._llama3(plain, s)
        if s["rope_type"] == "yarn":
            return self._yarn(plain, s)
        return plain

    def attention_factor(self) -> float:
        """What yarn multiplies cos and sin by (1 otherwise)."""
        s = self.scaling or {}
        if s.get("rope_type") != "yarn":
            return 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor = self._yarn_factor(s)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if s.get("mscale") and s.get("mscale_all_dim"):
            return mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        return mscale(factor)

    @staticmethod
    def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
        """Long wavelengths slowed by `factor`, short ones kept, the band in between interpolated
        linearly in 1/wavelength."""
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        original = s["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        blend = (original / wavelength - low) / (high - low)
        interpolated = (1 - blend) * scaled / factor + blend * scaled
        in_band = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(in_band, interpolated, scaled)

    def _yarn_factor(self, s: dict) -> float:
        return s["factor"] if s.get("factor") is not None else self.max_position_embeddings / self._yarn_original(s)

    def _yarn_original(self, s: dict) -> int:
        return s.get("original_max_position_embeddings") or self.max_position_embeddings

    def _yarn(self, inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
        """Dimensions that turn fewer than beta_slow times over the original context are
        interpolated (divided by `factor`), those turning more than beta_fast times kept, a linear
        ramp between them."""
        dim, factor, original = self.head_dim, self._yarn_factor(s), self._yarn_original(s)

        def dim_turning(turns: float) -> float:  # the dimension that turns `turns` times over `original`
            return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(self.theta))
        low, high = dim_turning(s.get("beta_fast") or 32), dim_turning(s.get("beta_slow") or 1)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def tables(self, max_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_positions, head_dim] for rotate-half RoPE, the minus of the first half of
        the rotation folded into sin, both times the attention factor."""
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq())  # [max_positions, head_dim // 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        sin = angles.sin()
        half = sin.shape[-1] // 2
        signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        factor = self.attention_factor()
        return (angles.cos() * factor).to(dtype).to(device), (signed * factor).to(dtype).to(device)
