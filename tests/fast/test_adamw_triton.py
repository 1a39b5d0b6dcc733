"""TritonAdamW and total_norm: the kernels' own code, compared with torch's AdamW and
get_total_norm. Without a GPU they run through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET); with one, compiled on it. The H200 timing is benchmarks/optim_step.py."""

import pytest
import torch

from dflash_model.fast.optim import MasterAdamW, adamw, clipped_step

pytest.importorskip("triton", reason="the kernels are Triton code (the test extra installs triton)")
from dflash_model.fast import adamw_triton as kernels  # noqa: E402  (imports triton)

SHAPES = ((70, 90), (24,), (7, 3, 5))  # 6,300 elements: several programs per kernel, the last partial
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _params(dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, dtype)) for s in SHAPES]


def _grads(step: int, scale: float, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * scale).to(DEV, dtype) for s in SHAPES]


@pytest.mark.parametrize("max_norm, scale", [(1.0, 5.0), (1.0, 0.001), (None, 5.0)])
def test_triton_adamw_equals_clip_then_adamw(max_norm, scale):
    ours, ref = _params(), _params()
    opt = kernels.TritonAdamW(ours, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6, foreach=False)
    for step in range(4):
        for p, q, g in zip(ours, ref, _grads(step, scale * (step + 1))):
            p.grad, q.grad = g.clone(), g.clone()
        ref_norm = (torch.nn.utils.clip_grad_norm_(ref, max_norm) if max_norm
                    else torch.nn.utils.get_total_norm([q.grad for q in ref]))
        ref_opt.step()
        torch.testing.assert_close(clipped_step(opt, max_norm), ref_norm)
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    for p, q in zip(ours, ref):  # the moments too, under torch's names
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key].to(opt.state[p][key]))


def _truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _adamw_bf16(p, grads, to_bf16, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=1e-2):
    """AdamW with bf16 parameter and moments, fp32 math, each store rounded by ``to_bf16``."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, g in enumerate(grads, 1):
        g = g.float()
        p32, m32, v32 = p.float(), m.float(), v.float()
        p32 = p32 - lr * wd * p32
        m32 = betas[0] * m32 + (1 - betas[0]) * g
        v32 = betas[1] * v32 + (1 - betas[1]) * g * g
        p32 = p32 - lr / (1 - betas[0] ** step) * m32 / (v32.sqrt() / (1 - betas[1] ** step) ** 0.5 + eps)
        p, m, v = to_bf16(p32), to_bf16(m32), to_bf16(v32)
    return p


def test_triton_adamw_bf16_is_torch_fused_math():
    """bf16 parameters and moments, fp32 math, as torch's fused AdamW. On a GPU the kernel rounds
    to nearest and matches torch's kernel; Triton's interpreter (CPU) stores float32 as bfloat16
    by truncation, so there the kernel is held to the same math truncated, and that math, rounded
    to nearest, to torch's kernel."""
    grads = [torch.randn(70, 90, generator=torch.Generator().manual_seed(100 + s)).to(DEV, torch.bfloat16)
             for s in range(3)]
    p0 = torch.randn(70, 90, generator=torch.Generator().manual_seed(0)).to(DEV, torch.bfloat16)
    ours, fused = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = kernels.TritonAdamW([ours], lr=1e-2)
    ref_opt = torch.optim.AdamW([fused], lr=1e-2, fused=True)
    for g in grads:
        ours.grad, fused.grad = g.clone(), g.clone()
        opt.step()  # (the clip's norm: get_total_norm rounds it to bf16 for bf16 gradients, ours not)
        ref_opt.step()
    assert ours.dtype == opt.state[ours]["exp_avg"].dtype == opt.state[ours]["exp_avg_sq"].dtype == torch.bfloat16
    nearest = _adamw_bf16(p0, grads, lambda x: x.to(torch.bfloat16))
    assert (nearest != fused).float().mean() < 0.002  # the math is torch's (a rare last-bit tie apart)
    torch.testing.assert_close(nearest, fused.detach(), rtol=8e-3, atol=1e-4)
    if DEV == "cuda":
        assert (ours != fused).float().mean() < 0.002
        torch.testing.assert_close(ours.detach(), fused.detach(), rtol=8e-3, atol=1e-4)
    else:
        assert torch.equal(ours.detach(), _adamw_bf16(p0, grads, _truncate_bf16))


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_the_fused_master_step_is_the_unfused_one(max_norm):
    """MasterAdamW over TritonAdamW takes one kernel pass per parameter: it reads the bf16 gradient
    as it is and writes the float32 master, the moments and the bf16 weight. Its clip's norm and
    masters equal the unfused MasterAdamW's (float32 gradient copies, torch's AdamW, a copy back),
    and its weights are its masters rounded (truncated by Triton's interpreter, see above)."""
    to_bf16 = _truncate_bf16 if DEV == "cpu" else (lambda x: x.to(torch.bfloat16))
    ours, ref = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = MasterAdamW(ours, lr=1e-2, weight_decay=0.1, kernel="torch")
    opt.inner = kernels.TritonAdamW(opt.masters, lr=1e-2, weight_decay=0.1)
    ref_opt = MasterAdamW(ref, lr=1e-2, weight_decay=0.1, kernel="torch")
    assert opt.fused and not ref_opt.fused
    for step in range(4):
        for p, q, g in zip(ours, ref, _grads(step, 5.0 * (step + 1), torch.bfloat16)):
            p.grad, q.grad = g.clone(), g.clone()
        torch.testing.assert_close(clipped_step(opt, max_norm), clipped_step(ref_opt, max_norm))
        for p, m, q, n in zip(ours, opt.masters, ref, ref_opt.masters):
            torch.testing.assert_close(m, n, rtol=1e-6, atol=1e-6)
            assert torch.equal(p, to_bf16(m.detach()))
            assert m.grad is None  # no float32 gradient copy was made
        opt.zero_grad()
        ref_opt.zero_grad()
    assert all(not torch.equal(p.float(), q.float()) for p, q in zip(_params(torch.bfloat16), ours))


