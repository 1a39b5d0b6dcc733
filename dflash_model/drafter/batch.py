"""The packed row the drafter's loss reads, as one typed value.

A feature row arrives as a mapping of a dozen fields (``dflash_core.rows.FEATURE_ROW``); the loss
needs six of them as tensors, with the documents given one of two ways. :class:`FeatureBatch` holds
exactly those, built once per row (:meth:`FeatureBatch.from_row`) and handed to ``drafter_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class FeatureBatch:
    """One packed row: documents back to back, T tokens, and the target's features for them."""

    features: torch.Tensor
    """[T, k·H]: the chosen target layers' outputs, concatenated (on the drafter's device)."""
    input_ids: torch.Tensor
    """[T] the row's tokens."""
    loss_mask: torch.Tensor
    """[T] 1 where the drafter is trained to predict the token."""
    position_ids: torch.Tensor
    """[T] positions restarting at 0 for every document."""
    doc_lengths: Sequence[int] | None = None
    """The documents' lengths, summing to T (rows after the last are padding) ..."""
    doc_ids: torch.Tensor | None = None
    """... or [T] each token's document (-1: padding); one of the two is given."""
    target_hidden: torch.Tensor | None = None
    """[T, H] the target's final-normed last hidden state: what the ``target_argmax`` and ``kl``
    losses read."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any], device: torch.device) -> FeatureBatch:
        """The batch of a feature row as extract streams it: its features (and last hidden state)
        borrowed onto ``device``, its token fields as host tensors (the loss copies them over
        without a host sync; anchors are drawn from the host mask)."""
        last = row.get("last_hidden")
        return cls(features=borrow(row["features"], device),
                   input_ids=torch.as_tensor(row["input_ids"]).long(),
                   loss_mask=torch.as_tensor(row["loss_mask"]).long(),
                   position_ids=torch.as_tensor(row["position_ids"]).long(),
                   doc_lengths=row["doc_lengths"],
                   target_hidden=None if last is None else borrow(last, device))


def borrow(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without a host sync, safe to drop right after.

    The producer (extract) allocated ``t`` on its own CUDA stream; the step reads it on the
    current stream (a peer copy runs on the source device's current stream). Nothing waits for that
    read before the row is dropped, so the allocator is told about it, or extract could reuse the
    memory for a later row while the read is still queued."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))
    return t.to(device, non_blocking=True)
