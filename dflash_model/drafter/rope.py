"""Rotary position embeddings exactly as the target computes them (HF formulas).

Supported rope types: default, linear, llama3, yarn; partial_rotary_factor (the first fraction of
each head is rotated, HF's rotate_half layout). Others (dynamic, longrope, ...) raise: a RoPE
different from the target's silently collapses acceptance, so we never approximate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def rope_inv_freq(params: Mapping[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim/2] float32 on CPU, cos/sin scale) for normalized RoPE ``params``."""
    kind = params["rope_type"]
    base = float(params["rope_theta"])
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, params), 1.0
    if kind == "yarn":
        return _yarn(base, dim, params), _yarn_attention_factor(params)
    raise NotImplementedError(f"rope_type {kind!r} is not supported by the drafter")


def _llama3(inv: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: Mapping[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    orig = float(p["original_max_position_embeddings"])
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_attention_factor(p: Mapping[str, Any]) -> float:
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = float(p["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = p.get("mscale"), p.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [len(positions), rot_dim] computed in float32 (as HF does), then cast to ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32  # float64: exact reference runs
    freqs = positions.to(work)[:, None] * inv_freq.to(device=positions.device, dtype=work)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [S, heads, d] by cos/sin [S, rot_dim]; dims beyond rot_dim pass through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out
