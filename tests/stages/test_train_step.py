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

from dflash_model.fast.compile_gate import CompileGate
from dflash_stages.pack.random_rows import RandomRowsConfig, random_row
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.trainer import weights_digest
from tests.stages.test_drafter_init import header, tiny_qwen3, trainer

LAYERS = [0, 2]
ROWS = 5


class RecordingGate(CompileGate):
    """The compile gate with every call taken as a compiled one (CUDA's case), recording whether
    each call was held alone (cold) or ran beside others (warm)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def call(self, party, key=None, compiled=True):
        self.calls.append(not self.is_warm(party, key))
        return super().call(party, key, True)


def recording_gate(monkeypatch: pytest.MonkeyPatch) -> RecordingGate:
    """A :class:`RecordingGate` in place of the trainer's."""
    from dflash_stages.train import trainer as trainer_module

    gate = RecordingGate()
    monkeypatch.setattr(trainer_module, "GATE", gate)
    return gate


def feature_rows(hidden: int, docs_per_row: int = 3) -> list[dict[str, Any]]:
    """Rows as extract sends them (random features), each reporting the epoch as pack does."""
    cfg = RandomRowsConfig(rows=ROWS, tokens_per_row=96, docs_per_row=docs_per_row, vocab_size=499)
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


def test_a_validation_document_is_chosen_by_its_tokens_alone() -> None:
    """``validation_tokens``: whole documents, the same document chosen in any row at any place,
    none at share 0, about ``share`` of many documents."""
    import numpy as np

    from dflash_model.drafter import FeatureBatch
    from dflash_stages.train.trainer import validation_tokens

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5000, n) for n in rng.integers(5, 40, 2000)]

    def batch(chosen: list) -> FeatureBatch:
        ids = torch.as_tensor(np.concatenate(chosen)).long()
        return FeatureBatch(features=torch.zeros(len(ids), 1), input_ids=ids, loss_mask=torch.ones_like(ids),
                            position_ids=torch.zeros_like(ids), doc_lengths=[len(d) for d in chosen])

    def chosen(row: list, share: float) -> list[bool]:
        held = validation_tokens(batch(row), share)
        out, start = [], 0
        for d in row:
            part = torch.zeros(len(d), dtype=torch.bool) if held is None else held[start:start + len(d)]
            assert bool(part.all()) or not bool(part.any())  # whole documents
            out.append(bool(part.all()))
            start += len(d)
        return out

    every = chosen(docs, 0.25)
    assert 0.2 < sum(every) / len(docs) < 0.3
    assert chosen(docs[::-1], 0.25) == every[::-1]  # other neighbours, other places
    assert chosen(docs[5:9], 0.25) == every[5:9]
    assert validation_tokens(batch(docs[:50]), 0.0) is None


