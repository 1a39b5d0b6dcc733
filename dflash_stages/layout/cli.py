"""``dflash-pipe plan PIPELINE``: which multi-GPU layout to train with, predicted from one-GPU rates.

Without ``--rates`` it times the pipeline's own target forward and drafter step on one device
(``dflash_stages/layout/measure.py``, imported only then: torch stays out of ``--help``), then prints
the tokens/s and memory per GPU of pairs, fan-in N→M and colocated on G GPUs (the model:
``dflash_stages/layout/planner.py``, docs/multi_gpu.md) and recommends the fastest that fits.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from rich.table import Table

from dflash_core.cli.common import EXIT_CONFIG, EXIT_OK, add_pipeline_args, console, err_console, load
from dflash_stages.layout.planner import DEFAULT_LINK_GBPS, GIB, Layout, Plan, PlanInputs, plan

ELEMENT_BYTES = {"auto": 2, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}
"""Bytes per feature element by the extract stage's dtype; auto = bf16 (what it is on CUDA)."""


def _two_numbers(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers separated by a comma, got {text!r}") from None
    if a < 0 or b < 0:
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
    return a, b


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plan", parents=[common],
                       help="predict tokens/s of multi-GPU layouts (pairs, fan-in, colocated) and pick one")
    add_pipeline_args(p)
    p.add_argument("--gpus", type=int, metavar="G",
                   help="GPUs of the host (default: the visible CUDA devices when 2 or more, else 4)")
    p.add_argument("--rates", type=_two_numbers, metavar="TARGET_TOK_S,DRAFTER_TOK_S",
                   help="one-GPU tokens/s of the target forward and of the drafter; skips the measurement")
    p.add_argument("--memory", type=_two_numbers, metavar="TARGET_GIB,DRAFTER_GIB",
                   help="peak GiB of the target and of the drafter (default: measured on CUDA)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB",
                   help="memory of one GPU (default: the CUDA device's; unchecked without one)")
    p.add_argument("--rows", type=int, default=3, metavar="K",
                   help="timed forwards and drafter steps, each after 1 warm-up (default 3)")
    p.add_argument("--device", help="where to measure (default: cuda:0 if available, else cpu)")
    p.add_argument("--tokens", type=int, metavar="T",
                   help="tokens per row (default: the pack stage's tokens_per_row)")
    p.add_argument("--overlap", type=float, default=1.0, metavar="F",
                   help="colocated speed-up over back to back (default 1.0 = none, conservative)")
    p.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS, metavar="GB_S",
                   help=f"GPU-to-GPU bandwidth for the feature copy, GB/s (default {DEFAULT_LINK_GBPS:g})")
    p.add_argument("--hidden-size", type=int, metavar="H",
                   help="the target's hidden size, when --rates is given and it cannot be read from the model")
    p.add_argument("--job-tokens", type=float, metavar="N",
                   help="tokens the whole job trains on (every epoch counted, e.g. 10.8e9): also print its "
                        "wall time on the recommended layout")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.set_defaults(func=run)


def _stage(pipeline: Any, kind: str) -> Any:
    specs = [pipeline.stages[n] for n in pipeline.order() if pipeline.stages[n].cls.kind == kind]
    return specs[0] if specs else None


class _Refused(Exception):
    """A plan that cannot be made from these arguments; :func:`run` prints it as the error (exit EXIT_CONFIG)."""


