"""Loss and metrics for one packed row, with a chunked LM head (never all N*(B-1)*V logits).

loss = Σ_k w_k m CE_k / Σ_k w_k m over supervised slots, w_k = exp(-(k-1)/γ).
Targets: "data" (the row's own tokens, the paper's CE on target-regenerated data),
"target_argmax" (CE against the target's greedy token) or "kl" (KL(p_target || p_draft)).
The target's prediction for the token at row p comes from its hidden state at row p - 1, so
``target_hidden`` (the input of the target's LM head, after its final norm) is read at a+k-1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dflash_core.drafter.anchors import block_labels, build_blocks, resolve_doc_ids, slot_weights
from dflash_core.drafter.config import default_gamma

TARGETS = ("data", "target_argmax", "kl")


class ChunkedLMHeadLoss(torch.autograd.Function):
    """Σ_r coef_r · loss_r of ``h @ weight.T`` computed ``chunk_rows`` rows at a time.

    The gradient w.r.t. h (softmax - target, times coef, @ weight) is formed chunk by chunk in the
    forward pass, so only one [chunk, V] block of logits ever lives and backward is a scale: two
    LM-head matmuls per row in all (the DESIGN §8 model). ``weight`` is frozen (no gradient).
    Returns (loss, draft argmax [R], target token [R]).
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor,
                labels: torch.Tensor | None, soft_h: torch.Tensor | None, chunk_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        R, work = h.shape[0], coef.dtype
        loss = torch.zeros((), dtype=work, device=h.device)
        grad = torch.empty_like(h)
        pred = torch.empty(R, dtype=torch.long, device=h.device)
        tgt = labels.clone() if labels is not None else torch.empty_like(pred)
        for s in range(0, R, chunk_rows):
            e = min(R, s + chunk_rows)
            logp = (h[s:e].to(weight.dtype) @ weight.t()).to(work)
            pred[s:e] = logp.argmax(-1)
            logp -= logp.logsumexp(-1, keepdim=True)
            c = coef[s:e]
            if soft_h is None:
                y = labels[s:e]
                loss -= (c * logp.gather(1, y[:, None]).squeeze(1)).sum()
                g = logp.exp_()
                g[torch.arange(e - s, device=g.device), y] -= 1
            else:
                tlogp = (soft_h[s:e].to(weight.dtype) @ weight.t()).to(work).log_softmax(-1)
                tgt[s:e] = tlogp.argmax(-1)
                tp = tlogp.exp_()
                loss += (c * (torch.special.xlogy(tp, tp).sum(-1) - (tp * logp).sum(-1))).sum()
                g = logp.exp_().sub_(tp)
            grad[s:e] = (g.mul_(c[:, None]).to(weight.dtype) @ weight).to(h.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(pred, tgt)
        return loss, pred, tgt

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


@torch.no_grad()
def chunked_argmax(h: torch.Tensor, weight: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """argmax_v (h @ weight.T) row by row chunk, without holding all logits."""
    out = [(h[s:s + chunk_rows].to(weight.dtype) @ weight.t()).argmax(-1) for s in range(0, h.shape[0], chunk_rows)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=h.device)


@dataclass
class LossOutput:
    """Loss (differentiable scalar) and metrics of one row.

    per_slot_* are over slots 1..B-1; a slot counts only where supervised. tau_sim treats an
    unsupervised slot as a miss (acceptance stops there). acc/per_slot_acc are NaN when empty.
    """

    loss: torch.Tensor
    per_slot_acc: torch.Tensor
    per_slot_correct: torch.Tensor
    per_slot_count: torch.Tensor
    acc: torch.Tensor
    tau_sim: torch.Tensor
    n_blocks: int
    n_supervised: int


def tau_sim(correct: torch.Tensor) -> torch.Tensor:
    """Mean over blocks of 1 + number of leading correct slots (correct: [N, B-1] bool)."""
    if correct.shape[0] == 0:
        return torch.tensor(math.nan, dtype=torch.float64)
    return (1 + correct.long().cumprod(dim=1).sum(dim=1)).double().mean()


def drafter_loss(model: torch.nn.Module, features: torch.Tensor, input_ids: torch.Tensor,
                 loss_mask: torch.Tensor, position_ids: torch.Tensor, doc_lengths: Any,
                 anchors: torch.Tensor, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, *,
                 doc_ids: torch.Tensor | None = None, gamma: float | None = None, target: str = "data",
                 target_hidden: torch.Tensor | None = None, chunk_rows: int = 1024,
                 attn_backend: str | None = None) -> LossOutput:
    """Loss and metrics for one packed row.

    features [T, k*H]; input_ids, loss_mask, position_ids (per-document) [T]; documents as
    ``doc_lengths`` (rows after them are padding) or ``doc_ids=`` [T] (-1 = padding); anchors [N]
    (``sample_anchors``); embed_weight / lm_head_weight [V, H] are the target's (frozen).
    gamma defaults to ``default_gamma(B)``; target in TARGETS ("target_argmax"/"kl" need
    ``target_hidden`` [T, H], the target's final-normed last hidden state).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if target != "data" and target_hidden is None:
        raise ValueError(f"target={target!r} needs target_hidden (the target's last hidden state)")
    B = model.block_size
    dev = features.device
    input_ids, loss_mask, position_ids = (t.to(dev) for t in (input_ids, loss_mask, position_ids))
    anchors = anchors.to(device=dev, dtype=torch.long)
    docs = resolve_doc_ids(input_ids.shape[0], doc_lengths, doc_ids, dev)
    labels, sup, rows = block_labels(input_ids, loss_mask, docs, anchors, B)
    ids, pos, layout = build_blocks(input_ids, position_ids, docs, anchors, B, model.mask_token_id)
    hidden = model(features, ids, position_ids, pos, layout, embed_weight, attn_backend=attn_backend)

    N = anchors.shape[0]
    sel = sup.reshape(-1).nonzero().squeeze(1)
    h = hidden[:, 1:].reshape(N * (B - 1), -1)[sel]
    work = torch.promote_types(h.dtype, torch.float32)
    w = slot_weights(B, default_gamma(B) if gamma is None else gamma, dev).expand(N, B - 1).reshape(-1)[sel]
    coef = (w / w.sum()).to(work) if sel.numel() else w.to(work)
    lm_head_weight = lm_head_weight.detach()
    soft_h = None
    if target == "data":
        y = labels.reshape(-1)[sel]
    else:
        th = target_hidden.to(dev)[(rows - 1).reshape(-1)[sel]]  # the target predicts row p at row p - 1
        y = chunked_argmax(th, lm_head_weight, chunk_rows) if target == "target_argmax" else None
        soft_h = th if target == "kl" else None
    loss, pred, tgt = ChunkedLMHeadLoss.apply(h, lm_head_weight, coef, y, soft_h, chunk_rows)

    correct = torch.zeros(N * (B - 1), dtype=torch.bool, device=dev)
    correct[sel] = pred == tgt
    correct = correct.view(N, B - 1)
    count = sup.long().sum(0)
    per_correct = correct.long().sum(0)
    return LossOutput(
        loss=loss, per_slot_acc=per_correct.double() / count.double(), per_slot_correct=per_correct,
        per_slot_count=count, acc=per_correct.sum().double() / count.sum().double(),
        tau_sim=tau_sim(correct), n_blocks=N, n_supervised=int(sel.numel()))
