"""Drafter training-step benchmark: step time, tokens/s, TFLOP/s (docs/drafter.md, 'FLOP model'), peak memory.

What it times is the train stage's own step, ``Trainer.train_step`` (the step ``Trainer.fit``
takes), on a trainer set up as a run sets it up: the drafter it builds for Qwen3-8B (random
weights, no downloads), tuned and compiled, AdamW (fused on CUDA) over float32 master weights,
grad clip 1.0, bf16 weights; one 8,192-token packed row of 3 documents as extract sends it, 512
anchors, B=16, 5 draft layers. ``--shape qwen3.6-27b``: the drafter for Qwen3.6-27B instead (hidden
5,120, vocabulary 248,320, the published draft-layer shape), read from the package as a run would.
``--shape smollm2-135m``: the quality jobs' drafter (SmolLM2's own layer, hidden 576, vocabulary
49,152); with ``--layers 4 --features 5 --anchors 2048 --docs 22`` near the step of
``pipelines/quality_gpu.yaml`` (its 8,192-token rows hold about 22 documents).

    python benchmarks/train_step.py                      # the default run (CUDA)
    python benchmarks/train_step.py --shape qwen3.6-27b --breakdown --chunk-rows 2560,3840,7680
    python benchmarks/train_step.py --device cpu --shape tiny  # smoke test (any machine; --tiny too)
    python benchmarks/train_step.py --out results/       # also write results/train_step.json
    python benchmarks/train_step.py --profile results/   # + torch.profiler top-kernel tables
    python benchmarks/train_step.py --compile off        # eager layers and loss (flex still compiled)
    python benchmarks/train_step.py --adamw-kernel torch # torch's fused AdamW instead of the Triton one
    python benchmarks/train_step.py --lm-head fp8        # the loss's LM-head products in FP8 (lm_head_dtype)
    python benchmarks/train_step.py --mlp fp8            # the draft layers' MLP products in FP8 (mlp_dtype)
    python benchmarks/train_step.py --no-master-weights  # AdamW on the bf16 weights (before session 16)
    python benchmarks/train_step.py --compile-cache DIR  # load/save the portable compile cache
    python benchmarks/train_step.py --cuda-graph         # + the step captured as a CUDA graph, replayed
    python benchmarks/train_step.py --breakdown          # + the step's time phase by phase (step_phases.py)
    python benchmarks/train_step.py --chunk-rows 3840,7680  # one table row per LM-head loss chunk size

The back-to-back steps are timed with nvidia-smi sampling the GPU beside them (``gpu_clocks.py``):
the SM clock and power it held, since a GPU can run this step at its power limit.

Run it twice with ``--compile-cache`` on a fresh machine (empty TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR) to see the cold and the cached first step.
"""

from __future__ import annotations

import sys


import argparse
import dataclasses
import json
import logging
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core import StageContext
from dflash_model.drafter import (H200_BF16_PEAK, DFlashDrafter, DrafterConfig, FeatureBatch, build_blocks,
                                 doc_ids_from_lengths, drafter_loss, sample_anchors, training_flops)
from dflash_model.drafter.attention import resolve_backend
from dflash_model.drafter.loss import loss_chunks
from dflash_model.fast import tune_drafter
from dflash_model.fast.optim import clipped_step
from dflash_model.target.features import feature_layer_ids
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.drafter_init import drafter_config
from dflash_stages.train.trainer import Trainer
from gpu_clocks import ClockLog, describe  # noqa: E402  (benchmarks/ is the script's directory)
from step_phases import LOSS, PhaseClock, breakdown, breakdown_table  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=8, vocab_size=512, rms_norm_eps=1e-6, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu")
"""The ``tiny`` shape's target: small enough for a CPU smoke test."""
SHAPES = ("tiny", "qwen3-8b", "qwen3.6-27b", "smollm2-135m")
"""``--shape``: ``tiny``, or the target ``random:NAME`` of ``dflash_model.target.load.PRESETS``."""


def target_config(name: str) -> dict[str, Any]:
    """The config of the target ``random:NAME`` (``TINY`` for ``tiny``)."""
    if name == "tiny":
        return dict(TINY)
    from dflash_model.drafter.config import config_dict
    from dflash_model.target.load import random_config

    return config_dict(random_config(name))


