"""Greedy block drafting for inference: one block after all verified tokens of each sequence."""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_model.drafter.mask import BlockLayout
from dflash_model.drafter.model import DFlashDrafter


@torch.no_grad()
def draft_block(model: DFlashDrafter, features: torch.Tensor, positions: torch.Tensor, last_token: int,
                embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                last_position: int | None = None) -> torch.Tensor:
    """The B-1 greedy draft tokens (argmax of slots 1..B-1) following ``last_token``.

    features [T, k*H]: context features of the T verified tokens (their k target hidden states
    concatenated; the last token's own features are not known yet), positions [T] their positions.
    The block [last_token, MASK x (B-1)] sits at last_position + 0..B-1 (default positions[-1] + 1).
    Returns a LongTensor [B-1] on features' device.
    """
    return draft_blocks(model, [features], [positions], [last_token], embed_weight, lm_head_weight,
                        [last_position])[0]


@torch.no_grad()
def draft_blocks(model: DFlashDrafter, features: Sequence[torch.Tensor], positions: Sequence[torch.Tensor],
                 last_tokens: Sequence[int], embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 last_positions: Sequence[int | None] | None = None) -> torch.Tensor:
    """:func:`draft_block` for several sequences in one drafter forward: LongTensor [N, B-1]."""
    hidden = draft_hidden(model, features, positions, last_tokens, embed_weight, last_positions)
    return (hidden.to(lm_head_weight.dtype) @ lm_head_weight.t()).argmax(-1)


@torch.no_grad()
def draft_hidden(model: DFlashDrafter, features: Sequence[torch.Tensor], positions: Sequence[torch.Tensor],
                 last_tokens: Sequence[int], embed_weight: torch.Tensor,
                 last_positions: Sequence[int | None] | None = None) -> torch.Tensor:
    """Final-normed hidden states [N, B-1, H] of slots 1..B-1 of one block after each context.

    The N contexts are packed into one row as N documents, each followed by its block: the training
    mask with the anchor right after the context, so a block sees its own context and nothing else.
    """
    B, dev = model.block_size, features[0].device
    starts, ctx_pos, block_pos = [], [], []
    offset = 0
    for i, (f, p) in enumerate(zip(features, positions)):
        last = (last_positions or [None] * len(features))[i]
        if last is None:
            if f.shape[0] == 0:
                raise ValueError("last_position is required when there is no context")
            last = int(p[-1]) + 1
        offset += f.shape[0]
        starts.append(offset)
        ctx_pos.append(p.to(dev))
        block_pos.append(last + torch.arange(B, device=dev))
    lengths = torch.tensor([f.shape[0] for f in features], device=dev)
    ids = torch.full((len(features), B), model.mask_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = torch.tensor([int(t) for t in last_tokens], device=dev)
    layout = BlockLayout(ctx_doc=torch.repeat_interleave(torch.arange(len(features), device=dev), lengths),
                         block_doc=torch.arange(len(features), device=dev),
                         block_start=torch.tensor(starts, dtype=torch.long, device=dev), block_size=B)
    return model(torch.cat(list(features)), ids, torch.cat(ctx_pos), torch.stack(block_pos), layout,
                 embed_weight, attn_backend="sdpa")
