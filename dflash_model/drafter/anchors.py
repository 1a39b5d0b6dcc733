"""Anchors, blocks and labels for a packed row (document-aware).

A packed row holds several documents back to back (then padding). Every rule here keeps a block
inside its anchor's document: candidates need loss_mask[a] = loss_mask[a+1] = 1 in one document,
and slot k (1..B-1) is labelled with the token AT a+k (not a+k+1) only if a+k is in the same
document with loss_mask = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_model.drafter.mask import BlockLayout


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for a GPU goes through pinned memory.

    A copy from ordinary (pageable) host memory makes the host wait until the GPU has finished
    everything queued before it, so the next step could not be launched while this one runs.
    From pinned memory the copy is queued like a kernel and the host goes on (torch keeps the
    pinned block alive until the copy is done)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def doc_ids_from_lengths(doc_lengths: Sequence[int] | torch.Tensor, total: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """[total] document index per row; rows after the last document are padding (-1).

    Built where the lengths are (on the host for a list) and then copied, so a CUDA caller
    pays no host sync for the length check."""
    lengths = torch.as_tensor(doc_lengths, dtype=torch.long)
    used = int(lengths.sum())
    if used > total:
        raise ValueError(f"doc_lengths sum to {used} > row length {total}")
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    ids = torch.cat([ids, ids.new_full((total - used,), -1)])
    return to_device(ids, device) if device is not None else ids


def resolve_doc_ids(total: int, doc_lengths: Sequence[int] | torch.Tensor | None,
                    doc_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Exactly one of doc_lengths / doc_ids describes the documents of a row."""
    if (doc_lengths is None) == (doc_ids is None):
        raise ValueError("pass exactly one of doc_lengths or doc_ids")
    if doc_ids is not None:
        return to_device(doc_ids.long(), device)
    return doc_ids_from_lengths(doc_lengths, total, device)


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Rows a with loss_mask[a] = loss_mask[a+1] = 1 and a, a+1 in the same (non-padding) document."""
    lm = loss_mask.bool()
    ok = lm[:-1] & lm[1:] & (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)
    return ok.nonzero().squeeze(1)


def sample_anchors(loss_mask: torch.Tensor, doc_lengths: Sequence[int] | torch.Tensor | None = None,
                   num_anchors: int = 512, generator: torch.Generator | None = None, *,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draw min(num_anchors, #candidates) anchors without replacement, sorted ascending.

    Draw afresh each step; ``generator`` makes it reproducible (its device decides where the
    permutation is drawn). Returns a LongTensor on loss_mask's device.
    """
    return sample_anchor_shares(loss_mask, doc_lengths, num_anchors, 1, generator, doc_ids=doc_ids)[0]


def sample_anchor_shares(loss_mask: torch.Tensor, doc_lengths: Sequence[int] | torch.Tensor | None,
                         num_anchors: int, shares: int, generator: torch.Generator | None = None, *,
                         doc_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``shares`` disjoint draws of up to ``num_anchors`` anchors each, sorted: min(num_anchors x
    shares, #candidates) drawn without replacement, in the order drawn, cut into consecutive
    shares. When the candidates run short they are spread evenly (sizes differ by at most one),
    so that no step of ``steps_per_row`` training, which takes one share a step, is left with
    nothing to learn while another is full. One share is :func:`sample_anchors`."""
    docs = resolve_doc_ids(loss_mask.shape[0], doc_lengths, doc_ids, loss_mask.device)
    cand = anchor_candidates(loss_mask, docs)
    n = min(int(num_anchors) * int(shares), cand.numel())
    gen_device = generator.device if generator is not None else torch.device("cpu")
    pick = cand[torch.randperm(cand.numel(), generator=generator, device=gen_device)[:n].to(cand.device)]
    shares = int(shares)
    bounds = [i * n // shares for i in range(shares + 1)]
    return [pick[bounds[i]:bounds[i + 1]].sort().values for i in range(shares)]


def pad_anchors(anchors: torch.Tensor, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors padded to ``size`` with row 0, valid [size] bool) — padding blocks keep the shapes
    of every step equal (no recompilation); ``valid`` keeps them out of the mask, loss and metrics."""
    n = int(anchors.shape[0])
    valid = torch.ones(n, dtype=torch.bool, device=anchors.device)
    if size is None or size <= n:
        return anchors, valid
    extra = size - n
    return torch.cat([anchors, anchors.new_zeros(extra)]), torch.cat([valid, valid.new_zeros(extra)])


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor,
                 anchors: torch.Tensor, block_size: int, valid: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels [N, B-1], supervised [N, B-1] bool, label rows [N, B-1]) for slots 1..B-1.

    Slot k of anchor a is labelled with input_ids[a+k]; it is supervised iff a+k < T, same
    document as a, and loss_mask[a+k] = 1 (and the block is not padding, see ``pad_anchors``).
    Unsupervised slots carry a harmless label.
    """
    T = input_ids.shape[0]
    rows = anchors[:, None] + torch.arange(1, block_size, device=anchors.device)[None, :]
    safe = rows.clamp(max=T - 1)
    ok = (rows < T) & (doc_ids[safe] == doc_ids[anchors][:, None]) & loss_mask[safe].bool()
    if valid is not None:
        ok = ok & valid[:, None]
    return input_ids[safe], ok, safe


PADDING_BLOCK_DOC = -2  # a document id no context row has: padding blocks see only themselves


def build_blocks(input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor,
                 anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, BlockLayout]:
    """(block token ids [N, B], block positions [N, B], layout) for the given anchors.

    Slot 0 = the anchor's token, slots 1..B-1 = mask_token_id; positions pos(a) + k (per document).
    """
    ids = input_ids.new_full((anchors.shape[0], block_size), int(mask_token_id))
    ids[:, 0] = input_ids[anchors]
    pos = position_ids[anchors][:, None] + torch.arange(block_size, device=anchors.device)[None, :]
    block_doc = doc_ids[anchors]
    if valid is not None:
        block_doc = torch.where(valid, block_doc, PADDING_BLOCK_DOC)
    layout = BlockLayout(ctx_doc=doc_ids, block_doc=block_doc, block_start=anchors, block_size=block_size)
    return ids, pos, layout


def slot_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1 (slot 1, the first draft token, weighs 1)."""
    k = torch.arange(1, block_size, dtype=torch.float64, device=device)
    return torch.exp(-(k - 1) / float(gamma))

