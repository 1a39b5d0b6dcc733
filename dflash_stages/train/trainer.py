"""The training loop behind train:dflash (kept apart from the stage so it reads top to bottom).

:meth:`Trainer.train_step` is the one optimizer step: the loop (:meth:`Trainer.fit`) takes its
steps through it, and so do ``dflash-pipe plan``'s measurement and the benchmarks, so what they
time is the step a run takes.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from dflash_core import StageContext
from dflash_core.artifacts import read_json
from dflash_core.devices import use_device
from dflash_core.facts import snapshot_cadence, tokenizer_metadata
from dflash_core.paths import resolve_path
from dflash_core.resume import PIPELINE_STATE
from dflash_model.drafter import drafter_loss, sample_anchors
from dflash_model.fast import compile_cache, tune_drafter
from dflash_model.fast.compile_gate import GATE
from dflash_model.fast.optim import clipped_step, drafter_optimizer
from dflash_model.fast.settings import compile_wanted, peak_gib
from dflash_model.target.capture import tied
from dflash_model.target.load import resolve_dtype
from dflash_stages.train.config import (TrainConfig, append_metrics, lr_at, metrics_path, now,
                                         truncate_metrics)
from dflash_stages.train.drafter_init import build_drafter

TRAIN_STATE = "train_state.pt"


@dataclass
class StepStats:
    """What one :meth:`Trainer.train_step` did. The tensors stay on the device (reading them back
    would make the host wait for the GPU every step); ``Trainer._log`` syncs once per window."""

    rows: int
    """Rows trained on: ``rows_per_step``, fewer only for a stream's last, partial step."""
    tokens: int
    row_stats: list[dict[str, torch.Tensor]]
    """Per row that had anchors: ``loss``, ``acc``, ``tau_sim``, ``tau_serve``, ``per_slot_acc``."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping."""
    lr: float
    """The learning rate the step took."""


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: StageContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.device = use_device(ctx.device)
        self.dtype = resolve_dtype(cfg.dtype, ctx.device)
        self.step = 0
        self.total: int | None = cfg.total_steps or None
        """Optimizer steps the LR schedule spans; learnt from the first row that reports its
        epoch when not configured (None: unknown, the rate stays flat after warmup)."""
        self.data_state: dict[str, Any] = {}
        self.metrics_file = metrics_path(ctx)
        self.tb: Any = None
        self.distributed = ctx.world_size > 1
        self.interrupt_votes: torch.Tensor | None = None
        """Replicas asked to stop by an interrupt, summed by the last step's all-reduce."""

    # ------------------------------------------------------------------ setup
    def setup(self, header: dict[str, Any]) -> None:
        cfg = self.cfg
        self.target = header
        embed, head = header["embed_weight"], header["lm_head_weight"]
        torch.manual_seed(cfg.seed)
        model = build_drafter(header, cfg, self.ctx)
        self.model = model.to(device=self.device, dtype=self.dtype)
        tuned = tune_drafter(self.model, self.device, self.dtype, kernel_options=cfg.flex_kernel_options,
                             tile=cfg.flex_tile, compile=compile_wanted(cfg.compile, self.device),
                             cache_root=cfg.compile_cache, logger=self.ctx.logger)
        self.compiled, self.cache_url = tuned.compiled, tuned.cache_url
        # frozen verifier weights: moved once, shared (tied) when the target ties them
        self.embed = embed.detach().to(self.device, self.dtype)
        self.head = self.embed if tied(embed, head) else head.detach().to(self.device, self.dtype)
        if self.distributed:
            self._init_distributed()
        # after the replicas' weights are made equal: master weights are copied from them
        self.opt = drafter_optimizer(self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.adamw_kernel,
                                     cfg.master_weights)
        if self.ctx.resume_checkpoint:
            self._restore(self.ctx.resume_checkpoint)
        if self.ctx.rank == 0:
            if self.ctx.resume_checkpoint:  # the steps after the checkpoint are logged again
                truncate_metrics(self.metrics_file, self.step)
            elif "://" not in self.metrics_file and os.path.exists(self.metrics_file):
                os.remove(self.metrics_file)
        self._open_tensorboard()

    def _init_distributed(self) -> None:
        import torch.distributed as dist

        from dflash_core import remote

        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        # the replicas of this stage: all ranks, or the drafter ranks of a fan-in layout
        self.group = remote.group(self.ctx.ranks)
        first = self.ctx.ranks[0] if self.ctx.ranks else 0
        for p in self.model.parameters():  # identical start on every replica
            dist.broadcast(p.data, src=first, group=self.group)

    def _open_tensorboard(self) -> None:
        if self.ctx.rank != 0 or "://" in self.ctx.run_dir:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard not installed: JSONL metrics only
            return
        # resumed: hide what the earlier run logged after the checkpoint (it is logged again)
        purge = self.step + 1 if self.ctx.resume_checkpoint else None
        self.tb = SummaryWriter(os.path.join(self.ctx.run_dir, "tensorboard"), purge_step=purge)

    def _restore(self, ckpt: str) -> None:
        import fsspec

        with fsspec.open(f"{ckpt}/{TRAIN_STATE}", "rb") as f:
            saved = torch.load(f, map_location="cpu", weights_only=True)
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["optimizer"])
        self.step = int(saved["step"])
        # the data cursors saved with it, kept until a row moves them: a snapshot before any
        # new row (nothing left to train) must not drop them
        cursors = read_json(f"{ckpt}/{PIPELINE_STATE}") or {}
        self.data_state = {stage: st for stage, st in cursors.items() if stage != self.ctx.stage}
        rank = self.ctx.rank
        if rank != 0:
            with fsspec.open(f"{ckpt}/rng.rank{rank}.pt", "rb") as f:
                saved = torch.load(f, map_location="cpu", weights_only=True)
        torch.set_rng_state(saved["rng"][str(rank)]["cpu"])
        self.ctx.logger.info("resumed from %s at step %d", ckpt, self.step)

    # ------------------------------------------------------------------- loop
    def total_steps(self, row: dict[str, Any]) -> int | None:
        """Steps of the whole run from the pack stage's epoch plan (``cfg.total_steps`` unset)."""
        per_epoch, epochs = row.get("rows_per_epoch"), row.get("epochs")
        if per_epoch and epochs:
            return max(1, int(per_epoch) * int(epochs) * self.fan_in() // self.cfg.rows_per_step)
        return None

    def fan_in(self) -> int:
        """Producer ranks feeding each replica of this stage (N/M in an N -> M fan-in, else 1):
        the rows per epoch a row reports are its producer rank's share. The engine computes it."""
        return self.ctx.fan_in.get("features", 1)

    def limit_reached(self) -> bool:
        return bool(self.cfg.total_steps) and self.step >= self.cfg.total_steps

    def interrupt_here(self, boundary: bool) -> bool:
        """Stop for an interrupt after this step? Only where one data cursor fits every producer
        rank (``boundary``), and on every replica alike: one that stopped alone would leave the
        others waiting in the next all-reduce."""
        if not boundary:
            return False
        if self.interrupt_votes is not None:
            return bool(self.interrupt_votes.item() > 0)
        return self.ctx.interrupted()

    def snapshot_every(self) -> int:
        """Steps between snapshots: ``checkpoint_every``, else the cadence the consumers (the
        checkpoint stage) publish to this stage."""
        return self.cfg.checkpoint_every or snapshot_cadence(self.ctx.consumer_facts)

    def fit(self, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Train on the stream of feature rows, ``rows_per_step`` rows a step, until it ends, the
        step limit or an interrupt; logs, and yields the snapshots to checkpoint (the last one
        always)."""
        cfg, ctx = self.cfg, self.ctx
        every = self.snapshot_every()
        fan_in, rows_done = self.fan_in(), self.step * cfg.rows_per_step
        if fan_in > 1 and every and (every * cfg.rows_per_step) % fan_in:
            raise ValueError(
                f"{fan_in} producer ranks feed each drafter replica: checkpoints must fall where each "
                f"has sent as many rows, so every_steps x rows_per_step ({every} x {cfg.rows_per_step}) "
                f"must be a multiple of {fan_in}")
        window: list[dict[str, torch.Tensor]] = []
        interrupted, grad_norm = False, None
        self.started, self.tokens_seen = now(), 0
        t0, window_from, step_from = now(), 0, 0  # where the log window / the step began
        if self.step:  # resumed: the display counts on from the checkpoint's step
            ctx.progress(0, total=cfg.total_steps, unit="steps", start=self.step)
        feed = iter(rows)
        while not self.limit_reached():
            step_rows = _StepRows(feed, cfg.rows_per_step)
            done = self.train_step(step_rows)
            if done is None:  # the stream ended on a step boundary
                break
            self.tokens_seen += done.tokens
            window += done.row_stats
            grad_norm = done.grad_norm
            if done.rows < cfg.rows_per_step:  # the stream ended within this last, partial step
                break
            rows_done += cfg.rows_per_step
            if rows_done % fan_in == 0:  # every producer rank has sent as many rows: one state fits all
                self.data_state = _row_state(step_rows.last)
            if self.step == 1:
                self.save_compile_cache()  # everything is compiled by now
            ctx.progress(1, total=self.total, unit="steps", tokens=self.tokens_seen - step_from)
            step_from = self.tokens_seen
            if self.step % cfg.log_every == 0 or self.step == self.total:
                self._log(window, grad_norm, done.lr, (self.tokens_seen - window_from) / max(now() - t0, 1e-9))
                window, window_from, t0 = [], self.tokens_seen, now()
            if every and self.step % every == 0:
                yield self.snapshot(final=False)
            if self.interrupt_here(rows_done % fan_in == 0):
                interrupted = True
                break
        if not self.step:  # a drafter that never stepped would be exported as if trained
            raise ValueError("train: no feature rows reached it, so no optimizer step was taken; "
                             "the upstream stages kept nothing (see their counts: tokenize's "
                             "samples_out, pack's rows)")
        if window:
            self._log(window, grad_norm, lr_at(self.step, self.total, cfg),
                      (self.tokens_seen - window_from) / max(now() - t0, 1e-9))
        ctx.summary.update(steps=self.step, peak_gib=peak_gib(self.device))
        if interrupted:
            ctx.summary["interrupted_at"] = self.step
        if self.distributed:
            self._check_replicas()
        if self.tb is not None:
            self.tb.close()
        yield self.snapshot(final=not interrupted, interrupted=interrupted)

    def train_step(self, rows: Iterable[dict[str, Any]]) -> StepStats | None:
        """One optimizer step, as training takes it: forward and backward of each feature row
        (extract's rows: ``features``, ``input_ids``, ``position_ids``, ``loss_mask``,
        ``doc_lengths``, optionally ``last_hidden``), their gradients averaged across the replicas,
        clip and AdamW at the schedule's rate, then ``step`` + 1.

        ``rows``: at most ``rows_per_step`` rows, read one at a time (each row's features can be
        freed once its backward is done); fewer only for a stream's last, partial step. Each row's
        anchors are drawn from (seed, step, its slot in the global batch), so the same rows at the
        same step give the same weights however they are fed. Returns None, and takes no step,
        when ``rows`` is empty. Call after :meth:`setup`."""
        cfg = self.cfg
        row_stats: list[dict[str, torch.Tensor]] = []
        count = tokens = 0
        for micro, row in enumerate(rows):
            if micro == cfg.rows_per_step:
                raise ValueError(f"train_step: more than rows_per_step ({cfg.rows_per_step}) rows")
            self.total = self.total or self.total_steps(row)
            n = int(row["features"].shape[0])
            with GATE.call(self.ctx.stage, n, self.compiled):  # a new length may compile (forward, backward)
                stats = self._forward_backward(row, micro)
            count, tokens = micro + 1, tokens + n
            if stats is not None:
                row_stats.append(stats)
        if not count:
            return None
        grad_norm, lr = self._optimizer_step(self.total)
        self.step += 1
        return StepStats(rows=count, tokens=tokens, row_stats=row_stats, grad_norm=grad_norm, lr=lr)

    def save_compile_cache(self) -> str | None:
        """Save everything this process has compiled to the compile cache (once the first step
        has compiled it all), on rank 0 only; the URL written, or None (no cache to write, it was
        loaded warm, another rank, or nothing compiled)."""
        if not self.cache_url or self.ctx.rank != 0:
            return None
        return self.cache_url if compile_cache.save(self.cache_url, self.ctx.logger) else None

    def _forward_backward(self, row: dict[str, Any], micro: int) -> dict[str, torch.Tensor] | None:
        cfg = self.cfg
        features = _borrow(row["features"], self.device)
        loss_mask = torch.as_tensor(row["loss_mask"]).to(torch.long)
        # seeded by the row's place in the global batch: one process with rows_per_step=R
        # draws the same anchors as R ranks with one row each
        slot = self.ctx.rank * cfg.rows_per_step + micro
        gen = torch.Generator().manual_seed(hash((cfg.seed, self.step, slot)) & 0x7FFFFFFFFFFFFFFF)
        anchors = sample_anchors(loss_mask, row["doc_lengths"], cfg.num_anchors, gen)
        if anchors.numel() == 0:
            return None
        last = row.get("last_hidden")
        out = drafter_loss(
            self.model, features, torch.as_tensor(row["input_ids"]).long(), loss_mask,
            torch.as_tensor(row["position_ids"]).long(), row["doc_lengths"], anchors,
            self.embed, self.head, gamma=cfg.gamma, target=cfg.loss_target,
            target_hidden=None if last is None else _borrow(last, self.device),
            chunk_rows=cfg.chunk_rows, pad_anchors_to=cfg.num_anchors if cfg.pad_anchors else None,
            compile_loss=self.compiled)
        (out.loss / cfg.rows_per_step).backward()
        # tensors, not floats: reading them back would stall the GPU every row; _log syncs once
        return {"loss": out.loss.detach(), "acc": out.acc, "tau_sim": out.tau_sim, "tau_serve": out.tau_serve,
                "per_slot_acc": out.per_slot_acc}

    def _optimizer_step(self, total: int | None) -> tuple[torch.Tensor, float]:
        params = [p for p in self.model.parameters()]
        if self.distributed:
            import torch.distributed as dist

            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            # the replicas' interrupt votes ride along: every one learns of an interrupt at once
            vote = torch.tensor([float(self.ctx.interrupted())], device=grads[0].device)
            flat = torch.cat([g.reshape(-1).float() for g in grads] + [vote])
            dist.all_reduce(flat, group=self.group)
            self.interrupt_votes = flat[-1].clone()  # not a view: flat is freed
            flat /= self.ctx.world_size
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
                offset += n
        lr = lr_at(self.step, total, self.cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        grad_norm = clipped_step(self.opt, self.cfg.grad_clip)
        self.opt.zero_grad(set_to_none=True)
        return grad_norm, lr

    def _check_replicas(self) -> None:
        """Data-parallel replicas must end with equal weights: compare every rank's weights_digest
        (32 bytes each move, not the weights) and put the verdict in the summary."""
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(weights_digest(self.model)), dtype=torch.uint8).to(self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        distinct = len({bytes(d.cpu().tolist()) for d in every})
        self.ctx.summary.update(replicas=len(every), replicas_equal=distinct == 1)
        if distinct > 1:
            self.ctx.logger.error("the %d drafter replicas differ after %d steps (%d distinct weight sets)",
                                  len(every), self.step, distinct)

    def _log(self, window: list[dict[str, torch.Tensor]], grad_norm: torch.Tensor | float, lr: float,
             tps: float) -> None:
        if not window:
            return
        means = torch.stack([torch.stack([w[k].double().cpu() for k in ("loss", "acc", "tau_sim", "tau_serve")])
                             for w in window]).mean(0).tolist()  # the one host sync of the window
        record = {"step": self.step, "loss": means[0], "acc": means[1], "tau_sim": means[2], "tau_serve": means[3],
                  "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tps,
                  "tokens": self.tokens_seen, "elapsed_s": now() - self.started, "time": time.time(),
                  "per_slot_acc": [round(a, 4) for a in window[-1]["per_slot_acc"].tolist()]}
        self.ctx.summary.update(loss=round(record["loss"], 4), tau_sim=round(record["tau_sim"], 3),
                                acc=round(record["acc"], 4))
        shown = ("step", "loss", "acc", "tau_sim", "lr", "grad_norm", "tokens_per_s")  # step: trackers' x axis
        self.ctx.emit({"type": "metrics", **{k: record[k] for k in shown}})
        if self.ctx.rank == 0:
            append_metrics(self.metrics_file, record)
            if self.tb is not None:
                for key in ("loss", "acc", "tau_sim", "tau_serve", "lr", "grad_norm", "tokens_per_s"):
                    self.tb.add_scalar(f"train/{key}", record[key], self.step)

    # -------------------------------------------------------------- snapshots
    def snapshot(self, final: bool, interrupted: bool = False) -> dict[str, Any]:
        """Everything a checkpoint needs, copied to CPU so training can go on meanwhile."""
        tok = tokenizer_metadata(self.ctx.upstream_facts)  # what the tokenize stage upstream published
        rng = {"cpu": torch.get_rng_state()}
        return {
            "kind": "state", "step": self.step, "final": final, "interrupted": interrupted,
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "model": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(self.opt.state_dict()),
            "rng": rng,
            "drafter_config": self.model.config,
            "pipeline_state": {self.ctx.stage: {"step": self.step}, **self.data_state},
            "metrics_file": self.metrics_file,
            "metadata": {"target": self.target["model"], "tokenizer": tok.get("tokenizer"),
                         "thinking": tok.get("thinking"),
                         "chat_template_kwargs": tok.get("chat_template_kwargs") or {},
                         "heldout": resolve_path(self.cfg.heldout, os.getcwd()) if self.cfg.heldout else None,
                         "metrics": resolve_path(self.metrics_file, os.getcwd()), "step": self.step},
        }


def weights_digest(model: torch.nn.Module) -> bytes:
    """SHA-256 of every parameter's bytes in order: equal exactly when the weights are."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.digest()


def _borrow(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without a host sync, safe to drop right after.

    The producer (extract) allocated ``t`` on its own CUDA stream; this step reads it on the
    current stream (a peer copy runs on the source device's current stream). Nothing waits for that
    read before the row is dropped, so the allocator is told about it, or extract could reuse the
    memory for a later row while the read is still queued."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))
    return t.to(device, non_blocking=True)


class _StepRows:
    """The next (at most) ``n`` rows of a stream, handed on one at a time; remembers the last."""

    def __init__(self, feed: Iterator[dict[str, Any]], n: int) -> None:
        self.feed, self.n = feed, n
        self.last: dict[str, Any] = {}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for row in itertools.islice(self.feed, self.n):
            self.last = row
            yield row


def _row_state(row: dict[str, Any]) -> dict[str, Any]:
    """The data position after this row, keyed by the stage that produced it (pack)."""
    state, stage = row.get("state"), row.get("state_stage")
    return {stage: state} if state is not None and stage else {}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
