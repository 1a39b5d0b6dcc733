"""LM-head loss chunk benchmark: Inductor's fused chunk vs the Triton kernels of ``loss_triton``.

One chunk of the drafter step's loss (960 rows of the 7,680 predicted slots; the LM head of the
drafter for Qwen3-8B, vocabulary 151,936 x hidden 4,096, or ``--shape``'s; bf16): both versions
against a float64 reference (loss, argmax, gradient), then GPU time by CUDA events (median of 20
after 5, each call queued behind a spin kernel): the whole chunk (two products and the softmax passes), the two products alone, and the softmax
passes alone (``softmax_grad_`` on a logits buffer), at a few tile sizes; also each version's
first call (its compile). Bandwidth counts three passes over the bf16 logits (read, read, write).

    python benchmarks/loss_chunk.py               # the default run (CUDA)
    python benchmarks/loss_chunk.py --rows 1920 --variants 4096x4   # larger chunks (--chunk-rows 2048)
    python benchmarks/loss_chunk.py --shape qwen3.6-27b --rows 3840  # the 27B drafter's LM head (V 248,320)
    python benchmarks/loss_chunk.py --tiny        # smoke test (CPU: Triton's interpreter, no Inductor)
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

from dflash_model.drafter import loss as loss_mod
from dflash_model.fast import loss_triton

from train_step import SHAPES, drafter_shape, median_ms, sync  # noqa: E402  (benchmarks/ is the script's directory)

STEP_ROWS = 7680  # predicted slots of the reference step: 512 blocks x 15
VARIANTS = ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 8), (8192, 16))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    p.add_argument("--shape", default="qwen3-8b", choices=[n for n in SHAPES if n != "tiny"],
                   help="vocabulary and hidden size: those of the drafter for this target (train_step.py)")
    p.add_argument("--rows", type=int, default=None, help="rows per chunk (default 960; tiny 16)")
    p.add_argument("--variants", type=lambda v: tuple(tuple(int(n) for n in x.split("x")) for x in v.split(",")),
                   default=None, help="tile x warps of the Triton version, e.g. 4096x4,2048x4 (default: a sweep)")
    p.add_argument("--out", type=Path, default=None, help="directory for a JSON result file")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = args.rows or (16 if args.tiny else 960)
    cfg = None if args.tiny else drafter_shape(args.shape)
    V, H = (1000, 64) if cfg is None else (cfg.vocab_size, cfg.hidden_size)
    variants = args.variants or (((256, 4),) if args.tiny else VARIANTS)
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, H, device=dev, generator=g).to(torch.bfloat16)
    weight = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    coef = torch.rand(rows, device=dev, generator=g)
    coef /= coef.sum()
    y = torch.randint(0, V, (rows,), device=dev, generator=g)

    # float64 reference
    logits = h.double() @ weight.double().t()
    lse = logits.logsumexp(-1)
    ref_loss = (coef.double() * (lse - logits.gather(1, y[:, None]).squeeze(1))).sum()
    soft = (logits - lse[:, None]).exp()
    soft[torch.arange(rows, device=dev), y] -= 1
    ref_grad = (soft * coef.double()[:, None]) @ weight.double()
    ref_pred = (h @ weight.t()).argmax(-1)  # the bf16 product's argmax: both versions round to it
    del logits, soft

    inductor = loss_mod._compiled(loss_mod._hard_chunk) if dev.type == "cuda" else loss_mod._hard_chunk
    versions: dict[str, Callable[[], Any]] = {"inductor": lambda: inductor(h, weight, coef, y)}
    for block, warps in variants:
        versions[f"triton {block}x{warps}"] = (lambda b=block, w=warps: loss_triton.hard_chunk(
            h, weight, coef, y, block=b, num_warps=w))
    results: dict[str, dict[str, Any]] = {}
    for name, fn in versions.items():
        sync(dev)
        t0 = time.perf_counter()
        loss, pred, grad = fn()
        sync(dev)
        first_s = time.perf_counter() - t0
        results[name] = {
            "first_call_s": round(first_s, 2),
            "loss_rel_err": abs(loss.double().item() - ref_loss.item()) / abs(ref_loss.item()),
            "argmax_equal": float((pred == ref_pred).double().mean()),
            "grad_rel_err": float((grad.double() - ref_grad).norm() / ref_grad.norm()),
        }

    reps = 3 if dev.type != "cuda" else 20
    products = median_ms(lambda: (h @ weight.t()) @ weight, dev, reps=reps, behind_spin=True)
    buf = (h @ weight.t()).contiguous()
    for name, fn in versions.items():
        results[name]["chunk_ms"] = median_ms(fn, dev, reps=reps, behind_spin=True)
        if name.startswith("triton"):
            block, warps = (int(v) for v in name.split()[1].split("x"))
            ms = median_ms(lambda: loss_triton.softmax_grad_(buf, y, coef, block, warps), dev, reps=reps,
                           behind_spin=True)
            results[name]["softmax_ms"] = ms
            results[name]["TB/s"] = 3 * buf.numel() * buf.element_size() / ms / 1e9

    print(f"\nloss chunk {rows} x {V} (hidden {H}), {dev}: the two products alone {products:.3f} ms "
          f"({products * STEP_ROWS / rows:.2f} ms per {STEP_ROWS:,} rows, the drafter step's)")
    print(f"| version | chunk ms | per {STEP_ROWS:,} rows | softmax passes ms (TB/s) | first call s | loss rel err "
          "| argmax = bf16 argmax | grad rel err (vs float64) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        soft_ms = (f"{r['softmax_ms']:.3f} ({r['TB/s']:.2f})" if "softmax_ms" in r
                   else f"~{r['chunk_ms'] - products:.3f} (chunk − products)")
        print(f"| {name} | {r['chunk_ms']:.3f} | {r['chunk_ms'] * STEP_ROWS / rows:.2f} | {soft_ms} "
              f"| {r['first_call_s']} | {r['loss_rel_err']:.1e} | {r['argmax_equal']:.4f} | {r['grad_rel_err']:.2e} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loss_chunk.json").write_text(json.dumps({"rows": rows, "V": V, "H": H, "products_ms": products,
                                                              "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
