"""Greedy speculative decoding of many prompts at once, for dense targets (one forward per cycle).

The per-prompt loop (:func:`dflash_model.target.spec_decode.speculative_decode`) crops the KV cache to the
accepted tokens. A batch cannot be cropped row by row, so here nothing is cropped: every cycle
appends the same number of slots W to every row (the block of the row with the most drafts), and an
attention mask says which slots are real:

    slots  [prompt (right-padded) | cycle 1: last, drafts…, pad | cycle 2: … ]
    valid   1 1 1 1 0 0              1    1 1 0 0 0                …

After the verify forward, a row's slots for its last token and its accepted drafts stay valid; its
rejected drafts and padding are masked for every later query. Positions are given per row, so RoPE
sees each row's own token positions whatever slot they sit in. Prompts are right-padded so that
every query has at least one real key (its row's first prompt token). Each row's output is then
the target's greedy decode, as in the per-prompt loop; a finished row keeps riding along, masked.

Linear-attention layers (hybrid targets) fold every slot into their state and cannot be masked:
those targets use the per-prompt loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from dflash_model.target import spec_cache, spec_decode
from dflash_model.target.capture import FeatureCapture
from dflash_model.target.spec_decode import (DecodeResult, Drafter, DraftRequest, eos_set, forward_kwargs, new_cache,
                                             timed)

BatchDrafter = Callable[[list[DraftRequest]], list[Sequence[int]]]


def one_by_one(drafter: Drafter) -> BatchDrafter:
    """A per-request drafter (n-gram, an oracle, a test's) as a batch drafter."""
    return lambda reqs: [drafter(r) for r in reqs]


def dflash_batch_drafter(drafter: nn.Module, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> BatchDrafter:
    """The DFlash drafter drafting every sequence's block in one forward (``draft_blocks``)."""
    from dflash_model.drafter import draft_blocks

    dtype = next(drafter.parameters()).dtype

    def draft(reqs: list[DraftRequest]) -> list[list[int]]:
        if any(r.features is None for r in reqs):
            raise ValueError("the DFlash drafter needs target features: pass layer_ids")
        out = draft_blocks(drafter, [r.features.to(dtype) for r in reqs], [r.positions for r in reqs],
                           [r.last_token for r in reqs], embed_weight, lm_head_weight,
                           [r.last_position for r in reqs]).tolist()
        return [o[:r.max_tokens] for o, r in zip(out, reqs)]

    return draft


def supports_batch(model: nn.Module) -> bool:
    """Whether the target's cache can be masked instead of cropped (no linear-attention state)."""
    return not spec_cache.linear_state_layers(new_cache(model))


@torch.no_grad()
def _forward(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: Any,
             capture: FeatureCapture | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [R, W, V], features [R, W, k*H] or None) of W new slots per row; ``valid`` [R, S+W]."""
    cache_arg, takes_cache_position = forward_kwargs(model)
    kw: dict[str, Any] = {"input_ids": ids, "position_ids": positions,
                          "attention_mask": valid.to(ids.device, torch.long),
                          cache_arg: cache, "use_cache": True}
    if takes_cache_position:  # slots, not positions: the cache is indexed by slot
        kw["cache_position"] = torch.arange(valid.shape[1] - ids.shape[1], valid.shape[1], device=ids.device)
    if capture is None:
        return model(**kw).logits, None
    return capture.record(lambda: model(**kw).logits)


@dataclass
class _Row:
    """One prompt's decode state: its verified tokens (prompt + output, the last one not yet run through
    the target), the target features of all but that last one, and the result so far."""

    tokens: list[int]
    feats: list[torch.Tensor]
    result: DecodeResult


def _prefill(model: nn.Module, prompts: Sequence[Sequence[int]], block_size: int, pad_id: int, cache: Any,
             capture: FeatureCapture | None) -> tuple[list[_Row], torch.Tensor]:
    """(rows, valid [R, P] on the host) after one forward over the right-padded prompts: right padding
    gives every query a real key, and each row's first token is read after its own last prompt token."""
    dev = next(model.parameters()).device
    R, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((R, P), pad_id, dtype=torch.long)  # built on the host, sent in one copy
    valid = torch.zeros((R, P), dtype=torch.bool)  # on the host; one copy per forward
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(list(p))
        valid[r, :len(p)] = True
    logits, feats = _forward(model, ids.to(dev), torch.arange(P, device=dev).expand(R, P), valid, cache, capture)
    lasts = torch.tensor([len(p) - 1 for p in prompts], device=dev)
    firsts = logits[torch.arange(R, device=dev), lasts].argmax(-1).tolist()  # one read-back for all rows
    rows = []
    for r, (p, first) in enumerate(zip(prompts, firsts)):
        rows.append(_Row(tokens=[int(t) for t in p] + [first],
                         feats=[feats[r, :len(p)]] if feats is not None else [],
                         result=DecodeResult(tokens=[first], block_size=block_size)))
    return rows, valid


def _draft(drafter: BatchDrafter, reqs: list[DraftRequest]) -> list[list[int]]:
    """Each request's drafts, cut to its ``max_tokens``; a row with no budget left is not asked (it gets
    none), and the drafter is not called at all when no row has any."""
    asked = [q for q in reqs if q.max_tokens > 0]
    proposed = iter(drafter(asked) if asked else [])
    return [[int(t) for t in list(next(proposed))[:q.max_tokens]] if q.max_tokens > 0 else [] for q in reqs]


def _block(n_rows: int, live: list[int], reqs: list[DraftRequest], drafts: list[list[int]], pad_id: int,
           dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [R, W] and positions [R, W] on ``dev``, valid [R, W] on the host) of a cycle's W new slots per
    row: each live row's [last token, drafts…] at its own positions, padded to the widest row; finished
    rows get only masked padding. Built as lists on the host and sent in one copy each: per-row writes
    into device tensors would cost a launch per row and cycle."""
    W = 1 + max(len(d) for d in drafts)
    block = [[pad_id] * W for _ in range(n_rows)]
    pos = [[0] * W for _ in range(n_rows)]
    new_valid = [[False] * W for _ in range(n_rows)]
    for r, q, d in zip(live, reqs, drafts):
        block[r][:1 + len(d)] = [q.last_token] + d
        pos[r] = list(range(q.last_position, q.last_position + W))
        new_valid[r][:1 + len(d)] = [True] * (1 + len(d))
    return torch.tensor(block, device=dev), torch.tensor(pos, device=dev), torch.tensor(new_valid)


def _accept(row: _Row, req: DraftRequest, drafts: list[int], target: list[int], feats: torch.Tensor | None,
            eos: set[int]) -> int:
    """Takes a row's accepted drafts and the target's own token after them, keeps their features for the
    next draft and records the cycle (``record_cycle``, as the per-prompt loop does); returns how many
    drafts were accepted, so the caller can mask the rest."""
    n = spec_decode.accepted_prefix(drafts, target)
    if feats is not None:
        row.feats.append(feats[:n + 1])
    spec_decode.record_cycle(row.result, req, drafts, n, target[n], row.tokens, eos)
    return n


@torch.no_grad()
def speculative_decode_batch(model: nn.Module, prompts: Sequence[Sequence[int]], drafter: BatchDrafter,
                             block_size: int, max_new_tokens: int, layer_ids: Sequence[int] | None = None,
                             eos_token_id: int | Iterable[int] | None = None, pad_id: int = 0,
                             capture: FeatureCapture | None = None,
                             clock: dict[str, float] | None = None) -> list[DecodeResult]:
    """:func:`dflash_model.target.spec_decode.speculative_decode` of every prompt, one target forward per
    cycle for all of them; same results (each row is its prompt's greedy decode). ``clock``: as there."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    if not supports_batch(model):
        raise ValueError("a target with linear-attention layers cannot be decoded in a batch: "
                         "use spec_decode.speculative_decode per prompt")
    eos = eos_set(eos_token_id)
    if capture is None and layer_ids is not None:
        capture = FeatureCapture(model, layer_ids)
    dev = next(model.parameters()).device
    cache = new_cache(model)
    rows, valid = _prefill(model, prompts, block_size, pad_id, cache, capture)
    while live := [r for r, row in enumerate(rows)
                   if len(row.result.tokens) < max_new_tokens and row.result.tokens[-1] not in eos]:
        reqs = [spec_decode.draft_request(rows[r].tokens, rows[r].feats, len(rows[r].result.tokens), block_size,
                                          max_new_tokens, dev) for r in live]
        with timed(clock, "draft"):
            drafts = _draft(drafter, reqs)
        block, pos, new_valid = _block(len(rows), live, reqs, drafts, pad_id, dev)
        valid = torch.cat([valid, new_valid], 1)
        with timed(clock, "verify"):
            logits, feats = _forward(model, block, pos, valid, cache, capture)
            target = logits.argmax(-1).tolist()
        for r, q, d in zip(live, reqs, drafts):
            n = _accept(rows[r], q, d, target[r], feats[r] if feats is not None else None, eos)
            valid[r, valid.shape[1] - block.shape[1] + n + 1:] = False  # the rejected drafts: never seen again
    for row in rows:
        row.result.tokens = row.result.tokens[:max_new_tokens]
    return [row.result for row in rows]
