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


def test_steps_per_row_takes_k_steps_on_each_row_with_disjoint_anchors(tmp_path: Path) -> None:
    """``steps_per_row: 3``: 5 rows give 15 optimizer steps, the LR schedule spans them, the three
    steps of a row take three disjoint draws of its anchors (the row's one draw of 3 x 8, cut in
    three), its tokens count at the first step only, and the loop's weights are those of the
    same steps taken one by one."""
    from dflash_model.drafter import FeatureBatch, sample_anchor_shares

    k = 3
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, steps_per_row=k, log_every=1)
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"])

    looped = trainer(cfg, header(target, LAYERS), tmp_path / "loop")
    snapshots = list(looped.fit(iter(rows)))
    assert looped.step == ROWS * k == looped.total and snapshots[-1]["final"]

    stepped = trainer(cfg, header(target, LAYERS), tmp_path / "steps")
    for i, row in enumerate(rows):
        done = [stepped.train_step([row]) for _ in range(k)]
        shares = [d.anchors[0].tolist() for d in done]
        drawn = [a for share in shares for a in share]
        assert len(drawn) == len(set(drawn)) == 3 * 8  # 24 distinct anchors, 8 a step
        batch = FeatureBatch.from_row(row, torch.device("cpu"))
        gen = torch.Generator().manual_seed(hash((cfg.seed, i * k, 0)) & 0x7FFFFFFFFFFFFFFF)
        want = sample_anchor_shares(batch.loss_mask, batch.doc_lengths, 8, k, gen)
        assert shares == [w.tolist() for w in want]
        assert [d.tokens for d in done] == [96, 0, 0]
    assert weights_digest(stepped.model) == weights_digest(looped.model)


def test_steps_per_row_spreads_a_short_rows_anchors_over_its_steps(tmp_path: Path) -> None:
    """4 steps of up to 64 anchors on rows of 84 candidates: 21 anchors a step, every candidate
    once, rather than 64, 20 and two steps with nothing to learn (which once stopped a GPU run:
    the Triton norm of no gradients)."""
    from dflash_model.drafter import FeatureBatch, anchor_candidates, doc_ids_from_lengths

    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=64, lr=1e-2, steps_per_row=4)
    target = tiny_qwen3()
    row = feature_rows(target["hidden_size"])[0]
    batch = FeatureBatch.from_row(row, torch.device("cpu"))
    cand = anchor_candidates(batch.loss_mask, doc_ids_from_lengths(batch.doc_lengths, batch.loss_mask.shape[0]))
    assert cand.numel() == 84
    t = trainer(cfg, header(target, LAYERS), tmp_path)
    shares = [t.train_step([row]).anchors[0].tolist() for _ in range(4)]
    assert [len(a) for a in shares] == [21] * 4
    assert sorted(a for share in shares for a in share) == cand.tolist()


def test_steps_per_row_snapshots_between_rows_and_resumes_into_the_same_weights(tmp_path: Path) -> None:
    """A snapshot every 4 steps with 2 steps a row falls after rows 2 and 4, never inside a row;
    a trainer that loads the first one and trains on the rows after its cursor ends with the
    weights of the uninterrupted run."""
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, steps_per_row=2, checkpoint_every=4)
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"])
    whole = trainer(cfg, header(target, LAYERS), tmp_path / "whole")
    snaps = list(whole.fit(iter(rows)))
    assert [(s["step"], s["pipeline_state"]["pack"]) for s in snaps] == [
        (4, {"position": 2}), (8, {"position": 4}), (10, {"position": 5})]

    first = snaps[0]
    resumed = trainer(cfg, header(target, LAYERS), tmp_path / "resumed")
    resumed.load_state_dict({"model": first["model"], "optimizer": first["optimizer"], "step": first["step"],
                             "rng": first["rng"], "data": {"pack": first["pipeline_state"]["pack"]}})
    list(resumed.fit(iter(rows[2:])))
    assert resumed.step == 10 and weights_digest(resumed.model) == weights_digest(whole.model)


def test_steps_per_row_refuses_what_cannot_hold() -> None:
    from dflash_stages.train.snapshots import SnapshotPolicy

    with pytest.raises(ValueError, match="exclude each other"):
        TrainConfig(rows_per_step=2, steps_per_row=2)
    with pytest.raises(ValueError, match="multiple of 3"):
        SnapshotPolicy(every=10, steps_per_row=3)
    policy = SnapshotPolicy.for_trainer(0, {"checkpoint": {"snapshot_about_every": 10}}, 1, 1, 3)
    assert policy.every == 12 and policy.boundary(12) and not policy.boundary(13)
