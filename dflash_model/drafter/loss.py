"""Loss and metrics for one packed row, with a chunked LM head (never all N*(B-1)*V logits).

loss = Σ_k w_k m CE_k / Σ_k w_k m over supervised slots, w_k = exp(-(k-1)/γ).
Targets: "data" (the row's own tokens, the paper's CE on target-regenerated data),
"target_argmax" (CE against the target's greedy token) or "kl" (KL(p_target || p_draft)).
The target's prediction for the token at row p comes from its hidden state at row p - 1, so
``target_hidden`` (the input of the target's LM head, after its final norm) is read at a+k-1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash_model.drafter.anchors import (block_labels, build_blocks, pad_anchors, resolve_doc_ids, slot_weights,
                                         to_device)
from dflash_model.drafter.batch import FeatureBatch
from dflash_model.drafter.config import default_gamma
from dflash_model.drafter.fp8_head import LMHead, head_back, head_logits
from dflash_model.fast.compile_gate import compiled
from dflash_model.fast.settings import triton_installed

TARGETS = ("data", "target_argmax", "kl")


def _hard_chunk(h: torch.Tensor, weight: LMHead, coef: torch.Tensor, y: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ coef·CE, draft argmax, d loss/d h) of one chunk against hard labels ``y``.

    Written as plain tensor ops so that, compiled, the [chunk, V] logits are read once for the
    reductions (max, argmax, log-sum-exp, picked logit) and once for the gradient, instead of the
    ~10 full passes eager float32 code makes over them.
    """
    logits = head_logits(h, weight).to(coef.dtype)
    pred = logits.argmax(-1)
    lse = logits.logsumexp(-1)
    loss = (coef * (lse - logits.gather(1, y[:, None]).squeeze(1))).sum()
    onehot = torch.arange(logits.shape[1], device=y.device)[None, :] == y[:, None]
    g = ((logits - lse[:, None]).exp() - onehot.to(logits.dtype)) * coef[:, None]
    return loss, pred, head_back(g, weight).to(h.dtype)


def _soft_chunk(h: torch.Tensor, weight: LMHead, coef: torch.Tensor, soft_h: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ coef·KL(p_target || p_draft), draft argmax, target argmax, d loss/d h) of one chunk."""
    logp = head_logits(h, weight).to(coef.dtype).log_softmax(-1)
    tlogp = head_logits(soft_h, weight).to(coef.dtype).log_softmax(-1)
    tp = tlogp.exp()
    loss = (coef * (torch.special.xlogy(tp, tp).sum(-1) - (tp * logp).sum(-1))).sum()
    g = (logp.exp() - tp) * coef[:, None]
    return loss, logp.argmax(-1), tlogp.argmax(-1), head_back(g, weight).to(h.dtype)


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One compiled copy per chunk function and process (fixed chunk shapes: one graph each)."""
    return compiled(fn, dynamic=False)


def chunk_fn(fn: Callable[..., Any], device: torch.device, compile: bool) -> Callable[..., Any]:
    """``fn`` with its softmax passes fused on CUDA when asked, eager elsewhere: hard labels by
    ``loss_triton`` (two Triton kernels, faster than Inductor's for this shape), KL compiled."""
    if not compile or device.type != "cuda":
        return fn
    if fn is _hard_chunk and triton_installed():
        from dflash_model.fast.loss_triton import hard_chunk
        return hard_chunk
    return _compiled(fn)


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Σ_r coef_r · loss_r of ``h @ weight.T`` computed ``chunk_rows`` rows at a time.

    The gradient w.r.t. h (softmax - target, times coef, @ weight) is formed chunk by chunk in the
    forward pass, so only one [chunk, V] block of logits ever lives and backward is a scale: two
    LM-head matmuls per row in all (docs/drafter.md, 'FLOP model'). ``weight`` is frozen (no gradient).
    Rows are split into equal chunks (zero-coefficient rows pad the last one) so that a compiled
    chunk function sees one shape. Returns (loss, draft argmax [R], target token [R]).
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: LMHead, coef: torch.Tensor,
                labels: torch.Tensor | None, soft_h: torch.Tensor | None, chunk_rows: int,
                compile: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        R = h.shape[0]
        n, size = loss_chunks(R, chunk_rows)
        pad = n * size - R
        h_p, coef_p = _pad_rows(h, pad), _pad_rows(coef, pad)
        other = _pad_rows(labels if soft_h is None else soft_h, pad)
        if labels is not None:  # on the device, without a host sync: a label outside the vocabulary
            # is an index error in the plain chunk, but the Triton kernels would give a wrong loss
            torch._assert_async(((labels >= 0) & (labels < weight.shape[0])).all(),
                                "labels must be token ids of the LM head's vocabulary")
        fn = chunk_fn(_hard_chunk if soft_h is None else _soft_chunk, h.device, compile)
        loss = torch.zeros((), dtype=coef.dtype, device=h.device)
        grad = torch.empty_like(h_p)
        pred = torch.empty(n * size, dtype=torch.long, device=h.device)
        tgt = _pad_rows(labels.clone(), pad) if labels is not None else torch.empty_like(pred)
        for s in range(0, n * size, size):
            e = s + size
            out = fn(h_p[s:e], weight, coef_p[s:e], other[s:e])
            if soft_h is None:
                part, pred[s:e], grad[s:e] = out
            else:
                part, pred[s:e], tgt[s:e], grad[s:e] = out
            loss = loss + part
        ctx.save_for_backward(grad[:R])
        pred, tgt = pred[:R], tgt[:R]
        ctx.mark_non_differentiable(pred, tgt)
        return loss, pred, tgt

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None


