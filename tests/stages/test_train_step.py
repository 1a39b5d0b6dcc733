"""``Trainer.train_step`` is the step the training loop takes: the same rows through N calls of
it end in the weights, optimizer state and logged metrics of ``Trainer.fit`` on those rows (the
loop of the train stage), a last partial step included. ``dflash-pipe plan`` and the benchmarks
time this method, so this is what makes their figures the figures of a run. And a trainer's
``state_dict`` is all its next step depends on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_stages.pack.random_rows import RandomRowsConfig, random_row
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.trainer import weights_digest
from tests.stages.test_drafter_init import header, tiny_qwen3, trainer

LAYERS = [0, 2]
ROWS = 5


def feature_rows(hidden: int) -> list[dict[str, Any]]:
    """Rows as extract sends them (random features), each reporting the epoch as pack does."""
    cfg = RandomRowsConfig(rows=ROWS, tokens_per_row=96, vocab_size=499)
    g = torch.Generator().manual_seed(1)
    return [dict(random_row(cfg, i), kind="row", features=torch.randn(96, len(LAYERS) * hidden, generator=g),
                 last_hidden=None, rows_per_epoch=ROWS, epochs=1, state={"position": i + 1}, state_stage="pack")
            for i in range(ROWS)]


def test_train_step_is_the_loops_step(tmp_path: Path) -> None:
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, rows_per_step=2, log_every=1)
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"])

    looped = trainer(cfg, header(target, LAYERS), tmp_path / "loop")
    snapshots = list(looped.fit(iter(rows)))
    assert looped.step == 3 and snapshots[-1]["final"]  # 2 full steps and a partial one
    logged = [json.loads(line) for line in (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]

    stepped = trainer(cfg, header(target, LAYERS), tmp_path / "steps")
    done = [stepped.train_step(rows[i:i + cfg.rows_per_step]) for i in range(0, ROWS, cfg.rows_per_step)]
    assert stepped.train_step([]) is None and stepped.step == 3  # no rows: no step
    assert [d.rows for d in done] == [2, 2, 1] and stepped.total == looped.total == 2

    assert weights_digest(stepped.model) == weights_digest(looped.model)
    for a, b in zip(stepped.opt.state.values(), looped.opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in logged] == [1, 2, 3]
    for record, d in zip(logged, done):
        loss = torch.stack([s["loss"].double() for s in d.row_stats]).mean().item()
        assert record["loss"] == loss and record["grad_norm"] == float(d.grad_norm)
    assert [r["lr"] for r in logged[:2]] == [d.lr for d in done[:2]]


def test_train_step_refuses_more_rows_than_a_step_takes(tmp_path: Path) -> None:
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, rows_per_step=1)
    target = tiny_qwen3()
    t = trainer(cfg, header(target, LAYERS), tmp_path)
    with pytest.raises(ValueError, match="rows_per_step"):
        t.train_step(feature_rows(target["hidden_size"])[:2])


def test_a_trainer_loaded_with_another_ones_state_steps_identically(tmp_path: Path) -> None:
    """``state_dict`` is all a trainer's future depends on: one that has trained elsewhere, then
    loads it, takes the same next step (weights, optimizer state, loss, LR, RNG, data cursors)."""
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, rows_per_step=1)
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"])
    source = trainer(cfg, header(target, LAYERS), tmp_path / "source")
    for row in rows[:2]:
        source.train_step([row])
    source.data_state = {"pack": {"position": 2}}
    torch.rand(3)  # the RNG off where a new trainer's setup leaves it: loading must bring it back
    state = copy.deepcopy(source.state_dict())

    loaded = trainer(cfg, header(target, LAYERS), tmp_path / "loaded")
    loaded.train_step([rows[4]])  # somewhere else: other weights, moments and step
    loaded.load_state_dict(state)
    assert loaded.step == 2 and loaded.data_state == {"pack": {"position": 2}}
    assert torch.equal(torch.get_rng_state(), state["rng"]["cpu"])

    expected, got = source.train_step(rows[2:3]), loaded.train_step(rows[2:3])
    assert weights_digest(loaded.model) == weights_digest(source.model)
    for a, b in zip(loaded.opt.state.values(), source.opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert got.lr == expected.lr and torch.equal(got.grad_norm, expected.grad_norm)
    assert torch.equal(got.row_stats[0]["loss"], expected.row_stats[0]["loss"])