def target_header(name: str, embed: torch.Tensor, lm_head: torch.Tensor,
                  features: int | None = None) -> dict[str, Any]:
    """The header extract would send for the target ``random:NAME`` with these embedding and LM
    head weights: what the trainer builds its drafter from. ``features``: how many target layers
    extract reads (``layers: auto``); None: as many as draft layers."""
    config = target_config(name)
    layer_ids = feature_layer_ids("auto", features, config["num_hidden_layers"]) if features else None
    return {"model": f"random:{name}", "config": config, "embed_weight": embed,
            "lm_head_weight": lm_head, "target_layer_ids": layer_ids,
            "tokenizer_len": embed.shape[0] - 1}  # a random target's stand-in tokenizer: every row but the last


def drafter_shape(name: str, layers: int = 5, block_size: int = 16, features: int | None = None) -> DrafterConfig:
    """The drafter a run builds for the target ``random:NAME`` (``TINY`` for ``tiny``): attention
    shape, RoPE, target layers and mask token chosen by ``drafter_init.drafter_config``, from the
    header extract would send, so the benchmark's dimensions are the package's own."""
    target = target_config(name)
    weights = torch.empty(target["vocab_size"], target["hidden_size"], device="meta")
    header = target_header(name, weights, weights, features)
    return drafter_config(header, TrainConfig(num_layers=layers, block_size=block_size))[0]


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options shared with flex_vs_sdpa.py."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="qwen3-8b", choices=SHAPES,
                   help="the target whose drafter is timed (tiny: small dims and row, a smoke test)")
    p.add_argument("--tiny", dest="shape", action="store_const", const="tiny", help="--shape tiny")
    p.add_argument("--tokens", type=int, default=None, help="packed row length (default 8192; tiny 256)")
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--anchors", type=int, default=None, help="anchors per row (default 512; tiny 16)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--features", type=int, default=None,
                   help="target layers the drafter reads (extract's num_features; default: as many as --layers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory for a JSON result file")


