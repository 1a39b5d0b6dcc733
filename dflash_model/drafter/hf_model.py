"""The DFlash drafter as a transformers model, shipped in every export as ``modeling_dflash.py``.

``AutoModel.from_pretrained(export_dir, trust_remote_code=True)`` loads it through the export's
``auto_map``. It imports torch and transformers only (the export must load where dflash-pipe is
not installed) and runs under transformers 4.57 and 5.x. Its forward has the signature of the
DFlash drafters z-lab publishes, and computes what dflash-pipe's drafter computes for one block
drafted after the context:

    target_hidden [b, T, k*H] -> ctx = hidden_norm(fc(target_hidden))
    noise_embedding [b, B, H] (the target's embedding of [last token, MASK x (B-1)]) -> x
    every layer (Qwen3 pre-norm): queries from x, keys/values from [ctx ; x], RoPE by position_ids
      ([context positions ; block positions]), GQA; full-attention layers see every key, sliding
      layers the keys whose position is at most the query's and within the window; then the MLP
    -> norm(x) [b, B, H]; the target's LM head turns slots 1..B-1 into draft tokens

With a KV cache (``past_key_values``), the cached keys are taken to be the positions right
before ``position_ids`` (the caller crops the block's entries before the next call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import (Qwen3Config, Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [b, heads, S, d] with cos/sin [b, S, rot] (rotate-half layout; dims past rot unrotated)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, rest], dim=-1)


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [context ; block]; q/k norms per head; GQA."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        H, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: Cache | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos[:, -n:], sin[:, -n:]), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    """x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: Cache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as an additive one; additive masks pass unchanged."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class DFlashDraftModel(Qwen3PreTrainedModel):
    """fc + hidden_norm on the target's features, the draft layers, the final norm (no embedding or LM head)."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = config.dflash_config
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = dflash["mask_token_id"]
        self.block_size = dflash.get("block_size", config.block_size)
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool = False, **kwargs: object) -> torch.Tensor:
        """Final-normed hidden states [b, B, H] of the block.

        position_ids [b, T + B]: positions of the (new) context rows, then of the block.
        attention_mask: optional, bool (True = attend) or additive, broadcast to [b, heads, B, keys]
        and applied in every layer on top of the sliding windows. ``use_cache`` and ``kwargs`` are
        accepted for the published signature; the cache is used whenever ``past_key_values`` is given.
        """
        x = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden.to(x.dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        masks = {lt: self._mask(lt, position_ids, x, attention_mask, past) for lt in set(self.config.layer_types)}
        for layer, lt in zip(self.layers, self.config.layer_types):
            x = layer(x, ctx, cos, sin, masks[lt], past_key_values)
        return self.norm(x)

    def _mask(self, layer_type: str, position_ids: torch.Tensor, x: torch.Tensor,
              attention_mask: torch.Tensor | None, past: int) -> torch.Tensor | None:
        """Additive mask [b, 1, B, keys] of one layer type, or None (every key visible); ``past``
        cached keys come before the context rows."""
        window = self.config.sliding_window if layer_type == "sliding_attention" else None
        mask = None if attention_mask is None else additive(attention_mask, x.dtype)
        if window is None:
            return mask
        earlier = position_ids[:, :1] - past + torch.arange(past, device=position_ids.device)
        keys = torch.cat([earlier, position_ids], dim=1)[:, None, None, :]
        queries = position_ids[:, -x.shape[1]:][:, None, :, None]
        slide = additive((keys <= queries) & (queries - keys < window), x.dtype)
        return slide if mask is None else slide + mask
