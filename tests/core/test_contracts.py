"""The contracts between stages (issue 35): every link has an item type that ``validate`` checks
and the consumer checks again where items enter it; what crosses stages (fan-in, facts) is wired
by the engine; and each stage's ``check`` refuses cross-stage mistakes at the file's line before
anything runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import pytest

from dflash_core import Stage, StageContext, hookimpl
from dflash_core.facts import SNAPSHOT_ABOUT_EVERY, SNAPSHOT_EVERY, TOKENIZER
from dflash_core.items import TRAIN_STATE, ItemError, misfit
from dflash_core.pipeline_file import load_pipeline
from dflash_core.plugins import PluginManager
from dflash_core.rows import FEATURE_ROW, PACKED_ROW
from dflash_stages.train.snapshots import SnapshotPolicy
from tests.conftest import REPO, STAGES, cli_env

EXAMPLE = REPO / "plugins" / "dflash-pipe-example"


# ------------------------------------------------------------------------------ port types

def test_a_feature_row_fits_a_packed_row_port_and_not_the_other_way() -> None:
    assert misfit(FEATURE_ROW, PACKED_ROW) is None
    assert misfit(PACKED_ROW, FEATURE_ROW) == "packed rows lack 'features' of a feature row"
    assert "marked kind='state'" in misfit(FEATURE_ROW, TRAIN_STATE)
    assert misfit(None, PACKED_ROW) is None and misfit(PACKED_ROW, None) is None  # untyped sides


def test_validate_refuses_a_link_whose_ports_do_not_fit_naming_both_ends(cli, write_pipeline) -> None:
    path = write_pipeline("""
        stages:
          pack:  {uses: 'pack:random', params: {rows: 2, tokens_per_row: 16}}
          train:
            uses: 'train:dflash'
            after: pack
    """)
    res = cli("validate", path)
    assert res.code == 2, res.text
    assert (f"{path}:8:12: 'pack' (pack:random) yields packed rows, but port 'features' of 'train' "
            "(train:dflash) takes feature rows: packed rows lack 'features' of a feature row") in res.text


def test_untyped_ports_of_third_party_stages_take_any_item(cli, write_pipeline) -> None:
    """engine_stages declares ``inputs = ("items",)`` and no output: both ends of a link to a
    built-in stage stay valid."""
    path = write_pipeline("""
        stages:
          pack: {uses: 'pack:random', params: {rows: 2, tokens_per_row: 16}}
          sink: {uses: collect, after: pack}
          samples: {uses: test_samples}
          packed: {uses: 'pack:best_fit', after: samples}
    """)
    res = cli("validate", "-p", STAGES, path)
    assert res.code == 0, res.text


def test_list_stages_shows_each_ports_types_and_the_output(cli) -> None:
    res = cli("list-stages", "extract")
    assert res.code == 0 and res.lines_with("extract:hf_hooks", "rows: packed rows", "feature rows"), res.text


# ------------------------------------------------------------------------------ stage checks

TOKENIZE_TOO_LONG = """
    stages:
      download: {uses: fsspec, params: {source: "/nowhere/*.jsonl"}}
      tokenize: {uses: chat_template, after: download, params: {tokenizer: smollm2, max_len: 2048}}
      pack:     {uses: best_fit, after: tokenize, params: {tokens_per_row: 1024}}
"""

FAN_IN = """
    stages:
      pack:       {uses: 'pack:random', params: {rows: 8, tokens_per_row: 64}, ranks: [0, 1]}
      extract:    {uses: 'extract:hf_hooks', after: pack, params: {model: smollm2}, ranks: [0, 1]}
      train:      {uses: 'train:dflash', after: extract, ranks: [2]}
      checkpoint: {uses: 'checkpoint:fsspec', after: train, params: {every_steps: 3}, ranks: [2]}
