"""benchmarks/side_by_side.py and train:specforge: the reference trainer is fed what train:dflash
sees (the same documents, tokens, loss masks and features), from a pipeline that differs from ours
only in its train stage. SpecForge itself runs only on the GPU benchmark (docs/quality.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from benchmarks.side_by_side import apply_sets, drop_evaluate, reference_pipeline
from benchmarks.specforge_train import Document, SpecForgeTrain, batch, documents, import_specforge, step_cost
from dflash_core.rows import feature_row, producer_fields
from dflash_stages.pack.packing import BestFitPacker, SampleIndex
from tests.stages.online_fixtures import tiny_target

REPO = Path(__file__).resolve().parents[2]


def samples(rng: np.random.Generator) -> list[dict[str, list[int]]]:
    """Documents of several lengths, each a prompt (unsupervised) then a supervised answer,
    one with a single supervised token (no anchor candidate)."""
    out = []
    for prompt, answer in ((5, 9), (3, 1), (7, 14), (4, 6)):
        ids = rng.integers(10, 5000, prompt + answer).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * answer})
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, list[int]]], dict, object]:
    """The samples packed into one padded row as pack:best_fit does, and its feature row as
    extract:hf_hooks makes it (a tiny random Qwen3, fp32, hooks on layers 0-2)."""
    from dflash_model.target.capture import FeatureCapture
    from dflash_model.target.load import load_target

    docs = samples(np.random.default_rng(0))
    packer = BestFitPacker(SampleIndex.build(docs), tokens_per_row=64, pad_to=64, pad_token_id=0)
    row = next(iter(packer))
    row.update(producer_fields(state=packer.state_dict(), stage="pack", epochs=1, rows_per_epoch=1))
    model, _ = load_target(str(tiny_target(tmp_path_factory.getbasetemp(), initializer_range=0.1)), "cpu",
                           "float32", "sdpa")
    capture = FeatureCapture(model, [0, 1, 2])
    feats, _ = capture.capture_row(row)
    return docs, feature_row(row, feats), capture


def test_a_row_splits_into_the_documents_train_dflash_sees(packed: tuple) -> None:
    docs, row, capture = packed
    assert int(row["num_pad"]) > 0  # the row ends in padding, which is not a document
    split = documents(row)
    order = [int(s) for s in row["samples"]]
    assert len(split) == len(docs) == len(order)
    for got, sid in zip(split, order):
        want = docs[sid]
        assert got.input_ids.tolist() == want["input_ids"]
        assert got.loss_mask.tolist() == [float(m) for m in want["loss_mask"]]
        # the features are the row's own rows, and equal the target run on the document alone
        alone, _ = capture.capture(got.input_ids[None], torch.arange(len(got.input_ids))[None])
        torch.testing.assert_close(got.features, alone[0], atol=1e-5, rtol=1e-5)
    assert sum(len(d.input_ids) for d in split) == sum(len(d["input_ids"]) for d in docs)


def test_anchor_candidates_are_train_dflash_s(packed: tuple) -> None:
    from dflash_model.drafter.anchors import anchor_candidates, doc_ids_from_lengths

    _, row, _ = packed
    mask = torch.as_tensor(row["loss_mask"])
    ours = anchor_candidates(mask, doc_ids_from_lengths(row["doc_lengths"][:-1], len(mask)))
    bounds = np.cumsum([0] + [int(n) for n in row["doc_lengths"][:-1]])
    split = documents(row)
    assert [d.candidates for d in split] == [
        int(((ours >= lo) & (ours < hi)).sum()) for lo, hi in zip(bounds[:-1], bounds[1:])]
    assert 0 in [d.candidates for d in split]  # the one-token answer: SpecForge cannot train on it


def test_a_batch_pads_on_the_right_with_nothing_supervised() -> None:
    a = Document(torch.tensor([7, 8, 9]), torch.tensor([0.0, 1.0, 1.0]), torch.ones(3, 2))
    b = Document(torch.tensor([4]), torch.tensor([1.0]), torch.full((1, 2), 2.0))
    ids, feats, mask = batch([a, b], "cpu")
    assert ids.tolist() == [[7, 8, 9], [4, 0, 0]]
    assert mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert feats.tolist() == [[[1.0, 1.0]] * 3, [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]]


def test_a_step_costs_the_padded_width_and_counts_the_real_blocks() -> None:
    from dflash_model.drafter import DrafterConfig, training_flops

    cfg = DrafterConfig.from_target(dict(model_type="qwen3", hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, vocab_size=1000),
                                    num_layers=2, block_size=4, mask_token_id=999)
    blocks, flop = step_cost(cfg, seq_len=50, counts=[30, 5, 12], num_anchors=16)
    assert blocks == 16 + 5 + 12
    assert flop == training_flops(cfg, 3 * 50, 3 * 16, 0, lm_head_rows=3 * 16 * 4)["step"]


def test_the_reference_pipeline_differs_from_ours_only_in_train() -> None:
    from dflash_core.pipeline_file import load_pipeline_text
    from dflash_core.plugins import PluginManager
    import benchmarks.specforge_train as plugin

    base = yaml.safe_load((REPO / "pipelines" / "quality_gpu.yaml").read_text())
    base["stages"].pop("generate")
    base["stages"]["tokenize"]["after"] = "download"
    ours = drop_evaluate(base)
    ref = apply_sets(reference_pipeline(base, "/opt/SpecForge", Path("/tmp/x/export")),
                     {"stages.train.params.batch_size": "8"})
    assert list(ours["stages"]) == ["download", "tokenize", "pack", "extract", "train", "checkpoint"]
    assert list(ref["stages"]) == ["download", "tokenize", "pack", "extract", "train"]
    for name in ("download", "tokenize", "extract"):
        assert ref["stages"][name] == ours["stages"][name]
    assert ref["stages"]["pack"]["params"] == {**ours["stages"]["pack"]["params"], "epochs": 1}
    train, ours_train = ref["stages"]["train"]["params"], ours["stages"]["train"]["params"]
    assert ref["stages"]["train"]["uses"] == "train:specforge"
    assert train == {"specforge": "/opt/SpecForge", "export": "/tmp/x/export",
                     "epochs": base["stages"]["pack"]["params"]["epochs"], "heldout": ours_train["heldout"],
                     "num_layers": ours_train["num_layers"], "block_size": ours_train["block_size"],
                     "mask_token_id": ours_train["mask_token_id"], "batch_size": 8}
    pm = PluginManager(autoload=False)
    pm.add_plugin(plugin, "specforge_train")
    pipeline = load_pipeline_text(yaml.safe_dump(ref), pm, check_devices=False, base_dir=str(REPO / "pipelines"))
    assert pipeline is not None


def test_the_stage_refuses_rows_of_several_epochs_and_a_missing_checkout(tmp_path: Path) -> None:
    from dflash_core import StageContext

    stage = SpecForgeTrain(SpecForgeTrain.Config())
    row = {"epochs": 2, "doc_lengths": [2], "input_ids": [1, 2], "loss_mask": [1, 1], "features": torch.zeros(2, 1)}
    with pytest.raises(ValueError, match="set the pack stage's epochs to 1"):
        stage._collect(iter([row]), torch.device("cpu"), StageContext(stage="train", config=None))
    with pytest.raises(ValueError, match="needs a SpecForge checkout"):
        import_specforge(str(tmp_path))


def test_training_prompts_are_the_first_download_source_of_the_quality_file(tmp_path: Path) -> None:
    """--train-prompts serves the prompts the records were generated from: the download source
    (the first of a list), resolved against the pipeline file's folder."""
    from benchmarks.side_by_side import training_prompts

    base = yaml.safe_load((REPO / "pipelines" / "quality_gpu.yaml").read_text())
    assert training_prompts(base, REPO / "pipelines") == str(REPO / "pipelines/data/sharegpt/train.jsonl")
    base["stages"]["download"]["params"]["source"] = ["data/sharegpt/train_later.jsonl", "data/other.jsonl"]
    assert training_prompts(base, tmp_path) == str(tmp_path / "data/sharegpt/train_later.jsonl")


