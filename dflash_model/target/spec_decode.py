"""Greedy speculative decoding against a real target with a KV cache (pure functions, torch only).

The loop (docs/evaluate.md, 'What is measured')::

    prefill the prompt (KV cache, hooks on the chosen layers) -> first token t, context features
    repeat until max_new_tokens (or EOS):
        drafts = drafter(DraftRequest(features of all verified tokens, their positions, t, ...))
        one target forward over [t, drafts...] with the cache (hooks capture the same forward)
        n = longest prefix of drafts equal to the target's argmax; accept drafts[:n] + the target's
        own token after them; keep the features of t, drafts[:n]; crop the cache to them
        tau = n + 1

On a hybrid target (linear-attention layers, docs/hybrid_targets.md) cropping is not enough: the linear layers'
state is snapshotted before the verify forward and, when a draft was rejected, restored, and the
kept tokens [t, drafts[:n]] run again (:mod:`dflash_model.target.spec_cache`), whose features are then
the ones kept; fully accepted blocks need no second forward.

A drafter is any callable ``DraftRequest -> sequence of token ids`` (at most ``max_tokens``): the
DFlash drafter (:func:`dflash_drafter`), the prompt-lookup n-gram baseline (:func:`ngram_drafter`),
or anything a test injects (an oracle, a deliberately wrong one). Whatever it proposes, the output is
the target's greedy decode: acceptance only ever takes tokens the target itself would have chosen.

Features are read by :class:`dflash_model.target.capture.FeatureCapture` hooks (the ±1 layer-id convention
lives there) during the very forward that prefills or verifies, so a dense target runs once per cycle.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from dflash_model.target import spec_cache
from dflash_model.target.capture import FeatureCapture


@dataclass
class DraftRequest:
    """What a drafter may use to propose the tokens after ``last_token``.

    features [T, k*H] / positions [T]: target features of the T verified tokens before
    ``last_token`` (its own features are not known until the target has run on it);
    tokens: all verified token ids (prompt + generated, ``last_token`` last);
    last_position: the position of ``last_token``; max_tokens: how many drafts are useful (B-1,
    fewer near ``max_new_tokens``).
    """

    features: torch.Tensor | None
    positions: torch.Tensor
    tokens: list[int]
    last_token: int
    last_position: int
    max_tokens: int


Drafter = Callable[[DraftRequest], Sequence[int]]


@dataclass
class DecodeResult:
    """One prompt's decode: generated tokens and per-cycle draft statistics."""

    tokens: list[int]
    """Generated token ids (prompt excluded), at most max_new_tokens, ending at EOS if hit."""
    drafted: list[int] = field(default_factory=list)
    """Per cycle: number of draft tokens proposed."""
    accepted: list[int] = field(default_factory=list)
    """Per cycle: number of those accepted (tau = accepted + 1)."""
    budget: list[int] = field(default_factory=list)
    """Per cycle: how many drafts were useful (B-1, fewer when max_new_tokens was near)."""
    anchors: list[int] = field(default_factory=list)
    """Per cycle: position of the block's first token (the last verified token) in prompt + output."""
    block_size: int = 0

    @property
    def taus(self) -> list[int]:
        return [a + 1 for a in self.accepted]

    @property
    def cycles(self) -> int:
        return len(self.accepted)

    @property
    def full(self) -> list[bool]:
        """Per cycle: the draft budget was a whole block (not cut short by max_new_tokens)."""
        return [b == self.block_size - 1 for b in self.budget]

    @property
    def full_accepted(self) -> list[int]:
        """Accepted drafts of the cycles with a whole block of budget (the reported τ's basis)."""
        return [a for a, f in zip(self.accepted, self.full) if f]

    @property
    def tau(self) -> float:
        """Mean τ over the full-budget cycles, or over all cycles when none had a whole block."""
        return served_tau(zip(self.taus, self.full))


