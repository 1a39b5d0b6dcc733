"""FP8 activation quantization benchmark: the Triton kernel of ``fp8_quant_triton`` vs the compiled
function it replaces outside compiled layers (``fp8._compiled_quantize``).

The activation rows an ``FP8BlockLinear`` quantizes before its product: 16,384 tokens (the
production row) by the input widths of the Qwen3.6-27B shape's FP8 layers (5,120 the hidden size;
6,144 the attention outputs, 24 x 256 and 48 x 128; 17,408 the MLP's down projection), bf16. For
each width: the kernel's e4m3 bytes and scales (values and strides) against torch's eager
``fp8._quantize_columns``, which must be equal, and against the compiled function (Inductor divides
by the scale with Triton's approximate division, so a rare value may round the other way: counted,
not required); then GPU time by CUDA events (median of 50 after 5, each call queued behind a spin
kernel) of the compiled function and of the kernel at a few row blocks, against the memory-bound
ideal (x read once, q and the scales written once, at ``--tbps``). Also each version's first call
(its compile). Exits 1 when the kernel differs from the eager function.

    python benchmarks/fp8_quantize.py                              # the default run (CUDA)
    python benchmarks/fp8_quantize.py --k 17408 --rows 16 --json $OUT/fp8_quantize.json

Needs a CUDA GPU: the check is of e4m3 bytes, which Triton's interpreter does not write as a GPU
does (tests/fast/test_fp8_quant_triton.py runs the kernel on the CPU, through the interpreter).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_model.target import fp8  # noqa: E402

from train_step import int_list, median_ms, sync  # noqa: E402  (benchmarks/ is the script's directory)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NO_CUDA = ("fp8_quantize.py needs a CUDA GPU: it compares e4m3 bytes written on the GPU and times them "
           "(the CPU tests of the kernel: tests/fast/test_fp8_quant_triton.py)")


def traffic(m: int, k: int, in_bytes: int) -> int:
    """Bytes the quantization must move at least: x [m, k] read once, q (a byte an element) and
    the float32 scales written once."""
    return m * k * (in_bytes + 1) + m * (k // fp8.BLOCK) * 4


def differences(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """How (q, scales) ``got`` differs from ``want``: q bytes and scales that differ, and whether
    the scales' strides are the same (column-major)."""
    (q, s), (q_want, s_want) = got, want
    return {"q_bytes": int((q.view(torch.uint8) != q_want.view(torch.uint8)).sum()),
            "scales": int((s != s_want).sum()), "same_strides": s.stride() == s_want.stride()}


def first_call(fn: Callable[[], Any], dev: torch.device) -> tuple[Any, float]:
    """fn()'s result and the seconds its first call took (a compile)."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, round(time.perf_counter() - t0, 2)


def measure(x: torch.Tensor, rows: list[int], warmup: int, reps: int, tbps: float) -> dict[str, Any]:
    """One width's checks and timings (see the module docstring)."""
    from dflash_model.fast.fp8_quant_triton import quantize_columns  # (imports triton)

    dev = x.device
    m, k = x.shape
    eager = fp8._quantize_columns(x)
    compiled_fn = fp8._compiled_quantize()
    compiled, compiled_first = first_call(lambda: compiled_fn(x), dev)
    nbytes = traffic(m, k, x.element_size())
    result: dict[str, Any] = {
        "M": m, "K": k, "dtype": str(x.dtype).removeprefix("torch."), "bytes": nbytes,
        "ideal_ms": nbytes / (tbps * 1e9),
        "compiled": {"ms": median_ms(lambda: compiled_fn(x), dev, warmup, reps, behind_spin=True),
                     "first_call_s": compiled_first, "vs_eager": differences(compiled, eager)},
        "triton": []}
    for r in rows:
        out, first = first_call(lambda r=r: quantize_columns(x, rows=r), dev)
        result["triton"].append({
            "rows": r, "ms": median_ms(lambda r=r: quantize_columns(x, rows=r), dev, warmup, reps, behind_spin=True),
            "first_call_s": first, "vs_eager": differences(out, eager), "vs_compiled": differences(out, compiled)})
    return result


def equal(d: dict[str, Any]) -> bool:
    return d["q_bytes"] == 0 and d["scales"] == 0 and d["same_strides"]


def _diff(d: dict[str, Any]) -> str:
    return "equal" if equal(d) else f"{d['q_bytes']} q bytes, {d['scales']} scales" + (
        "" if d["same_strides"] else ", other strides")


def table(results: list[dict[str, Any]], tbps: float) -> str:
    """The results as a markdown table, one line per version and width."""
    lines = [f"| M x K ({results[0]['dtype'] if results else ''}) | version | ms | TB/s | x ideal ({tbps} TB/s) "
             "| first call s | vs eager _quantize_columns | vs compiled |", "|---|---|---|---|---|---|---|---|"]
    for res in results:
        nbytes = res["bytes"]
        shape = f"{res['M']:,} x {res['K']:,}"
        c = res["compiled"]
        lines.append(f"| {shape} | compiled | {c['ms']:.3f} | {nbytes / c['ms'] / 1e9:.2f} "
                     f"| {c['ms'] / res['ideal_ms']:.1f} | {c['first_call_s']} | {_diff(c['vs_eager'])} | |")
        for t in res["triton"]:
            lines.append(f"| {shape} | triton {t['rows']} rows | {t['ms']:.3f} | {nbytes / t['ms'] / 1e9:.2f} "
                         f"| {t['ms'] / res['ideal_ms']:.1f} | {t['first_call_s']} | {_diff(t['vs_eager'])} "
                         f"| {_diff(t['vs_compiled'])} |")
        lines.append(f"| {shape} | memory-bound ideal | {res['ideal_ms']:.3f} | {tbps} | 1.0 | | | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=16384, help="rows (tokens)")
    p.add_argument("--k", type=int_list, default=[5120, 6144, 17408], help="widths, multiples of 128")
    p.add_argument("--rows", type=int_list, default=[8, 16, 32, 64], help="the kernel's rows per program")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tbps", type=float, default=4.8, help="memory bandwidth of the ideal (H200: 4.8 TB/s)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    results = []
    for k in args.k:
        g = torch.Generator(device=dev).manual_seed(k)
        x = torch.randn(args.m, k, device=dev, generator=g).to(DTYPES[args.dtype])
        results.append(measure(x, args.rows, args.warmup, args.reps, args.tbps))
        del x
        torch.cuda.empty_cache()
    print(f"\nFP8 activation quantization on {torch.cuda.get_device_name(dev)}, median of {args.reps} "
          f"(CUDA events, behind a spin kernel)")
    print(table(results, args.tbps))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "results": results}, indent=1))
    return 0 if all(equal(t["vs_eager"]) for res in results for t in res["triton"]) else 1


if __name__ == "__main__":
    sys.exit(main())
