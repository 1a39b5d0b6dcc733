"""clipped_step: the clip folded into fused AdamW equals clip_grad_norm_ then AdamW."""

import pytest
import torch

from dflash_model.fast.optim import adamw, clipped_step


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((40, 24), (24,), (7, 3, 5))]


def _grads(step: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g) * scale for shape in ((40, 24), (24,), (7, 3, 5))]


@pytest.mark.parametrize("max_norm, scale", [(1.0, 5.0), (1.0, 0.001), (None, 5.0), (0.0, 5.0)])
def test_clipped_step_equals_clip_grad_norm_then_adamw(max_norm, scale):
    ours, ref = _params(), _params()
    opt = adamw(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)  # the plain loop
    for step in range(4):
        for p, q, g in zip(ours, ref, _grads(step, scale * (step + 1))):
            p.grad, q.grad = g.clone(), g.clone()
        if max_norm:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        else:
            ref_norm = torch.nn.utils.get_total_norm([q.grad for q in ref])
        ref_opt.step()
        norm = clipped_step(opt, max_norm)
        torch.testing.assert_close(norm, ref_norm)
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    clipped = max_norm and scale > 1
    # the clip really acted (or really did not): unclipped AdamW lands elsewhere when it acts
    free = _params()
    free_opt = torch.optim.AdamW(free, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(4):
        for q, g in zip(free, _grads(step, scale * (step + 1))):
            q.grad = g
        free_opt.step()
    same = all(torch.allclose(p, q, rtol=1e-6, atol=1e-6) for p, q in zip(ours, free))
    assert same != bool(clipped)


def test_train_config_grad_clip():
    from dflash_stages.train.config import TrainConfig

    assert TrainConfig(grad_clip=None).grad_clip is None and TrainConfig(grad_clip=0).grad_clip == 0
    with pytest.raises(ValueError, match="grad_clip must be a positive norm"):
        TrainConfig(grad_clip=-1.0)
