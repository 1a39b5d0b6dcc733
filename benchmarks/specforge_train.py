"""train:specforge — SpecForge's DFlash trainer, unmodified, fed by our extract stage.

The reference side of ``benchmarks/side_by_side.py``. The pipeline is the quality job's down to
extract; this stage takes the place of ``train:dflash``. Load it by path:

    PYTHONPATH=. dflash-pipe run -p benchmarks.specforge_train PIPELINE   (from the repository's root)

with ``SPECFORGE_PATH`` (or the ``specforge`` param) naming a checkout of
github.com/sgl-project/SpecForge (``docs/quality.md`` gives the commit).

What is SpecForge's, imported from its checkout as it is: the draft model
(``specforge.modeling.draft.dflash.DFlashDraftModel``), the training module
(``specforge.algorithms.common.dflash_family_model.OnlineDFlashModel``: anchor sampling, the noise
block, the flex mask, labels and the decayed cross-entropy) and the optimizer
(``specforge.optimizer.BF16Optimizer``: AdamW over fp32 masters, gradient clipping, linear warmup
then cosine). What is ours: splitting extract's packed rows back into documents
(:func:`documents`), the loop that feeds them (a fresh shuffle each epoch, ``batch_size``
documents padded on the right, as SpecForge's own loader hands them over) and the export, written
by our exporter from SpecForge's weights so that ``dflash-pipe evaluate`` serves both drafters alike.

The drafter's shape is the one ``train:dflash`` builds for the same target and params
(``drafter_config``), handed to SpecForge as the z-lab ``config.json`` both sides export.
One epoch of documents is kept on the device, as SpecForge's offline mode trains from stored
features: the pack stage must yield one epoch (``epochs: 1``); this stage runs ``epochs`` itself.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from dflash_core import Stage, StageContext, hookimpl
from dflash_core.facts import tokenizer_metadata
from dflash_core.rows import FEATURE_ROW, TARGET_HEADER, check_fields, checked, is_target_header


@dataclass
class SpecForgeConfig:
    """SpecForge's small-target DFlash recipe (examples/configs/qwen2.5-0.5b-dflash-online.yaml)
    by default; the drafter's shape params are train:dflash's."""

    specforge: str | None = field(default=None, metadata={
        "help": "path of a SpecForge checkout (default: $SPECFORGE_PATH)"})
    export: str = field(default="export", metadata={
        "help": "where the trained drafter is exported (relative: inside the stage's work dir)"})
    epochs: int = field(default=10, metadata={"help": "passes over the documents"})
    max_steps: int | None = field(default=10000, metadata={
        "help": "stop after this many steps; the schedule's length is the smaller of this and epochs"})
    batch_size: int = field(default=1, metadata={"help": "documents per optimizer step"})
    lr: float = field(default=6.0e-4, metadata={"help": "peak learning rate"})
    warmup_ratio: float = field(default=0.04, metadata={"help": "linear warmup, as a fraction of the steps"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    num_anchors: int = field(default=512, metadata={"help": "anchors (blocks) per document"})
    loss_decay_gamma: float = field(default=7.0, metadata={"help": "γ of the slot weights exp(-(k-1)/γ)"})
    attention_backend: str = field(default="flex_attention", metadata={
        "help": "SpecForge's attention backend (flex_attention on CUDA; sdpa elsewhere)"})
    num_layers: int = field(default=5, metadata={"help": "draft layers (as train:dflash)"})
    block_size: int = field(default=16, metadata={"help": "block size (as train:dflash)"})
    mask_token_id: int | None = field(default=None, metadata={"help": "mask token (as train:dflash)"})
    heldout: str | None = field(default=None, metadata={
        "help": "held-out prompts recorded in the export, as train:dflash records them"})
    seed: int = field(default=42, metadata={"help": "initialisation and shuffle seed"})
    log_every: int = field(default=200, metadata={"help": "steps between log lines"})


@dataclass
class Document:
    """One training sample as train:dflash sees it inside a packed row."""

    input_ids: Any   # LongTensor [T]
    loss_mask: Any   # float tensor [T], 0/1
    features: Any    # tensor [T, k·H]

    @cached_property
    def candidates(self) -> int:
        """Anchor candidates by SpecForge's rule: positions whose token and the next are supervised
        (a document without one cannot be trained on). Counted once: the loop reads it every step."""
        m = self.loss_mask > 0.5
        return int((m[:-1] & m[1:]).sum())


def documents(row: Mapping[str, Any]) -> list[Document]:
    """Split a feature row into its documents (the row's padding is not one); each keeps its
    tokens, loss mask and feature rows exactly as the row holds them."""
    import torch

    lengths = [int(n) for n in row["doc_lengths"]]
    if int(row.get("num_pad") or 0):
        lengths = lengths[:-1]
    ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
    mask = torch.as_tensor(row["loss_mask"]).float()
    feats = row["features"]
    out, start = [], 0
    for n in lengths:
        out.append(Document(ids[start:start + n], mask[start:start + n], feats[start:start + n]))
        start += n
    return out


def batch(docs: Sequence[Document], device: Any) -> tuple[Any, Any, Any]:
    """(input_ids [B, S], features [B, S, k·H], loss_mask [B, S]) padded on the right to the
    longest document: padding is unsupervised, and SpecForge's positions count from 0 per sequence."""
    import torch

    S = max(len(d.input_ids) for d in docs)
    ids = torch.zeros(len(docs), S, dtype=torch.long)
    mask = torch.zeros(len(docs), S)
    feats = docs[0].features.new_zeros(len(docs), S, docs[0].features.shape[-1])
    for i, d in enumerate(docs):
        n = len(d.input_ids)
        ids[i, :n], mask[i, :n], feats[i, :n] = d.input_ids, d.loss_mask, d.features
    return ids.to(device), feats.to(device), mask.to(device)


def step_cost(drafter_cfg: Any, seq_len: int, counts: Sequence[int], num_anchors: int) -> tuple[int, float]:
    """(anchor blocks trained, drafter FLOPs by the model of docs/drafter.md, 'FLOP model', attention left out) of one
    SpecForge step on documents with ``counts`` candidates padded to ``seq_len``: each document
    gets min(num_anchors, its candidates) blocks, every document is padded to the batch's widest
    block count, and its LM head runs on every slot of every block."""
    from dflash_model.drafter import training_flops

    width = min(num_anchors, max(counts))
    n = len(counts) * width
    flop = training_flops(drafter_cfg, len(counts) * seq_len, n, 0,
                          lm_head_rows=n * drafter_cfg.block_size)["step"]
    return sum(min(num_anchors, c) for c in counts), flop


def import_specforge(path: str | None) -> Any:
    """SpecForge's modules, from the checkout at ``path`` (or $SPECFORGE_PATH)."""
    root = path or os.environ.get("SPECFORGE_PATH")
    if not root or not os.path.isdir(os.path.join(root, "specforge")):
        raise ValueError("train:specforge needs a SpecForge checkout: set the specforge param or "
                         f"$SPECFORGE_PATH (got {root!r})")
    if root not in sys.path:
        sys.path.insert(0, root)
    import specforge.algorithms.common.dflash_family_model as family
    import specforge.modeling.draft.dflash as draft
    import specforge.optimizer as optimizer

    return family, draft, optimizer


class SpecForgeTrain(Stage):
    kind = "train"
    name = "specforge"
    Config = SpecForgeConfig
    inputs = {"features": FEATURE_ROW}
    needs_torch = True

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        if "steps" not in summary:
            return None
        return (f"train (SpecForge): {summary['steps']} steps, {summary['documents']} documents, "
                f"loss {summary['loss']:.4f}, accuracy {summary['acc']:.4f}; export {summary['export']}")

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        import torch

        cfg = self.config
        family, draft_mod, optimizer = import_specforge(cfg.specforge)
        rows = checked(inputs["features"], FEATURE_ROW, ctx.stage, ctx.upstream("features"))
        header = next(rows, None)
        if not is_target_header(header):
            raise ValueError("train:specforge expects the extract stage's target header first")
        check_fields(header, TARGET_HEADER, ctx.stage, ctx.upstream("features"))
        device = torch.device(ctx.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        docs = self._collect(rows, device, ctx)

        torch.manual_seed(cfg.seed)
        drafter_cfg, export_dict = self._drafter_config(header)
        draft_config = draft_mod.Qwen3Config(**export_dict)
        draft_config._attn_implementation = cfg.attention_backend
        draft = draft_mod.DFlashDraftModel(draft_config).to(device=device, dtype=dtype)
        embed = torch.nn.Embedding.from_pretrained(header["embed_weight"].to(device, dtype), freeze=True)
        head = torch.nn.Linear(drafter_cfg.hidden_size, drafter_cfg.vocab_size, bias=False).to(device, dtype)
        head.weight = torch.nn.Parameter(header["lm_head_weight"].to(device, dtype), requires_grad=False)
        model = family.OnlineDFlashModel(
            draft_model=draft, target_lm_head=head, target_embed_tokens=embed,
            mask_token_id=drafter_cfg.mask_token_id, block_size=drafter_cfg.block_size,
            attention_backend=cfg.attention_backend, num_anchors=cfg.num_anchors,
            loss_decay_gamma=cfg.loss_decay_gamma)
        steps_per_epoch = math.ceil(len(docs) / cfg.batch_size)
        total = steps_per_epoch * cfg.epochs
        if cfg.max_steps:
            total = min(total, cfg.max_steps)
        opt = optimizer.BF16Optimizer(draft, lr=cfg.lr, max_grad_norm=cfg.max_grad_norm,
                                      total_steps=total, warmup_ratio=cfg.warmup_ratio)
        log = self._loop(model, opt, docs, total, drafter_cfg, device, ctx)
        export = self._export(draft, drafter_cfg, header["model"], ctx, log)
        ctx.summary.update(steps=total, documents=len(docs), export=export, **log[-1])
        yield from ()  # a sink: the export is its output

    def _collect(self, rows: Iterator[dict[str, Any]], device: Any, ctx: StageContext) -> list[Document]:
        """One epoch of documents, features moved to ``device``; rows of a second epoch are refused."""
        docs: list[Document] = []
        skipped = 0
        for row in rows:
            if is_target_header(row):
                continue
            if int(row["epochs"]) != 1:
                raise ValueError(f"train:specforge runs its own epochs: set the pack stage's epochs to 1 "
                                 f"(its rows say {row['epochs']})")
            for d in documents(row):
                if d.candidates:
                    d.features = d.features.to(device)
                    docs.append(d)
                else:
                    skipped += 1
        ctx.logger.info("%d documents kept on %s (%d without two consecutive supervised tokens left out)",
                        len(docs), device, skipped)
        if not docs:
            raise ValueError("train:specforge got no trainable documents")
        return docs

    def _drafter_config(self, header: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """train:dflash's drafter for this target and shape params, and its export config."""
        from dflash_stages.train.config import TrainConfig
        from dflash_stages.train.drafter_init import drafter_config

        cfg = self.config
        ours = TrainConfig(num_layers=cfg.num_layers, block_size=cfg.block_size,
                           mask_token_id=cfg.mask_token_id)
        drafter_cfg, _ = drafter_config(dict(header), ours)
        return drafter_cfg, drafter_cfg.to_export_dict()

    def _loop(self, model: Any, opt: Any, docs: list[Document], total: int, drafter_cfg: Any,
              device: Any, ctx: StageContext) -> list[dict[str, Any]]:
        """``total`` optimizer steps over shuffled batches of documents; one log record every
        ``log_every`` steps (and the last), also appended to the run's metrics file, with the
        anchors and drafter FLOPs spent so far (``step_cost``)."""
        import torch

        cfg = self.config
        blocks = flop = 0.0
        gen = torch.Generator().manual_seed(cfg.seed)
        metrics = os.path.join(ctx.run_dir, "specforge_metrics.jsonl")
        log: list[dict[str, Any]] = []
        step, t0 = 0, time.perf_counter()
        loss_sum = acc_sum = 0.0
        n = 0
        ctx.progress(0, total=total, unit="steps")
        while step < total:
            order = torch.randperm(len(docs), generator=gen).tolist()
            for i in range(0, len(order), cfg.batch_size):
                if step >= total:
                    break
                picked = [docs[j] for j in order[i:i + cfg.batch_size]]
                ids, feats, mask = batch(picked, device)
                step_blocks, step_flop = step_cost(drafter_cfg, ids.shape[1], [d.candidates for d in picked],
                                                   cfg.num_anchors)
                blocks, flop = blocks + step_blocks, flop + step_flop
                loss, acc, _ = model(input_ids=ids, hidden_states=feats, loss_mask=mask)
                loss.backward()
                opt.step()
                step += 1
                loss_sum, acc_sum, n = loss_sum + float(loss), acc_sum + float(acc), n + 1
                ctx.progress(1, unit="steps", tokens=int(ids.numel()))
                if step % cfg.log_every == 0 or step == total:
                    rec = {"step": step, "loss": loss_sum / n, "acc": acc_sum / n, "lr": opt.get_learning_rate(),
                           "elapsed_s": round(time.perf_counter() - t0, 1), "anchor_blocks": int(blocks),
                           "drafter_flop": flop}
                    if device.type == "cuda":
                        rec["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                    log.append(rec)
                    with open(metrics, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    ctx.logger.info("step %d/%d loss %.4f acc %.4f", step, total, rec["loss"], rec["acc"])
                    loss_sum = acc_sum = 0.0
                    n = 0
        return log

    def _export(self, draft: Any, drafter_cfg: Any, target: str, ctx: StageContext,
                log: list[dict[str, Any]]) -> str:
        """SpecForge's trained weights in our drafter, exported as train:dflash's checkpoints are: the
        weight names must match the z-lab export one to one (a strict load)."""
        from dflash_model.drafter import DFlashDrafter, export_drafter

        ours = DFlashDrafter(drafter_cfg, attn_backend="sdpa")
        state = {k: v.detach().float().cpu() for k, v in draft.state_dict().items()
                 if not k.startswith("rotary_emb.")}
        ours.load_state_dict(state, strict=True)
        dest = self.config.export if os.path.isabs(self.config.export) else os.path.join(ctx.work_dir, self.config.export)
        export_drafter(ours, dest, extra_metadata={
            "target": target, **tokenizer_metadata(ctx.upstream_facts), "heldout": self.config.heldout,
            "trainer": "specforge", "step": log[-1]["step"]})
        return dest


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(SpecForgeTrain)