def served_pool(cycles: Iterable[tuple[int, bool]]) -> list[int]:
    """The τ of the (τ, whole block of draft budget) cycles a served decode counts: those with a
    whole block, or every cycle when none had one (the last cycles before max_new_tokens are cut
    short and would bias short outputs down)."""
    cycles = list(cycles)
    return [t for t, whole in cycles if whole] or [t for t, _ in cycles]


def served_tau(cycles: Iterable[tuple[int, bool]]) -> float:
    """Mean τ of the cycles :func:`served_pool` counts; nan without cycles."""
    pool = served_pool(cycles)
    return sum(pool) / len(pool) if pool else float("nan")


# --------------------------------------------------------------------------- target forwards

def new_cache(model: nn.Module) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def forward_kwargs(model: nn.Module) -> tuple[str, bool]:
    """(name of the cache argument, whether ``cache_position`` is taken): transformers 5.24 renamed
    ``past_key_values`` to ``cache`` and dropped ``cache_position``; 5.17 has both old names."""
    import inspect

    key = (type(model), "spec_decode_kwargs")
    hit = _KW_CACHE.get(key)
    if hit is None:
        params = inspect.signature(model.forward).parameters
        hit = ("cache" if "cache" in params else "past_key_values", "cache_position" in params)
        _KW_CACHE[key] = hit
    return hit


_KW_CACHE: dict[Any, tuple[str, bool]] = {}


@torch.no_grad()
def _forward(model: nn.Module, ids: Sequence[int], start: int, cache: Any,
             capture: FeatureCapture | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [n, V], features [n, k*H] or None) of ``ids`` at positions start.., extending ``cache``."""
    dev = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    pos = torch.arange(start, start + x.shape[1], device=dev)[None]
    cache_arg, takes_cache_position = forward_kwargs(model)
    kw: dict[str, Any] = {"input_ids": x, "position_ids": pos, cache_arg: cache, "use_cache": True}
    if takes_cache_position:
        kw["cache_position"] = pos[0]
    if capture is None:
        return model(**kw).logits[0], None
    logits, feats = capture.record(lambda: model(**kw).logits[0])
    return logits, feats[0]


def eos_set(eos_token_id: int | Iterable[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def accepted_prefix(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many drafts the target accepts: the longest prefix equal to its own argmax tokens
    (``target[i]`` = the target's token after block row i)."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n


@torch.no_grad()
def greedy_decode(model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_id: int | Iterable[int] | None = None) -> list[int]:
    """The target's plain greedy decode, one token per forward with a KV cache (the reference)."""
    eos = eos_set(eos_token_id)
    cache = new_cache(model)
    logits, _ = _forward(model, prompt_ids, 0, cache, None)
    out: list[int] = []
    pos = len(prompt_ids)
    while len(out) < max_new_tokens:
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok in eos or len(out) >= max_new_tokens:
            break
        logits, _ = _forward(model, [tok], pos, cache, None)
        pos += 1
    return out


@contextmanager
def timed(clock: dict[str, float] | None, phase: str) -> Iterator[None]:
    """Adds the block's wall seconds to ``clock[phase]`` (nothing without a clock). Each phase of
    the loops ends by reading its result on the host (the drafts, the target's argmax), so the
    seconds include the GPU's work for it."""
    if clock is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        clock[phase] = clock.get(phase, 0.0) + time.perf_counter() - t0


