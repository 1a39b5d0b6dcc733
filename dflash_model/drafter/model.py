"""The DFlash draft model, top to bottom.

    features [T, k*H] (k target layers, verified/context rows)
      -> ctx = hidden_norm(fc(features))                       computed once, shared by all layers
    block ids [N, B] (anchor token, MASK x (B-1)) -> target's frozen embedding -> x [N*B, H]
      (the first layer works on the N + 1 distinct rows of x: the anchors' and the mask token's)
    every draft layer (Qwen3 pre-norm):
      h = input_layernorm(x)
      q = q_norm(q_proj(h))                                    queries: block stream only
      k = k_norm(k_proj([ctx ; h])), v = v_proj([ctx ; h])     keys/values: context + block stream
        (computed as h @ [q;k;v]_proj and ctx @ [k;v]_proj: two products instead of three)
      RoPE on q (block positions) and k ([context positions ; block positions]); GQA attention
      with the training mask (mask.py); x = x + o_proj(attn)
      x = x + down(silu(gate(post_attention_layernorm(x))) * up(.))
    (the last layer's MLP only on slots 1..B-1: no later layer reads the anchor rows)
    -> norm(x) of slots 1..B-1  (then the target's frozen LM head, by loss.py / draft.py in chunks)

The target's embedding and LM head are passed in on every call: they are neither parameters of
this module nor saved, so tied embeddings need nothing special. Parameter names are exactly the
exported tensor names.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_model.drafter.attention import BACKENDS, attend, resolve_backend
from dflash_model.drafter.config import SLIDING, DrafterConfig
from dflash_model.drafter.fp8_head import fits_fp8
from dflash_model.drafter.fp8_linear import fp8_linear
from dflash_model.drafter.mask import TILE, BlockLayout
from dflash_model.drafter.rope import apply_rope, rope_cos_sin, rope_inv_freq
from dflash_model.fast.compile_gate import compiled

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class RMSNorm(nn.Module):
    """HF/Qwen3 RMSNorm: normalize in (at least) float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class DraftAttention(nn.Module):
    """Queries from the block stream; keys/values from [context ; block stream]; GQA; q/k norms."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, nkv * d, bias=False)
        self.v_proj = nn.Linear(H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Any, backend: str, kernel_options: dict[str, Any] | None = None,
                distinct_of: int = 0) -> torch.Tensor:
        """``distinct_of`` = B (first layer): x holds the block stream's N + 1 distinct rows
        (``expand_blocks``); they are projected once each and laid out as the stream after."""
        T, nq, nkv = ctx.shape[0], self.nh * self.d, self.nkv * self.d
        # one product for the block stream's q, k and v, one for the context's k and v (context
        # features enter k/v without the layer's input norm): wider products than one per
        # projection run faster, and concatenating the weights costs less than the inputs
        wk, wv = self.k_proj.weight, self.v_proj.weight
        q, k_x, v_x = F.linear(x, torch.cat([self.q_proj.weight, wk, wv])).split([nq, nkv, nkv], -1)
        k_c, v_c = F.linear(ctx, torch.cat([wk, wv])).split([nkv, nkv], -1)
        q = self.q_norm(q.reshape(x.shape[0], self.nh, self.d))
        if distinct_of:
            q, k_x, v_x = (expand_blocks(t, distinct_of) for t in (q, k_x, v_x))
        k = self.k_norm(torch.cat([k_c, k_x]).view(-1, self.nkv, self.d))
        v = torch.cat([v_c, v_x]).view(-1, self.nkv, self.d)
        q = apply_rope(q, cos[T:], sin[T:])
        k = apply_rope(k, cos, sin)
        return self.o_proj(attend(q, k, v, mask, backend, kernel_options).reshape(q.shape[0], self.nh * self.d))


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)). ``fp8`` (off unless ``DFlashDrafter.use_fp8_mlp``):
    its products through FP8 (fp8_linear.py), gate and up as one product; the weights stay as
    they are."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fp8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            gate, up = fp8_linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, -1)
            return fp8_linear(self.act(gate) * up, self.down_proj.weight)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then x + mlp(norm(x)), as two calls (``attend``,
    ``feed_forward``) so that the model can run the second on a subset of the rows."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attend(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any,
               backend: str, kernel_options: dict[str, Any] | None = None, distinct_of: int = 0) -> torch.Tensor:
        """x + attn(norm(x)): the first half, on every row of the block stream."""
        attn = self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask, backend, kernel_options, distinct_of)
        return (expand_blocks(x, distinct_of) if distinct_of else x) + attn

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + mlp(norm(x)): the second half, row by row (so it may run on a subset of the rows)."""
        return x + self.mlp(self.post_attention_layernorm(x))