def test_split_figures_read_the_reports_ngram_split() -> None:
    """The table's 'where τ is lost' columns, from a session-18 report (SpecForge's point): DFlash
    1.87 and n-gram 3.34 where n-gram had a match, 1.54 and 1.00 on new text."""

    from benchmarks.side_by_side import split_figures

    report = json.loads((REPO / "docs/data/quality_2026-12-02_session18/sf-3ep-b8_eval.json").read_text())
    got = {k: round(v, 2) for k, v in split_figures(report).items()}
    assert got == {"tau_copy": 1.87, "copy_share": 0.76, "tau_ngram_copy": 3.34, "tau_new": 1.54,
                   "tau_ngram_new": 1.0}
    assert split_figures({}) == {}


def test_an_evaluation_starts_as_its_training_ends_beside_the_queue(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``on_exit`` is called once per process as it ends, with its return code; what it returns (a
    point's evaluation) starts at once, outside the ``parallel`` limit, beside the next queued
    training, and is itself handed to ``on_exit`` when it ends, before that training has."""
    import subprocess
    import sys

    from benchmarks.side_by_side import run_queued

    log = tmp_path / "log"
    code = ("import sys, time; f = open(sys.argv[1], 'a'); f.write(f'start {sys.argv[2]}\\n'); f.flush(); "
            "time.sleep(float(sys.argv[3])); f.write(f'end {sys.argv[2]}\\n'); sys.exit(int(sys.argv[4]))")

    def start(name: str, seconds: float, rc: int = 0):
        return lambda: subprocess.Popen([sys.executable, "-c", code, str(log), name, str(seconds), str(rc)])

    ended: list[tuple[object, int]] = []

    def on_exit(key: object, rc: int, seconds: float) -> dict | None:
        ended.append((key, rc))
        return {("fast", "eval"): start("fast-eval", 0.5)} if key == "fast" else None

    done = run_queued({"fast": start("fast", 0.0, 3), "slow": start("slow", 3.0)}, 1, on_exit)
    assert ended == [("fast", 3), (("fast", "eval"), 0), ("slow", 0)]
    assert {k: v[0] for k, v in done.items()} == {"fast": 3, ("fast", "eval"): 0, "slow": 0}
    events = log.read_text().splitlines()
    assert events[:2] == ["start fast", "end fast"]
    assert sorted(events[2:4]) == ["start fast-eval", "start slow"]
    assert events[4:] == ["end fast-eval", "end slow"]
    assert "fast exited 3" in capsys.readouterr().out


def test_at_most_parallel_points_train_at_once_in_the_order_given(tmp_path: Path) -> None:
    """--parallel N: the first N points start, and each later one starts only when one has ended.
    Each process writes to a shared log as it starts and ends; b outlasts a and c by seconds."""
    import subprocess
    import sys

    from benchmarks.side_by_side import run_queued

    code = ("import sys, time; f = open(sys.argv[1], 'a'); f.write(f'start {sys.argv[2]}\\n'); f.flush(); "
            "time.sleep(float(sys.argv[3])); f.write(f'end {sys.argv[2]}\\n')")

    def events(parallel: int) -> list[str]:
        log = tmp_path / f"log{parallel}"
        done = run_queued({name: (lambda name=name, s=s: subprocess.Popen([sys.executable, "-c", code, str(log),
                                                                           name, str(s)]))
                           for name, s in (("a", 0.2), ("b", 3.0), ("c", 0.2))}, parallel)
        assert {k: v[0] for k, v in done.items()} == {"a": 0, "b": 0, "c": 0}
        return log.read_text().splitlines()

    assert events(1) == ["start a", "end a", "start b", "end b", "start c", "end c"]
    two = events(2)
    assert sorted(two[:2]) == ["start a", "start b"]
    assert two.index("end a") < two.index("start c") < two.index("end c") < two.index("end b")

def test_a_point_is_served_against_the_target_it_names(tmp_path: Path) -> None:
    """``serve_target=MODEL`` is no pipeline key: it is taken out of the point's sets and becomes
    evaluate's ``--target``, as dflash-pipe's own parser reads it; a point without it is served
    against the target it trained on (no --target)."""
    from benchmarks.side_by_side import evaluate_cmd, point_spec
    from dflash_core.cli.main import build_parser

    assert point_spec("fp8feat:stages.extract.params.model=runs/smollm2-fp8,serve_target=smollm2") == (
        "fp8feat", {"stages.extract.params.model": "runs/smollm2-fp8"}, False, "smollm2", None, None)
    assert point_spec("sf:trainer=specforge,stages.train.params.epochs=3,gpu=1") == (
        "sf", {"stages.train.params.epochs": "3"}, True, None, None, "1")
    assert point_spec("sf:reuse=saved/sf-10ep") == ("sf", {}, False, None, "saved/sf-10ep", None)
    for bad in ("x", "", "-1"):
        with pytest.raises(SystemExit, match="one GPU's index"):
            point_spec(f"sf:gpu={bad}")

    def parsed(target: str | None):
        cmd = evaluate_cmd("EXPORT", "held.jsonl", 64, tmp_path / "eval", 256, 64, target, tmp_path / "references")
        assert cmd[1:4] == ["-m", "dflash_core.cli.main", "evaluate"]
        return build_parser(cmd[3:]).parse_args(cmd[3:])

    served = parsed("smollm2")
    assert (served.export, served.target, served.num_prompts, served.out) == ("EXPORT", "smollm2", 64,
                                                                              str(tmp_path / "eval"))
    assert parsed(None).target is None
    assert served.reference == parsed(None).reference == str(tmp_path / "references")  # one shared directory


def test_points_are_compared_with_the_reference_prompt_by_prompt() -> None:
    """paired(): the pooled ratio, the mean per-prompt difference with its standard error, and the
    prompts won and lost, over the prompts both reports measured (NaN and missing ones left out)."""
    from benchmarks.side_by_side import paired

    ref = {"tau_ref": 2.0, "per_prompt": [{"index": i, "tau_ref": t} for i, t in enumerate([2.0, 2.0, 2.0, 1.0])]}
    point = {"tau_ref": 2.5, "per_prompt": [{"index": 0, "tau_ref": 3.0}, {"index": 1, "tau_ref": 2.0},
                                             {"index": 2, "tau_ref": 2.5}, {"index": 3, "tau_ref": float("nan")},
                                             {"index": 4, "tau_ref": 9.0}]}
    got = paired(ref, point, "tau_ref")
    assert got["n"] == 3 and (got["wins"], got["losses"]) == (2, 0)
    assert got["ratio"] == pytest.approx(1.25) and got["diff"] == pytest.approx(0.5)
    assert got["se"] == pytest.approx(0.5 / 3 ** 0.5)  # differences 1, 0, 0.5: sd 0.5
    assert paired(ref, {"tau_ref": None, "per_prompt": []}, "tau_ref") is None


def test_the_session_21_gap_to_specforge_is_inside_its_standard_error() -> None:
    """On the served τ of session 21's reports: ours 0.991 of SpecForge pooled, 0.047 lower per
    prompt on average with a standard error of 0.051, 28 prompts won and 35 lost."""
    from benchmarks.side_by_side import paired

    data = REPO / "docs/data/quality_2026-12-03_session21"
    sf, ours = (json.loads((data / f"{p}_eval.json").read_text()) for p in ("sf-3ep-b8", "ours-3ep-k4-lr6"))
    got = paired(sf, ours, "tau")
    assert round(got["ratio"], 3) == 0.991 and round(got["diff"], 3) == -0.047 and round(got["se"], 3) == 0.051
    assert (got["n"], got["wins"], got["losses"]) == (64, 28, 35)


def test_ours_are_compared_with_the_first_reference_given_that_has_trained() -> None:
    from benchmarks.side_by_side import reference_of

    refs = ["sf-s0", "sf-s1"]
    assert reference_of(refs, ["ours", "sf-s1"]) == "sf-s1"  # the only one trained so far
    assert reference_of(refs, ["sf-s1", "ours", "sf-s0"]) == "sf-s0"  # given first, though it ended later
    assert reference_of(refs, ["ours"]) is None


def test_an_evaluation_queued_first_takes_no_training_slot(tmp_path: Path) -> None:
    """A reused point's evaluation, queued before the trainings, starts at once beside the first
    training under --parallel 1; the second training still waits for the first."""
    import subprocess
    import sys

    from benchmarks.side_by_side import run_queued

    log = tmp_path / "log"
    code = ("import sys, time; f = open(sys.argv[1], 'a'); f.write(f'start {sys.argv[2]}\\n'); f.flush(); "
            "time.sleep(float(sys.argv[3])); f.write(f'end {sys.argv[2]}\\n')")

    def start(name: str, seconds: float):
        return lambda: subprocess.Popen([sys.executable, "-c", code, str(log), name, str(seconds)])

    done = run_queued({("old", "eval"): start("old-eval", 3.0), "a": start("a", 0.2), "b": start("b", 0.2)}, 1)
    assert {k: v[0] for k, v in done.items()} == {("old", "eval"): 0, "a": 0, "b": 0}
    events = log.read_text().splitlines()
    assert sorted(events[:2]) == ["start a", "start old-eval"]
    assert events.index("end a") < events.index("start b") < events.index("end b") < events.index("end old-eval")


def _point_folder(home: Path, reference: bool) -> Path:
    """A point's folder as a side-by-side run leaves it: SpecForge's with export/, ours with two
    checkpoints, each with its trainer state beside its export."""
    train = {"uses": "train:specforge" if reference else "dflash", "after": "extract", "params": {}}
    doc = {"version": 1, "stages": {"pack": {"uses": "best_fit", "params": {"tokens_per_row": 64}}, "train": train}}
    (home / "run").mkdir(parents=True)
    (home / "pipeline.yaml").write_text(yaml.safe_dump(doc))
    (home / "train.log").write_text("train: done, peak 3.8 GiB\n")
    (home / "run" / "state.json").write_text("{}")
    if reference:
        (home / "run" / "specforge_metrics.jsonl").write_text(json.dumps(
            {"step": 10, "anchor_blocks": 500, "drafter_flop": 2e15, "elapsed_s": 4.0, "loss": 1.5, "acc": 0.5}) + "\n")
        (home / "export").mkdir()
        (home / "export" / "model.safetensors").write_bytes(b"sf")
    else:
        (home / "run" / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.5, "acc": 0.5}) + "\n")
        for step in (5, 10):
            ckpt = home / "run" / "checkpoints" / f"step-{step:07d}"
            (ckpt / "export").mkdir(parents=True)
            (ckpt / "export" / "model.safetensors").write_bytes(b"ours%d" % step)
            (ckpt / "train_state.pt").write_bytes(b"state")
    return home


@pytest.mark.parametrize("reference", [True, False])
def test_a_bundle_holds_what_reuse_reads_and_unpacks_to_a_reusable_point(tmp_path: Path, reference: bool) -> None:
    """--bundle packs the pipeline file, training log, metrics and the final export only (no
    trainer state, no earlier checkpoint); unpacked elsewhere, reuse= reads the same kind of point
    and the same figures from it, with the export where it was unpacked."""
    import tarfile

    from benchmarks.side_by_side import reference_figures, reused_pipeline, write_bundle

    home = _point_folder(tmp_path / "run1" / "pt", reference)
    bundle = write_bundle(home, tmp_path / "bundles" / "pt.tar.gz")
    with tarfile.open(bundle) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
    final = ["pt/export/model.safetensors"] if reference else [
        "pt/run/checkpoints/step-0000010/export/model.safetensors"]
    metrics = "pt/run/specforge_metrics.jsonl" if reference else "pt/run/metrics.jsonl"
    assert names == sorted(["pt/pipeline.yaml", "pt/train.log", metrics] + final)

    with tarfile.open(bundle) as tar:
        tar.extractall(tmp_path / "saved", filter="data")
    moved = tmp_path / "saved" / "pt"
    assert reused_pipeline(moved)[0] is reference
    if reference:
        got = reference_figures(moved / "run", moved / "export")
        assert (got["steps"], got["anchors_per_step"], got["export"]) == (10, 50.0, str(moved / "export"))


def test_reuse_refuses_a_folder_without_a_pipeline_file(tmp_path: Path) -> None:
    from benchmarks.side_by_side import reused_pipeline

    with pytest.raises(SystemExit, match="no pipeline.yaml"):
        reused_pipeline(tmp_path)


def test_our_figures_come_from_the_metrics_log_with_the_last_validation_tau(tmp_path: Path) -> None:
    """ours_figures: steps and anchor blocks of the last record, the trainer's last tau_serve, and
    the last val_tau_serve logged (a later window may have measured no validation document), with
    the last checkpoint's export; no val_tau_serve without validation records."""
    from benchmarks.side_by_side import ours_figures
    from dflash_model.drafter import DrafterConfig

    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=32, rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=512,
                        vocab_size=100, num_target_layers=4, num_layers=1, block_size=4, target_layer_ids=[1],
                        mask_token_id=3, layer_types=["full_attention"], sliding_window=None)
    run = tmp_path / "run"
    for step in (2, 4):
        (run / "checkpoints" / f"step-{step:07d}" / "export").mkdir(parents=True)
    records = [{"step": 2, "loss": 3.0, "acc": 0.1, "tau_serve": 1.5, "val_tau_serve": 1.2, "elapsed_s": 5.0},
               {"step": 4, "loss": 2.0, "acc": 0.2, "tau_serve": 2.5, "elapsed_s": 9.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = ours_figures(run, cfg, 64, 8)
    assert (got["steps"], got["anchor_blocks"], got["train_s"]) == (4, 32, 9.0)
    assert (got["tau_serve"], got["val_tau_serve"]) == (2.5, 1.2)
    assert got["export"].endswith("step-0000004/export")
    (run / "metrics.jsonl").write_text(json.dumps(records[1]) + "\n")
    assert ours_figures(run, cfg, 64, 8)["val_tau_serve"] is None


def test_a_point_validate_refuses_stops_the_run_before_any_point_trains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A point whose keys the run would refuse (checkpoints every 380 steps, 3 steps on each row) ends
    the side-by-side with exit 2 and validate's message before any point, the valid ones (ours and a
    reference point, validated with its -p plugin) included, has started: no process is launched and
    each point's folder holds its pipeline file only."""
    import sys

    import benchmarks.side_by_side as sbs

    shard = tmp_path / "shard-0.jsonl"
    shard.write_text(json.dumps({"source": "train.jsonl", "line": 0, "text": "hi"}) + "\n")
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--records", str(shard), "--specforge", str(tmp_path),
                                      "--out", str(out), "good:", "sf:trainer=specforge",
                                      "bad:stages.train.params.steps_per_row=3"])
    monkeypatch.setattr(sbs, "run", lambda cmd, log, gpu=None: pytest.fail(f"started {' '.join(cmd[3:])}"))
    assert sbs.main() == 2
    printed = capsys.readouterr().out
    assert "bad: dflash-pipe validate refuses" in printed and "must be a multiple of 3" in printed
    assert "good:" not in printed and "sf:" not in printed
    for name in ("good", "sf", "bad"):
        assert [p.name for p in (out / name).iterdir()] == ["pipeline.yaml"]


