"""The progress display's model (dflash_core/progress.py) on rich's Progress tasks, rendered into
a recording console, on a clock the test moves: row order, counts, rates that stay put once a
stage is done, no negative ETA; plain lines; libraries kept quiet while the table is live."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from rich.console import Console

from dflash_core.progress import PlainDisplay, RichDisplay, Display
from dflash_core.quiet_libraries import quiet_libraries

STAGES = ["download", "tokenize", "pack", "train"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Result:
    items: int = 0
    started: float = 0.0
    ended: float = 0.0


def console(**kw: Any) -> Console:
    return Console(record=True, width=220, file=io.StringIO(), **kw)


def rows(display: Display) -> dict[str, str]:
    """Each stage's rendered row, by stage, in the order shown."""
    display.console.print(display.progress.make_tasks_table(display.progress.tasks))
    lines = display.console.export_text().splitlines()
    return {line.split()[0]: " ".join(line.split()) for line in lines if line.strip()}


def progress(display: Display, stage: str, advance: int, **kw: Any) -> None:
    display.event(stage, {"type": "progress", "advance": advance, **kw})


def test_rows_follow_pipeline_order_not_start_order() -> None:
    d = Display(STAGES, console(), Clock())
    for stage in ("train", "pack", "download"):
        d.stage_started(stage)
    d.stage_started("evaluate")  # not announced: a row at the end
    shown = rows(d)
    assert list(shown) == [*STAGES, "evaluate"]
    assert shown["tokenize"].startswith("tokenize pending")
    assert shown["train"].startswith("train running")


def test_counts_queue_and_metrics() -> None:
    clock = Clock()
    d = Display(STAGES, console(), clock)
    d.stage_started("tokenize")
    for t in (1, 2, 3):
        clock.now = t
        progress(d, "tokenize", 100, unit="records", tokens=1000)
    progress(d, "tokenize", 0, unit="records", total=500)
    d.event("train", {"type": "metrics", "loss": 2.123456, "acc": 0.5})
    d.queues({"pack->train": (3, 8), "tokenize->pack": (0, 8)})
    shown = rows(d)
    assert "300/500 records" in shown["tokenize"]
    assert "100.0 records/s 1,000 tokens/s" in shown["tokenize"]  # 2 s of samples after the first
    assert shown["train"].endswith("3/8 loss=2.123 acc=0.5")
    task = d.task("tokenize")
    assert (task.completed, task.total, task.fields["counters"]["tokens"].completed) == (300, 500, 3000)


def test_rate_freezes_once_done() -> None:
    clock = Clock()
    d = Display(STAGES, console(), clock)
    d.stage_started("pack")
    clock.now = 15.0
    progress(d, "pack", 100, unit="rows", tokens=1000)
    clock.now = 20.0
    progress(d, "pack", 100, unit="rows", tokens=1000)
    assert "20.0 rows/s 200 tokens/s" in rows(d)["pack"]  # rich's window: the last 100 in 5 s
    d.stage_done("pack", "done", Result(items=200))
    done = rows(d)["pack"]
    assert "pack done" in done and "200/200 rows 10.0 rows/s 100 tokens/s" in done  # over 20 s
    clock.now = 1000.0
    assert rows(d)["pack"] == done


def test_eta_counts_down_and_is_never_negative() -> None:
    clock = Clock()
    d = Display(STAGES, console(), clock)
    d.stage_started("train")
    for t in range(1, 6):
        clock.now = float(t)
        progress(d, "train", 10, unit="steps", total=100)
    assert "50/100 steps" in rows(d)["train"] and "ETA 00:05" in rows(d)["train"]
    clock.now = 6.0
    progress(d, "train", 70, unit="steps", total=100)  # the total was an estimate: overrun
    overrun = rows(d)["train"]
    assert "120/100 steps" in overrun and "ETA" not in overrun
    d.stage_done("train", "done", Result(items=1))
    assert "ETA" not in rows(d)["train"]


def test_cached_and_silent_stages_count_their_items() -> None:
    d = Display(STAGES, console(), Clock())
    d.stage_done("download", "cached", Result(items=7))
    d.stage_started("tokenize")
    d.stage_done("tokenize", "done", Result(items=3))
    shown = rows(d)
    assert "download cached" in shown["download"] and "7/7 items" in shown["download"]
    assert "3/3 items" in shown["tokenize"]


def test_plain_lines_at_most_every_ten_seconds() -> None:
    clock = Clock()
    out = console()
    d = PlainDisplay(STAGES, out, clock)
    d.stage_started("tokenize")
    for t in (1, 2, 11):
        clock.now = float(t)
        progress(d, "tokenize", 50, unit="records", tokens=500)
    d.stage_done("tokenize", "done", Result(items=2, started=100.0, ended=111.0))
    assert out.export_text().splitlines() == [
        "[tokenize] started",
        "[tokenize] 50 records  50.0 records/s  500 tokens/s",  # one sample: the average so far
        "[tokenize] 150 records  10.0 records/s  100 tokens/s",  # rich's: 100 after it in 9 s
        "[tokenize] done in 11.0s (2 items)",
    ]


# ------------------------------------------------------------------ libraries kept quiet
def test_quiet_libraries_switches_bars_and_routes_log_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    hf_logging.enable_progress_bar()
    handler = logging.StreamHandler(sys.__stderr__)
    log = logging.getLogger("some_library")
    log.addHandler(handler)
    redirected = io.StringIO()  # what a live display has put in place of stderr
    monkeypatch.setattr(sys, "stderr", redirected)
    try:
        with quiet_libraries():
            spawned = subprocess.run(  # as a stage process started under the live table
                [sys.executable, "-c", "from tqdm import tqdm\nfor _ in tqdm(range(3)): pass"],
                capture_output=True, text=True, check=True)
            assert spawned.stderr == ""
            assert not hf_logging.is_progress_bar_enabled()
            assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
            log.warning("loading weights")
        assert redirected.getvalue() == "loading weights\n"
        assert handler.stream is sys.__stderr__
        assert hf_logging.is_progress_bar_enabled() and "TQDM_DISABLE" not in os.environ
    finally:
        log.removeHandler(handler)


def test_live_table_prints_library_log_lines_above_it() -> None:
    out = console(force_terminal=True)
    handler = logging.StreamHandler(sys.__stderr__)
    log = logging.getLogger("another_library")
    log.addHandler(handler)
    try:
        d = RichDisplay(STAGES, out)
        d.stage_started("download")
        log.warning("fetching shard 1 of 3")
        d.close()
    finally:
        log.removeHandler(handler)
    text = out.export_text()
    assert "fetching shard 1 of 3" in text
    assert text.rindex("download running") > text.index("fetching shard 1 of 3")