def run(args: argparse.Namespace) -> int:
    _, pipeline = load(args)
    extract, train, pack = (_stage(pipeline, k) for k in ("extract", "train", "pack"))
    tokens = args.tokens or getattr(getattr(pack, "config", None), "tokens_per_row", None)
    try:
        if args.rows < 1 or (args.gpus is not None and args.gpus < 1):
            raise _Refused("--rows and --gpus must be >= 1")
        measured = None if args.rates is not None else _measure(args, pipeline, extract, train, tokens)
        rt, rd, mt, md = _rates(args, measured)
        gpus, gpus_why = (args.gpus, "--gpus") if args.gpus else _default_gpus()
        gpu_gib, gpu_why = _gpu_memory(args, measured)
        k, hidden, elem, row_bytes = _feature_row(args, extract, measured, tokens)
        from dflash_core.runner import QUEUE_BOUND

        try:
            inputs = PlanInputs(target_tok_s=rt, drafter_tok_s=rd, target_gib=mt, drafter_gib=md, gpu_gib=gpu_gib,
                                overlap=args.overlap, row_tokens=int(tokens) if tokens else None,
                                row_bytes=row_bytes, link_gbps=args.link_gbps, queued_rows=QUEUE_BOUND,
                                allreduce_gib=4 * measured.drafter_params / GIB if measured else None)
        except ValueError as exc:
            raise _Refused(str(exc)) from None
    except _Refused as exc:
        err_console.print(f"error: {exc}")
        return EXIT_CONFIG
    result = plan(inputs, gpus)
    job_h = _job_hours(result, args.job_tokens)
    if args.json:
        print(json.dumps({"pipeline": str(pipeline.path), "gpus": gpus,
                          "measured": asdict(measured) if measured else None, "plan": asdict(result),
                          "job": {"tokens": args.job_tokens, "hours": job_h} if job_h is not None else None},
                         indent=1))
        return EXIT_OK
    report(result, pipeline.path, gpus_why, gpu_why, measured, given_rates=args.rates is not None,
           given_memory=args.memory is not None, k=k, hidden=hidden, elem=elem)
    if job_h is not None:
        console.print(f"job: {args.job_tokens:,.0f} tokens at {_num(result.recommended.tokens_per_s)} tokens/s "
                      f"({result.recommended.name}) = {job_h:,.1f} h")
    return EXIT_OK


def _job_hours(result: Plan, job_tokens: float | None) -> float | None:
    """Wall hours of a job of ``job_tokens`` on the recommended layout (None without one of either)."""
    if not job_tokens or result.recommended is None:
        return None
    return job_tokens / result.recommended.tokens_per_s / 3600


def _measure(args: argparse.Namespace, pipeline: Any, extract: Any, train: Any, tokens: int | None) -> Any:
    """Times the pipeline's own target forward and drafter step on one device (``measure.py``, imported
    only here: torch stays out of ``--help``); it needs the stages it knows how to build and the row length."""
    missing = [f"{kind}:{impl}" for kind, impl, spec in (("extract", "hf_hooks", extract), ("train", "dflash", train))
               if spec is None or spec.impl != f"{kind}:{impl}"]
    if missing:
        raise _Refused(f"measuring needs the stages {' and '.join(missing)} in {pipeline.path}; "
                       "give --rates (and --memory) instead")
    if not tokens:
        raise _Refused("tokens per row unknown (the pack stage has no tokens_per_row): give --tokens")
    from dflash_stages.layout.measure import measure

    return measure(extract.config, train.config, int(tokens), args.device or _default_device(), rows=args.rows,
                   log=(lambda s: None) if args.quiet or args.json else
                   (lambda s: err_console.print(s, markup=False)))


def _rates(args: argparse.Namespace, measured: Any) -> tuple[float, float, float | None, float | None]:
    """(tokens/s, peak GiB) of the target and of the drafter on one GPU: given (--rates) or measured,
    with --memory overriding either's memory (rates given without it leave the memory unknown)."""
    if measured is not None:
        rt, rd = measured.target_tok_s, measured.drafter_tok_s
        mt, md = measured.target_gib, measured.drafter_gib
    else:
        rt, rd = args.rates
        mt = md = None
        if rt <= 0 or rd <= 0:
            raise _Refused("--rates must be > 0")
    if args.memory is not None:
        mt, md = args.memory
    return rt, rd, mt, md


def _gpu_memory(args: argparse.Namespace, measured: Any) -> tuple[float | None, str]:
    """(GiB of one GPU, where that figure comes from): --gpu-memory, else the measuring device's, else
    (rates given) cuda:0's; None when unknown, and then layouts are not checked for fit."""
    if args.gpu_memory is not None:
        return args.gpu_memory, "--gpu-memory"
    if measured is None:
        return _cuda_memory()
    if measured.gpu_gib is not None:
        return measured.gpu_gib, f"{measured.device}'s"
    return None, "--gpu-memory"


def _feature_row(args: argparse.Namespace, extract: Any, measured: Any,
                 tokens: int | None) -> tuple[int, int | None, int, int | None]:
    """(k feature layers, hidden size, bytes per element, bytes of one row or None when unknown) of the
    feature row the extract GPU copies to the drafter's: its size prices the copy between GPUs."""
    hidden, k = (None, 0) if extract is None else _dims(extract.config)
    if measured is not None:
        hidden, k = measured.hidden_size, measured.feature_rows
    hidden = args.hidden_size or hidden
    elem = ELEMENT_BYTES.get(str(getattr(getattr(extract, "config", None), "dtype", "auto")), 2)
    row_bytes = int(tokens) * k * hidden * elem if tokens and k and hidden else None
    return k, hidden, elem, row_bytes