@torch.no_grad()
def speculative_decode(model: nn.Module, prompt_ids: Sequence[int], drafter: Drafter, block_size: int,
                       max_new_tokens: int, layer_ids: Sequence[int] | None = None,
                       eos_token_id: int | Iterable[int] | None = None,
                       capture: FeatureCapture | None = None, clock: dict[str, float] | None = None) -> DecodeResult:
    """Greedy speculative decoding of one prompt (batch 1) with blocks of ``block_size``.

    ``layer_ids``: target layers whose features the drafter reads (``DraftRequest.features``);
    None: no hooks (drafters that need no features, e.g. n-gram). Always produces the target's
    greedy decode; acceptance statistics are in the result. ``clock`` gathers the seconds spent
    drafting (``draft``) and verifying (``verify``: the target's forwards) across calls.
    """
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt")
    eos = eos_set(eos_token_id)
    if capture is None and layer_ids is not None:
        capture = FeatureCapture(model, layer_ids)
    cache = new_cache(model)
    linear = spec_cache.linear_state_layers(cache)  # hybrid target: state to roll back by re-running
    tokens = [int(t) for t in prompt_ids]
    logits, feats = _forward(model, tokens, 0, cache, capture)
    ctx_feats = [feats] if feats is not None else []
    dev = logits.device
    last = int(logits[-1].argmax())
    tokens.append(last)
    res = DecodeResult(tokens=[last], block_size=block_size)
    while len(res.tokens) < max_new_tokens and last not in eos:
        req = draft_request(tokens, ctx_feats, len(res.tokens), block_size, max_new_tokens, dev)
        n_ctx, want = req.last_position, req.max_tokens
        with timed(clock, "draft"):
            drafts = [int(t) for t in list(drafter(req))[:want]] if want > 0 else []
        with timed(clock, "verify"):
            saved = spec_cache.snapshot(linear)
            logits, feats = _forward(model, [last] + drafts, n_ctx, cache, capture)
            target = logits.argmax(-1).tolist()  # target[i] = its token after block row i
            n = accepted_prefix(drafts, target)
            if linear and n < len(drafts):
                # the linear layers have folded the rejected drafts in: rewind to before the block and
                # run the kept tokens again (that forward's features are the ones kept)
                spec_cache.restore(linear, saved)
                spec_cache.crop(cache, n_ctx)
                _, feats = _forward(model, [last] + drafts[:n], n_ctx, cache, capture)
        if feats is not None:
            ctx_feats.append(feats[:n + 1])  # rows of `last` and the accepted drafts
        spec_cache.crop(cache, n_ctx + n + 1)
        record_cycle(res, req, drafts, n, target[n], tokens, eos)
        last = tokens[-1]
    res.tokens = res.tokens[:max_new_tokens]
    return res


def draft_request(tokens: list[int], feats: list[torch.Tensor], produced: int, block_size: int,
                  max_new_tokens: int, dev: torch.device) -> DraftRequest:
    """What the drafter sees before a cycle: the features of the verified tokens (all of ``tokens``
    but the last, which the target has not run yet), and as many drafts as are still useful (B-1,
    fewer near ``max_new_tokens``; ``produced`` tokens are out so far)."""
    n_ctx = len(tokens) - 1
    return DraftRequest(features=torch.cat(feats) if feats else None, positions=torch.arange(n_ctx, device=dev),
                        tokens=tokens, last_token=tokens[-1], last_position=n_ctx,
                        max_tokens=min(block_size - 1, max_new_tokens - produced - 1))


def record_cycle(res: DecodeResult, req: DraftRequest, drafts: list[int], n: int, target_next: int,
                 tokens: list[int], eos: set[int]) -> None:
    """Records a verified cycle in ``res`` and appends what it keeps to ``tokens`` and ``res.tokens``:
    the ``n`` accepted drafts and the target's own token after them (so the output is the target's
    greedy decode whatever was drafted), up to an end token."""
    res.drafted.append(len(drafts))
    res.budget.append(req.max_tokens)
    res.anchors.append(req.last_position)
    res.accepted.append(n)
    for t in drafts[:n] + [int(target_next)]:
        tokens.append(t)
        res.tokens.append(t)
        if t in eos:
            break


# --------------------------------------------------------------------------- drafters