def test_total_norm_equals_get_total_norm():
    grads = _grads(0, 3.0)
    torch.testing.assert_close(kernels.total_norm(grads), torch.nn.utils.get_total_norm(grads))
    # a non-contiguous view is read in its logical order
    t = torch.randn(40, 30, device=DEV).t()
    torch.testing.assert_close(kernels.total_norm([t]), t.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_without_gradients_moves_nothing(dtype):
    """A step whose rows drew no anchors (``steps_per_row`` on a row with fewer candidates than
    steps) has no gradient at all: the norm is 0 on the weights' device and no weight moves,
    in the Triton kernels' fused master step as in their plain one."""
    ours = _params(dtype)
    if dtype == torch.float32:
        opt = kernels.TritonAdamW(ours, lr=1e-2)
    else:
        opt = MasterAdamW(ours, lr=1e-2, weight_decay=0.1, kernel="torch")
        opt.inner = kernels.TritonAdamW(opt.masters, lr=1e-2, weight_decay=0.1)  # the fused path on CUDA
    norm = clipped_step(opt, 1.0)
    assert norm.item() == 0.0 and norm.device == ours[0].device
    assert all(torch.equal(p, q) for p, q in zip(_params(dtype), ours))


def test_state_interchanges_with_torch_fused_adamw():
    """A checkpoint of either optimizer resumes in the other, landing where one of them alone does."""
    a, b, alone = _params(), _params(), _params()
    ta = kernels.TritonAdamW(a, lr=1e-2, weight_decay=0.1)
    tb = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True)
    t_alone = torch.optim.AdamW(alone, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        for ps, o in ((a, ta), (b, tb), (alone, t_alone)):
            for p, g in zip(ps, _grads(step, 1.0)):
                p.grad = g.clone()
            o.step()
        if step == 1:  # swap: a's state into a torch optimizer, b's into a Triton one
            sa, sb = ta.state_dict(), tb.state_dict()
            ta = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, fused=True)
            tb = kernels.TritonAdamW(b, lr=1e-2, weight_decay=0.1)
            ta.load_state_dict(sa)
            tb.load_state_dict(sb)
    for p, q, r in zip(a, b, alone):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(q, r, rtol=1e-6, atol=1e-6)


def test_adamw_kernel_choice():
    p = [torch.nn.Parameter(torch.zeros(3))]  # on the CPU
    assert type(adamw(p, 1e-3, 0.0)) is torch.optim.AdamW  # auto on CPU: torch's fused AdamW
    assert type(adamw(p, 1e-3, 0.0, kernel="torch")) is torch.optim.AdamW
    with pytest.raises(ValueError, match="needs the parameters on a CUDA device"):
        adamw(p, 1e-3, 0.0, kernel="triton")
    with pytest.raises(ValueError, match="adamw kernel must be one of"):
        adamw(p, 1e-3, 0.0, kernel="apex")


def test_triton_adamw_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="amsgrad, maximize and tensor lr"):
        kernels.TritonAdamW(_params(), lr=1e-3, amsgrad=True)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.TritonAdamW([torch.nn.Parameter(torch.zeros(4, 3, device=DEV).t())], lr=1e-3)


def test_train_config_adamw_kernel():
    from dflash_model.fast.optim import KERNELS
    from dflash_stages.train.config import ADAMW_KERNELS, TrainConfig

    assert ADAMW_KERNELS == KERNELS and TrainConfig().adamw_kernel == "auto"
    with pytest.raises(ValueError, match="adamw_kernel must be one of auto, triton, torch"):
        TrainConfig(adamw_kernel="apex")
