"""What train:dflash is configured by, and the small helpers its stage and its trainer share:
the learning-rate schedule and the metrics file.

Kept apart from the stage and the trainer so that neither imports the other, and so that a
pipeline file's ``train`` params are checked without importing torch.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, get_args

from dflash_core import StageContext
from dflash_core.artifacts import join
from dflash_core.paths import PATH_FIELD
from dflash_model.fast.settings import AttnBackend, CompileSetting, DtypeName, WarmUpSetting, check_switch

AdamWKernel = Literal["auto", "triton", "torch"]
ADAMW_KERNELS = get_args(AdamWKernel)
LossTarget = Literal["data", "target_argmax", "kl"]
ProductDtype = Literal["model", "fp8"]
FlexTile = Literal["auto", 16, 32, 64, 128]


@dataclass
class DrafterAttention:
    """Explicit draft-layer attention, over what ``drafter_shape`` chose (unset fields keep it)."""

    num_attention_heads: int | None = field(default=None, metadata={"help": "query heads"})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "key/value heads (GQA)"})
    head_dim: int | None = field(default=None, metadata={"help": "size of one head"})
    rope_theta: float | None = field(default=None, metadata={
        "help": "plain full-rotary RoPE at this base (replaces the chosen RoPE)"})


@dataclass
class TrainConfig:
    """The drafter's shape, the optimizer and schedule, and how the step is computed."""

    num_layers: int = field(default=5, metadata={"help": "draft layers"})
    block_size: int = field(default=16, metadata={
        "help": "tokens per block: the anchor and the block_size - 1 tokens drafted after it"})
    num_anchors: int = field(default=512, metadata={"help": "anchors (blocks) per row"})
    lr: float = field(default=6e-4, metadata={"help": "peak AdamW learning rate"})
    warmup_ratio: float = field(default=0.04, metadata={
        "help": "share of the steps spent warming up linearly, before the cosine decay to 0"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's decoupled weight decay"})
    grad_clip: float | None = field(default=1.0, metadata={
        "help": "clip gradients to this global L2 norm; null or 0 = no clip"})
    adamw_kernel: AdamWKernel = field(default="auto", metadata={
        "help": "AdamW step: triton (CUDA; fewer passes over the weights than torch's) | torch (fused) | "
                "auto = triton when the drafter is on CUDA and triton is installed"})
    master_weights: bool = field(default=True, metadata={
        "help": "keep float32 master weights and moments when the drafter computes in bf16 / fp16 (off: "
                "AdamW updates the low-precision weights in place, and updates below their precision are lost)"})
    rows_per_step: int = field(default=1, metadata={"help": "rows per optimizer step (per rank)"})
    steps_per_row: int = field(default=1, metadata={
        "help": "optimizer steps on each row's features, each on its own num_anchors anchors of the row "
                "(disjoint draws): more steps and anchors for one target forward; needs rows_per_step 1"})
    total_steps: int | None = field(default=None, metadata={
        "help": "stop after this many optimizer steps (or sooner, when the data runs out); the "
                "warmup and decay span it. Default: the pack stage's rows per epoch x epochs"})
    dtype: DtypeName = field(default="auto", metadata={"help": "auto = bf16 on CUDA, float32 on CPU"})
    lm_head_dtype: ProductDtype = field(default="model", metadata={
        "help": "the loss's LM-head products: model = in the drafter's dtype; fp8 = through an e4m3 copy of the "
                "frozen head (row-wise scales, torch._scaled_mm; fast on FP8 tensor cores; vocabulary and hidden "
                "size must be multiples of 16). 10% off the 27B-shape step; with mlp_dtype fp8 too, no loss of served "
                "tau measured (docs/fp8_target.md); the production file sets both"})
    mlp_dtype: ProductDtype = field(default="model", metadata={
        "help": "the draft layers' MLP products while training: model = in the drafter's dtype; fp8 = the forward "
                "and the input gradient through FP8 (each weight quantized row-wise at every step; the weight "
                "gradient and the weights themselves stay in the drafter's dtype; hidden and intermediate sizes "
                "multiples of 16). Exports are the same either way; with lm_head_dtype fp8 too, no loss of served "
                "tau measured (docs/fp8_target.md)"})
    loss_target: LossTarget = field(default="data", metadata={
        "help": "what each slot learns: data = the row's own tokens; target_argmax = the target's "
                "greedy token; kl = the target's distribution (both need extract's last_hidden)"})
    gamma: float | None = field(default=None, metadata={
        "help": "decay of the loss weight along the block, exp(-(k-1)/gamma) for slot k; default "
                "by block size (7 for 16, 5 for 10, 4 for 8)"})
    mask_token_id: int | None = field(default=None, metadata={
        "help": "default: the published drafter's for the target's family (drafter_shape), else "
                "the first unused embedding row of the target"})
    drafter_shape: Literal["auto", "target", "published"] = field(default="auto", metadata={
        "help": "draft layers' attention and RoPE: target = the target's own attention layer; "
                "published = the published drafter of the target's family (Qwen3.5/3.6: 32 q / 8 kv "
                "heads x 128, full rotary, rope_theta 1e7, mask token 248070); auto = published "
                "where the family has one, else target (docs/drafter.md)"})
    drafter_attention: DrafterAttention | None = field(default=None, metadata={
        "help": "explicit num_attention_heads / num_key_value_heads / head_dim / rope_theta over "
                "drafter_shape's"})
    intermediate_size: int | None = field(default=None, metadata={
        "help": "the draft layers' MLP width; None: the target's (a wider or narrower MLP changes what "
                "the drafter can fit, and serving engines read it from the export's config.json)"})
    init_from: str | None = field(default=None, metadata={
        **PATH_FIELD, "help": "an exported drafter (directory or URL, z-lab format) to start from instead of "
                "random weights; its hidden size, vocab, target layers, block size and layer count "
                "must match this run"})
    attn_backend: AttnBackend = field(default="auto", metadata={
        "help": "the draft layers' attention: flex (flex_attention, a block mask) | sdpa (a dense "
                "mask) | auto = flex on CUDA, sdpa elsewhere"})
    seed: int = field(default=0, metadata={"help": "weights' initialisation and anchor draws"})
    log_every: int = field(default=10, metadata={
        "help": "steps per metrics record (log line, metrics.jsonl, TensorBoard)"})
    checkpoint_every: int = field(default=0, metadata={
        "help": "snapshot cadence; 0 = the checkpoint stage's every_steps"})
    chunk_rows: int = field(default=4096, metadata={
        "help": "LM-head rows per loss chunk: memory (a [chunk, vocab] block of logits) vs the LM head's "
                "re-reads, one per chunk (4096: 2 chunks a row at 512 anchors x 16)"})
    compile: CompileSetting = field(default="auto", metadata={
        "help": "torch.compile the draft layers, fuse the loss chunks: auto (on CUDA) | on | off"})
    warm_up: WarmUpSetting = field(default="auto", metadata={
        "help": "when every row has one length (pack pads rows to tokens_per_row), take a step's forward and "
                "backward on random tokens of that length before the first row (its gradients dropped), so "
                "that its compile overlaps the stages upstream: auto (where the step compiles) | on | off"})
    compile_cache: str | None = field(default="~/.cache/dflash-pipe/compile", metadata={
        **PATH_FIELD, "help": "path or URL where compiled kernels are kept across runs and machines; null = off"})
    flex_kernel_options: dict[str, Any] | Literal["auto"] | None = field(default="auto", metadata={
        "help": "Triton options for the drafter's flex attention (e.g. bwd_BLOCK_M1): auto = the ones "
                "measured fastest on this GPU kind if known (benchmarks/flex_tune.py), null = torch's "
                "defaults, or a mapping"})
    flex_tile: FlexTile = field(default="auto", metadata={
        "help": "the flex attention BlockMask's tile (a power of two, 16-128): auto = the one measured "
                "fastest on this GPU kind if known and torch allows it, else 128"})
    pad_anchors: bool = field(default=True, metadata={
        "help": "pad rows with fewer anchor candidates to num_anchors (fixed shapes, no recompiles)"})
    heldout: str | None = field(default=None, metadata={
        **PATH_FIELD, "help": "JSONL of held-out records, recorded in the export for 'dflash-pipe evaluate'"})
    validation_share: float = field(default=0.0, metadata={
        "help": "share of the documents never trained on, chosen by a hash of their tokens (the same ones in "
                "every epoch, on every rank): the drafter is measured on them without a gradient, logged as "
                "val_loss, val_acc, val_tau_sim and val_tau_serve, what it does on text it has not seen; 0 = off"})
    validation_max_new_tokens: int | None = field(default=None, metadata={
        "help": "val_tau_serve walks at most this many tokens of each validation response, as a decode "
                "with evaluate's max_new_tokens would (set the two alike to read one against the other); "
                "None: each whole response"})

    def __post_init__(self) -> None:
        if isinstance(self.drafter_attention, Mapping):  # built in code rather than from a file
            self.drafter_attention = DrafterAttention(**self.drafter_attention)
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1 (or null), got {self.intermediate_size}")
        for name in ("lm_head_dtype", "mlp_dtype"):
            if getattr(self, name) not in get_args(ProductDtype):
                raise ValueError(f"{name} must be model or fp8, got {getattr(self, name)!r}")
        if self.loss_target not in get_args(LossTarget):
            raise ValueError("loss_target must be data, target_argmax or kl")
        check_switch("compile", self.compile)
        check_switch("warm_up", self.warm_up)
        if self.adamw_kernel not in ADAMW_KERNELS:  # (optim.KERNELS, named here so configs load without torch)
            raise ValueError(f"adamw_kernel must be one of {', '.join(ADAMW_KERNELS)}, got {self.adamw_kernel!r}")
        if isinstance(self.flex_kernel_options, str) and self.flex_kernel_options != "auto":
            raise ValueError("flex_kernel_options must be auto, null or a mapping")
        if isinstance(self.flex_tile, bool) or self.flex_tile not in get_args(FlexTile):
            raise ValueError(f"flex_tile must be auto, 16, 32, 64 or 128, got {self.flex_tile!r}")
        if self.rows_per_step < 1 or self.steps_per_row < 1:
            raise ValueError("rows_per_step and steps_per_row must be >= 1")
        if self.rows_per_step > 1 and self.steps_per_row > 1:
            raise ValueError("rows_per_step > 1 (several rows a step) and steps_per_row > 1 (several steps "
                             "a row) exclude each other: set one of them to 1")
        if self.block_size < 2 or self.num_layers < 1 or self.num_anchors < 1:
            raise ValueError("block_size >= 2, num_layers >= 1 and num_anchors >= 1 are required")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ValueError("grad_clip must be a positive norm, or null / 0 for no clip")
        if not 0.0 <= self.validation_share < 1.0:
            raise ValueError(f"validation_share must be in [0, 1), got {self.validation_share}")
        if self.validation_max_new_tokens is not None and self.validation_max_new_tokens < 1:
            raise ValueError(f"validation_max_new_tokens must be >= 1 or None, got {self.validation_max_new_tokens}")


def lr_at(step: int, total: int | None, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_ratio`` of the steps, then cosine to zero.
    Without a known total the rate stays at ``lr`` after a 100-step warmup."""
    warmup = max(1, round(cfg.warmup_ratio * total)) if total else 100
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if not total:
        return cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def metrics_path(ctx: StageContext) -> str:
    """Where the metrics JSONL goes: beside the run (a local path) or in the stage's work dir."""
    return join(ctx.run_dir if "://" not in ctx.run_dir else ctx.work_dir, "metrics.jsonl")


def append_metrics(path: str, record: dict[str, Any]) -> None:
    if "://" in path:
        return  # object stores cannot append; the checkpoint stage uploads the local copy
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(path: str, step: int) -> None:
    """Keep the records of steps up to ``step`` (and no half-written line): a run resumed from
    the checkpoint of ``step`` logs the later steps again, and each step is to appear once."""
    if "://" in path or not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line.rstrip("\n") + "\n" for line in f if _record_step(line) <= step]
    with open(f"{path}.tmp", "w") as f:
        f.writelines(kept)
    os.replace(f"{path}.tmp", path)


def _record_step(line: str) -> float:
    """The step of a metrics line; infinity for a line that is not a whole record."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def now() -> float:
    return time.perf_counter()
