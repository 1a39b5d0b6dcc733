"""tokenize:chat_template — Arrow shards, the quarantine file and the stats record."""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_stages.tokenize.masks import HIST_BINS, BatchResult, hist_label

SHARD_NAME = "shard-{:05d}.arrow"


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if base else name


def shard_schema() -> Any:
    import pyarrow as pa

    return pa.schema([
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("source", pa.string()),
        pa.field("line", pa.int32()),
    ])


class ShardWriter:
    """Buffers samples in arrival order and writes ``shard-NNNNN.arrow`` every ``shard_samples``."""

    def __init__(self, fs: Any, root: str, url: str, shard_samples: int) -> None:
        self.fs, self.root, self.url = fs, root, url
        self.shard_samples = shard_samples
        self.index = 0
        self._reset()

    def _reset(self) -> None:
        self.ids: list[np.ndarray] = []
        self.mask: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.lines: list[np.ndarray] = []
        self.sources: list[tuple[str, int]] = []
        self.samples = 0
        self.tokens = 0

    def add(self, source: str, res: BatchResult) -> list[dict]:
        """Add one batch's samples; returns the items of the shards completed by it."""
        done = []
        offsets = np.zeros(len(res.lengths) + 1, np.int64)
        np.cumsum(res.lengths, out=offsets[1:])
        i = 0
        while i < len(res.lengths):
            j = min(len(res.lengths), i + self.shard_samples - self.samples)
            a, b = offsets[i], offsets[j]
            self.ids.append(res.ids[a:b])
            self.mask.append(res.mask[a:b])
            self.lengths.append(res.lengths[i:j])
            self.lines.append(res.lines[i:j])
            self.sources.append((source, j - i))
            self.samples += j - i
            self.tokens += int(b - a)
            i = j
            if self.samples >= self.shard_samples:
                done.append(self.flush())
        return done

    def flush(self) -> dict:
        import pyarrow as pa
        import pyarrow.ipc as ipc

        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        offsets = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32)
        mask = np.concatenate(self.mask) if self.mask else np.zeros(0, np.int8)
        lines = np.concatenate(self.lines) if self.lines else np.zeros(0, np.int32)
        source = pa.array([s for s, n in self.sources for _ in range(n)], pa.string())
        table = pa.Table.from_arrays([
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.astype(np.int32, copy=False))),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask.astype(np.int8, copy=False))),
            source,
            pa.array(lines.astype(np.int32, copy=False)),
        ], schema=shard_schema())
        name = SHARD_NAME.format(self.index)
        with self.fs.open(join(self.root, name), "wb") as f:
            with ipc.new_file(f, table.schema) as writer:
                writer.write_table(table)
        item = {"shard": join(self.url, name), "index": self.index, "samples": self.samples,
                "tokens": self.tokens, "loss_tokens": int(mask.sum(dtype=np.int64))}
        self.index += 1
        self._reset()
        return item


def new_stats(cfg: Any) -> dict:
    return {
        "records_in": 0, "samples_out": 0, "filtered_total": 0, "quarantined_total": 0,
        "filtered": {}, "quarantined": {}, "files": 0, "blank_lines": 0, "bom_stripped": 0,
        "tokens": 0, "loss_tokens": 0, "assistant_turns": 0, "rewritten_turns": 0,
        "truncated": 0, "reasoning_dropped": 0, "shards": 0,
        "loss_tokens_hist": {hist_label(lo, hi): 0 for lo, hi in HIST_BINS},
        "thinking": bool(cfg.thinking), "max_len": int(cfg.max_len),
        "min_loss_tokens": int(cfg.min_loss_tokens), "tokenizer": str(cfg.tokenizer),
    }