def test_a_point_runs_its_training_and_evaluations_on_the_gpu_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gpu=N``: the process a point starts sees CUDA_VISIBLE_DEVICES=N (a real child reads it back),
    for a training (ours, gpu=0) and for a reused point's evaluation (gpu=1); a point without it
    inherits the environment's."""
    import subprocess
    import sys

    import benchmarks.side_by_side as sbs

    echo = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    for gpu, seen in (("1", "1"), (None, "7")):
        sbs.run(echo, tmp_path / "log", gpu).wait()
        assert (tmp_path / "log").read_text().strip() == seen

    shard = tmp_path / "shard-0.jsonl"
    shard.write_text(json.dumps({"source": "train.jsonl", "line": 0, "text": "hi"}) + "\n")
    old = _point_folder(tmp_path / "saved" / "old", reference=True)
    started: dict[str, str | None] = {}

    def run(cmd: list[str], log: Path, gpu: str | None = None) -> subprocess.Popen:
        started[f"{log.parent.name}/{log.name}"] = gpu
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(sbs, "run", run)
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--records", str(shard), "--specforge", str(tmp_path),
                                      "--out", str(tmp_path / "out"), f"old:reuse={old},gpu=1", "new:gpu=0",
                                      "plain:"])
    assert sbs.main() == 1  # every process here exits 1
    assert started == {"old/eval.log": "1", "new/train.log": "0", "plain/train.log": None}