"""


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_sample_longer_than_a_row_is_refused_before_anything_runs(cli, write_pipeline, tmp_path,
                                                                    command) -> None:
    path = write_pipeline(TOKENIZE_TOO_LONG)
    res = cli(command, path)
    assert res.code == 2, res.text
    assert (f"{path}:7:56: 'tokenize' upstream of 'pack' yields samples of up to 2048 tokens, longer than "
            "a row of 'pack' (tokens_per_row=1024): set tokenize max_len <= 1024 or raise tokens_per_row"
            ) in res.text
    assert not (tmp_path / "run").exists()  # nothing started
    assert cli("validate", path, "--set", "stages.tokenize.params.max_len=1024").code == 0


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_cadence_that_splits_a_fan_in_is_refused_before_anything_runs(cli, write_pipeline, tmp_path,
                                                                        command) -> None:
    path = write_pipeline(FAN_IN)
    res = cli(command, path)
    assert res.code == 2, res.text
    assert (f"{path}:8:66: 'train' snapshots every 3 steps (the cadence 'checkpoint' asks for), but 2 "
            "producer ranks feed each drafter replica: checkpoints must fall where each has sent as many "
            "rows, so every_steps x rows_per_step (3 x 1) must be a multiple of 2") in res.text
    assert not (tmp_path / "run").exists()
    assert cli("validate", path, "--set", "stages.checkpoint.params.every_steps=4").code == 0
    # the trainer's own cadence is named as such
    res = cli("validate", path, "--set", "stages.train.params.checkpoint_every=5")
    assert "'train' snapshots every 5 steps (its checkpoint_every)" in res.text
    # no cadence in the file: the default one moves to steps the fan-in can be saved at
    assert cli("validate", write_pipeline(FAN_IN.replace("params: {every_steps: 3}, ", ""))).code == 0


def test_a_cadence_inside_a_row_of_several_steps_is_refused(cli, write_pipeline) -> None:
    """With ``steps_per_row: 3`` a snapshot after step 10 would cut a row's steps: refused where the
    cadence is set; a multiple of 3 passes."""
    path = write_pipeline(FAN_IN.replace(", ranks: [0, 1]", "").replace(", ranks: [2]", "")
                          .replace("'train:dflash', after: extract", "'train:dflash', after: extract, "
                                   "params: {steps_per_row: 3}")
                          .replace("every_steps: 3", "every_steps: 10"))
    res = cli("validate", path)
    assert res.code == 2, res.text
    assert ("'train' snapshots every 10 steps (the cadence 'checkpoint' asks for), but the trainer takes 3 "
            "steps on each row (steps_per_row): checkpoints must fall between rows, so every_steps (10) must "
            "be a multiple of 3") in res.text.replace("\n", " ")
    assert cli("validate", path, "--set", "stages.checkpoint.params.every_steps=12").code == 0


def test_fp8_training_on_a_gpu_without_fp8_tensor_cores_is_refused_with_the_settings_to_change(
        cli, write_pipeline) -> None:
    """lm_head_dtype / mlp_dtype fp8 need compute capability 8.9 or newer: ``run`` refuses an A100
    with the --set that trains in the drafter's dtype; Ada and Hopper pass; so does the CPU (where
    the tests run FP8 products). ``validate`` reads a file away from its GPUs and does not judge."""
    from dflash_stages.train.stage import fp8_capability_refusal, fp8_refusal

    assert fp8_capability_refusal("NVIDIA H200", (9, 0), "cuda:0", ["lm_head_dtype"]) is None
    assert fp8_capability_refusal("NVIDIA L40S", (8, 9), "cuda:1", ["mlp_dtype"]) is None
    assert fp8_capability_refusal("NVIDIA A100-SXM4-80GB", (8, 0), "cuda:2", ["lm_head_dtype", "mlp_dtype"]) == (
        "lm_head_dtype and mlp_dtype: fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: "
        "Ada, Hopper, Blackwell); cuda:2 is NVIDIA A100-SXM4-80GB (8.0). Train in the drafter's dtype instead: "
        "--set stages.train.params.lm_head_dtype=model --set stages.train.params.mlp_dtype=model")
    assert fp8_refusal("cpu", ["lm_head_dtype"]) is None
    assert fp8_refusal("cuda:0", []) is None
    path = write_pipeline(FAN_IN.replace(", ranks: [0, 1]", "").replace(", ranks: [2]", "")
                          .replace("'train:dflash', after: extract", "'train:dflash', after: extract, "
                                   "params: {lm_head_dtype: fp8, mlp_dtype: fp8}"))
    assert cli("validate", path).code == 0


@pytest.mark.parametrize("fan_in, rows_per_step, every", [(1, 1, 1000), (2, 1, 1000), (3, 1, 1002),
                                                         (3, 2, 1002), (4, 2, 1000), (6, 4, 1002)])
def test_the_default_cadence_moves_up_to_the_nearest_step_a_fan_in_can_save_at(fan_in, rows_per_step,
                                                                                every) -> None:
    about = {"checkpoint": {SNAPSHOT_ABOUT_EVERY: 1000}}
    policy = SnapshotPolicy.for_trainer(0, about, fan_in, rows_per_step)
    assert policy.every == every and policy.boundary(every)
    assert SnapshotPolicy.for_trainer(7 * fan_in, about, fan_in, 1).every == 7 * fan_in  # its own: exact
    exact = {"checkpoint": {SNAPSHOT_EVERY: 1000}, "other": {SNAPSHOT_ABOUT_EVERY: 1000}}
    if (1000 * rows_per_step) % fan_in:
        with pytest.raises(ValueError, match="must be a multiple of"):
            SnapshotPolicy.for_trainer(0, exact, fan_in, rows_per_step)
    else:
        assert SnapshotPolicy.for_trainer(0, exact, fan_in, rows_per_step).every == 1000


# ------------------------------------------------------------------------------ wiring

@dataclass
class ProbeConfig:
    tag: str = ""


class Publisher(Stage):
    """A source whose ``tag`` is a fact for every stage downstream of it."""

    kind = "publisher"
    name = "probe"
    Config = ProbeConfig
    inputs = ()

    @classmethod
    def facts_for_consumers(cls, config: ProbeConfig) -> Mapping[str, Any]:
        return {TOKENIZER: config.tag}

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        yield {"i": 0}


class Relay(Stage):
    """Passes items on and records what the engine handed it."""

    kind = "relay"
    name = "probe"
    Config = ProbeConfig

    @classmethod
    def facts_for_producers(cls, config: ProbeConfig) -> Mapping[str, Any]:
        return {SNAPSHOT_EVERY: len(config.tag)}

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        ctx.summary.update(fan_in=ctx.fan_in, upstream_facts=ctx.upstream_facts,
                           consumer_facts=ctx.consumer_facts)
        yield from inputs["items"]


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(Publisher)
    registry.add(Relay)


def test_the_engine_hands_each_stage_what_its_neighbours_publish(dflash_run) -> None:
    """Facts reach a stage from the publisher upstream of it (not another one in the file), and
    a consumer's facts reach the stage feeding it."""
    run = dflash_run("""
        stages:
          other: {uses: 'publisher:probe', params: {tag: unrelated}}
          first: {uses: 'publisher:probe', params: {tag: mine}}
          mid:   {uses: 'relay:probe', after: first, params: {tag: ab}}
          last:  {uses: 'relay:probe', after: mid, params: {tag: abcd}}
    """, plugins=(sys.modules[__name__],), autoload=False)
    mid, last = run.results["mid"].summary, run.results["last"].summary
    assert mid["upstream_facts"] == last["upstream_facts"] == {TOKENIZER: "mine"}
    assert mid["consumer_facts"] == {"last": {SNAPSHOT_EVERY: 4}} and last["consumer_facts"] == {}
    assert mid["fan_in"] == {"items": 1}


