"""tokenize:chat_template — JSONL chat records → Arrow shards of input_ids + assistant-only loss masks.

The parent thread reads the input files (sorted by source, so the output does not depend on the
order downloads finished), cuts them into batches of lines and hands the batches to ``workers``
spawned processes; results are taken back in submission order, so the shards are the same bytes
for any worker count. Each worker renders the conversations with the tokenizer's own chat template
and tokenizes them in one batch with the fast tokenizer; the loss mask is found from the template's
own rendering (``tokenize_masks``), so templates without ``{% generation %}`` tags work.

Outputs in ``ctx.work_dir``: ``shard-NNNNN.arrow`` (Arrow IPC file: ``input_ids list<int32>``,
``loss_mask list<int8>``, ``source string``, ``line int32``), ``quarantine.jsonl`` and
``stats.json``. Yields one item per shard. See ``docs/tokenize.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generator, Iterator, Literal, Mapping, get_args

from dflash_core import facts
from dflash_core.artifacts import write_json
from dflash_core.items import FILE_ITEM, SAMPLE_SHARD, checked
from dflash_core.stage import Stage, StageContext
from dflash_stages.tokenize.output import (ShardWriter, check_invariant, check_some_kept, join, merge,
                                           new_stats, stats_table)

__all__ = ["ChatTemplateTokenize", "TokenizeConfig", "stats_table"]

_BATCH_BYTES = 32 << 20


Overflow = Literal["truncate", "drop"]


@dataclass
class TokenizeConfig:
    tokenizer: str = field(metadata={"help": "HF tokenizer path or hub name with a chat template; "
                                             "'smollm2' = the SmolLM2-135M-Instruct GGUF asset"})
    thinking: bool = field(default=True, metadata={
        "help": "render as served with enable_thinking=<this>; off: reasoning is dropped"})
    max_len: int = field(default=4096, metadata={"help": "longest sample in tokens"})
    overflow: Overflow = field(default="drop", metadata={
        "help": "samples longer than max_len: cut to max_len, or drop (counted as too_long)"})
    min_loss_tokens: int = field(default=1, metadata={
        "help": "drop samples with fewer supervised tokens (counted as min_loss_tokens)"})
    workers: int = field(default=2, metadata={
        "help": "tokenizer processes (spawned); 0 = in the stage's own thread"})
    batch_size: int = field(default=256, metadata={"help": "records per batch sent to a worker"})
    shard_samples: int = field(default=4096, metadata={"help": "samples per Arrow shard"})
    chat_template_kwargs: dict = field(default_factory=dict, metadata={
        "help": "extra variables for the chat template (chat_template: a template override)"})
    max_record_bytes: int = field(default=4 << 20, metadata={
        "help": "longer JSONL lines are quarantined unparsed (record_too_large)"})

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ValueError("tokenizer must be a path or hub name")
        if self.overflow not in get_args(Overflow):
            raise ValueError("overflow must be 'truncate' or 'drop'")
        if self.max_len < 1 or self.batch_size < 1 or self.shard_samples < 1:
            raise ValueError("max_len, batch_size and shard_samples must be >= 1")
        if self.min_loss_tokens < 0 or self.workers < 0:
            raise ValueError("min_loss_tokens and workers must be >= 0")
        if self.max_record_bytes < 1:
            raise ValueError("max_record_bytes must be >= 1")
        if self.max_len * self.shard_samples >= 2**31:
            raise ValueError("max_len * shard_samples must stay below 2**31 (int32 list offsets)")
        if "enable_thinking" in (self.chat_template_kwargs or {}):
            raise ValueError("set thinking: instead of chat_template_kwargs.enable_thinking")


def file_items(items: Any, consumer: str, producer: str | None) -> list[dict]:
    """Upstream file items (download's, generate's; a bare path is one too), checked where they
    enter stage ``consumer``, in a stable order: by source."""
    paths = ({"path": item} if isinstance(item, str) else item for item in items)
    out = [dict(item) for item in checked(paths, FILE_ITEM, consumer, producer)]
    return sorted(out, key=lambda it: (str(it.get("source") or it["path"]), it["path"]))


class ChatTemplateTokenize(Stage):
    """Chat-template tokenization with assistant-only loss masks (thinking on/off)."""

    kind = "tokenize"
    name = "chat_template"
    preload = ("transformers:AutoTokenizer", "transformers:AutoModelForCausalLM")
    version = "1"
    Config = TokenizeConfig
    inputs = {"files": FILE_ITEM}
    output = SAMPLE_SHARD
    default_link = "materialize"
    default_executor = "thread"
    cache_ignore = ("workers", "batch_size")

    @classmethod
    def facts_for_consumers(cls, config: TokenizeConfig) -> Mapping[str, Any]:
        """How the samples were made (an export records it) and how long one can be (pack's rows
        must hold it)."""
        return {facts.TOKENIZER: config.tokenizer, facts.THINKING: config.thinking,
                facts.CHAT_TEMPLATE_KWARGS: dict(config.chat_template_kwargs),
                facts.MAX_SAMPLE_TOKENS: config.max_len}

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        return stats_table(summary)

    def run(self, inputs: Mapping[str, Any], ctx: StageContext) -> Iterator[dict]:
        import fsspec

        cfg: TokenizeConfig = self.config
        items = file_items(inputs["files"], ctx.stage, ctx.upstream("files"))
        fs, root = fsspec.core.url_to_fs(ctx.work_dir)
        fs.makedirs(root, exist_ok=True)
        stats = new_stats(cfg)
        writer = ShardWriter(fs, root, ctx.work_dir, cfg.shard_samples)
        pool = _start_pool(cfg.workers)
        stopped = False
        try:
            with fs.open(join(root, "quarantine.jsonl"), "w") as qfile:
                stopped = yield from self._tokenize(items, cfg, pool, qfile, stats, writer, ctx)
            if stopped:
                return
            if writer.samples:
                stats["shards"] += 1
                yield writer.flush()
        finally:
            if pool is not None:
                pool.shutdown(wait=not stopped, cancel_futures=True)
        _finish(stats, ctx)

    def _tokenize(self, items: list[dict], cfg: TokenizeConfig, pool: Any, qfile: Any,
                  stats: dict, writer: ShardWriter, ctx: StageContext
                  ) -> Generator[dict, None, bool]:
        """Feed the batches to the workers and take the results back in submission order, so the
        shards do not depend on the worker count; at most ``2 * workers + 1`` batches are in
        flight, to bound memory. Yields the full shards; returns True if the run was stopped."""
        from dflash_stages.tokenize.masks import process_batch

        wcfg = dataclasses.asdict(cfg)
        for key in ("workers", "batch_size", "shard_samples"):
            wcfg.pop(key)
        pending: deque = deque()
        limit = 2 * max(1, cfg.workers) + 1
        reading_done = False

        def collect() -> Iterator[dict]:
            source, fut = pending.popleft()
            res = fut.result() if pool is not None else fut
            for q in res.quarantine:
                qfile.write(json.dumps(q, ensure_ascii=False) + "\n")
            merge(stats, res)
            ctx.progress(advance=res.records, unit="records", tokens=int(res.lengths.sum()),
                         **({"total": stats["records_in"]} if reading_done else {}))
            for shard in writer.add(source, res):
                stats["shards"] += 1
                yield shard

        for source, entries in self._batches(items, cfg, stats):
            if ctx.should_stop():
                return True
            if pool is not None:
                pending.append((source, pool.submit(process_batch, wcfg, source, entries)))
            else:
                pending.append((source, process_batch(wcfg, source, entries)))
            while len(pending) >= limit or (pool is None and pending):
                yield from collect()
        reading_done = True
        while pending:
            if ctx.should_stop():
                return True
            yield from collect()
        return False

    @staticmethod
    def _batches(items: list[dict], cfg: TokenizeConfig, stats: dict
                 ) -> Iterator[tuple[str, list[tuple[int, bytes, int]]]]:
        """``(source, [(line_no, raw, size), …])`` per batch; blank lines are not records."""
        import fsspec

        for item in items:
            source = str(item.get("source") or item["path"])
            stats["files"] += 1
            batch: list[tuple[int, bytes, int]] = []
            nbytes = 0
            with fsspec.open(item["path"], "rb", compression="infer") as f:
                for line_no, raw in enumerate(f, 1):
                    raw = raw.rstrip(b"\r\n")
                    if not raw.strip() or (line_no == 1 and raw == b"\xef\xbb\xbf"):
                        stats["blank_lines"] += 1
                        continue
                    size = len(raw)
                    if size > cfg.max_record_bytes:
                        raw = raw[:1024]
                    stats["records_in"] += 1
                    batch.append((line_no, raw, size))
                    nbytes += len(raw)
                    if len(batch) >= cfg.batch_size or nbytes >= _BATCH_BYTES:
                        yield source, batch
                        batch, nbytes = [], 0
            if batch:
                yield source, batch


def _start_pool(workers: int) -> Any:
    """The spawned tokenizer processes (None for ``workers == 0``), the CPUs split between them so
    their Rust thread pools do not oversubscribe the machine."""
    if workers <= 0:
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from dflash_stages.tokenize.masks import init_process

    threads = max(1, (os.cpu_count() or 1) // workers)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=init_process, initargs=(threads,))


def _finish(stats: dict, ctx: StageContext) -> None:
    """Check the counts add up, then write ``stats.json``, the summary and the log line; fail a
    run that kept nothing (pointing at the quarantine) only after its reports are written."""
    check_invariant(stats)
    write_json(join(ctx.work_dir, "stats.json"), stats)
    ctx.summary.update(stats)
    ctx.logger.info("tokenize: %d records -> %d samples (%d filtered, %d quarantined), "
                    "%d tokens, %d supervised", stats["records_in"], stats["samples_out"],
                    stats["filtered_total"], stats["quarantined_total"], stats["tokens"],
                    stats["loss_tokens"])
    check_some_kept(stats, join(ctx.work_dir, "quarantine.jsonl"))
