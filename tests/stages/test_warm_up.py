"""``warm_up``: when pack pads every row to one length, extract and train compile for it before
the first row arrives (while the stages upstream still run), and nothing else changes.

- pack publishes the row length only when every row has it;
- the trainer's warm-up leaves weights, optimizer state, step, gradients and RNG as they were,
  so a warmed run trains exactly the weights of an unwarmed one;
- after the warm-ups, the first row's calls run warm through the compile gate (beside the other
  stage's), where without them they are held alone;
- end to end: the warmed pipeline ends in the same train state as the unwarmed one, and both
  stages report the warm-up;
- the trainer says when its first row came and when its first step was done, so that a cold
  start's wait for data and its compile read apart.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core.facts import ROW_TOKENS
from dflash_core.pipeline_file import load_pipeline
from dflash_core.plugins import PluginManager
from dflash_core.stage import StageContext
from dflash_stages.extract import ExtractConfig, HFHooksExtract
from dflash_stages.pack.random_rows import RandomRows, RandomRowsConfig
from dflash_stages.pack.stage import BestFitPack, PackConfig
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.trainer import weights_digest
from tests.stages import online_fixtures
from tests.stages.online_fixtures import TINY_TRAIN, online_pipeline, tiny_target
from tests.stages.test_extract import packed_row
from tests.stages.test_drafter_init import header, tiny_qwen3, trainer
from tests.stages.test_online_train import PLUGIN, assert_same_train_state, latest, run_in_process, write
from tests.stages.test_train_step import LAYERS, RecordingGate, feature_rows, recording_gate

T = 96  # feature_rows' length


def test_pack_publishes_the_row_length_only_when_every_row_has_it() -> None:
    assert BestFitPack.facts_for_consumers(PackConfig(tokens_per_row=4096, pad_to=4096)) == {ROW_TOKENS: 4096}
    assert BestFitPack.facts_for_consumers(PackConfig(tokens_per_row=4096, pad_to=1024)) == {}  # 1 to 4 x 1,024
    assert BestFitPack.facts_for_consumers(PackConfig(tokens_per_row=4096)) == {}  # unpadded
    assert RandomRows.facts_for_consumers(RandomRowsConfig(tokens_per_row=256)) == {ROW_TOKENS: 256}


def test_extract_and_train_learn_the_row_length_from_pack(tmp_path: Path) -> None:
    pm = PluginManager(autoload=True)
    pm.add_plugin(online_fixtures, PLUGIN)
    path = write(tmp_path / "p.yaml", online_pipeline("run", "unused", rows="random",
                                                      pack=dict(rows=2, tokens_per_row=80), train=TINY_TRAIN))
    pipeline = load_pipeline(str(path), pm)
    assert pipeline.upstream_facts("extract")[ROW_TOKENS] == 80
    assert pipeline.upstream_facts("train")[ROW_TOKENS] == 80


@pytest.mark.parametrize("validation_share", [0.0, 0.5])
def test_a_warmed_trainer_trains_the_weights_of_an_unwarmed_one(tmp_path: Path, validation_share: float) -> None:
    """The warm-up's backward leaves gradients that the first step would add to, and an optimizer
    step on them would move the weights: neither may survive it."""
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, validation_share=validation_share)
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"])
    cold = trainer(cfg, header(target, LAYERS), tmp_path / "cold")
    warm = trainer(cfg, header(target, LAYERS), tmp_path / "warm")
    before, opt_before, rng = copy.deepcopy(warm.model.state_dict()), copy.deepcopy(warm.opt.state_dict()), \
        torch.get_rng_state()

    assert warm.warm_up(T) >= 0 and warm.ctx.summary["warm_up_s"] >= 0
    assert warm.step == 0 and all(p.grad is None for p in warm.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in warm.model.state_dict().items())
    assert warm.opt.state_dict() == opt_before and torch.equal(torch.get_rng_state(), rng)

    for row in rows:
        cold.train_step([row])
        warm.train_step([row])
    assert weights_digest(warm.model) == weights_digest(cold.model)
    for a, b in zip(warm.opt.state.values(), cold.opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_after_the_trainers_warm_up_its_first_row_runs_warm(tmp_path: Path, monkeypatch) -> None:
    """The step's and the validation's graphs compile in the warm-up, each held alone; the rows'
    calls then all run beside the target's (without it the first row's two are held alone:
    test_train_step.test_a_training_step_compiles_alone_after_a_validation_of_its_row_length)."""
    gate = recording_gate(monkeypatch)
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, validation_share=0.5)
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"], docs_per_row=6)[:3]
    t = trainer(cfg, header(target, LAYERS), tmp_path)
    t.warm_up(T)
    assert gate.calls == [True, True]
    for row in rows:
        assert t.train_step([row]).val_stats  # every row holds validation documents at this share
    assert gate.calls == [True, True] + [False] * 6


def rows_of_40() -> list[dict]:
    """Two packed rows of 40 tokens, two documents each."""
    rng = np.random.default_rng(0)
    return [packed_row([rng.integers(0, 5999, 25), rng.integers(0, 5999, 15)]) for _ in range(2)]


def extract_items(target: Path, rows: Iterable[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, facts: dict,
                  warm_up: str, **cfg: str) -> tuple[list[dict], dict, RecordingGate]:
    """extract's items and summary for ``rows``, given pack's ``facts``, through a gate of its own."""
    from dflash_stages import extract as extract_module

    gate = RecordingGate()
    monkeypatch.setattr(extract_module, "GATE", gate)
    stage = HFHooksExtract(ExtractConfig(model=str(target), layers=[0, 1], warm_up=warm_up, **cfg))
    ctx = StageContext(stage="extract", config=stage.config, device="cpu", run_dir=str(tmp_path),
                       work_dir=str(tmp_path), cache_dir=str(tmp_path), upstream_facts=facts)
    return list(stage.run({"rows": rows}, ctx)), ctx.summary, gate


@pytest.mark.parametrize("facts,warm_up,warmed", [
    ({ROW_TOKENS: 40}, "on", True),
    ({}, "on", False),                  # rows of several lengths: nothing to warm up for
    ({ROW_TOKENS: 40}, "off", False),
    ({ROW_TOKENS: 40}, "auto", False),  # the CPU's forward does not compile
])
def test_extracts_warm_up_is_a_forward_of_the_rows_length_before_the_first(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch, facts: dict, warm_up: str,
        warmed: bool) -> None:
    target = tiny_target(tmp_path_factory.getbasetemp(), initializer_range=0.1)
    rows = rows_of_40()
    plain, _, _ = extract_items(target, rows, tmp_path / "plain", monkeypatch, {}, "off")
    items, summary, gate = extract_items(target, rows, tmp_path, monkeypatch, facts, warm_up)
    # held alone: the warm-up, else the first row
    assert gate.calls == ([True, False, False] if warmed else [True, False])
    assert ("warm_up_s" in summary) == warmed
    for a, b in zip(items[1:], plain[1:], strict=True):
        assert torch.equal(a["features"], b["features"])


def test_a_warmed_pipeline_ends_in_the_train_state_of_an_unwarmed_one(tmp_path: Path,
                                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    target = tiny_target(tmp_path_factory.getbasetemp())
    results = {}
    for mode, run in (("on", "warm"), ("off", "cold")):
        path = write(tmp_path / f"{run}.yaml", online_pipeline(
            run, target, rows="random", pack=dict(rows=4, tokens_per_row=64, vocab_size=5999),
            train=dict(TINY_TRAIN, warm_up=mode), extract=dict(warm_up=mode), checkpoint=dict(every_steps=100)))
        results[mode] = run_in_process(path)
        assert all(r.status == "done" for r in results[mode].values()), results[mode]
    for stage in ("extract", "train"):
        assert results["on"][stage].summary["warm_up_s"] >= 0 and "warm_up_s" not in results["off"][stage].summary
    assert_same_train_state(latest(tmp_path / "warm"), latest(tmp_path / "cold"), "warmed vs not")


def test_compiled_the_warm_up_leaves_nothing_for_the_first_rows_to_compile(tmp_path: Path) -> None:
    """With ``compile: on`` (Inductor's CPU backend here; the drafter's attention is SDPA's, not
    flex's as on CUDA) the warm-up's random tokens and zero features compile every graph the rows
    then take: shapes, dtypes and strides alike, validation included."""
    from torch._dynamo.utils import counters

    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, compile="on", validation_share=0.5)
    target = tiny_qwen3()
    t = trainer(cfg, header(target, LAYERS), tmp_path)
    assert t.compiled
    counters.clear()
    t.warm_up(T)
    compiled = dict(counters["stats"])
    assert compiled["unique_graphs"] >= 2  # the step's and the validation's
    for row in feature_rows(target["hidden_size"], docs_per_row=6)[:3]:
        assert t.train_step([row]).val_stats
    assert dict(counters["stats"]) == compiled


def test_compiled_extracts_warm_up_compiles_the_one_graph_its_rows_take(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch) -> None:
    from torch._dynamo.utils import counters

    target = tiny_target(tmp_path_factory.getbasetemp(), initializer_range=0.1)
    at_first_row: list[dict] = []

    def rows():  # pack's stream: what was compiled when extract asks for its first row
        at_first_row.append(dict(counters["stats"]))
        yield from rows_of_40()

    counters.clear()
    items, summary, gate = extract_items(target, rows(), tmp_path, monkeypatch, {ROW_TOKENS: 40}, "on",
                                         compile="on")
    assert len(items) == 3 and summary["warm_up_s"] > 0 and gate.calls == [True, False, False]
    assert at_first_row[0]["unique_graphs"] == 1
    assert dict(counters["stats"]) == at_first_row[0]  # the rows (two documents, not three) took the warm-up's


def test_extract_reports_a_rows_forward_time(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                            monkeypatch) -> None:
    """``forward_ms``: the mean time of a row's forward, apart from the waits around it."""
    from dflash_model.target.capture import FeatureCapture

    real = FeatureCapture.capture_row

    def slow(self, row):  # a forward of at least 50 ms
        time.sleep(0.05)
        return real(self, row)

    def late_rows() -> Iterable[dict]:  # pack's rows come late: not counted
        for row in rows_of_40():
            time.sleep(0.5)
            yield row

    monkeypatch.setattr(FeatureCapture, "capture_row", slow)
    target = tiny_target(tmp_path_factory.getbasetemp(), initializer_range=0.1)
    items, summary, _ = extract_items(target, late_rows(), tmp_path, monkeypatch, {}, "off")
    assert summary["rows"] == len(rows_of_40()) and 50 <= summary["forward_ms"] < 450


def test_the_trainer_says_when_its_first_row_came_and_its_first_step_was_done(tmp_path: Path) -> None:
    """Counted from the stage's start (the trainer's making), not from the loop's."""
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2)
    target = tiny_qwen3()
    t = trainer(cfg, header(target, LAYERS), tmp_path)
    rows = feature_rows(target["hidden_size"])

    def late() -> Iterable[dict]:  # the stages upstream take a while to send the first row
        time.sleep(0.5)
        yield from rows

    time.sleep(0.3)  # and the loop starts a while after the stage
    assert list(t.fit(late()))[-1]["final"]
    assert 0.8 <= t.ctx.summary["first_row_s"] <= t.ctx.summary["first_step_s"]
    first = json.loads(Path(t.metrics.path).read_text().splitlines()[0])
    assert first["row_wait_share"] * first["elapsed_s"] >= 0.5  # the first window waited for its row