def test_fan_in_is_the_producer_ranks_per_consumer_rank(write_pipeline) -> None:
    path = write_pipeline(FAN_IN.replace("every_steps: 3", "every_steps: 4"))
    pipeline = load_pipeline(str(path), PluginManager(autoload=False), check_devices=False)
    assert pipeline.fan_in("train") == {"features": 2}
    assert pipeline.fan_in("extract") == {"rows": 1}
    assert pipeline.consumer_facts("train") == {"checkpoint": {SNAPSHOT_EVERY: 4}}


def test_tokenizer_facts_reach_the_trainer_from_the_tokenize_stage_upstream(write_pipeline) -> None:
    path = write_pipeline("""
        stages:
          download: {uses: fsspec, params: {source: "/nowhere/*.jsonl"}}
          unused:   {uses: chat_template, after: download, params: {tokenizer: first-in-file}}
          tokenize: {uses: chat_template, after: download, params: {tokenizer: smollm2, thinking: false, max_len: 64}}
          pack:     {uses: best_fit, after: tokenize, params: {tokens_per_row: 64}}
          extract:  {uses: hf_hooks, after: pack, params: {model: smollm2}}
          train:    {uses: dflash, after: extract}
    """)
    pipeline = load_pipeline(str(path), PluginManager(autoload=False), check_devices=False)
    assert pipeline.upstream_facts("train") == {"tokenizer": "smollm2", "thinking": False,
                                                "chat_template_kwargs": {}, "max_sample_tokens": 64}


