"""plugins/dflash-pipe-mlflow on a tiny real training run: what the trainer logged to
metrics.jsonl is what MLflow's own client reads back from a local file store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.stages import online_fixtures
from tests.stages.online_fixtures import TINY_TRAIN, online_pipeline

pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (scripts/install.sh test "
                                     "installs it with plugins/dflash-pipe-mlflow)")


def test_train_metrics_reach_mlflow(tmp_path: Path, target: Path, dflash_run: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.syspath_prepend(str(REPO / "plugins" / "dflash-pipe-mlflow"))
    from dflash_pipe_mlflow import plugin

    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv(plugin.URI_ENV, store)
    monkeypatch.setenv(plugin.EXPERIMENT_ENV, "tiny")
    run = dflash_run(online_pipeline(tmp_path / "run", target, pack=dict(rows=8, tokens_per_row=64),
                                     train=dict(TINY_TRAIN, log_every=2)),
                     plugins=(online_fixtures, plugin), autoload=False)
    assert run.results["train"].summary["steps"] == 8
    run_id = plugin.end_run()
    logged = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]

    client = MlflowClient(tracking_uri=store)
    tracked = client.get_run(run_id)
    assert tracked.info.status == "FINISHED"
    assert client.get_experiment(tracked.info.experiment_id).name == "tiny"
    assert tracked.data.params == {"pack.uses": "pack:synthetic", "pack.device": "cpu",
                                   "extract.uses": "extract:hf_hooks", "extract.device": "cpu",
                                   "train.uses": "train:dflash", "train.device": "cpu"}
    assert sorted(tracked.data.metrics) == ["train/acc", "train/grad_norm", "train/loss", "train/lr",
                                            "train/tau_sim", "train/tokens_per_s"]
    for name in ("loss", "acc", "tau_sim", "lr", "tokens_per_s"):
        history = client.get_metric_history(run_id, f"train/{name}")
        assert [(m.step, m.value) for m in history] == [(r["step"], r[name]) for r in logged]
    assert [r["step"] for r in logged] == [2, 4, 6, 8]
