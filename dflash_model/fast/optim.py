"""The drafter's optimizer step: fused AdamW with the gradient clip folded into it, over float32
master weights when the drafter computes in a lower precision."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dflash_model.fast.settings import triton_installed

KERNELS = ("auto", "triton", "torch")


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
          kernel: str = "auto") -> torch.optim.AdamW:
    """Fused AdamW: one pass over parameters, gradients and moments per step, taking the clip
    as a divisor (``clipped_step``). ``kernel``: "torch" = ``torch.optim.AdamW(fused=True)`` (CPU
    and CUDA); "triton" = ``adamw_triton.TritonAdamW`` (CUDA; same state, a faster norm and
    update); "auto" = triton where every parameter is on CUDA and triton is installed."""
    if kernel not in KERNELS:
        raise ValueError(f"adamw kernel must be one of {KERNELS}, got {kernel!r}")
    params = list(params)
    on_cuda = all(p.device.type == "cuda" for p in params)
    if kernel == "auto":
        kernel = "triton" if on_cuda and triton_installed() else "torch"
    if kernel == "torch":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    if not on_cuda:
        raise ValueError("the triton AdamW kernel needs the parameters on a CUDA device")
    from dflash_model.fast.adamw_triton import TritonAdamW

    return TritonAdamW(params, lr=lr, weight_decay=weight_decay)


class MasterAdamW:
    """AdamW over float32 master copies of low-precision (bf16 / fp16) parameters.

    Why: a bf16 weight can only move in steps of its own precision, 2^-8 of its size. An AdamW
    update of ~lr = 1e-3 on a norm weight at 1.0 rounds away at every step, so the norms never
    train, and late in a cosine schedule the updates of the other weights round away too. Here the
    update is taken on float32 masters with float32 moments, and the parameters the model computes
    with are the masters rounded. Offers what the trainer and ``clipped_step`` use of an optimizer:
    ``param_groups`` (the learning rate), ``grad_scale``, ``step``, ``zero_grad`` and the state."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                 kernel: str = "auto") -> None:
        self.params = list(params)
        self.masters = [torch.nn.Parameter(p.detach().float().contiguous()) for p in self.params]
        self.inner = adamw(self.masters, lr, weight_decay, kernel)
        self.grad_scale: torch.Tensor | None = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def fused(self) -> bool:
        """Whether the step is one kernel pass per parameter (``TritonAdamW.step_masters``): the
        low-precision gradients read as they are, the weights written rounded by the update
        itself. Otherwise float32 gradient copies go to the inner AdamW and the weights are
        copied back after it."""
        return hasattr(self.inner, "step_masters")

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the step takes, for the clip's norm (``clipped_step``), which is summed in
        float32 either way: the low-precision ones when fused (Triton's norm reads them as
        float32), else their float32 copies, made here."""
        if self.fused:
            return [p.grad for p in self.params if p.grad is not None]
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        return [m.grad for m in self.masters if m.grad is not None]

    def total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return getattr(self.inner, "total_norm", torch.nn.utils.get_total_norm)(grads)

    @torch.no_grad()
    def step(self) -> None:
        if self.fused:
            self.inner.grad_scale = self.grad_scale
            self.inner.step_masters([p.grad for p in self.params], self.params)
            return
        for p, m in zip(self.params, self.masters):
            if m.grad is None and p.grad is not None:  # not copied yet by ``gradients``
                m.grad = p.grad.float()
        self.inner.grad_scale = self.grad_scale
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {"adamw": self.inner.state_dict(), "masters": [m.detach() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore the moments and the masters (the parameters become the masters rounded). A state
        saved without masters (a plain AdamW's) takes them from the parameters as they are now."""
        if "masters" in state:
            for m, saved in zip(self.masters, state["masters"], strict=True):
                m.copy_(saved)
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        else:
            for p, m in zip(self.params, self.masters):
                m.copy_(p)
        self.inner.load_state_dict(state.get("adamw", state))


def drafter_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                      kernel: str = "auto", master_weights: bool = True) -> torch.optim.AdamW | MasterAdamW:
    """``MasterAdamW`` when ``master_weights`` and a parameter is below float32, else ``adamw``."""
    params = list(params)
    if master_weights and any(p.dtype != torch.float32 for p in params):
        return MasterAdamW(params, lr, weight_decay, kernel)
    return adamw(params, lr, weight_decay, kernel)


def clipped_step(opt: torch.optim.Optimizer | MasterAdamW, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients to global L2 norm ``max_norm`` (as ``clip_grad_norm_``; None or 0: no
    clip), take the optimizer step, and return the norm before clipping.

    ``clip_grad_norm_`` rescales every gradient in place: one more read and write of all of them.
    The fused AdamW kernels divide each gradient by
    ``grad_scale`` as they read it (the hook AMP's GradScaler uses), so here the clip costs only
    the norm. The divisor is the inverse of ``clip_grad_norm_``'s factor, clamped the same way."""
    grads = (opt.gradients() if isinstance(opt, MasterAdamW)
             else [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None])
    norm = getattr(opt, "total_norm", torch.nn.utils.get_total_norm)(grads)  # TritonAdamW brings its own
    if not grads:  # a step whose rows drew no anchors: AdamW skips every parameter; the norm is 0 on their device
        params = opt.params if isinstance(opt, MasterAdamW) else opt.param_groups[0]["params"]
        norm = norm.to(params[0].device)
    opt.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0) if max_norm else None
    opt.step()
    return norm
