"""A dflash-pipe run's metrics to MLflow, through the run's hooks alone.

Off unless ``DFLASH_PIPE_MLFLOW_URI`` names a tracking URI (``file:./mlruns``, ``sqlite:///m.db``,
``http://host:5000``). Then one MLflow run per pipeline run, in the experiment named by
``DFLASH_PIPE_MLFLOW_EXPERIMENT`` (default ``dflash-pipe``): each stage's implementation and device
as params, and every ``metrics`` event a stage emits (train: loss, acc, tau_sim, lr, grad_norm,
tokens_per_s; evaluate: eval_tau, eval_tau_ngram, …) as the metric ``<stage>/<name>`` at the
event's ``step``. The MLflow run ends FAILED when a stage fails, FINISHED when the process exits.
Under torchrun only rank 0 logs.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

from dflash_core import hookimpl

URI_ENV = "DFLASH_PIPE_MLFLOW_URI"
EXPERIMENT_ENV = "DFLASH_PIPE_MLFLOW_EXPERIMENT"


class Tracker:
    """One MLflow run, written through the client API (no global active run to leak)."""

    def __init__(self, uri: str, experiment: str) -> None:
        from mlflow.tracking import MlflowClient

        if uri.startswith("file:"):  # MLflow gates its file store behind this; the URI asks for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id: str = self.client.create_run(experiment_id).info.run_id

    def log_metrics(self, stage: str, event: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(event.get("step") or 0), int(time.time() * 1000)
        metrics = [Metric(f"{stage}/{key}", float(value), now, step) for key, value in event.items()
                   if key not in ("type", "step") and isinstance(value, (int, float))]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)


_tracker: Tracker | None = None


def tracker() -> Tracker | None:
    """The MLflow run of this pipeline run, started on first use; None when switched off."""
    global _tracker
    if not os.environ.get(URI_ENV) or os.environ.get("RANK", "0") != "0":
        return None
    if _tracker is None:
        _tracker = Tracker(os.environ[URI_ENV], os.environ.get(EXPERIMENT_ENV, "dflash-pipe"))
        atexit.register(end_run)
    return _tracker


def end_run(status: str = "FINISHED") -> str | None:
    """End the MLflow run (the next pipeline run in this process starts another); its id."""
    global _tracker
    if _tracker is None:
        return None
    done, _tracker = _tracker, None
    done.client.set_terminated(done.run_id, status)
    return done.run_id


@hookimpl
def dflash_pipe_before_stage(stage: str, kind: str, impl: str, device: str) -> None:
    t = tracker()
    if t is not None:
        t.client.log_param(t.run_id, f"{stage}.uses", impl)  # kind:name
        t.client.log_param(t.run_id, f"{stage}.device", device)


@hookimpl
def dflash_pipe_on_event(stage: str, event: dict[str, Any]) -> None:
    t = tracker()
    if t is not None and event.get("type") == "metrics":
        t.log_metrics(stage, event)


@hookimpl
def dflash_pipe_on_stage_error(stage: str, error: BaseException) -> None:
    t = tracker()
    if t is not None:
        t.client.set_tag(t.run_id, "failed_stage", stage)
        end_run("FAILED")
