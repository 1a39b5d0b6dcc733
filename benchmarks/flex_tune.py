"""Block sizes for the drafter's flex attention: time forward and backward under several Triton
kernel options at the exact mask of the train-step benchmark, and check each against fp32.

Default: CUDA, Qwen3-8B attention (32 query heads, 8 KV heads, head dim 128), the 8,192-token row
of 3 documents with 512 anchors and B=16 of ``train_step.py`` (8,192 queries over 16,384 keys).

    python benchmarks/flex_tune.py                     # every config in CONFIGS, 8 at a time
    python benchmarks/flex_tune.py --only default,b64  # some of them
    python benchmarks/flex_tune.py --only NAME@64      # NAME with the BlockMask in 64-tiles

The BlockMask's tile is 128 (``mask.TILE``) unless ``@TILE`` follows the name; flex needs every
kernel block size to divide it.

Each config compiles in its own process with its own empty Inductor and Triton caches, so the
compiles run side by side and each one's cold compile time is its own (slowed by the others
sharing the CPU); the GPU timing is taken one process at a time (CUDA events, median). The
reference is SDPA in float32 with the dense mask of the same mask function. A config passes when
every error is at most 1.25 x the default config's + 1e-3 (the rule of flex_vs_sdpa.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _bwd(m1: int, n1: int, m2: int, n2: int, stages: int, warps: int) -> dict[str, int]:
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_stages": stages, "bwd_num_warps": warps}


def _fwd(m: int, n: int, stages: int, warps: int) -> dict[str, int]:
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_stages": stages, "fwd_num_warps": warps}


# name -> kernel_options. torch's sm90 defaults for bf16, head dim 128: forward (128, 64, 3 stages,
# 8 warps), backward (64, 128, 128, 64, 3 stages, 8 warps). Each entry pairs one forward and one
# backward variant, so one compile measures two changes; the table reports the two apart.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "tma": {"USE_TMA": True},
    "f128x128s2w8+b64x64s3w4": {**_fwd(128, 128, 2, 8), **_bwd(64, 64, 64, 64, 3, 4)},
    "f64x128s3w4+b64x128s2w8": {**_fwd(64, 128, 3, 4), **_bwd(64, 128, 128, 64, 2, 8)},
    "f128x64s4w8+b32x128s3w4": {**_fwd(128, 64, 4, 8), **_bwd(32, 128, 128, 32, 3, 4)},
    "f128x64s2w8+b64x128s4w8": {**_fwd(128, 64, 2, 8), **_bwd(64, 128, 128, 64, 4, 8)},
    "f128x128s3w8+b32x64s3w4": {**_fwd(128, 128, 3, 8), **_bwd(32, 64, 64, 32, 3, 4)},
    "f64x64s3w4+b64x64s2w4": {**_fwd(64, 64, 3, 4), **_bwd(64, 64, 64, 64, 2, 4)},
    # around the best forward (64x64, 3 stages, 4 warps) and backward (32, 64, 64, 32) above
    "f64x64s4w4+b32x64s4w4": {**_fwd(64, 64, 4, 4), **_bwd(32, 64, 64, 32, 4, 4)},
    "f64x64s2w4+b32x64s2w4": {**_fwd(64, 64, 2, 4), **_bwd(32, 64, 64, 32, 2, 4)},
    "f64x64s3w8+b32x64s3w8": {**_fwd(64, 64, 3, 8), **_bwd(32, 64, 64, 32, 3, 8)},
    "f64x128s2w4+b32x32s3w4": {**_fwd(64, 128, 2, 4), **_bwd(32, 32, 32, 32, 3, 4)},
    "f64x64s3w4+b64x64s4w4": {**_fwd(64, 64, 3, 4), **_bwd(64, 64, 64, 64, 4, 4)},
    "tma+f64x64s3w4+b32x64s3w4": {"USE_TMA": True, **_fwd(64, 64, 3, 4), **_bwd(32, 64, 64, 32, 3, 4)},
    "f64x64s3w4+b32x64s3w4": {**_fwd(64, 64, 3, 4), **_bwd(32, 64, 64, 32, 3, 4)},
    # the best backward above (4 stages) with the chosen forward (slower than with 3 stages)
    "f64x64s3w4+b32x64s4w4": {**_fwd(64, 64, 3, 4), **_bwd(32, 64, 64, 32, 4, 4)},
    # blocks that fit BlockMask tiles of 32 (run as NAME@32)
    "f32x32s3w4+b32x32s3w4": {**_fwd(32, 32, 3, 4), **_bwd(32, 32, 32, 32, 3, 4)},
    "f32x32s4w2+b16x32s3w4": {**_fwd(32, 32, 4, 2), **_bwd(16, 32, 32, 16, 3, 4)},
}


def make_inputs(args: argparse.Namespace, dev: Any) -> dict[str, Any]:
    """q [Q, 32, 128], k/v [KV, 8, 128] (bf16, the drafter's layout before attend() transposes),
    the row's BlockLayout and a fixed output gradient: all seeded, equal in every process."""
    import torch

    from dflash_model.drafter import build_blocks, doc_ids_from_lengths, sample_anchors
    from train_step import make_row

    row = make_row(args.tokens, args.docs, 151936, args.seed)
    anchors = sample_anchors(row["loss_mask"], row["lengths"], args.anchors, torch.Generator().manual_seed(args.seed))
    docs = doc_ids_from_lengths(row["lengths"], args.tokens)
    layout = build_blocks(row["input_ids"], row["position_ids"], docs, anchors, args.block_size, 0)[2]
    layout = type(layout)(layout.ctx_doc.to(dev), layout.block_doc.to(dev), layout.block_start.to(dev),
                          layout.block_size)
    g = torch.Generator().manual_seed(args.seed + 1)
    Q, KV = layout.q_len, layout.kv_len
    q = torch.randn(Q, 32, 128, generator=g)
    k = torch.randn(KV, 8, 128, generator=g)
    v = torch.randn(KV, 8, 128, generator=g)
    gout = torch.randn(Q, 32, 128, generator=g)
    return dict(layout=layout, q=q.to(dev), k=k.to(dev), v=v.to(dev), gout=gout.to(dev),
                pairs=layout.attended_pairs())


def reference(args: argparse.Namespace, path: Path) -> None:
    """fp32 SDPA with the dense mask: output and input gradients, saved for the workers."""
    import torch

    from dflash_model.drafter.attention import attend

    dev = torch.device(args.device)
    s = make_inputs(args, dev)
    q, k, v = (s[n].float().requires_grad_() for n in ("q", "k", "v"))
    out = attend(q, k, v, s["layout"].dense_mask(), "sdpa")
    out.backward(s["gout"].float())
    torch.save({"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}, path)


def parse(name: str) -> tuple[dict[str, Any], int]:
    """'config' or 'config@tile' -> (kernel options, BlockMask tile)."""
    from dflash_model.drafter.mask import TILE

    base, _, tile = name.partition("@")
    return CONFIGS[base], int(tile) if tile else TILE


def worker(name: str, args: argparse.Namespace, ref_path: str, lock: Any, results: Any) -> None:
    """Compile flex attention with ``opts``, then (holding ``lock``) time it and check it."""
    try:
        results.put((name, measure(*parse(name), args, ref_path, lock)))
    except Exception as e:  # reported in the table; one bad config must not stop the others
        results.put((name, {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                            "trace": traceback.format_exc()[-2000:]}))


def measure(opts: dict[str, Any], tile: int, args: argparse.Namespace, ref_path: str, lock: Any) -> dict[str, Any]:
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from train_step import median_ms

    from dflash_core.devices import use_device
    from dflash_model.drafter import DFlashDrafter
    from dflash_model.fast import tune_drafter
    from train_step import drafter_shape

    dev = use_device(args.device)
    # the drafter's tuning entry point, on a weightless (meta) drafter of this head shape: it checks
    # that the blocks fit the tile and lets the backward take the tile
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_shape("qwen3-8b", layers=1))
    tune_drafter(drafter, dev, torch.bfloat16, kernel_options=opts, tile=tile)
    s = make_inputs(args, dev)
    mask = s["layout"].flex_block_mask(tile=tile)
    flex = torch.compile(flex_attention, dynamic=False)
    q, k, v = (s[n].to(torch.bfloat16).requires_grad_() for n in ("q", "k", "v"))
    gout = s["gout"].to(torch.bfloat16)

    def fwd() -> Any:
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # as attend() does
        out = flex(qh, kh, vh, block_mask=mask, enable_gqa=True, kernel_options=opts or None)
        return out.squeeze(0).transpose(0, 1)

    def fwd_bwd() -> Any:
        q.grad = k.grad = v.grad = None
        out = fwd()
        out.backward(gout)
        return out

    t0 = time.perf_counter()
    fwd_bwd()
    torch.cuda.synchronize(dev)
    compile_s = time.perf_counter() - t0
    with lock:  # one process on the GPU at a time
        fwd_ms = median_ms(fwd, dev, args.warmup, args.reps)
        fb_ms = median_ms(fwd_bwd, dev, args.warmup, args.reps)
        out = fwd_bwd()
        torch.cuda.synchronize(dev)
    ref = torch.load(ref_path, weights_only=True)

    def rel(x: Any, r: Any) -> float:
        x, r = x.detach().double().cpu(), r.double()
        return float((x - r).norm() / r.norm())

    pairs = s["pairs"] * 32  # attended (query, key) pairs over all query heads
    return {"tile": tile, "compile_s": compile_s, "fwd_ms": fwd_ms, "bwd_ms": fb_ms - fwd_ms, "fwd_bwd_ms": fb_ms,
            # attention FLOPs (docs/drafter.md, 'FLOP model'): 4·P·d forward, 2.5x that for the backward
            "fwd_tflops": 4 * pairs * 128 / fwd_ms / 1e9, "bwd_tflops": 10 * pairs * 128 / (fb_ms - fwd_ms) / 1e9,
            "err": {"out": rel(out, ref["out"]), "dq": rel(q.grad, ref["dq"]), "dk": rel(k.grad, ref["dk"]),
                    "dv": rel(v.grad, ref["dv"])}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--parallel", type=int, default=8, help="configs compiling at once")
    p.add_argument("--budget", type=float, default=300.0, help="seconds before unfinished configs are dropped")
    p.add_argument("--only", default=None, help="comma-separated config names")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    work = Path(tempfile.mkdtemp(prefix="flex_tune_"))
    ref_path = work / "ref.pt"
    t0 = time.perf_counter()
    reference(args, ref_path)
    print(f"fp32 reference in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    ctx = mp.get_context("spawn")
    lock, results = ctx.Lock(), ctx.Queue()
    threads = max(1, (os.cpu_count() or 2) // max(1, min(args.parallel, len(names))))
    pending, running, done = list(names), {}, {}
    deadline = time.perf_counter() + args.budget
    while (pending or running) and time.perf_counter() < deadline:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            cache = work / name
            os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
                              TORCHINDUCTOR_COMPILE_THREADS=str(threads))
            proc = ctx.Process(target=worker, args=(name, args, str(ref_path), lock, results))
            proc.start()
            running[name] = proc
        try:
            name, res = results.get(timeout=1.0)
        except queue.Empty:
            continue
        done[name] = res
        running.pop(name).join()
        msg = res.get("error") or (f"fwd {res['fwd_ms']:.2f} ms, bwd {res['bwd_ms']:.2f} ms, "
                                   f"compile {res['compile_s']:.0f} s")
        print(f"{name}: {msg}", file=sys.stderr, flush=True)
    for name, proc in running.items():
        proc.kill()
        done[name] = {"error": f"no result within the {args.budget:.0f} s budget"}
    for name in pending:
        done[name] = {"error": "not started (budget)"}

    base = done.get("default", {}).get("err")
    print(f"\n{'config':32} {'tile':>4} {'compile s':>9} {'fwd ms':>7} {'TFLOP/s':>7} {'bwd ms':>7} {'TFLOP/s':>7} "
          f"{'fwd+bwd':>8}  {'err out / dq / dk / dv':27} ok")
    for name in names:
        r = done[name]
        if "error" in r:
            print(f"{name:32} {r['error']}")
            continue
        e = r["err"]
        ok = base is None or all(e[kk] <= 1.25 * base[kk] + 1e-3 for kk in e)
        print(f"{name:32} {r['tile']:4} {r['compile_s']:9.0f} {r['fwd_ms']:7.2f} {r['fwd_tflops']:7.0f} "
              f"{r['bwd_ms']:7.2f} {r['bwd_tflops']:7.0f} {r['fwd_bwd_ms']:8.2f}  "
              f"{e['out']:.1e}/{e['dq']:.1e}/{e['dk']:.1e}/{e['dv']:.1e} {'PASS' if ok else 'FAIL'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flex_tune.json").write_text(json.dumps({"configs": CONFIGS, "results": done}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
