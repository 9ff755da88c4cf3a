"""Rotary position embeddings (RoPE) with explicit positions: the tables and their application.

Shared by the models (which build one ``Rotary`` per layer), the attention backends (which hand its
tables to the fused kernels), the presses that re-rotate keys, and the transformers bridge.
Plain torch; nothing here knows of models, pages or attention.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvcache.errors import UnsupportedArchitecture


class Rotary:
    """RoPE with explicit positions: HF's rotate_half convention, optional partial rotary dims,
    HF's 'linear', 'llama3', 'yarn' and 'longrope' scaling, and a GGUF's frequency factors
    (``freq_factors`` [rot/2]: llama.cpp's ``rope_freqs``, each frequency divided by its factor).
    Tables of cos/sin over positions are built once and grown on demand; a forward gathers the
    rows of its positions."""

    SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")

    def __init__(
        self, rot_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position: int = 2048,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        self.rot_dim = rot_dim
        self.theta = theta
        self.attention_factor = 1.0
        inv = 1.0 / _pow(theta, torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)  # [rot/2]
        if scaling is not None:
            inv = self._scale(inv, scaling, max_position)
        if freq_factors is not None:
            if freq_factors.shape != inv.shape:
                raise UnsupportedArchitecture(
                    f"RoPE frequency factors of shape {tuple(freq_factors.shape)}; the model rotates "
                    f"{rot_dim} dims, so {inv.shape[0]} factors are needed")
            inv = inv / freq_factors.float()
        self.inv_freq = inv  # [rot_dim / 2]
        self.cos = torch.empty(0, rot_dim)  # [P, rot_dim]
        self.sin = torch.empty(0, rot_dim)  # [P, rot_dim], rotate_half's sign folded in

    def _scale(self, inv: torch.Tensor, s: dict[str, Any], max_position: int) -> torch.Tensor:
        kind = s.get("rope_type", s.get("type", "default"))
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / float(s["factor"])
        if kind == "llama3":
            factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old = float(s["original_max_position_embeddings"])
            low_wl, high_wl = old / low, old / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wl, inv / factor, inv)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return torch.where(medium, smoothed, scaled)
        if kind == "yarn":
            return self._yarn(s, max_position)
        if kind == "longrope":
            return self._longrope(s, max_position)
        raise UnsupportedArchitecture(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(self.SUPPORTED)}"
        )

    def _yarn(self, s: dict[str, Any], max_position: int) -> torch.Tensor:
        """HF's _compute_yarn_parameters: inverse frequencies [rot/2]; sets attention_factor."""
        dim, base = self.rot_dim, self.theta
        old = float(s["original_max_position_embeddings"])
        factor = float(s.get("factor") or max_position / old)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = s.get("attention_factor")
        if att is None:
            m, m_all = s.get("mscale"), s.get("mscale_all_dim")
            att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        self.attention_factor = float(att)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(float(s.get("beta_fast") or 32)), corr_dim(float(s.get("beta_slow") or 1))
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = _pow(base, torch.arange(0, dim, 2).float() / dim)
        extra = 1 - ramp  # share of the unscaled (extrapolated) frequency
        return (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra

    def _longrope(self, s: dict[str, Any], max_position: int) -> torch.Tensor:
        """Phi-3's LongRoPE: base frequencies divided by per-dimension factors, the long ones when
        the model's context exceeds the original one (llama.cpp's rule, fixed for the model's
        life: transformers switches per forward, by the longest position it sees), cos and sin
        scaled by the attention factor."""
        old = float(s["original_max_position_embeddings"])
        factor = float(s.get("factor") or max_position / old)
        att = s.get("attention_factor")
        self.attention_factor = float(att) if att is not None else (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old)))
        ext = torch.tensor(s["long_factor"] if max_position > old else s["short_factor"], dtype=torch.float32)
        if ext.shape[0] != self.rot_dim // 2:
            raise UnsupportedArchitecture(f"longrope factors of length {ext.shape[0]}; {self.rot_dim // 2} needed")
        return 1.0 / (ext * _pow(self.theta, torch.arange(0, self.rot_dim, 2, dtype=torch.int64).float() / self.rot_dim))

    def _grow(self, upto: int) -> None:
        n = max(upto, 2 * self.cos.shape[0], 256)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]  # [n, rot/2]
        emb = torch.cat((freqs, freqs), -1).double()  # [n, rot]; cos and sin in float64, then rounded:
        # float32 cos/sin take the vector code of the CPU's torch build, whose last bits vary by host
        self.cos = emb.cos().float() * self.attention_factor
        sin = emb.sin().float() * self.attention_factor
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): the sign lives in the table
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), -1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions [N]: each [N, 1, rot_dim] (broadcast over heads)."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self.cos.shape[0]:
            self._grow(top)
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


    def rotate(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Turn already-rotated x: [N, H, D] by a further ``delta`` positions: [N] int64 (may be
        negative). RoPE rotations compose, so R(delta) R(p) x = R(p + delta) x."""
        cos, sin = self.tables(delta.abs())  # [N, 1, R] each
        sign = torch.where(delta < 0, -1.0, 1.0)[:, None, None]
        if self.attention_factor != 1.0:
            cos, sin = cos / self.attention_factor, sin / self.attention_factor
        return apply_rotary(x, cos, sin * sign)


def _pow(base: float, e: torch.Tensor) -> torch.Tensor:
    """base ** e for float32 e, computed in float64 and rounded once: the same float32 on every host
    (torch's float32 pow takes the CPU's vector code)."""
    return torch.pow(float(base), e.double()).float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos, signed sin from Rotary.tables: [N, 1, R] with R <= D (partial rotary
    leaves the last D - R dims alone) -> [N, H, D]. HF's x * cos + rotate_half(x) * sin, where
    rotate_half's halves swap is a roll by R/2 (its sign is in the sin table)."""
    r = cos.shape[-1]
    rot = x if r == x.shape[-1] else x[..., :r]
    out = (rot * cos).addcmul_(rot.roll(r // 2, -1), sin)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), -1)
