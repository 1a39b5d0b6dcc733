"""Optimizer-step benchmark: the drafter's AdamW + clip, torch's fused kernels vs the Triton ones.

The drafter for Qwen3-8B (5 layers, 1.05B parameters, bf16; ``--shape`` as in train_step.py), random
gradients. Checks both against a float32 AdamW + clip_grad_norm_ (three steps), then times the GPU
work with CUDA events (median of 20 after 5 warm-up calls, each queued behind a spin kernel): the clip's norm,
the AdamW update, and the two together (``clipped_step``, as the trainer calls them); also the
Triton kernels' first call (their compile) and a few block sizes. Bandwidth counts 14 bytes per
bf16 parameter for the update (read p, g, m, v; write p, m, v) and 2 for the norm.

    python benchmarks/optim_step.py                 # the default run (CUDA)
    python benchmarks/optim_step.py --shape qwen3.6-27b  # the drafter for Qwen3.6-27B
    python benchmarks/optim_step.py --tiny          # smoke test (CPU: Triton's interpreter)
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported)

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_model.drafter import DFlashDrafter
from dflash_model.fast import adamw_triton
from dflash_model.fast.optim import adamw, clipped_step

from train_step import SHAPES, drafter_shape, median_ms, sync  # noqa: E402  (benchmarks/ is the script's directory)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="qwen3-8b", choices=SHAPES)
    p.add_argument("--tiny", dest="shape", action="store_const", const="tiny", help="--shape tiny")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="directory for optim_step.json")
    args = p.parse_args()
    dev = torch.device(args.device)
    warmup, reps = (1, 3) if args.shape == "tiny" else (5, 20)

    def timed(fn: Callable[[], Any]) -> float:  # the GPU time of fn's kernels (queued behind a spin kernel)
        return median_ms(fn, dev, warmup, reps, behind_spin=True)

    torch.manual_seed(0)
    model = DFlashDrafter(drafter_shape(args.shape, args.layers))
    start = [t.detach().to(dev, torch.bfloat16) for t in model.parameters()]
    n = sum(t.numel() for t in start)
    g = torch.Generator(device=dev).manual_seed(1)
    grads = [[torch.randn(t.shape, generator=g, device=dev).mul_(2e-4).to(torch.bfloat16) for t in start]
             for _ in range(3)]
    print(f"{n / 1e9:.3f}B parameters in {len(start)} tensors on {dev}", file=sys.stderr)

    def params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(t.to(dtype, copy=True)) for t in start]

    def optimizer(ps: list[torch.nn.Parameter], kernel: str) -> torch.optim.Optimizer:
        if dev.type == "cuda":
            return adamw(ps, 6e-4, 0.01, kernel=kernel)
        if kernel == "triton":  # (adamw() keeps triton to CUDA; the smoke test runs it interpreted)
            return adamw_triton.TritonAdamW(ps, lr=6e-4, weight_decay=0.01)
        return torch.optim.AdamW(ps, lr=6e-4, weight_decay=0.01, fused=True)

    # correctness: three clipped steps of each, against float32 AdamW + clip_grad_norm_
    ref = params(torch.float32)
    ref_opt = torch.optim.AdamW(ref, lr=6e-4, weight_decay=0.01, foreach=False)
    runs: dict[str, list[torch.nn.Parameter]] = {}
    first_call_s = None
    for kernel in ("torch", "triton"):
        ps = params(torch.bfloat16)
        opt = optimizer(ps, kernel)
        for i, step_grads in enumerate(grads):
            for q, gr in zip(ps, step_grads):
                q.grad = gr.clone()
            sync(dev)
            t0 = time.perf_counter()
            clipped_step(opt, 1.0)
            sync(dev)
            if kernel == "triton" and i == 0:
                first_call_s = time.perf_counter() - t0  # the kernels' compile (or cache load)
        runs[kernel] = ps
    ref_norms = []
    for step_grads in grads:
        for q, gr in zip(ref, step_grads):
            q.grad = gr.float()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref, 1.0).item())
        ref_opt.step()
    errs = {}
    for kernel, ps in runs.items():
        diff = [(a.detach().float() - b.detach()).abs() for a, b in zip(ps, ref)]
        errs[kernel] = dict(max_abs=max(d.max().item() for d in diff),
                            mean_abs=sum(d.sum().item() for d in diff) / n)
    unequal = sum((a != b).sum().item() for a, b in zip(runs["torch"], runs["triton"])) / n
    last = grads[-1]
    norm_err = {"torch": (torch.nn.utils.get_total_norm(last).float().item() / ref_norms[-1] - 1),
                "triton": (adamw_triton.total_norm(last).item() / ref_norms[-1] - 1)}
    del ref, ref_opt, runs

    # timing, on fresh bf16 parameters with the last step's gradients
    res: dict[str, Any] = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               torch=torch.__version__, parameters=n, tensors=len(start),
                               triton_first_call_s=first_call_s, error_vs_fp32=errs, unequal_share=unequal,
                               norm_rel_error=norm_err, ms={})
    for kernel in ("torch", "triton"):
        ps = params(torch.bfloat16)
        opt = optimizer(ps, kernel)
        for q, gr in zip(ps, last):
            q.grad = gr
        gs = [q.grad for q in ps]
        norm_fn = getattr(opt, "total_norm", torch.nn.utils.get_total_norm)
        res["ms"][kernel] = dict(norm=timed(lambda: norm_fn(gs)),
                                 update=timed(opt.step),
                                 clipped_step=timed(lambda: clipped_step(opt, 1.0)))
        if kernel == "triton":  # block sizes: elements per program, warps
            st = [opt.state[q] for q in ps]
            variants = {}
            for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)):
                def update() -> None:
                    for q, x in zip(ps, st):
                        adamw_triton.adamw_update(q, q.grad, x["exp_avg"], x["exp_avg_sq"], x["step"], None, 6e-4,
                                                  (0.9, 0.999), 1e-8, 0.01, block=block, num_warps=warps)
                variants[f"{block}w{warps}"] = dict(
                    update=timed(update),
                    norm=timed(lambda: adamw_triton.total_norm(gs, block=block, num_warps=warps)))
            res["variants"] = variants
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "optim_step.json").write_text(json.dumps(res, indent=2))

    gb_update, gb_norm = 14 * n / 1e9, 2 * n / 1e9
    print(f"\n{n / 1e9:.3f}B bf16 parameters; Triton kernels' first call {first_call_s:.2f} s")
    print(f"error vs float32 AdamW after 3 clipped steps: torch max {errs['torch']['max_abs']:.2e} mean "
          f"{errs['torch']['mean_abs']:.2e}; triton max {errs['triton']['max_abs']:.2e} mean "
          f"{errs['triton']['mean_abs']:.2e}; elements unequal torch vs triton: {unequal:.4%}")
    print(f"clip norm vs float32: torch {norm_err['torch']:+.2e}, triton {norm_err['triton']:+.2e}")
    print(f"{'kernel':12} {'norm ms':>8} {'TB/s':>5} {'update ms':>9} {'TB/s':>5} {'clipped_step ms':>15}")
    for kernel, t in res["ms"].items():
        print(f"{kernel:12} {t['norm']:8.3f} {gb_norm / t['norm']:5.2f} {t['update']:9.3f} "
              f"{gb_update / t['update']:5.2f} {t['clipped_step']:15.3f}")
    for name, t in res.get("variants", {}).items():
        print(f"{'  ' + name:12} {t['norm']:8.3f} {gb_norm / t['norm']:5.2f} {t['update']:9.3f} "
              f"{gb_update / t['update']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
