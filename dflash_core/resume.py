"""Where ``--resume`` finds each stage's saved state: the latest complete checkpoint.

The checkpoint stage writes ``<run_dir>/checkpoints/<step>/pipeline_state.json`` (a map
stage -> state) and points ``<run_dir>/checkpoints/latest`` at the directory only once the
checkpoint is complete, so a crash mid-save leaves the previous one as latest. The pointer
says ``"final": true`` once training has ended (the data ran out) at that checkpoint: resuming
such a run trains nothing, and runs at all only where a stage after training still owes its output
for that checkpoint (``Stage.owes_after_training``: evaluate stopped by a signal);
``"interrupted": true`` when a signal stopped the run there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash_core.artifacts import join, read_json

if TYPE_CHECKING:
    from dflash_core.pipeline import Pipeline

CHECKPOINTS = "checkpoints"
LATEST = "latest.json"
PIPELINE_STATE = "pipeline_state.json"


def latest_checkpoint(run_dir: str) -> str | None:
    """URL/path of the latest complete checkpoint directory, or None."""
    pointer = read_json(join(run_dir, CHECKPOINTS, LATEST))
    return join(run_dir, CHECKPOINTS, pointer["name"]) if pointer else None


def finished_at(run_dir: str) -> int | None:
    """The last step of a run whose training ended at its latest checkpoint, else None."""
    return _step_if(run_dir, "final")


def interrupted_at(run_dir: str) -> int | None:
    """The step a signal (SIGINT/SIGTERM) stopped the run at, saved as its latest checkpoint."""
    return _step_if(run_dir, "interrupted")


def _step_if(run_dir: str, flag: str) -> int | None:
    pointer = read_json(join(run_dir, CHECKPOINTS, LATEST))
    return int(pointer["step"]) if pointer and pointer.get(flag) else None


def owed_after_training(pipeline: Pipeline, step: int | None) -> list[str]:
    """Stages whose output for the final checkpoint is missing, where training ended at ``step``
    (:func:`finished_at`; None: it has not, and nothing is owed)."""
    from dflash_core.runstate import is_materialized, stream_work_dir

    if step is None:
        return []
    return [name for name, spec in pipeline.stages.items() if not is_materialized(pipeline, name)
            and spec.cls.owes_after_training(spec.config, stream_work_dir(pipeline, name), step)]


def resume_states(run_dir: str) -> tuple[str | None, dict[str, Any]]:
    """(latest complete checkpoint, per-stage states saved with it); (None, {}) if none."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None, {}
    return ckpt, read_json(join(ckpt, PIPELINE_STATE)) or {}