def loss_chunks(rows: int, chunk_rows: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of ``ChunkedLMHeadLoss``: the fewest chunks of at most
    ``chunk_rows`` rows, all of one size (a compiled chunk function sees one shape)."""
    n = max(1, math.ceil(rows / chunk_rows))
    return n, max(1, math.ceil(rows / n))


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` with ``pad`` zero rows appended (zero coefficient rows add nothing to loss or grad)."""
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t


@torch.no_grad()
def chunked_argmax(h: torch.Tensor, weight: LMHead, chunk_rows: int) -> torch.Tensor:
    """argmax_v (h @ weight.T) row by row chunk, without holding all logits."""
    out = [head_logits(h[s:s + chunk_rows], weight).argmax(-1) for s in range(0, h.shape[0], chunk_rows)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=h.device)


@dataclass
class LossOutput:
    """Loss (differentiable scalar) and metrics of one row, all tensors on the row's device.

    Nothing here is read back to the host: the caller decides when to pay for a sync (the trainer
    does it once per log window). per_slot_* are over slots 1..B-1; a slot counts only where
    supervised. tau_sim treats an unsupervised slot as a miss (acceptance stops there); tau_serve
    is the τ a served decode would make on the same blocks (``tau_serve``).
    acc/per_slot_acc are NaN when empty. n_blocks counts real (not padding) blocks; block_tau
    [N] is each block's τ (float64), padding blocks last.
    """

    loss: torch.Tensor
    per_slot_acc: torch.Tensor
    per_slot_correct: torch.Tensor
    per_slot_count: torch.Tensor
    acc: torch.Tensor
    tau_sim: torch.Tensor
    tau_serve: torch.Tensor
    block_tau: torch.Tensor
    n_blocks: int
    n_supervised: torch.Tensor


def tau_sim(correct: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over blocks of 1 + number of leading correct slots (correct: [N, B-1] bool);
    ``valid`` [N] bool leaves padding blocks out (without a host sync)."""
    return _mean(_block_tau(correct), valid)


def tau_serve(correct: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The τ a served decode would make on the text of these blocks: their harmonic mean τ.

    A decode does not draft at every anchor. It crosses a stretch where τ is high in a few cycles
    and spends many cycles in a stretch where τ is low, so its τ (tokens per cycle) is the number
    of blocks over the sum of 1/τ, where ``tau_sim`` is the plain mean. Exact where τ stays the same
    along each cycle's span; an estimate otherwise. Same arguments as ``tau_sim``."""
    return _harmonic_mean(_block_tau(correct), valid)


def _block_tau(correct: torch.Tensor) -> torch.Tensor:
    """Each block's τ: 1 + its leading correct slots, in float64."""
    return (1 + correct.long().cumprod(dim=1).sum(dim=1)).double()


def _mean(block: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if block.shape[0] == 0:
        return torch.tensor(math.nan, dtype=torch.float64)
    return block.mean() if valid is None else (block * valid).sum() / valid.sum()


def _harmonic_mean(block: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if block.shape[0] == 0:
        return torch.tensor(math.nan, dtype=torch.float64)
    inverse = 1 / block
    return 1 / inverse.mean() if valid is None else valid.sum() / (inverse * valid).sum()


def drafter_loss(model: torch.nn.Module, batch: FeatureBatch, anchors: torch.Tensor, embed_weight: torch.Tensor,
                 lm_head_weight: LMHead, *, gamma: float | None = None, target: str = "data",
                 chunk_rows: int = 4096, attn_backend: str | None = None, pad_anchors_to: int | None = None,
                 compile_loss: bool = False) -> LossOutput:
    """Loss and metrics for one packed row.

    ``batch``: the row (``FeatureBatch``); anchors [N] (``sample_anchors``); embed_weight /
    lm_head_weight [V, H] are the target's (frozen; the head may be its ``FP8LMHead``, whose
    products then stand for every LM-head product of the loss). gamma defaults to ``default_gamma(B)``;
    target in TARGETS ("target_argmax"/"kl" need the batch's ``target_hidden``).
    ``pad_anchors_to``: add padding blocks (they see only themselves, carry no loss) up to this
    many, so every step has the same shapes and compiled code never recompiles.
    ``compile_loss``: fuse the LM-head loss chunks' softmax passes (CUDA only; ``chunk_fn``).
    Every slot of every block goes through the LM head (unsupervised ones with weight 0): the
    shapes then depend on N alone and no host sync is needed to select rows.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if target != "data" and batch.target_hidden is None:
        raise ValueError(f"target={target!r} needs target_hidden (the target's last hidden state)")
    features, target_hidden = batch.features, batch.target_hidden
    B = model.block_size
    dev = features.device
    input_ids, loss_mask, position_ids = (to_device(t, dev) for t in (batch.input_ids, batch.loss_mask,
                                                                       batch.position_ids))
    docs = resolve_doc_ids(input_ids.shape[0], batch.doc_lengths, batch.doc_ids, dev)
    n_real = int(anchors.shape[0])
    anchors, valid = pad_anchors(anchors.to(dtype=torch.long), pad_anchors_to)
    anchors, valid = to_device(anchors, dev), to_device(valid, dev)
    labels, sup, rows = block_labels(input_ids, loss_mask, docs, anchors, B, valid)
    ids, pos, layout = build_blocks(input_ids, position_ids, docs, anchors, B, model.mask_token_id, valid)
    hidden = model(features, ids, position_ids, pos, layout, embed_weight, attn_backend=attn_backend)

    N = anchors.shape[0]
    h = hidden.reshape(N * (B - 1), -1)
    work = torch.promote_types(h.dtype, torch.float32)
    flat_sup = sup.reshape(-1)
    w = slot_weights(B, default_gamma(B) if gamma is None else gamma, dev).expand(N, B - 1).reshape(-1) * flat_sup
    coef = (w / w.sum().clamp_min(torch.finfo(w.dtype).tiny)).to(work)
    if isinstance(lm_head_weight, torch.Tensor):
        lm_head_weight = lm_head_weight.detach()
    soft_h = None
    if target == "data":
        y = labels.reshape(-1)
    else:
        th = target_hidden.to(dev)[(rows - 1).reshape(-1)]  # the target predicts row p at row p - 1
        y = chunked_argmax(th, lm_head_weight, chunk_rows) if target == "target_argmax" else None
        soft_h = th if target == "kl" else None
    loss, pred, tgt = ChunkedLMHeadLoss.apply(h, lm_head_weight, coef, y, soft_h, chunk_rows, compile_loss)

    correct = ((pred == tgt) & flat_sup).view(N, B - 1)
    count = sup.long().sum(0)
    per_correct = correct.long().sum(0)
    block = _block_tau(correct)  # once: the step logs both means of it
    return LossOutput(
        loss=loss, per_slot_acc=per_correct.double() / count.double(), per_slot_correct=per_correct,
        per_slot_count=count, acc=per_correct.sum().double() / count.sum().double(),
        tau_sim=_mean(block, valid), tau_serve=_harmonic_mean(block, valid), block_tau=block,
        n_blocks=n_real, n_supervised=count.sum())