def _dims(extract_cfg: Any) -> tuple[int | None, int]:
    if not hasattr(extract_cfg, "model"):
        return None, 0
    from dflash_stages.layout.measure import feature_dims

    return feature_dims(extract_cfg)


def _default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _default_gpus() -> tuple[int, str]:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 2:
        return n, f"the {n} visible CUDA devices"
    return 4, f"default: {n} CUDA device{'' if n == 1 else 's'} visible, so planning for 4; --gpus to change"


def _cuda_memory() -> tuple[float | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, ""
    return torch.cuda.get_device_properties(0).total_memory / GIB, "cuda:0's"


# ------------------------------------------------------------------------------ output
def _num(x: float) -> str:
    return f"{x:,.0f}"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def _pct(x: float) -> str:
    return f"{x:.1%}" if x >= 0.001 else "<0.1%"


def _gpus_cell(lay: Layout, gpus: int) -> str:
    if lay.kind in ("colocated", "single"):
        return f"{lay.gpus} × (target + drafter)"
    t = f"{lay.target_gpus} target{'s' if lay.target_gpus > 1 else ''}"
    d = f"{lay.drafter_gpus} drafter{'s' if lay.drafter_gpus > 1 else ''}"
    return f"{t} → {d}" + (f" (+{gpus - lay.gpus} idle)" if gpus > lay.gpus else "")


def _memory_cell(lay: Layout) -> str:
    if len(lay.memory) == 1:
        return _gib(lay.memory[0][1])
    return " / ".join(f"{role} {_gib(gib)}" for role, gib in lay.memory)


def _fits_cell(lay: Layout, gpu_gib: float | None) -> str:
    if lay.fits is None:
        return "?"
    return "yes" if lay.fits else f"NO (> {gpu_gib:.1f})"


def _copy_cell(lay: Layout) -> str:
    if lay.kind in ("colocated", "single"):
        return "none (same GPU)"
    if lay.link_busy is None:
        return "-"
    text = f"{_ms(lay.transfer_ms)} ms/row, link {_pct(lay.link_busy)} busy"
    return text if lay.transfer_hidden else f"NOT HIDDEN: {text}"


def report(result: Plan, path: str, gpus_why: str, gpu_why: str, measured: Any, *, given_rates: bool,
           given_memory: bool, k: int, hidden: int | None, elem: int) -> None:
    """The plan as text: what it was computed from, the layouts' table, the recommendation, its caveats."""
    console.print(f"plan for {path} on {result.gpus} GPUs ({gpus_why})")
    if measured is not None:
        _print_measurement(measured)
    _print_inputs(result.inputs, measured, gpu_why, given_rates=given_rates, given_memory=given_memory, k=k,
                  hidden=hidden, elem=elem)
    console.print(_table(result))
    if result.pairs is None:
        console.print("pairs and fan-in need 2 GPUs or more")
    _print_fan_in(result)
    _print_verdict(result, measured)


def _print_measurement(measured: Any) -> None:
    """How the rates were timed, so that warm-up and compilation, which are not counted, are visible."""
    console.print(f"measured on {measured.device}: {measured.rows} rows of {measured.tokens:,} tokens each "
                  f"after 1 warm-up (target attention {measured.attn}, layers {measured.layers}); target "
                  f"load {measured.target_load_s:.1f} s, warm-up forward {measured.target_warmup_s:.2f} s; "
                  f"drafter warm-up step {measured.drafter_warmup_s:.2f} s"
                  + (" (compilation)" if measured.compiled else "") + " — warm-ups not counted")
    if measured.compile_cache_saved:
        console.print(f"compile cache saved to {measured.compile_cache_saved} (the run will load it)")


def _print_inputs(inp: PlanInputs, measured: Any, gpu_why: str, *, given_rates: bool, given_memory: bool,
                  k: int, hidden: int | None, elem: int) -> None:
    """The figures the prediction rests on and where each comes from (given, measured or unknown)."""
    T = inp.row_tokens
    source = "given (--rates)" if given_rates else f"measured on {measured.device}"
    mem_source = ("given (--memory)" if given_memory else "peak allocated" if inp.target_gib is not None
                  else "unknown (measured off CUDA; give --memory)")
    per_row = f" = {T / inp.target_tok_s * 1e3:,.1f} ms per {T:,}-token row" if T else ""
    per_step = f" = {T / inp.drafter_tok_s * 1e3:,.1f} ms per row" if T else ""
    for what, rate, per, gib in (("target forward", inp.target_tok_s, per_row, inp.target_gib),
                                 ("drafter step  ", inp.drafter_tok_s, per_step, inp.drafter_gib)):
        console.print(f"  {what} {_num(rate):>9} tokens/s{per}; memory {_gib(gib)} GiB")
    console.print(f"  rates {source}; memory {mem_source}; one GPU: "
                  + (f"{inp.gpu_gib:.1f} GiB ({gpu_why})" if inp.gpu_gib is not None else
                     "unknown, fit not checked (--gpu-memory)"))
    if inp.row_bytes:
        console.print(f"  feature row: {T:,} tokens × {k} × {hidden} × {elem} B = {inp.row_bytes / 2**20:,.1f} MiB; "
                      f"copy {_ms(inp.transfer_s * 1e3)} ms at {inp.link_gbps:g} GB/s; up to {inp.queued_rows} "
                      f"queued rows = {inp.queue_gib:.1f} GiB on the extract GPU (counted)")
    else:
        console.print("  feature row size unknown (hidden size or tokens per row): copy not estimated "
                      "(--hidden-size, --tokens)")


def _table(result: Plan) -> Table:
    """One row per layout that the GPU count allows, one GPU first as the reference of the speed-ups."""
    table = Table(title=f"predicted on {result.gpus} GPUs")
    for col in ("layout", "GPUs", "tokens/s", "vs one GPU", "bound by", "GiB per GPU", "fits",
                "feature copy"):
        table.add_column(col, justify="right" if col in ("tokens/s", "vs one GPU") else "left")
    base = result.single.tokens_per_s
    for lay in (result.single, result.pairs, result.fan_in, result.colocated):
        if lay is None:
            continue
        name = lay.name + (" (reference)" if lay.kind == "single" else "")
        if lay is result.recommended:
            name += "  ← recommended"
        table.add_row(name, _gpus_cell(lay, result.gpus), _num(lay.tokens_per_s), f"{lay.tokens_per_s / base:.2f}×",
                      lay.bound, _memory_cell(lay), _fits_cell(lay, result.inputs.gpu_gib), _copy_cell(lay))
    return table


def _print_fan_in(result: Plan) -> None:
    """The fan-in splits weighed, and those left out, when the table's one fan-in row hides a choice."""
    if len(result.fan_in_splits) > 1 or result.fan_in_excluded:
        splits = ", ".join(f"{x.target_gpus}→{x.drafter_gpus} {_num(x.tokens_per_s)}"
                           + (" (= pairs)" if x.target_gpus == x.drafter_gpus else "") for x in result.fan_in_splits)
        line = f"fan-in splits (tokens/s, best first): {splits}"
        if result.fan_in_excluded:
            line += "; excluded: " + ", ".join(f"{n}→{m} ({n} targets do not divide among {m} drafters)"
                                               for n, m in result.fan_in_excluded)
        console.print(line)


def _print_verdict(result: Plan, measured: Any) -> None:
    """The recommended layout and what the prediction leaves out or rests on (notes)."""
    inp, T, best = result.inputs, result.inputs.row_tokens, result.recommended
    if best is None:
        console.print(f"recommended: none — no layout fits in {inp.gpu_gib:.1f} GiB per GPU")
    else:
        console.print(f"recommended: {best.name} — {_num(best.tokens_per_s)} tokens/s on {best.gpus} GPUs, "
                      f"{best.tokens_per_s / result.single.tokens_per_s:.2f}× one GPU ({best.how})")
    for note in result.notes:
        console.print(f"note: {note}")
    if inp.transfer_s is not None and T:
        pct = inp.transfer_s / (T / inp.drafter_tok_s)
        console.print(f"note: pairs in one process (extract and train on two devices of one rank): the trainer "
                      f"copies a row when its step starts and the drafter's stream waits for the peer copy, "
                      f"+{_pct(pct)} per drafter step (not in the figures above)")
    if measured is not None and not measured.device.startswith("cuda"):
        console.print("note: rates measured on the CPU rank the layouts for a GPU only if the target and the drafter "
                      "keep the same speed ratio there; measure on a GPU (--device) or give --rates")
    console.print("note: a prediction from one-GPU rates; on 2 H200s at Qwen3-32B dims it came within 2.1% of "
                  "the measured tokens/s of every layout (no 4-GPU run yet; docs/multi_gpu.md)")