def make_row(T: int, docs: int, vocab: int, seed: int) -> dict[str, Any]:
    """The benchmark row: ``docs`` equal documents, the first 10% of each a prompt (unsupervised)."""
    g = torch.Generator().manual_seed(seed)
    base, rest = divmod(T, docs)
    lengths = [base + (i < rest) for i in range(docs)]
    loss_mask = torch.ones(T, dtype=torch.long)
    start = 0
    for n in lengths:
        loss_mask[start:start + n // 10] = 0
        start += n
    return dict(lengths=lengths, loss_mask=loss_mask, generator=g,
                position_ids=torch.cat([torch.arange(n) for n in lengths]),
                input_ids=torch.randint(0, vocab - 1, (T,), generator=g))


def make_inputs(args: argparse.Namespace, cfg: DrafterConfig, dtype: torch.dtype) -> dict[str, Any]:
    """One packed row (3 docs, prompts unsupervised) with random features for ``cfg``'s target
    layers, and the frozen embedding / LM head, drawn on the device (the 27B shape's are billions
    of numbers): ``row`` as extract sends it (token fields on the host), ``batch`` the same row on
    the device for ``drafter_loss``."""
    dev = torch.device(args.device)
    tiny = args.shape == "tiny"
    T = args.tokens or (256 if tiny else 8192)
    N = args.anchors or (16 if tiny else 512)
    V, H = cfg.vocab_size, cfg.hidden_size
    row = make_row(T, args.docs, V, args.seed)
    g = row["generator"] if dev.type == "cpu" else torch.Generator(dev).manual_seed(args.seed)
    features = torch.randn(T, len(cfg.target_layer_ids) * H, generator=g, device=dev).to(dtype)
    host = {"input_ids": row["input_ids"], "loss_mask": row["loss_mask"], "position_ids": row["position_ids"]}
    return dict(
        cfg=cfg, T=T, N=N, lengths=row["lengths"], device=dev, loss_mask_cpu=row["loss_mask"],
        row=dict(host, doc_lengths=row["lengths"], features=features, last_hidden=None),
        batch=FeatureBatch(features, **{k: v.to(dev) for k, v in host.items()}, doc_lengths=row["lengths"]),
        embed=(torch.randn(V, H, generator=g, device=dev) * 0.02).to(dtype),
        lm_head=(torch.randn(V, H, generator=g, device=dev) * 0.02).to(dtype),
    )


def make_setup(args: argparse.Namespace, dtype: torch.dtype, backend: str, compile: bool = False) -> dict[str, Any]:
    """``make_inputs`` and a random drafter of the shape a run builds, tuned as the trainer tunes
    it (``tune_drafter``), compiled if ``compile``: for the loss alone (``flex_vs_sdpa.py``)."""
    dev = torch.device(args.device)
    s = make_inputs(args, drafter_shape(args.shape, args.layers, args.block_size, args.features), dtype)
    torch.manual_seed(args.seed)
    with dev:
        model = DFlashDrafter(s["cfg"], attn_backend=backend).to(dtype=dtype)
    tuned = tune_drafter(model, dev, dtype, kernel_options="auto", tile="auto", compile=compile, logger=LOG)
    return dict(s, model=model, tuned=tuned)


def make_trainer(args: argparse.Namespace, s: dict[str, Any], backend: str, work: str) -> Trainer:
    """The train stage's ``Trainer`` for the benchmark's target, set up as a run sets it up (its
    drafter built, tuned and compiled, its optimizer made), writing what it writes under ``work``."""
    cfg = TrainConfig(num_layers=args.layers, block_size=args.block_size, num_anchors=s["N"], seed=args.seed,
                      dtype="bfloat16", attn_backend=backend, compile=args.compile,
                      compile_cache=str(args.compile_cache) if args.compile_cache else None,
                      flex_kernel_options=args.flex_options, flex_tile=args.flex_tile,
                      adamw_kernel=args.adamw_kernel, master_weights=args.master_weights,
                      chunk_rows=args.chunk_rows[0], lm_head_dtype=args.lm_head,
                      mlp_dtype=args.mlp)
    ctx = StageContext(stage="train", config=cfg, device=args.device, run_dir=work, work_dir=work)
    trainer = Trainer(cfg, ctx, compile_options={"options": dict(args.inductor)} if args.inductor else None)
    trainer.setup(target_header(args.shape, s["embed"], s["lm_head"], args.features))
    return trainer


def attended_pairs(s: dict[str, Any], anchors: torch.Tensor) -> list[int]:
    """P of each draft layer's mask for these anchors (the FLOP model's attention term)."""
    cfg, batch = s["cfg"], s["batch"]
    docs = doc_ids_from_lengths(s["lengths"], s["T"], s["device"])
    layout = build_blocks(batch.input_ids, batch.position_ids, docs, anchors.to(s["device"]), cfg.block_size,
                          cfg.mask_token_id)[2]
    return [layout.attended_pairs(cfg.sliding_window if lt == "sliding_attention" else None) for lt in cfg.layer_types]


LOG = logging.getLogger("train_step")


def log(msg: str) -> None:
    """Progress on stderr, so a run cut short by a time limit still shows where it was."""
    print(msg, file=sys.stderr, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run(args: argparse.Namespace, backend: str) -> list[dict[str, Any]]:
    """Set a trainer up, take its first step once (it compiles), then time its step at each
    ``--chunk-rows`` value (one result each: only the LM-head loss chunks change between them)."""
    with tempfile.TemporaryDirectory(prefix="train-step-") as work:
        s = make_inputs(args, drafter_shape(args.shape, args.layers, args.block_size, args.features), torch.bfloat16)
        trainer = make_trainer(args, s, backend, work)
        try:
            return timed_steps(args, backend, dict(s, model=trainer.model, cfg=trainer.model.config), trainer)
        finally:
            trainer.metrics.close()


def timed_steps(args: argparse.Namespace, backend: str, s: dict[str, Any], trainer: Trainer) -> list[dict[str, Any]]:
    """``run``'s measurements of ``trainer``'s step on the row ``s["row"]``."""
    model, dev, opt = trainer.model, s["device"], trainer.opt
    log(f"[{backend}] --shape {args.shape}: {describe_shape(s['cfg'])}")

    def step(mark: Callable[[str], None] = lambda _: None) -> torch.Tensor:
        """The trainer's step on the row; ``mark`` is called at its start and after its forward,
        backward and optimizer (a ``PhaseClock``'s, to split the step's time). Returns the anchors
        it drew (the FLOP model's input)."""
        mark("start")
        return trainer.train_step([s["row"]], mark).anchors[0]

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sync(dev)
    t0 = time.perf_counter()
    log(f"[{backend}] first step (compiles on CUDA; compile cache loaded: {trainer.cache_loaded}; "
        f"{type(opt).__name__})...")
    laps = PhaseClock(dev, wall=True)  # the first step's compile time, split by phase
    step(laps.mark)
    phases = laps.phases()
    first = time.perf_counter() - t0
    first_peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    log(f"[{backend}] first step {first:.1f}s (" + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()) + ")"
        + ("" if first_peak is None else f"; peak {first_peak:.1f} GiB"))
    if trainer.compiled:
        log(torch._dynamo.utils.compile_times(repr="str", aggregate=True))
        log(compile_by_graph())
    trainer.save_compile_cache()
    common = dict(backend=resolve_backend(backend, dev), compiled=trainer.compiled, cache_loaded=trainer.cache_loaded,
                  device=str(dev), torch=torch.__version__, shape=args.shape, drafter=s["cfg"].to_export_dict(),
                  tokens=s["T"], anchors=s["N"], block_size=args.block_size, layers=args.layers, first_step_s=first,
                  first_step_phases_s=phases, first_step_peak_gib=first_peak, steps=args.steps,
                  flex_options=model.flex_kernel_options, flex_tile=model.flex_tile, adamw=type(opt).__name__,
                  lm_head=args.lm_head, mlp=args.mlp, cuda_graph=None)
    results = []
    for n in args.chunk_rows:
        trainer.cfg.chunk_rows = n  # read by every step
        results.append({**common, **measure(args, backend, s, step, n)})
    if args.cuda_graph:
        results[0]["cuda_graph"] = cuda_graph_compare(args, s, trainer, results[0]["steady_ms"] / 1e3,
                                                      args.chunk_rows[0])
    if args.profile:
        profile_steps(step, dev, args.profile / f"profile-{backend}-compile-{args.compile}.txt")
    return results


def measure(args: argparse.Namespace, backend: str, s: dict[str, Any], step: Callable[..., torch.Tensor],
            chunk_rows: int) -> dict[str, Any]:
    """Step time (synced steps by CUDA events, and back to back), TFLOP/s, peak memory (from the
    first warm-up step on), host syncs and time, and with ``--breakdown`` the time by phase, all
    at one loss chunk size."""
    dev, label = s["device"], f"[{backend} chunk-rows {chunk_rows}]"
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(args.warmup):
        t1 = time.perf_counter()
        step()
        sync(dev)
        log(f"{label} warm-up step {i + 1}: {time.perf_counter() - t1:.2f}s")
    host_syncs = count_host_syncs(step, dev)
    host = host_ms(step, dev)
    times, flops = [], []
    for _ in range(args.steps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            anchors = step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            anchors = step()
            times.append(time.perf_counter() - t0)
        flops.append(training_flops(s["cfg"], s["T"], anchors.numel(), attended_pairs(s, anchors)))
    med = statistics.median(times)
    tflops = statistics.median(f["step"] / t for f, t in zip(flops, times)) / 1e12
    step_flop = statistics.mean(f["step"] for f in flops)
    with ClockLog(dev) as clocks:  # the clock the chip held: it runs this step at its power limit
        steady = back_to_back_s(step, dev, args.steps)
    log(f"{label} back to back: {describe(clocks.summary)}")
    log(f"{label} steps alone (synced each): median {med * 1e3:.1f} ms; back to back: {steady * 1e3:.1f} ms/step; "
        f"host syncs per step: {host_syncs}; host time per step: {host if host is None else round(host, 1)} ms")
    n_chunks, size = loss_chunks(s["N"] * (args.block_size - 1), chunk_rows)
    phases = breakdown(step, s["model"], dev, args.breakdown) if args.breakdown else None
    lm_head_flop = 2 * statistics.mean(f["lm_head"] for f in flops)  # both products, in the forward
    return dict(chunk_rows=chunk_rows, loss_chunks=f"{n_chunks}x{size}",
                step_ms_median=med * 1e3, step_ms_min=min(times) * 1e3, tokens_per_s=s["T"] / med,
                tflop_per_step=step_flop / 1e12, tflop_per_s=tflops, host_syncs=host_syncs, host_ms=host,
                steady_ms=steady * 1e3, steady_gpu_clock=clocks.summary, steady_tokens_per_s=s["T"] / steady,
                steady_tflop_per_s=step_flop / steady / 1e12, mfu=tflops * 1e12 / H200_BF16_PEAK,
                peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
                breakdown_ms=phases, lm_head_tflop=lm_head_flop / 1e12,
                lm_head_tflop_per_s=lm_head_flop / phases[LOSS] / 1e9 if phases and phases.get(LOSS) else None)


def describe_shape(cfg: DrafterConfig) -> str:
    """The dimensions that set the step's FLOPs, for the log."""
    from dflash_stages.train.drafter_init import describe as describe_layers

    return (f"hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, target "
            f"layers {cfg.target_layer_ids} of {cfg.num_target_layers}; {describe_layers(cfg)}")


def compile_by_graph() -> str:
    """The first step's compile time graph by graph (Dynamo's records): which graph to shrink."""
    lines = [f"{'graph':28} {'pass':>8} {'ops':>5} {'total s':>8} {'dynamo':>7} {'aot':>6} {'inductor':>8} "
             f"{'triton':>7}"]
    for m in torch._dynamo.utils.get_compilation_metrics():
        def sec(us: int | None) -> str:
            return f"{us / 1e6:.2f}" if us else "-"
        lines.append(f"{(m.co_name or '?')[:28]:28} {'forward' if m.is_forward else 'backward':>8} "
                     f"{m.graph_op_count or 0:5} {sec(m.duration_us):>8} "
                     f"{sec(m.dynamo_cumulative_compile_time_us):>7} "
                     f"{sec(m.aot_autograd_cumulative_compile_time_us):>6} "
                     f"{sec(m.inductor_cumulative_compile_time_us):>8} {sec(m.triton_compile_time_us):>7}")
    return "\n".join(lines)


def cuda_graph_compare(args: argparse.Namespace, s: dict[str, Any], trainer: Trainer, eager_steady: float,
                       chunk_rows: int) -> dict[str, Any]:
    """The trainer's step rebuilt to be captured once as a CUDA graph (forward, backward, clip,
    AdamW on its drafter and optimizer; the documents as device ids, so nothing waits for the
    host) and replayed with fresh anchors copied into its input buffer: time against the eager
    step, and the losses and weights of K steps from the same state, eager vs replayed (prototype)."""
    model, opt, dev, N = trainer.model, trainer.opt, s["device"], s["N"]
    batch = dataclasses.replace(s["batch"], doc_lengths=None, doc_ids=doc_ids_from_lengths(s["lengths"], s["T"], dev))
    anchors_in = torch.zeros(N, dtype=torch.long, device=dev)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def body() -> torch.Tensor:
        out = drafter_loss(model, batch, anchors_in, trainer.embed, trainer.head, pad_anchors_to=N,
                           compile_loss=trainer.compiled, chunk_rows=chunk_rows)
        out.loss.backward()
        clipped_step(opt, 1.0)
        return out.loss.detach()

    params = list(model.parameters())
    inner = getattr(opt, "inner", opt)  # MasterAdamW steps float32 masters through an inner AdamW
    stepped = list(inner.param_groups[0]["params"])
    states = [inner.state[p] for p in stepped]
    live = params + (stepped if inner is not opt else []) + [
        t for st in states for t in (st["exp_avg"], st["exp_avg_sq"], st["step"])]

    def snapshot() -> list[torch.Tensor]:
        return [t.detach().clone() for t in live]

    def restore(snap: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, v in zip(live, snap):
                t.copy_(v)

    K = 5
    anchor_list = [sample_anchors(s["loss_mask_cpu"], s["lengths"], N, gen) for _ in range(K)]
    start = snapshot()
    eager_losses = []
    for a in anchor_list:
        anchors_in.copy_(a)
        eager_losses.append(body())
        opt.zero_grad(set_to_none=True)
    eager_end = [p.detach().clone() for p in params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA-graph capture asks
        for _ in range(2):
            body()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.reset_peak_memory_stats(dev)
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    try:
        with torch.cuda.graph(graph):
            loss_out = body()
    except Exception as e:  # a prototype: report why and keep the rest of the run
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    capture_s = time.perf_counter() - t0
    restore(start)
    graph_losses = []
    for a in anchor_list:
        anchors_in.copy_(a)
        graph.replay()
        graph_losses.append(loss_out.clone())
    sync(dev)
    loss_diff = max(abs(float(x) - float(y)) for x, y in zip(eager_losses, graph_losses))
    weight_diff = max(float((p.detach() - e).abs().max()) for p, e in zip(params, eager_end))

    def gstep() -> torch.Tensor:
        a = sample_anchors(s["loss_mask_cpu"], s["lengths"], N, gen)
        anchors_in.copy_(a.pin_memory(), non_blocking=True)
        graph.replay()
        return a

    for _ in range(3):
        gstep()
    syncs = count_host_syncs(gstep, dev)
    host = host_ms(gstep, dev)
    alone = median_ms(gstep, dev, warmup=2, reps=args.steps)
    steady = back_to_back_s(gstep, dev, args.steps)
    res = dict(capture_s=capture_s, alone_ms=alone, steady_ms=steady * 1e3, eager_steady_ms=eager_steady * 1e3,
               host_ms=host, host_syncs=syncs, loss_max_abs_diff=loss_diff, weight_max_abs_diff=weight_diff,
               eager_losses=[float(x) for x in eager_losses], graph_losses=[float(x) for x in graph_losses],
               peak_gib_from_capture=torch.cuda.max_memory_allocated(dev) / 2**30)
    log(f"[cuda graph] capture {capture_s:.1f}s; alone {alone:.1f} ms; back to back {steady * 1e3:.1f} ms/step "
        f"(eager {eager_steady * 1e3:.1f}); host {host} ms, syncs {syncs}; eager vs graph over {K} steps: "
        f"loss max |diff| {loss_diff:.3g}, weights max |diff| {weight_diff:.3g}; "
        f"peak since capture {res['peak_gib_from_capture']:.1f} GiB")
    return res


def back_to_back_s(step: Callable[[], Any], dev: torch.device, n: int) -> float:
    """Seconds per step of ``n`` steps back to back with no sync between them, as the trainer
    runs (its host prepares the next step while the GPU finishes this one): the steady state."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync(dev)
    return (time.perf_counter() - t0) / n


def count_host_syncs(step: Callable[[], Any], dev: torch.device) -> int | None:
    """Operations in one step that make the host wait for the GPU (torch's sync debug mode):
    each one stops the host from preparing the next step while this one runs."""
    if dev.type != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught  # (leaving out the mode's own notice)
             if "synchroniz" in str(w.message) and "debug mode is a prototype" not in str(w.message)]
    for msg in syncs[:5]:
        log(f"host sync in the step: {msg}")
    return len(syncs)


def host_ms(step: Callable[[], Any], dev: torch.device, n: int = 3) -> float | None:
    """Median host time to enqueue one step while the GPU is still busy with earlier work (a
    ~1 s spin kernel): the step's CPU cost. Near the GPU's step time, the host sets the pace."""
    if dev.type != "cuda":
        return None
    times = []
    for _ in range(n):
        sync(dev)
        torch.cuda._sleep(2_000_000_000)  # clock cycles
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        sync(dev)
    return statistics.median(times)


KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("flex attention", ("flex", "tem_fused")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "wgmma")),
    ("fused (Inductor)", ("triton_",)),
    ("optimizer", ("adam", "multi_tensor", "foreach", "sumsq")),
    ("loss softmax (Triton)", ("_tile_stats", "_tile_grad")),
    ("copy / cast", ("copy", "memcpy", "memset", "fill")),
)


def profile_steps(step: Callable[[], Any], dev: torch.device, path: Path, n: int = 3) -> None:
    """torch.profiler over ``n`` steps: top kernels by GPU time, time per kernel kind, GPU idle share."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync(dev)
        wall = (time.perf_counter() - t0) / n
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        # user annotations (e.g. "Optimizer.step#AdamW.step") span kernels listed on their own
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            kernels.setdefault(e.name, []).append(e.device_time / 1e3 / n)  # ms per step
    rows = sorted(((sum(v), len(v) / n, k) for k, v in kernels.items()), reverse=True)
    busy = sum(r[0] for r in rows)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    idle, gaps, long_idle, end = 0.0, 0, 0.0, spans[0][1] if spans else 0.0
    for a, b in spans[1:]:  # time the GPU ran nothing between kernels (what CUDA graphs could take back)
        if a > end:
            idle, gaps = idle + (a - end), gaps + 1
            long_idle += (a - end) if a - end > 50 else 0.0
        end = max(end, b)
    kinds: dict[str, float] = {}
    for ms, _, name in rows:
        kind = next((kd for kd, keys in KERNEL_KINDS if any(x in name.lower() for x in keys)), "other (aten)")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    lines = [f"profile of {n} steps: wall {wall * 1e3:.1f} ms/step (profiler on), GPU busy {busy:.1f} ms/step "
             f"({busy / (wall * 1e3):.0%})",
             f"GPU idle between kernels: {idle / 1e3 / n:.2f} ms/step in {gaps / n:.0f} gaps "
             f"({long_idle / 1e3 / n:.2f} ms/step in gaps over 50 us)",
             "", f"{'ms/step':>8} {'share':>6} {'calls':>6}  kernel"]
    lines += [f"{ms:8.2f} {ms / busy:6.1%} {calls:6.0f}  {name[:110]}" for ms, calls, name in rows[:25]]
    lines += ["", f"{'ms/step':>8} {'share':>6}  kind"]
    lines += [f"{ms:8.2f} {ms / busy:6.1%}  {kd}" for kd, ms in sorted(kinds.items(), key=lambda kv: -kv[1])]
    if dev.type == "cuda":
        lines += ["", *matmul_table(prof, dev, n)]
    lines += ["", "host: operators by own CPU time (all threads, profiler on)",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)]
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    prof.export_chrome_trace(str(path.with_suffix(".trace.json.gz")))  # where the GPU waits for the host
    log(text)


def matmul_table(prof: Any, dev: torch.device, n: int) -> list[str]:
    """GPU time of the step's matrix products by shape, next to the same product timed alone on
    contiguous bf16 inputs: a shape far slower in the step than alone points at its layout."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in ("aten::mm", "aten::addmm") or not e.input_shapes:
            continue
        a, b = e.input_shapes[-2:] if e.key == "aten::addmm" else e.input_shapes[:2]
        if len(a) != 2 or len(b) != 2:
            continue
        rows.append((e.device_time_total / 1e3 / n, e.count / n, (a[0], a[1], b[1])))
    rows.sort(reverse=True)
    lines = [f"{'ms/step':>8} {'calls':>6} {'alone ms':>9} {'TFLOP/s':>8}  M x K x N (matrix products)"]
    total = alone_total = 0.0
    for ms, calls, (m, k, nn) in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(k, nn, device=dev, dtype=torch.bfloat16)
        alone = median_ms(lambda: x @ w, dev) * calls
        total, alone_total = total + ms, alone_total + alone
        lines.append(f"{ms:8.2f} {calls:6.1f} {alone:9.2f} {2 * m * k * nn * calls / ms / 1e9:8.0f}  {m} x {k} x {nn}")
    lines.append(f"{total:8.2f} {'':6} {alone_total:9.2f} {'':8}  all")
    return lines


def median_ms(fn: Callable[[], Any], dev: torch.device, warmup: int = 5, reps: int = 20,
              behind_spin: bool = False) -> float:
    """Median milliseconds of fn() by CUDA events (wall clock off CUDA). ``behind_spin``: each call
    queued behind a 50 ms spin kernel, so the events time its kernels alone, however long the host
    takes to launch them (as in a training step, whose host runs ahead of the GPU)."""
    times = []
    for i in range(warmup + reps):
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if behind_spin:
                torch.cuda._sleep(100_000_000)  # clock cycles
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def inductor_option(text: str) -> tuple[str, Any]:
    """'key=value' -> (key, value), the value read as JSON when it is JSON (numbers, true/false)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def int_list(text: str) -> list[int]:
    """'4096' or '3840,7680' -> [4096] or [3840, 7680]."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,..., got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--backend", default="auto", choices=["auto", "flex", "sdpa", "both"])
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the draft layers and the loss chunks (auto: on CUDA)")
    p.add_argument("--chunk-rows", type=int_list, default=[4096], metavar="N[,N...]",
                   help="LM-head rows per loss chunk (default: the trainer's 4096); a list times each, one "
                        "table row each, in one process (the draft layers compile once)")
    p.add_argument("--breakdown", type=int, nargs="?", const=5, default=0, metavar="STEPS",
                   help="also time the step phase by phase (median of STEPS steps, default 5): fc, "
                        "attention and MLP halves, LM head + loss, backward, optimizer")
    p.add_argument("--inductor", type=inductor_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an Inductor config option for the draft-layer compile (repeatable), e.g. "
                        "prologue_fusion=false")
    p.add_argument("--adamw-kernel", default="auto", choices=["auto", "triton", "torch"],
                   help="AdamW step: Triton kernels (auto on CUDA) or torch's fused AdamW")
    p.add_argument("--lm-head", default="model", choices=["model", "fp8"],
                   help="the loss's LM-head products in the drafter's dtype or through an FP8 copy of the head")
    p.add_argument("--mlp", default="model", choices=["model", "fp8"],
                   help="the draft layers' MLP products in the drafter's dtype or in FP8 (forward and input gradient)")
    p.add_argument("--no-master-weights", dest="master_weights", action="store_false",
                   help="step the bf16 weights in place instead of float32 masters (the trainer's default)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps after the first (default 5; tiny 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 30; tiny 3)")
    p.add_argument("--profile", type=Path, default=None, help="directory for profiler tables (3 extra steps)")
    p.add_argument("--flex-options", type=lambda v: v if v == "auto" else json.loads(v), default="auto",
                   help='flex attention kernel_options: auto (measured ones for this GPU, see flex_tune.py), '
                        'null (torch\'s defaults) or JSON, e.g. \'{"bwd_num_warps": 4}\'')
    p.add_argument("--flex-tile", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="the flex BlockMask's tile: auto (the one measured fastest for this GPU, see "
                        "fast/flex.py TUNED_FLEX_TILE) or 16/32/64/128")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also capture the whole step as a CUDA graph and time its replays (CUDA, prototype)")
    p.add_argument("--compile-cache", type=Path, default=None,
                   help="portable compile cache directory: loaded before the first step, saved after it")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tiny = args.shape == "tiny"
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 5)
    args.steps = args.steps if args.steps is not None else (3 if tiny else 30)
    backends = ["flex", "sdpa"] if args.backend == "both" else [args.backend]
    if args.device == "cpu" and args.backend in ("auto", "both"):
        backends = ["sdpa"]  # flex_attention has no backward on CPU
    results, failures = [], {}
    for b in backends:
        try:
            results += run(args, b)
        except Exception as e:  # report and keep going: one backend failing must not hide the other
            traceback.print_exc()
            failures[b] = f"{type(e).__name__}: {e}"
            if b == "auto" and args.device != "cpu":
                print("auto backend failed; retrying with sdpa", file=sys.stderr)
                results += run(args, "sdpa")
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_step.json").write_text(json.dumps({"results": results, "failures": failures}, indent=2))
    print(f"\n--shape {args.shape}, LM-head products in {args.lm_head}, MLP products in {args.mlp}; "
          "step ms: median of steps timed alone "
          "(synced each); steady: steps back to back, as the trainer runs (tokens/s, TFLOP/s and MFU of those); "
          "loss chunks: LM-head chunks x rows")
    print(f"{'backend':8} {'compiled':>8} {'first step s':>12} {'loss chunks':>11} {'step ms':>9} {'steady ms':>9} "
          f"{'tokens/s':>10} {'TFLOP/step':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'SM MHz':>7}")
    for r in results:
        mem = f"{r['peak_mem_gib']:9.1f}" if r["peak_mem_gib"] is not None else f"{'-':>9}"
        clock = r["steady_gpu_clock"]
        mhz = f"{clock['sm_mhz_median']:7.0f}" if clock else f"{'-':>7}"
        print(f"{r['backend']:8} {str(r['compiled']):>8} {r['first_step_s']:12.1f} {r['loss_chunks']:>11} "
              f"{r['step_ms_median']:9.1f} {r['steady_ms']:9.1f} {r['steady_tokens_per_s']:10.0f} "
              f"{r['tflop_per_step']:10.2f} {r['steady_tflop_per_s']:8.1f} "
              f"{r['steady_tflop_per_s'] * 1e12 / H200_BF16_PEAK:6.1%} {mem} {mhz}")
    timed = [r for r in results if r["breakdown_ms"]]
    if timed:
        print(f"\nwhere the step's time goes (median of {args.breakdown} steps, each synced; backend, loss chunks):")
        print("\n".join(breakdown_table({f"{r['backend']} {r['loss_chunks']}": r["breakdown_ms"] for r in timed})))
        for r in timed:
            print(f"LM head ({r['backend']} {r['loss_chunks']}): {r['lm_head_tflop']:.2f} TFLOP in its two products, "
                  f"{r['lm_head_tflop_per_s']:.0f} TFLOP/s over the LM head + loss phase")
    for b, msg in failures.items():
        print(f"{b:8} FAILED: {msg}")
    return 1 if failures and not results else 0


if __name__ == "__main__":
    sys.exit(main())