def merge(stats: dict, res: BatchResult) -> None:
    n_out = len(res.lengths)
    stats["samples_out"] += n_out
    stats["tokens"] += int(res.lengths.sum(dtype=np.int64))
    stats["loss_tokens"] += int(res.mask.sum(dtype=np.int64))
    for q in res.quarantine:
        stats["quarantined"][q["reason"]] = stats["quarantined"].get(q["reason"], 0) + 1
        stats["quarantined_total"] += 1
    for reason, n in res.filtered.items():
        stats["filtered"][reason] = stats["filtered"].get(reason, 0) + n
        stats["filtered_total"] += n
    for (lo, hi), n in zip(HIST_BINS, res.hist):
        stats["loss_tokens_hist"][hist_label(lo, hi)] += n
    for key, n in res.counters.items():
        stats[key] = stats.get(key, 0) + n


def check_invariant(stats: dict) -> None:
    total = stats["samples_out"] + stats["filtered_total"] + stats["quarantined_total"]
    if stats["records_in"] != total:
        raise RuntimeError(
            f"tokenize: records in ({stats['records_in']}) != samples out ({stats['samples_out']})"
            f" + filtered ({stats['filtered_total']}) + quarantined ({stats['quarantined_total']})")


def check_some_kept(stats: dict, quarantine: str) -> None:
    """Refuse to finish without a sample: downstream would train nothing and the run would look
    like a success. The message names the commonest reasons and where the rejected records are."""
    if stats["samples_out"]:
        return
    if not stats["records_in"]:
        raise ValueError(f"tokenize: the {stats['files']} input file(s) hold no records "
                         f"({stats['blank_lines']} blank lines)")
    reasons = {**stats["filtered"], **stats["quarantined"]}
    top = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    more = f", {len(reasons) - len(top)} more reason(s)" if len(reasons) > len(top) else ""
    raise ValueError(
        f"tokenize: none of the {stats['records_in']:,} records became a sample "
        f"({stats['quarantined_total']:,} quarantined, {stats['filtered_total']:,} filtered); "
        f"top reasons: {', '.join(f'{r} {n:,}' for r, n in top)}{more}; "
        f"quarantined records with their reasons: {quarantine}")


def stats_table(stats: dict) -> Any:
    """The stats record as a rich table (records, reasons, tokens, supervised-token histogram)."""
    from rich.table import Table

    table = Table(title="tokenize", show_header=True, header_style="bold")
    table.add_column("", style="bold")
    table.add_column("count", justify="right")
    table.add_column("share", justify="right")
    n_in = max(1, stats.get("records_in", 0))

    def row(label: str, n: int, base: int = n_in, style: str | None = None) -> None:
        table.add_row(label, f"{n:,}", f"{100.0 * n / max(1, base):.1f}%", style=style)

    row("records in", stats.get("records_in", 0))
    row("samples out", stats.get("samples_out", 0), style="green")
    row("filtered", stats.get("filtered_total", 0), style="yellow")
    for reason, n in sorted(stats.get("filtered", {}).items()):
        row(f"  {reason}", n)
    row("quarantined", stats.get("quarantined_total", 0), style="red")
    for reason, n in sorted(stats.get("quarantined", {}).items()):
        row(f"  {reason}", n)
    table.add_section()
    tokens = stats.get("tokens", 0)
    table.add_row("tokens out", f"{tokens:,}", "")
    row("supervised tokens", stats.get("loss_tokens", 0), base=tokens)
    if stats.get("truncated"):
        row("truncated to max_len", stats["truncated"])
    if stats.get("reasoning_dropped"):
        row("reasoning dropped (thinking off)", stats["reasoning_dropped"])
    table.add_section()
    hist = stats.get("loss_tokens_hist", {})
    n_hist = max(1, sum(hist.values()))
    order = [hist_label(lo, hi) for lo, hi in HIST_BINS]  # stored JSON may have re-sorted the keys
    for label in sorted(hist, key=lambda k: order.index(k) if k in order else len(order)):
        n = hist[label]
        table.add_row(f"supervised/sample {label}", f"{n:,}", f"{100.0 * n / n_hist:.1f}%")
    return table
