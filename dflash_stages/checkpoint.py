"""checkpoint:fsspec — complete checkpoints or none: export + training state, then ``latest``.

Layout under ``<run_dir>/checkpoints/``: ``step-000100/`` with ``export/`` (the served
format), ``train_state.pt`` (drafter, optimizer, step, RNG of rank 0), ``rng.rank<r>.pt``
for the other ranks, ``pipeline_state.json`` (what ``--resume`` hands each stage), then
``latest.json`` pointing at it — written last, so a crash mid-save leaves the previous
checkpoint as latest. A directory that ``latest.json`` names is never rewritten; once training
has ended there, the pointer says ``"final": true`` (``--resume`` then only finishes the stages after
training that a signal stopped, such as evaluate), or
``"interrupted": true`` when a signal stopped the run there (``status`` says so). The
same files are uploaded to ``dest`` (any fsspec URL) with retries, ``latest.json`` last there too.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from dflash_core import Stage, StageContext
from dflash_core.artifacts import join, write_json
from dflash_core.facts import SNAPSHOT_ABOUT_EVERY, SNAPSHOT_EVERY
from dflash_core.items import CHECKPOINT, TRAIN_STATE, of_kind
from dflash_core.paths import PATH_FIELD
from dflash_core.resume import CHECKPOINTS, LATEST, PIPELINE_STATE
from dflash_core.retry import call_with_retries

ABOUT_EVERY = 1000
"""Steps between checkpoints when the pipeline file sets none."""


@dataclass
class CheckpointConfig:
    every_steps: int | None = field(default=None, metadata={
        "help": "save every N optimizer steps (and at the end); 0 = only at the end; unset = about every "
                f"{ABOUT_EVERY}, moved up to the nearest step a fan-in's producers can all be saved at"})
    keep_last: int = field(default=3, metadata={
        "help": "complete checkpoints kept in the run dir and at dest"})
    dest: str | None = field(default=None, metadata={**PATH_FIELD,
                                                     "help": "also upload to this URL (s3://…)"})
    retries: int = field(default=5, metadata={"help": "retries of each file's upload after its first attempt"})
    backoff: float = field(default=0.5, metadata={
        "help": "first retry's wait in seconds, doubled at each retry (x0.5-1.5 jitter, at most 60 s)"})
    storage_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "options of dest's fsspec filesystem (s3: endpoint_url, key, secret, client_kwargs...)"})


class FsspecCheckpoint(Stage):
    kind = "checkpoint"
    name = "fsspec"
    Config = CheckpointConfig
    inputs = {"states": TRAIN_STATE}
    output = CHECKPOINT
    needs_torch = True
    cache_ignore = ("retries", "backoff", "storage_options", "keep_last")

    @classmethod
    def facts_for_producers(cls, config: CheckpointConfig) -> Mapping[str, Any]:
        """The cadence is this stage's setting: the trainer snapshots at it, exactly when the user
        set it, else where it can near the default."""
        if config.every_steps is None:
            return {SNAPSHOT_ABOUT_EVERY: ABOUT_EVERY}
        return {SNAPSHOT_EVERY: config.every_steps}

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        if "export" not in summary:
            return None
        return (f"drafter export (step {summary.get('step')}): {summary['export']}\n"
                f"  evaluate it: dflash-pipe evaluate {summary['export']}")

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        root = join(ctx.run_dir, CHECKPOINTS)
        # on --resume, latest.json names the checkpoint the trainer restored
        latest = os.path.basename(ctx.resume_checkpoint.rstrip("/")) if ctx.resume_checkpoint else None
        saved = 0
        for state in of_kind(inputs["states"], TRAIN_STATE, ctx.stage, ctx.upstream("states")):
            name = f"step-{state['step']:07d}"
            if name == latest:
                # the state latest.json names already (the end-of-run state of the step just
                # saved, or a resumed run with no step left): its directory is never rewritten,
                # only the pointer learns that training ended or was interrupted there
                if (state["final"] or state.get("interrupted")) and ctx.rank == 0:
                    write_json(join(root, LATEST), _pointer(name, state))
                    self._point_dest(name, state, ctx)
                    ctx.summary.update(latest=join(root, name), export=join(root, name, "export"),
                                       step=state["step"])
                yield _saved(state, join(root, name))
                continue
            path = save_checkpoint(state, root, name, ctx)
            latest = name
            saved += 1
            if ctx.rank == 0:
                if self.config.dest:
                    _retry(lambda: _unpoint(self.config.dest, name, self.config.storage_options),
                           self.config, ctx)
                    upload(path, join(self.config.dest, name), self.config, ctx)
                    self._point_dest(name, state, ctx)
                    _retry(lambda: prune(self.config.dest, self.config.keep_last,
                                         self.config.storage_options), self.config, ctx)
                prune(root, self.config.keep_last)
                ctx.emit({"type": "checkpoint", "step": state["step"], "path": path})
                ctx.summary.update(latest=path, export=join(path, "export"), step=state["step"])
            yield _saved(state, path)
        ctx.summary["saved"] = saved

    def _point_dest(self, name: str, state: dict[str, Any], ctx: StageContext) -> None:
        """Point the dest's ``latest.json`` (if there is a dest) at ``name``."""
        if self.config.dest:
            _retry(lambda: write_json(join(self.config.dest, LATEST), _pointer(name, state),
                                      self.config.storage_options), self.config, ctx)


def _pointer(name: str, state: dict[str, Any]) -> dict[str, Any]:
    """What ``latest.json`` holds: the checkpoint, its step, whether training ended there, and
    whether a signal stopped the run there."""
    pointer = {"name": name, "step": state["step"], "final": bool(state["final"])}
    if state.get("interrupted"):
        pointer["interrupted"] = True
    return pointer


