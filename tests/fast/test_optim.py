"""clipped_step: the clip folded into fused AdamW equals clip_grad_norm_ then AdamW."""

import pytest
import torch

from dflash_model.fast.optim import MasterAdamW, adamw, clipped_step, drafter_optimizer


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


def _bf16_params() -> list[torch.nn.Parameter]:
    """A norm weight at 1.0 and a weight of the init's scale, in bf16 as the drafter trains on a GPU."""
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16)),
            torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.02).bfloat16())]


def _bf16_grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return [torch.randn(64, generator=g).bfloat16(), torch.randn(32, 16, generator=g).bfloat16()]


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_master_weights_take_the_float32_step_of_bf16_parameters(max_norm):
    params = _bf16_params()
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]  # AdamW on float32 copies
    opt = drafter_optimizer(params, lr=1e-3, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0, foreach=False)
    assert isinstance(opt, MasterAdamW)
    for step in range(6):
        for p, q, g in zip(params, ref, _bf16_grads(step)):
            p.grad, q.grad = g.clone(), g.float()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(ref, max_norm)
        ref_opt.step()
        clipped_step(opt, max_norm)
        opt.zero_grad()
        for p, m, q in zip(params, opt.masters, ref):
            torch.testing.assert_close(m, q, rtol=1e-5, atol=1e-6)  # fused vs loop AdamW rounding
            assert torch.equal(p, m.detach().bfloat16())  # the model computes with the masters rounded
    assert (opt.masters[0] != 1).all() and (params[0] != 1).any()  # the norm weight trains


def test_without_master_weights_a_bf16_norm_weight_never_moves():
    """Why master weights are the default: AdamW's ~1e-3 steps round away on a bf16 weight at 1.0."""
    params = _bf16_params()
    opt = drafter_optimizer(params, lr=1e-3, weight_decay=0.0, master_weights=False)
    assert not isinstance(opt, MasterAdamW)
    for step in range(6):
        for p, g in zip(params, _bf16_grads(step)):
            p.grad = g
        clipped_step(opt, 1.0)
    assert (params[0] == 1).all()


def test_float32_parameters_take_plain_adamw():
    assert type(drafter_optimizer(_params(), lr=1e-3, weight_decay=0.0)) is torch.optim.AdamW


def test_a_resumed_master_adamw_takes_the_steps_of_an_uninterrupted_one():
    def run(steps: range, params: list[torch.nn.Parameter], state: dict | None = None) -> MasterAdamW:
        opt = drafter_optimizer(params, lr=1e-3, weight_decay=0.1)
        if state is not None:
            opt.load_state_dict(state)
        for step in steps:
            for p, g in zip(params, _bf16_grads(step)):
                p.grad = g
            clipped_step(opt, 1.0)
            opt.zero_grad()
        return opt

    whole = _bf16_params()
    run(range(8), whole)
    first = _bf16_params()
    saved = run(range(4), first).state_dict()
    # a fresh start from the saved state: the model's weights are restored first, as the trainer does
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = run(range(4, 8), resumed, saved)
    for p, q in zip(resumed, whole):
        assert torch.equal(p, q)
    assert all(m.dtype == torch.float32 for m in opt.masters)


def test_a_plain_adamw_state_resumes_with_masters_taken_from_the_weights():
    """A checkpoint written before master weights: its moments load, the masters are the weights."""
    plain = _bf16_params()
    old = drafter_optimizer(plain, lr=1e-3, weight_decay=0.0, master_weights=False)
    for p, g in zip(plain, _bf16_grads(0)):
        p.grad = g
    clipped_step(old, 1.0)
    params = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    opt = drafter_optimizer(_bf16_params(), lr=1e-3, weight_decay=0.0)
    opt.params = params  # the trainer's order: weights restored, then the optimizer's state
    opt.load_state_dict(old.state_dict())
    for p, m in zip(params, opt.masters):
        assert torch.equal(m, p.detach().float())
