"""The training loop behind train:dflash (kept apart from the stage so it reads top to bottom).

:meth:`Trainer.train_step` is the one optimizer step: the loop (:meth:`Trainer.fit`) takes its
steps through it, and so do ``dflash-pipe plan``'s measurement and the benchmarks, so what they
time is the step a run takes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import torch

from dflash_core import StageContext
from dflash_core.artifacts import read_json
from dflash_core.devices import use_device
from dflash_core.facts import tokenizer_metadata
from dflash_core.paths import resolve_path
from dflash_core.resume import PIPELINE_STATE
from dflash_model.drafter import FeatureBatch, LossOutput, anchor_candidates, drafter_loss, sample_anchor_shares
from dflash_model.drafter.anchors import resolve_doc_ids
from dflash_model.drafter.fp8_head import FP8LMHead
from dflash_model.fast import compile_cache, tune_drafter
from dflash_model.fast.compile_gate import GATE
from dflash_model.fast.optim import clipped_step, drafter_optimizer
from dflash_model.fast.settings import compile_wanted, peak_gib
from dflash_model.target.capture import tied
from dflash_model.target.load import resolve_dtype
from dflash_stages.train.config import TrainConfig, lr_at, now
from dflash_stages.train.drafter_init import build_drafter
from dflash_stages.train.metrics import VAL_MEANS, MetricsLog, ServedWalk
from dflash_stages.train.snapshots import SnapshotPolicy

TRAIN_STATE = "train_state.pt"


def validation_tokens(batch: FeatureBatch, share: float) -> torch.Tensor | None:
    """[T] True on the tokens of ``batch``'s validation documents, or None where it has none. A
    document is one when the hash of its tokens falls below ``share``: it depends on nothing but the
    document, so it is one in every epoch, in any row, on every rank, and in every run."""
    ids = batch.input_ids.numpy()
    held = torch.zeros(len(ids), dtype=torch.bool)
    start = 0
    for n in (int(n) for n in batch.doc_lengths):
        digest = hashlib.blake2b(ids[start:start + n].tobytes(), digest_size=8).digest()
        if int.from_bytes(digest, "little") < share * 2 ** 64:
            held[start:start + n] = True
        start += n
    return held if bool(held.any()) else None


def supervised_spans(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of supervised tokens that stays within one document."""
    on = loss_mask.bool()
    same = doc_ids[1:] == doc_ids[:-1]
    no = on.new_zeros(1)
    starts = on & ~(torch.cat([no, on[:-1] & same]))
    ends = on & ~(torch.cat([on[1:] & same, no]))
    return list(zip(starts.nonzero().squeeze(1).tolist(), (ends.nonzero().squeeze(1) + 1).tolist()))


def _row_stats(out: LossOutput) -> dict[str, torch.Tensor]:
    """What a row's loss adds to the metrics window (``MEANS``). Tensors, not floats: reading them
    back would stall the GPU every row (MetricsLog reads a window at once)."""
    return {"loss": out.loss.detach(), "acc": out.acc, "tau_sim": out.tau_sim, "tau_serve": out.tau_serve}


def _unmarked(_phase: str) -> None:
    """A step's phase marks when nobody times its phases (training)."""


@dataclass
class StepStats:
    """What one :meth:`Trainer.train_step` did. The tensors stay on the device (reading them back
    would make the host wait for the GPU every step); :class:`MetricsLog` reads them once a window."""

    rows: int
    """Rows trained on: ``rows_per_step``, fewer only for a stream's last, partial step."""
    tokens: int
    row_stats: list[dict[str, torch.Tensor]]
    """Per row that had anchors: ``loss``, ``acc``, ``tau_sim``, ``tau_serve``, ``per_slot_acc``."""
    anchors: list[torch.Tensor]
    """Each row's anchors (host tensors, empty where a row had none): what the FLOP model reads."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping."""
    lr: float
    """The learning rate the step took."""
    val_stats: list[dict[str, Any]] = field(default_factory=list)
    """Per row with validation documents (``validation_share``), at its first step: their ``loss``,
    ``acc``, ``tau_sim`` and ``walk`` (a :class:`ServedWalk`), measured without a gradient."""