def _unpoint(root: str, name: str, storage_options: dict[str, Any] | None = None) -> None:
    """Remove ``root/latest.json`` if it names ``name``, whose directory is about to be rewritten
    (a fresh run saving a step an earlier run in this directory saved): until the new one is
    complete there is no latest, rather than a latest that names a half-written checkpoint."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(join(root, LATEST), **(storage_options or {}))
    try:
        named = json.loads(fs.cat_file(path)).get("name")
    except FileNotFoundError:
        return
    if named == name:
        fs.rm(path)


def _saved(state: dict[str, Any], path: str) -> dict[str, Any]:
    """The item a checkpoint stage yields (evaluate reads ``export``)."""
    return {"kind": "checkpoint", "step": state["step"], "final": state["final"], "path": path,
            "export": join(path, "export")}


def save_checkpoint(state: dict[str, Any], root: str, name: str, ctx: StageContext) -> str:
    """Write one checkpoint under ``root/name`` and point ``latest.json`` at it (rank 0)."""
    from dflash_model.drafter import DFlashDrafter, export_drafter

    final = join(root, name)
    local = "://" not in root
    # one name on every rank (rank r adds its rng file to the same directory); rank 0
    # clears what a crashed save may have left there before anyone writes
    staging = f"{final}.tmp-save" if local else final
    if ctx.world_size > 1:
        _barrier(ctx.ranks)  # every rank has its state in hand before rank 0 starts the directory
    rank = state["rank"]
    if rank == 0:
        _unpoint(root, name)
        if local:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        import torch

        # built on the meta device: a CPU init would draw from the global RNG, which the
        # trainer saves with each checkpoint (and this runs in another thread meanwhile)
        with torch.device("meta"):
            model = DFlashDrafter(state["drafter_config"])
        model.load_state_dict(state["model"], assign=True)
        export_drafter(model, join(staging, "export"), extra_metadata=state["metadata"])
        _torch_save({"model": state["model"], "optimizer": state["optimizer"], "step": state["step"],
                     "rng": {"0": state["rng"]}}, join(staging, "train_state.pt"))
        _copy_metrics(state.get("metrics_file"), staging)
    if ctx.world_size > 1:
        _barrier(ctx.ranks)
        if rank != 0:
            _torch_save({"rng": {str(rank): state["rng"]}},
                        join(staging if local else final, f"rng.rank{rank}.pt"))
        _barrier(ctx.ranks)
    if rank == 0:
        write_json(join(staging, PIPELINE_STATE), state["pipeline_state"])
        if local:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(staging, final)
        write_json(join(root, LATEST), _pointer(name, state))
    if ctx.world_size > 1:
        _barrier(ctx.ranks)
    return final


def _torch_save(obj: Any, url: str) -> None:
    import fsspec
    import torch

    with fsspec.open(url, "wb") as f:
        torch.save(obj, f)


def _copy_metrics(src: str | None, dest_dir: str) -> None:
    if src and "://" not in src and os.path.exists(src):
        import fsspec

        with open(src, "rb") as f, fsspec.open(join(dest_dir, "metrics.jsonl"), "wb") as g:
            g.write(f.read())


_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def _barrier(ranks: tuple[int, ...] | None) -> None:
    """Barrier among the checkpoint stage's ``ranks`` (None: every rank) on a gloo group of the
    stage's own: the trainer all-reduces on its group from another thread meanwhile, and two
    threads' collectives on one group pair up in a different order on each rank (a deadlock).
    The group is made by its members alone (local synchronization): in an N -> M fan-in with M > 1
    the producer ranks never save, and a group every rank had to make hung the first save."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        members = tuple(ranks or range(dist.get_world_size()))
        key = (id(dist.group.WORLD), members)
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(list(members), backend="gloo", use_local_synchronization=True)
        dist.barrier(group=_GROUPS[key])


def prune(root: str, keep: int, storage_options: dict[str, Any] | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``, the run dir's or
    the dest's (never the one its ``latest.json`` names)."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(root, **(storage_options or {}))
    try:
        latest = json.loads(fs.cat_file(f"{path}/{LATEST}")).get("name")
    except FileNotFoundError:
        latest = None
    names = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    steps = [n for n in names if n.startswith("step-") and ".tmp-" not in n]
    for old in steps[:-keep] if keep > 0 else []:
        if old != latest:
            fs.rm(f"{path}/{old}", recursive=True)


def upload(src: str, dest: str, cfg: CheckpointConfig, ctx: StageContext) -> None:
    """Copy a checkpoint directory to ``dest`` file by file, each with retries."""
    from fsspec.core import url_to_fs

    dfs, dpath = url_to_fs(dest, **cfg.storage_options)
    for dirpath, _, files in os.walk(src):
        for fname in sorted(files):
            local = os.path.join(dirpath, fname)
            rel = os.path.relpath(local, src)
            target = f"{dpath}/{rel}"
            _retry(lambda: dfs.put_file(local, target), cfg, ctx)


def _retry(fn: Any, cfg: CheckpointConfig, ctx: StageContext) -> None:
    def counted(attempt: int, exc: BaseException, delay: float) -> None:
        ctx.logger.warning("upload failed (%s); retry %d in %.1fs", type(exc).__name__, attempt, delay)
        ctx.summary["upload_retries"] = ctx.summary.get("upload_retries", 0) + 1

    call_with_retries(fn, retries=cfg.retries, backoff=cfg.backoff, on_retry=counted)