def expand_blocks(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N + 1, ...] (each block's anchor row, then the mask token's row) -> the [N * B, ...] stream.

    Slots 1..B-1 of every block embed the same mask token, so until attention mixes positions
    (the first layer's norm, q/k/v projections and q/k norms) they are one row: computing it once
    saves the first layer 15/16 of its q, k and v work for the block stream (forward, both
    gradients); the backward of the expansion sums the slots' gradients into that row."""
    n = rows.shape[0] - 1
    tail = rows.shape[1:]
    stream = torch.cat([rows[:n, None], rows[n:, None].expand(n, block_size - 1, *tail)], 1)
    return stream.reshape(n * block_size, *tail)


class DFlashDrafter(nn.Module):
    """DFlash block-diffusion drafter for a frozen target.

    Build from the target's HF config (object or dict): ``DFlashDrafter(target_config,
    num_layers=5, block_size=16, target_layer_ids=None, mask_token_id=151669)``; a ready
    ``DrafterConfig`` is also accepted (the other shape arguments are then ignored).
    ``attn_backend``: "auto" (flex on CUDA, sdpa otherwise), "flex" or "sdpa".
    ``flex_kernel_options`` (attribute, default None = torch's defaults): Triton block sizes etc.
    passed to flex_attention as ``kernel_options``; ``flex_tile`` (attribute, default
    ``mask.TILE``): the BlockMask's tile. Both are set by ``dflash_model.fast.tune_drafter``
    before the first compile (it also lets torch's flex backward compile for tiles below 128).
    They change speed, not results beyond rounding.
    ``compile_layers()`` compiles the draft layer's two halves once (all layers share the graphs).
    """

    def __init__(self, target_config: Any, *, mask_token_id: int | None = None, num_layers: int = 5,
                 block_size: int = 16, target_layer_ids: Sequence[int] | None = None,
                 layer_types: Sequence[str] | None = None, attn_backend: str = "auto") -> None:
        super().__init__()
        if isinstance(target_config, DrafterConfig):
            cfg = target_config
        else:
            if mask_token_id is None:
                raise ValueError("mask_token_id is required (see pick_mask_token_id)")
            cfg = DrafterConfig.from_target(target_config, num_layers=num_layers, block_size=block_size,
                                            target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                                            layer_types=layer_types)
        if attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got {attn_backend!r}")
        self.config = cfg
        self.attn_backend = attn_backend
        self.flex_kernel_options: dict[str, Any] | None = None
        self.flex_tile = TILE
        H, k = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        # RoPE tables per layer type, kept off the state dict and out of .to(dtype) casts; copied
        # once to each device they are used on (a per-step host copy would stall the host)
        self._rope = {lt: rope_inv_freq(cfg.rope_parameters(lt), cfg.head_dim) for lt in set(cfg.layer_types)}
        self._rope_on: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._attend: Any = _attend
        self._feed_forward: Any = _feed_forward
        self.reset_parameters()

    def compile_layers(self, **options: Any) -> None:
        """Run every draft layer through two torch.compile'd functions: its attention half and
        its MLP half.

        Regional compilation: the layers are identical, so one graph per half (norms, RoPE, SwiGLU
        and the residuals fused by Inductor, flex attention inlined) serves all of them and
        compiles in a fraction of the time of the whole model. The parameters are graph inputs,
        so the layers do not recompile one another. The MLP half is compiled for any number of
        rows (the last layer's runs on fewer, see ``forward``). The two norms outside the layers
        (context, output) are compiled too: eager, their float32 passes and backward are separate
        kernels over every row."""
        self._attend = compiled(_attend, **options)
        any_rows = {**options, "options": {**_any_rows_inductor_options(), **options.get("options", {})}}
        self._feed_forward = compiled(_feed_forward, **any_rows)
        for norm in (self.hidden_norm, self.norm):  # context rows, output rows
            norm.forward = types.MethodType(compiled(type(norm).forward, **any_rows), norm)

    def use_fp8_mlp(self) -> None:
        """Train the draft layers' MLPs through FP8 products (``MLP``); call before
        ``compile_layers``. Refused where ``torch._scaled_mm`` cannot take the sizes."""
        H, inter = self.config.hidden_size, self.config.intermediate_size
        if not fits_fp8(H, inter):
            raise ValueError(f"an FP8 MLP needs the hidden ({H}) and intermediate ({inter}) sizes to be multiples "
                             "of 16; use mlp_dtype: model")
        for layer in self.layers:
            layer.mlp.fp8 = True

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init: linear weights N(0, std), norm weights 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, features: torch.Tensor, block_ids: torch.Tensor, ctx_positions: torch.Tensor,
                block_positions: torch.Tensor, layout: BlockLayout, embed_weight: torch.Tensor,
                attn_backend: str | None = None) -> torch.Tensor:
        """Final-normed hidden states [N, B-1, H] of slots 1..B-1 of the blocks (the slots that
        predict a token; slot 0 holds the anchor's own token).

        features [T, k*H] (target layers in ``target_layer_ids`` order), block_ids/block_positions
        [N, B], ctx_positions [T], layout: documents/anchors for the mask, embed_weight [V, H].
        """
        N, B = block_ids.shape
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(_any_rows(self.fc(features.to(dtype))))
        # DFlash's block input is [anchor token, MASK x (B-1)]: the first layer reads slot 0 of each
        # block and one mask row (checked on the device, without waiting for it)
        torch._assert_async((block_ids[:, 1:] == self.mask_token_id).all(),
                            "block_ids: slots 1..B-1 must hold mask_token_id")
        distinct = torch.cat([block_ids[:, 0], block_ids.new_full((1,), self.mask_token_id)])
        x = F.embedding(distinct, embed_weight.detach()).to(dtype)
        positions = torch.cat([ctx_positions.reshape(-1), block_positions.reshape(-1)])
        backend = resolve_backend(attn_backend or self.attn_backend, x.device)
        masks, ropes = {}, {}
        for lt, (inv_freq, scale) in self._rope.items():
            if (lt, x.device) not in self._rope_on:
                self._rope_on[lt, x.device] = inv_freq.to(x.device)
            inv_freq = self._rope_on[lt, x.device]
            window = self.config.sliding_window if lt == SLIDING else None
            masks[lt] = (layout.flex_block_mask(window, tile=self.flex_tile) if backend == "flex"
                         else layout.dense_mask(window))
            ropes[lt] = rope_cos_sin(inv_freq, scale, positions, dtype)
        last = len(self.layers) - 1
        for i, (layer, lt) in enumerate(zip(self.layers, self.config.layer_types)):
            x = self._attend(layer, x, ctx, *ropes[lt], masks[lt], backend, self.flex_kernel_options,
                             B if i == 0 else 0)
            if i == last:  # nothing reads the anchor rows after the last attention: 1/B less MLP
                x = x.view(N, B, -1)[:, 1:].reshape(N * (B - 1), -1)
            x = self._feed_forward(layer, _any_rows(x))
        return self.norm(_any_rows(x)).view(N, B - 1, -1)