class Trainer:
    """Trains the drafter of one replica. Its components, built by :meth:`setup`: ``model`` (the
    drafter, tuned and maybe compiled), ``opt`` (AdamW, float32 master weights below float32),
    the LR schedule (:func:`lr_at` of ``step`` and ``total``), ``data_state`` (the upstream
    stages' cursors, saved with each snapshot) and ``metrics`` (:class:`MetricsLog`). Its state
    is :meth:`state_dict`; :meth:`fit` is the loop, :meth:`train_step` the step."""

    def __init__(self, cfg: TrainConfig, ctx: StageContext, compile_options: dict[str, Any] | None = None) -> None:
        """``compile_options``: ``torch.compile`` options for the draft layers, which runs leave
        at Inductor's defaults (``benchmarks/train_step.py --inductor`` tries others)."""
        self.cfg, self.ctx = cfg, ctx
        self.compile_options = compile_options
        self.device = use_device(ctx.device)
        self.dtype = resolve_dtype(cfg.dtype, ctx.device)
        self.step = 0
        self.total: int | None = cfg.total_steps or None
        """Optimizer steps the LR schedule spans; learnt from the first row that reports its
        epoch when not configured (None: unknown, the rate stays flat after warmup)."""
        self.data_state: dict[str, Any] = {}
        self.metrics = MetricsLog(ctx, cfg.log_every)
        self.distributed = ctx.world_size > 1
        self.interrupt_votes: torch.Tensor | None = None
        """Replicas asked to stop by an interrupt, summed by the last step's all-reduce."""
        self.created = now()
        """When the stage started, as far as the trainer can tell: what ``first_row_s`` and
        ``first_step_s`` count from."""
        self.validation_party = f"{ctx.stage}:validate"
        """The compile gate's party of the no-grad validation (:meth:`_validate`): it compiles
        graphs of its own, apart from the training step's."""

    # ------------------------------------------------------------------ setup
    def setup(self, header: dict[str, Any]) -> None:
        cfg = self.cfg
        self.target = header
        embed, head = header["embed_weight"], header["lm_head_weight"]
        torch.manual_seed(cfg.seed)
        model = build_drafter(header, cfg, self.ctx)
        if cfg.mlp_dtype == "fp8":  # before tune_drafter compiles the layers
            model.use_fp8_mlp()
        self.model = model.to(device=self.device, dtype=self.dtype)
        tuned = tune_drafter(self.model, self.device, self.dtype, kernel_options=cfg.flex_kernel_options,
                             tile=cfg.flex_tile, compile=compile_wanted(cfg.compile, self.device),
                             cache_root=cfg.compile_cache, logger=self.ctx.logger,
                             compile_options=self.compile_options)
        self.compiled, self.cache_url, self.cache_loaded = tuned.compiled, tuned.cache_url, tuned.cache_loaded
        # frozen verifier weights: moved once, shared (tied) when the target ties them
        self.embed = embed.detach().to(self.device, self.dtype)
        self.head = self.embed if tied(embed, head) else head.detach().to(self.device, self.dtype)
        if cfg.lm_head_dtype == "fp8":  # the loss's products only: embed stays as it is
            self.head = FP8LMHead(self.head)
        if self.distributed:
            self._init_distributed()
        # after the replicas' weights are made equal: master weights are copied from them
        self.opt = drafter_optimizer(self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.adamw_kernel,
                                     cfg.master_weights)
        ckpt = self.ctx.resume_checkpoint
        if ckpt:
            self.load_state_dict(read_checkpoint(ckpt, self.ctx.rank))
            self.ctx.logger.info("resumed from %s at step %d", ckpt, self.step)
        self.metrics.open(self.step, resumed=bool(ckpt))

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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What it takes to go on exactly from here: the drafter's weights, the optimizer's
        moments, the step (the LR schedule is a function of it), this process's RNG and the
        upstream stages' data cursors. Live tensors: :meth:`snapshot` copies them."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                "rng": {"cpu": torch.get_rng_state()}, "data": dict(self.data_state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`'s, or :func:`read_checkpoint`'s). Its data
        cursors are kept until a row moves them: a snapshot taken before any new row (nothing
        left to train) must not drop them."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"]["cpu"])
        self.data_state = {stage: st for stage, st in state["data"].items() if stage != self.ctx.stage}

    # ------------------------------------------------------------------- loop
    def total_steps(self, row: dict[str, Any]) -> int | None:
        """Steps of the whole run from the pack stage's epoch plan (``cfg.total_steps`` unset)."""
        per_epoch, epochs = row.get("rows_per_epoch"), row.get("epochs")
        if per_epoch and epochs:
            cfg = self.cfg
            return max(1, int(per_epoch) * int(epochs) * self.fan_in() * cfg.steps_per_row // cfg.rows_per_step)
        return None

    def epoch_steps(self, row: dict[str, Any]) -> float | None:
        """Optimizer steps one epoch of the pack stage's plan takes (None: the row has no plan)."""
        per_epoch = row.get("rows_per_epoch")
        cfg = self.cfg
        return int(per_epoch) * self.fan_in() * cfg.steps_per_row / cfg.rows_per_step if per_epoch else None

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

    def snapshot_policy(self) -> SnapshotPolicy:
        """When to snapshot: ``checkpoint_every``, else the cadence the consumers (the checkpoint
        stage) publish to this stage."""
        return SnapshotPolicy.for_trainer(self.cfg.checkpoint_every, self.ctx.consumer_facts,
                                          self.fan_in(), self.cfg.rows_per_step, self.cfg.steps_per_row)

    def fit(self, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Train on the stream of feature rows, ``rows_per_step`` rows a step (or each row for
        ``steps_per_row`` steps), until it ends, the step limit or an interrupt; logs, and yields
        the snapshots to checkpoint (the last one always)."""
        cfg, ctx = self.cfg, self.ctx
        policy = self.snapshot_policy()
        interrupted = False
        self.metrics.start()
        if self.step:  # resumed: the display counts on from the checkpoint's step
            ctx.progress(0, total=cfg.total_steps, unit="steps", start=self.step)
        feed = _each_row_repeated(self._first_row_noted(rows), cfg.steps_per_row)
        first = True
        while not self.limit_reached():
            step_rows = _StepRows(feed, cfg.rows_per_step)
            done = self.train_step(step_rows)
            if done is None:  # the stream ended on a step boundary
                break
            if first:
                first = False
                self._note_time("first_step_s", "its first step done")
            self.metrics.add(done, step_rows.waited)
            if done.rows < cfg.rows_per_step:  # the stream ended within this last, partial step
                break
            if policy.boundary(self.step):  # every producer rank has sent as many rows: one state fits all
                self.data_state = _row_state(step_rows.last)
            if self.step == 1:
                self.save_compile_cache()  # everything is compiled by now
            self.metrics.stepped(self.step, self.total, done)
            if policy.due(self.step):
                yield self.snapshot(final=False)
            if self.interrupt_here(policy.boundary(self.step)):
                interrupted = True
                break
        if not self.step:  # a drafter that never stepped would be exported as if trained
            raise ValueError("train: no feature rows reached it, so no optimizer step was taken; "
                             "the upstream stages kept nothing (see their counts: tokenize's "
                             "samples_out, pack's rows)")
        self.metrics.write(self.step, lr_at(self.step, self.total, cfg))
        ctx.summary.update(steps=self.step, peak_gib=peak_gib(self.device))
        if interrupted:
            ctx.summary["interrupted_at"] = self.step
        if self.distributed:
            self._check_replicas()
        self.metrics.close()
        yield self.snapshot(final=not interrupted, interrupted=interrupted)

    def _first_row_noted(self, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """``rows``, noting when the first one came (``first_row_s``)."""
        for i, row in enumerate(rows):
            if i == 0:
                self._note_time("first_row_s", "its first row came")
            yield row

    def _note_time(self, key: str, what: str) -> None:
        """Seconds since the stage started, into the summary as ``key`` and the log: on a cold
        start, the wait for data (first_row_s) and the compile before the first step (the
        difference to first_step_s) read apart."""
        took = round(now() - self.created, 2)
        self.ctx.summary[key] = took
        self.ctx.logger.info("train: %s %.1f s after the stage started", what, took)

    def train_step(self, rows: Iterable[dict[str, Any]], mark: Callable[[str], None] = _unmarked
                   ) -> StepStats | None:
        """One optimizer step, as training takes it: forward and backward of each feature row
        (extract's rows: ``features``, ``input_ids``, ``position_ids``, ``loss_mask``,
        ``doc_lengths``, optionally ``last_hidden``), their gradients averaged across the replicas,
        clip and AdamW at the schedule's rate, then ``step`` + 1.

        ``rows``: at most ``rows_per_step`` rows, read one at a time (each row's features can be
        freed once its backward is done); fewer only for a stream's last, partial step. Each row's
        anchors are drawn from (seed, step, its slot in the global batch), so the same rows at the
        same step give the same weights however they are fed. With ``steps_per_row`` k, the same
        row comes to k steps in a row, and each takes its own share of the row's anchors (its
        tokens count once, at the first). Returns None, and takes no step, when ``rows`` is empty.
        Call after :meth:`setup`.

        ``mark`` is called with "forward" and "backward" after each row's loss and backward, and
        with "optimizer" after the step: where ``benchmarks/step_phases.py`` splits its time."""
        cfg = self.cfg
        row_stats: list[dict[str, torch.Tensor]] = []
        val_stats: list[dict[str, Any]] = []
        drawn: list[torch.Tensor] = []
        count = tokens = 0
        for micro, row in enumerate(rows):
            if micro == cfg.rows_per_step:
                raise ValueError(f"train_step: more than rows_per_step ({cfg.rows_per_step}) rows")
            self.total = self.total or self.total_steps(row)
            self.metrics.epoch_steps = self.metrics.epoch_steps or self.epoch_steps(row)
            batch = FeatureBatch.from_row(row, self.device)
            held = validation_tokens(batch, cfg.validation_share) if cfg.validation_share else None
            if held is not None:  # measured once a row, then left out of what it trains on
                if self.step % cfg.steps_per_row == 0:
                    val_stats += self._validate(replace(batch, loss_mask=batch.loss_mask * held))
                batch = replace(batch, loss_mask=batch.loss_mask * ~held)
            anchors = self._anchors(batch, micro)
            n = int(batch.features.shape[0])
            count, tokens = micro + 1, tokens + (0 if self.step % cfg.steps_per_row else n)
            drawn.append(anchors)
            if anchors.numel() == 0:
                continue
            with GATE.call(self.ctx.stage, n, self.compiled):  # a new length may compile (forward, backward)
                row_stats.append(self._forward_backward(batch, anchors, mark))
        if not count:
            return None
        grad_norm, lr = self._optimizer_step(self.total)
        mark("optimizer")
        self.step += 1
        return StepStats(rows=count, tokens=tokens, row_stats=row_stats, anchors=drawn, grad_norm=grad_norm, lr=lr,
                         val_stats=val_stats)

    def warm_up(self, tokens: int) -> float:
        """Compile the step for rows of ``tokens`` tokens before the first row arrives: the forward
        and backward of one row of random tokens (three documents) and zero features, through the
        compile gate as a row's would go, and with ``validation_share`` the no-grad loss the
        validation takes. Its gradients are dropped; the weights, optimizer state, step and RNG
        that the next steps depend on do not change. Returns the seconds it took (also in the
        summary as ``warm_up_s``)."""
        from dflash_stages.pack.random_rows import warm_up_row

        embed, k = self.target["embed_weight"], len(self.target["target_layer_ids"])
        hidden = int(embed.shape[1])
        row = warm_up_row(self.target, tokens)

        def zeros(width: int) -> torch.Tensor:  # in the target's dtype, as extract's features come
            return torch.zeros(tokens, width, dtype=embed.dtype, device=self.device)

        last = zeros(hidden) if self.cfg.loss_target != "data" else None
        batch = FeatureBatch.from_row(dict(row, features=zeros(k * hidden), last_hidden=last), self.device)
        anchors = self._anchors(batch, 0)
        t0 = now()
        with GATE.call(self.ctx.stage, tokens, self.compiled):
            self._forward_backward(batch, anchors, _unmarked)
        self.opt.zero_grad(set_to_none=True)
        if self.cfg.validation_share:
            with torch.no_grad(), GATE.call(self.validation_party, tokens, self.compiled):
                self._loss(batch, anchors)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = round(now() - t0, 2)
        self.ctx.summary["warm_up_s"] = took
        self.ctx.logger.info("train: warmed up for %d-token rows in %.1f s, before the first row", tokens, took)
        return took

    def _anchors(self, batch: FeatureBatch, micro: int) -> torch.Tensor:
        """The anchors of the step's ``micro``-th row, seeded by its place in the global batch:
        one process with rows_per_step=R draws the same anchors as R ranks with one row each.
        With ``steps_per_row`` k the draw is seeded by the row's first step, and step i of the
        row takes share i of it: k disjoint sets (k = 1: the step's own draw)."""
        cfg = self.cfg
        slot = self.ctx.rank * cfg.rows_per_step + micro
        first, share = divmod(self.step, cfg.steps_per_row)
        first *= cfg.steps_per_row
        gen = torch.Generator().manual_seed(hash((cfg.seed, first, slot)) & 0x7FFFFFFFFFFFFFFF)
        return sample_anchor_shares(batch.loss_mask, batch.doc_lengths, cfg.num_anchors, cfg.steps_per_row,
                                    gen)[share]

    def _validate(self, batch: FeatureBatch) -> list[dict[str, Any]]:
        """The loss, acc and τ_sim of ``batch``'s supervised tokens (the row's validation documents)
        without a gradient, at every one of their anchors (``num_anchors`` at a time; the means
        weighted by anchors), and the walk of a served decode over them: what the drafter does on
        text it never trained on. Empty without an anchor."""
        docs = resolve_doc_ids(int(batch.loss_mask.shape[0]), batch.doc_lengths, batch.doc_ids, batch.loss_mask.device)
        anchors = anchor_candidates(batch.loss_mask, docs)
        if anchors.numel() == 0:
            return []
        outs = []
        # a party of its own: a no-grad call compiles other graphs than the training step's, and a
        # row length it has made warm must not let the step's first (compiling) call run beside extract
        with torch.no_grad(), GATE.call(self.validation_party, int(batch.features.shape[0]), self.compiled):
            for chunk in anchors.split(self.cfg.num_anchors):  # the training step's shape: nothing compiles anew
                outs.append((self._loss(batch, chunk), chunk.numel()))
        stats = {k: sum(getattr(out, k).detach().double() * m for out, m in outs) / anchors.numel() for k in VAL_MEANS}
        walk = ServedWalk(anchors.tolist(), torch.cat([out.block_tau[:m] for out, m in outs]),
                          supervised_spans(batch.loss_mask, docs), self.cfg.block_size,
                          self.cfg.validation_max_new_tokens)
        return [{**stats, "walk": walk}]

    def save_compile_cache(self) -> str | None:
        """Save everything this process has compiled to the compile cache (once the first step
        has compiled it all), on rank 0 only; the URL written, or None (no cache to write, it was
        loaded warm, another rank, or nothing compiled)."""
        if not self.cache_url or self.ctx.rank != 0:
            return None
        return self.cache_url if compile_cache.save(self.cache_url, self.ctx.logger) else None

    def _loss(self, batch: FeatureBatch, anchors: torch.Tensor) -> LossOutput:
        """The drafter's loss on ``batch`` at ``anchors`` as the configuration computes it."""
        cfg = self.cfg
        return drafter_loss(self.model, batch, anchors, self.embed, self.head, gamma=cfg.gamma,
                            target=cfg.loss_target, chunk_rows=cfg.chunk_rows,
                            pad_anchors_to=cfg.num_anchors if cfg.pad_anchors else None,
                            compile_loss=self.compiled)

    def _forward_backward(self, batch: FeatureBatch, anchors: torch.Tensor,
                          mark: Callable[[str], None]) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        out = self._loss(batch, anchors)
        mark("forward")
        (out.loss / cfg.rows_per_step).backward()
        mark("backward")
        return {**_row_stats(out), "per_slot_acc": out.per_slot_acc}

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

    # -------------------------------------------------------------- snapshots
    def snapshot(self, final: bool, interrupted: bool = False) -> dict[str, Any]:
        """The trainer's state and what the export records, copied to CPU so training can go on
        while the checkpoint stage writes them (in the layout :func:`read_checkpoint` reads)."""
        tok = tokenizer_metadata(self.ctx.upstream_facts)  # what the tokenize stage upstream published
        state = _to_cpu(self.state_dict())
        return {
            "kind": "state", "step": self.step, "final": final, "interrupted": interrupted,
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "model": state["model"],
            "optimizer": state["optimizer"],
            "rng": state["rng"],
            "drafter_config": self.model.config,
            "pipeline_state": {self.ctx.stage: {"step": self.step}, **state["data"]},
            "metrics_file": self.metrics.path,
            "metadata": {"target": self.target["model"], "tokenizer": tok.get("tokenizer"),
                         "thinking": tok.get("thinking"),
                         "chat_template_kwargs": tok.get("chat_template_kwargs") or {},
                         "heldout": resolve_path(self.cfg.heldout, os.getcwd()) if self.cfg.heldout else None,
                         "metrics": resolve_path(self.metrics.path, os.getcwd()), "step": self.step},
        }


def read_checkpoint(ckpt: str, rank: int) -> dict[str, Any]:
    """This rank's trainer state (:meth:`Trainer.state_dict`'s form) from a checkpoint as
    checkpoint:fsspec writes it: ``train_state.pt`` (with rank 0's RNG), ``rng.rank<r>.pt`` (the
    other ranks') and ``pipeline_state.json`` (the data cursors)."""
    import fsspec

    def load(name: str) -> dict[str, Any]:
        with fsspec.open(f"{ckpt}/{name}", "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)

    saved = load(TRAIN_STATE)
    rngs = saved["rng"] if rank == 0 else load(f"rng.rank{rank}.pt")["rng"]
    return {"model": saved["model"], "optimizer": saved["optimizer"], "step": saved["step"],
            "rng": rngs[str(rank)], "data": read_json(f"{ckpt}/{PIPELINE_STATE}") or {}}


def weights_digest(model: torch.nn.Module) -> bytes:
    """SHA-256 of every parameter's bytes in order: equal exactly when the weights are."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.digest()


def _each_row_repeated(rows: Iterable[dict[str, Any]], times: int) -> Iterator[dict[str, Any]]:
    """Each row ``times`` times in a row: the feed of ``steps_per_row`` training."""
    for row in rows:
        for _ in range(times):
            yield row


class _StepRows:
    """The next (at most) ``n`` rows of a stream, handed on one at a time; remembers the last, and
    how long the loop waited for them (``waited``, seconds): a loop that waits is fed too slowly by
    the stages upstream, one that does not is held by its own step."""

    def __init__(self, feed: Iterator[dict[str, Any]], n: int) -> None:
        self.feed, self.n = feed, n
        self.last: dict[str, Any] = {}
        self.waited = 0.0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for _ in range(self.n):
            asked = now()
            row = next(self.feed, None)
            self.waited += now() - asked
            if row is None:
                return
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