def dflash_drafter(drafter: nn.Module, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> Drafter:
    """The DFlash drafter as a loop drafter: ``draft_block`` on the features of the verified tokens."""
    from dflash_model.drafter import draft_block

    dtype = next(drafter.parameters()).dtype

    def draft(req: DraftRequest) -> list[int]:
        if req.features is None:
            raise ValueError("the DFlash drafter needs target features: pass layer_ids")
        out = draft_block(drafter, req.features.to(dtype), req.positions, req.last_token,
                          embed_weight, lm_head_weight, last_position=req.last_position)
        return out[:req.max_tokens].tolist()

    return draft


NGRAM_MAX_N = 3
"""The longest suffix the n-gram baseline looks up (evaluate's ``ngram_drafter()``)."""


def ngram_match(tokens: Sequence[int], max_n: int = NGRAM_MAX_N, min_n: int = 1) -> tuple[int, int] | None:
    """(n, where the continuation starts) of the latest earlier occurrence of the last n tokens, for the
    longest n in max_n..min_n that has one; None when none has. The lookup the n-gram drafter drafts
    from, and what evaluate's split of cycles by match (``ngram_split``) asks of each cycle's start."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(tokens[L - n:])
        for start in range(L - n - 1, -1, -1):  # latest match first, excluding the suffix itself
            if tokens[start + n - 1] == suffix[-1] and list(tokens[start:start + n]) == suffix:
                return n, start + n
    return None


def ngram_propose(tokens: Sequence[int], num_tokens: int, max_n: int = NGRAM_MAX_N, min_n: int = 1) -> list[int]:
    """Prompt-lookup drafting: the (up to ``num_tokens``) tokens that followed the latest earlier
    occurrence of the longest suffix of n = max_n..min_n tokens (:func:`ngram_match`)."""
    match = ngram_match(tokens, max_n, min_n) if num_tokens > 0 else None
    return list(tokens[match[1]:match[1] + num_tokens]) if match else []


def ngram_drafter(max_n: int = NGRAM_MAX_N, min_n: int = 1) -> Drafter:
    """Training-free baseline: prompt lookup over prompt + generated text."""

    def draft(req: DraftRequest) -> list[int]:
        return ngram_propose(req.tokens, req.max_tokens, max_n, min_n)

    return draft


def oracle_drafter(reference: Sequence[int], prompt_len: int) -> Drafter:
    """Proposes the target's own greedy continuation (``reference`` = prompt + greedy tokens)."""
    ref = list(reference)

    def draft(req: DraftRequest) -> list[int]:
        i = len(req.tokens)  # index of the token after last_token
        return ref[i:i + req.max_tokens]

    return draft


# --------------------------------------------------------------------------- checks and metrics

def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first difference of two token lists (or the shorter length), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tau_histogram(accepted: Iterable[int], block_size: int) -> list[int]:
    """Counts of tau = 0..B (index = tau; tau 0 never occurs, kept so index = value)."""
    hist = [0] * (block_size + 1)
    for a in accepted:
        hist[min(a + 1, block_size)] += 1
    return hist


def cycles_on_text(anchor_tau: Mapping[int, float], start: int, end: int, block_size: int) -> list[tuple[int, bool]]:
    """The cycles a lossless decode of one fixed text makes, as (τ, whole block of budget) pairs: the
    first cycle drafts from ``start`` (the first generated token's position), each next one from the
    previous anchor plus its τ. ``end`` is prompt length + max_new_tokens: a cycle at anchor a may
    draft up to end − a − 2 tokens (block_size − 1 at most; whole when it may draft that many), so its
    τ is at most end − a − 1, and the decode stops once it has produced its last token (a ≥ end − 1)
    or at an anchor without a measured τ (the text ended). ``anchor_tau``: τ per anchor position,
    from :func:`teacher_forced_tau`. Every drafter walked over the same text is scored on it."""
    cycles, a = [], start
    while a < end - 1 and a in anchor_tau:
        budget = min(block_size - 1, end - a - 2)
        cycles.append((min(int(round(anchor_tau[a])), budget + 1), budget == block_size - 1))
        a += cycles[-1][0]
    return cycles


@torch.no_grad()
def packed_features(target: nn.Module, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int],
                    row_tokens: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, features [T_i, k*H]) of each sequence, in order, from target forwards over rows of
    consecutive sequences packed as documents (at most ``row_tokens`` tokens a row, unless one
    sequence is longer): each document sees itself only, from position 0, so its features are those
    of a forward of it alone up to rounding. Why: one forward per sequence is dozens of small
    forwards, bound by the host on a GPU. ``row_tokens`` None: 8,192 on CUDA, one sequence a row
    elsewhere (on a CPU a row's masked attention over every pair of its tokens costs more than the
    forwards it saves)."""
    if row_tokens is None:
        row_tokens = 8192 if next(target.parameters()).is_cuda else 0
    capture = FeatureCapture(target, layer_ids)
    row: list[int] = []
    filled = 0  # tokens in ``row``

    def forward(indices: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
        lengths = [len(sequences[i]) for i in indices]
        feats, _ = capture.capture_row({"input_ids": [t for i in indices for t in sequences[i]],
                                        "position_ids": [p for n in lengths for p in range(n)],
                                        "doc_lengths": lengths})
        yield from zip(indices, feats.split(lengths))

    for i, seq in enumerate(sequences):
        if row and filled + len(seq) > row_tokens:
            yield from forward(row)
            row, filled = [], 0
        row.append(i)
        filled += len(seq)
    if row:
        yield from forward(row)


@torch.no_grad()
def teacher_forced_tau(drafter: nn.Module, target: nn.Module, prompt_ids: Sequence[int],
                       completion: Sequence[int], embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                       layer_ids: Sequence[int] | None = None, features: torch.Tensor | None = None
                       ) -> dict[str, Any]:
    """τ_sim of the drafter on [prompt + completion] the training way: target features from
    ``FeatureCapture.capture`` (no cache; or ``features`` of that text, made by
    :func:`packed_features`), anchors = every candidate in the completion,
    ``drafter_loss`` with loss_mask = completion tokens. Only anchors whose whole block lies inside
    the completion count (``full_blocks``; like the served τ, which counts only cycles with a whole
    block of draft budget), so the end of a short completion does not bias τ_sim down.
    Returns tau_sim, tau_serve, loss, acc, n_blocks, and ``anchor_tau``: each anchor's τ. A block
    sees the context's features and itself only, so the τ at a subset of anchors (e.g. the served
    cycles' block starts, where τ_sim and the served τ are the same quantity) is read from it."""
    from dflash_model.drafter import FeatureBatch, anchor_candidates, drafter_loss

    ids_list = list(prompt_ids) + list(completion)
    T, P = len(ids_list), len(prompt_ids)
    dev = next(target.parameters()).device
    ids = torch.tensor(ids_list, dtype=torch.long, device=dev)
    loss_mask = torch.zeros(T, dtype=torch.long, device=dev)
    loss_mask[P:] = 1
    docs = torch.zeros(T, dtype=torch.long, device=dev)
    anchors = anchor_candidates(loss_mask, docs)
    full = anchors[anchors + drafter.block_size - 1 < T]
    anchors = full if full.numel() else anchors
    if anchors.numel() == 0:
        return {"tau_sim": float("nan"), "tau_serve": float("nan"), "loss": float("nan"), "acc": float("nan"),
                "n_blocks": 0, "anchor_tau": {}}
    if features is None:
        features = FeatureCapture(target, layer_ids if layer_ids is not None else drafter.config.target_layer_ids
                                  ).capture(ids[None])[0][0]
    dtype = next(drafter.parameters()).dtype
    batch = FeatureBatch(features.to(dtype), ids, loss_mask, torch.arange(T, device=dev), [T])
    out = drafter_loss(drafter, batch, anchors, embed_weight, lm_head_weight, attn_backend="sdpa")
    return {"tau_sim": float(out.tau_sim), "tau_serve": float(out.tau_serve), "loss": float(out.loss),
            "acc": float(out.acc), "n_blocks": int(out.n_blocks),
            "anchor_tau": dict(zip(anchors.tolist(), out.block_tau.tolist()))}