# ------------------------------------------------------------------------------ entry checks

def test_checkpoint_refuses_a_train_state_without_its_fields_naming_the_producer(tmp_path) -> None:
    from dflash_stages.checkpoint import CheckpointConfig, FsspecCheckpoint

    ctx = StageContext(stage="checkpoint", config=CheckpointConfig(), run_dir=str(tmp_path),
                       pipeline={"checkpoint": {"after": {"states": "my_trainer"}}})
    states = [{"kind": "other"}, {"kind": "state", "step": 1, "final": True}]
    with pytest.raises(ItemError, match="stage 'checkpoint' got a train state from stage 'my_trainer' "
                                        "without 'rank', 'model', 'optimizer', 'rng', 'drafter_config'"):
        list(FsspecCheckpoint(CheckpointConfig()).run({"states": states}, ctx))


def test_pack_refuses_an_item_that_is_no_sample_source_naming_the_producer(tmp_path) -> None:
    from dflash_stages.pack.stage import BestFitPack, PackConfig

    ctx = StageContext(stage="pack", config=PackConfig(), run_dir=str(tmp_path),
                       pipeline={"pack": {"after": {"samples": "tokens"}}})
    with pytest.raises(ItemError, match="stage 'pack' expects sample shards or samples or file items from "
                                        "stage 'tokens', got \"{'ids': \\[1, 2\\]}\""):
        list(BestFitPack(PackConfig()).run({"samples": [{"ids": [1, 2]}]}, ctx))


def test_the_trainers_metrics_record_is_the_one_evaluate_reads(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from dflash_core.items import METRICS_RECORD
    from dflash_stages.evaluate.drafter import training_summary
    from dflash_stages.train.metrics import MetricsLog, ServedWalk

    log = MetricsLog(StageContext(stage="train", config=None, run_dir=str(tmp_path)), every=1)
    stat = {k: torch.tensor(0.5) for k in ("loss", "acc", "tau_sim", "tau_serve")}
    log.add(SimpleNamespace(tokens=256, row_stats=[{**stat, "per_slot_acc": torch.ones(3)}],
                            grad_norm=torch.tensor(1.0),
                            val_stats=[{**stat, "walk": ServedWalk(list(range(39)), torch.full((39,), 2.0), [(0, 40)],
                                                                   16)}]))
    record = log.record(step=1, lr=1e-3)
    assert METRICS_RECORD.matches(record), set(METRICS_RECORD.names) - set(record)
    assert {n for n in record if n.startswith("val_")} <= {f.name for f in METRICS_RECORD.optional}
    assert (record["val_tau_serve"], record["tau_serve"]) == (2.0, 0.5)
    log.write(1, 1e-3)
    log.add(SimpleNamespace(tokens=256, row_stats=[{**stat, "per_slot_acc": torch.ones(3)}],
                            grad_norm=torch.tensor(1.0), val_stats=[]))
    later = log.record(step=2, lr=1e-3)
    assert "val_tau_serve" not in later  # a window without validation documents
    out = training_summary([record, later])
    assert (out["train_tokens"], out["train_time_s"]) == (512, later["elapsed_s"])
    assert (out["tau_serve_train"], out["tau_serve_val"]) == (0.5, 2.0)  # the last window that measured some


def test_the_example_plugin_needs_no_dflash_stages() -> None:
    """Its packer runs with ``dflash_stages`` unimportable: it uses the public types only."""
    script = textwrap.dedent("""
        import sys
        sys.modules["dflash_stages"] = None  # any import of it fails
        from dflash_core import StageContext
        from dflash_pipe_example.plugin import SequentialConfig, SequentialPack
        samples = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5]}]
        ctx = StageContext(stage="pack", config=SequentialConfig(tokens_per_row=4))
        rows = list(SequentialPack(SequentialConfig(tokens_per_row=4)).run({"samples": samples}, ctx))
        print([list(r["input_ids"]) for r in rows])
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=cli_env([EXAMPLE]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[1, 2, 3], [4, 5]]"