def _any_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``, its row count marked as varying for torch.compile: one graph then serves every
    count (the MLP's N*B rows and the last layer's N*(B-1); the norms' context and output rows)
    instead of one per count, each compiled cold. A single row stays fixed (size 1 is special)."""
    if x.shape[0] > 1:
        torch._dynamo.maybe_mark_dynamic(x, 0)
    return x


def _any_rows_inductor_options() -> dict[str, Any]:
    """Inductor options for the graphs that serve any row count (``_any_rows``).

    Inductor fuses a norm's backward row and column sums into one kernel only from 2 x hidden
    rows up, a test it keeps as a guard on the row count: 8,192 rows then compile once more at
    7,680 (H = 4,096). Its non-strict mode fuses at any count, without the guard (and without the
    fusion where the option is missing: one graph matters more than one kernel)."""
    from torch._inductor import config

    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    if hasattr(config.triton, "mix_order_reduction"):
        return {"triton.mix_order_reduction": False}
    return {}


def _attend(layer: DraftLayer, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            mask: Any, backend: str, kernel_options: dict[str, Any] | None = None,
            distinct_of: int = 0) -> torch.Tensor:
    """A draft layer's attention half; one unit that ``DFlashDrafter.compile_layers`` compiles."""
    return layer.attend(x, ctx, cos, sin, mask, backend, kernel_options, distinct_of)


def _feed_forward(layer: DraftLayer, x: torch.Tensor) -> torch.Tensor:
    """A draft layer's MLP half; the other unit that ``compile_layers`` compiles."""
    return layer.feed_forward(x)
