"""Greedy block drafting for inference: one block after all verified tokens."""

from __future__ import annotations

import torch

from dflash_core.drafter.mask import BlockLayout
from dflash_core.drafter.model import DFlashDrafter


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
    hidden = draft_hidden(model, features, positions, last_token, embed_weight, last_position)
    return (hidden.to(lm_head_weight.dtype) @ lm_head_weight.t()).argmax(-1)


@torch.no_grad()
def draft_hidden(model: DFlashDrafter, features: torch.Tensor, positions: torch.Tensor, last_token: int,
                 embed_weight: torch.Tensor, last_position: int | None = None) -> torch.Tensor:
    """Final-normed hidden states [B-1, H] of slots 1..B-1 of the block after the context
    (``draft_block``'s arguments): the block sees all T context rows and its own block, i.e. the
    training mask with a single document and the anchor right after the context."""
    B, dev = model.block_size, features.device
    T = features.shape[0]
    if last_position is None:
        if T == 0:
            raise ValueError("last_position is required when there is no context")
        last_position = int(positions[-1]) + 1
    ids = torch.full((1, B), model.mask_token_id, dtype=torch.long, device=dev)
    ids[0, 0] = int(last_token)
    block_pos = (last_position + torch.arange(B, device=dev))[None, :]
    layout = BlockLayout(ctx_doc=torch.zeros(T, dtype=torch.long, device=dev),
                         block_doc=torch.zeros(1, dtype=torch.long, device=dev),
                         block_start=torch.full((1,), T, dtype=torch.long, device=dev), block_size=B)
    return model(features, ids, positions.to(dev), block_pos, layout, embed_weight, attn_backend="sdpa")[0]