def test_validation_documents_are_measured_and_never_trained_on(tmp_path: Path) -> None:
    """With ``validation_share`` the trainer takes no anchor in a validation document and trains
    exactly as on the same rows with those documents unsupervised; it measures them once a row
    (at the row's first of ``steps_per_row`` steps) without a gradient, and the metrics record
    averages what it measured as val_*."""
    from dflash_model.drafter import FeatureBatch
    from dflash_model.target.spec_decode import served_tau
    from dflash_stages.train.metrics import walked_cycles
    from dflash_stages.train.trainer import validation_tokens

    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, steps_per_row=2, log_every=2,
                      validation_share=0.15)
    target = tiny_qwen3()
    rows = []
    for i in range(ROWS):  # 6 documents a row, so that rows differ in how many are validation ones
        cfg_rows = RandomRowsConfig(rows=ROWS, tokens_per_row=96, docs_per_row=6, vocab_size=499)
        rows.append(dict(random_row(cfg_rows, i), kind="row",
                         features=torch.randn(96, len(LAYERS) * target["hidden_size"],
                                              generator=torch.Generator().manual_seed(i)),
                         last_hidden=None, rows_per_epoch=ROWS, epochs=1, state={"position": i + 1},
                         state_stage="pack"))
    held = [validation_tokens(FeatureBatch.from_row(r, torch.device("cpu")), cfg.validation_share) for r in rows]
    assert 0 < sum(h is not None for h in held) < ROWS
    masked = [dict(r, loss_mask=torch.as_tensor(r["loss_mask"]).long() * (1 if h is None else ~h))
              for r, h in zip(rows, held)]

    measured = trainer(cfg, header(target, LAYERS), tmp_path / "val")
    plain_cfg = TrainConfig(**{**cfg.__dict__, "validation_share": 0.0})
    plain = trainer(plain_cfg, header(target, LAYERS), tmp_path / "plain")
    for row, row_masked, h in zip(rows, masked, held):
        for share in range(cfg.steps_per_row):
            a, b = measured.train_step([row]), plain.train_step([row_masked])
            assert torch.equal(a.anchors[0], b.anchors[0])
            if h is not None:
                assert not h[a.anchors[0]].any()  # no anchor in a validation document
            assert len(a.val_stats) == (1 if h is not None and share == 0 else 0) and not b.val_stats
            for s in a.val_stats:
                assert torch.isfinite(s["loss"]) and 1.0 <= served_tau(walked_cycles([s["walk"]])) <= cfg.block_size
            measured.metrics.add(a)
            measured.metrics.stepped(measured.step, measured.total, a)
    assert weights_digest(measured.model) == weights_digest(plain.model)

    logged = [json.loads(line) for line in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == ROWS  # log_every 2: one record per row
    for record, h in zip(logged, held):
        assert ("val_tau_serve" in record) == (h is not None)
    with pytest.raises(ValueError, match="validation_share"):
        TrainConfig(validation_share=1.0)
    with pytest.raises(ValueError, match="validation_max_new_tokens"):
        TrainConfig(validation_max_new_tokens=0)


def test_a_training_step_compiles_alone_after_a_validation_of_its_row_length(tmp_path: Path, monkeypatch) -> None:
    """The validation of a row (no gradient) and the training step on it compile different graphs:
    the validation having run at a row length must not let the step's first call at that length run
    beside the target's compiled forward (the lazy backward compile flags FX tracing process-wide,
    and extract's compiled call then fails). Each is held alone at its first call, then runs warm."""
    gate = recording_gate(monkeypatch)
    cfg = TrainConfig(num_layers=1, block_size=4, num_anchors=8, lr=1e-2, validation_share=0.5)
    target = tiny_qwen3()
    rows = feature_rows(target["hidden_size"], docs_per_row=6)[:3]
    t = trainer(cfg, header(target, LAYERS), tmp_path)
    for row in rows:
        assert t.train_step([row]).val_stats  # every row holds validation documents at this share
    # per row: the validation, then the step
    assert gate.calls == [True, True, False, False, False, False]


@pytest.mark.parametrize("cap", [None, 9])
def test_val_tau_serve_is_a_decode_walked_over_the_validation_text(tmp_path: Path, cap: int | None) -> None:
    """val_tau_serve is what a served decode would make on the validation documents: each response
    walked from its first token, every next cycle at the last anchor plus its τ (capped by the
    tokens left: to the response's end, or to ``validation_max_new_tokens`` from its start, as a
    decode with that max_new_tokens), counted over the cycles with a whole block. Each anchor's τ
    is taken here from the drafter on that one block alone, before the step trains; the trainer
    takes them 8 at a time."""
    from dataclasses import replace

    from dflash_model.drafter import FeatureBatch
    from dflash_stages.train.trainer import validation_tokens

    B = 4
    cfg = TrainConfig(num_layers=1, block_size=B, num_anchors=8, lr=1e-2, log_every=1, validation_share=0.5,
                      validation_max_new_tokens=cap)
    target = tiny_qwen3()
    rows_cfg = RandomRowsConfig(rows=ROWS, tokens_per_row=96, docs_per_row=3, vocab_size=499)
    features = torch.randn(96, len(LAYERS) * target["hidden_size"], generator=torch.Generator().manual_seed(1))
    row = dict(random_row(rows_cfg, 1), kind="row", last_hidden=None, rows_per_epoch=ROWS, epochs=1,
               features=features, state={"position": 2}, state_stage="pack")
    tr = trainer(cfg, header(target, LAYERS), tmp_path / "val")
    learnt = trainer(replace(cfg, validation_share=0.0, validation_max_new_tokens=None, num_anchors=96,
                             total_steps=200, warmup_ratio=0.0),
                     header(target, LAYERS), tmp_path / "learnt")
    for _ in range(45):  # the row half by heart, its validation documents too: τ of 1 to B to walk over
        learnt.train_step([row])
    tr.model.load_state_dict(learnt.model.state_dict())
    batch = FeatureBatch.from_row(row, torch.device("cpu"))
    held = validation_tokens(batch, cfg.validation_share)
    assert held is not None and not bool(held.all())
    val = replace(batch, loss_mask=batch.loss_mask * held)
    mask, docs = val.loss_mask.tolist(), [d for d, n in enumerate(batch.doc_lengths) for _ in range(n)]
    tau = {a: round(float(tr._loss(val, torch.tensor([a])).block_tau[0]))
           for a in range(95) if mask[a] and mask[a + 1] and docs[a] == docs[a + 1]}
    cycles, uncapped = [], 0
    for start in (i for i in range(96) if mask[i] and (i == 0 or not mask[i - 1] or docs[i - 1] != docs[i])):
        end = next((j for j in range(start, 96) if not mask[j] or docs[j] != docs[start]), 96)
        stop = end if cap is None else min(end, start + cap - 1)  # the decode's last token: the response's
        a = start                                                # end token (end), or its max_new_tokens-th
        while a in tau:  # a decode drafts at most up to its last token
            uncapped += 1
            if a < stop:
                budget = min(B - 1, stop - 1 - a)
                cycles.append((min(tau[a], budget + 1), budget == B - 1))
            a += min(tau[a], end - a)
    whole = [t for t, w in cycles if w]
    assert {1, B} <= set(whole) or cap is not None
    assert len(cycles) < uncapped if cap is not None else len(whole) < len(cycles)  # the cap cuts the walk

    step = tr.train_step([row])
    tr.metrics.add(step)
    tr.metrics.stepped(tr.step, tr.total, step)
    record = json.loads((tmp_path / "val" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["val_tau_serve"] == pytest.approx(sum(whole) / len(whole))
    assert record["val_cycles"] == len(whole)
    assert record["epoch"] == 1 / ROWS  # one row an epoch, one step a row
    assert record["val_tau_sim"] > record["val_tau_serve"] + 0.5  # the mean over every anchor is another figure


def test_supervised_spans_are_runs_of_supervised_tokens_within_one_document() -> None:
    """Each run of supervised tokens is a span of its own; a document boundary ends one even where
    the next document's tokens are supervised too (a packed row), and a trailing run ends at the row."""
    from dflash_stages.train.trainer import supervised_spans

    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1])
    docs = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2])
    assert supervised_spans(mask, docs) == [(2, 5), (7, 9), (9, 11), (12, 13)]
    assert supervised_spans(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)) == []
