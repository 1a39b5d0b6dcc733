"""train:dflash — optimizer steps on the drafter from streamed feature rows.

Deterministic by construction: the drafter is initialised from ``seed`` and each row's
anchors come from a generator seeded by (seed, row's step, rank, micro-step), so a resumed run
replays exactly the steps an uninterrupted run takes (no RNG stream to restore for anchors).
With ``WORLD_SIZE > 1`` (torchrun) each rank trains on its shard of rows and gradients are
averaged with one all-reduce per step.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from dflash_core import Stage, StageContext
from dflash_core.facts import ROW_TOKENS, SNAPSHOT_EVERY, snapshot_cadence
from dflash_core.items import TRAIN_STATE
from dflash_core.pipeline import Pipeline, Problem
from dflash_core.rows import FEATURE_ROW, TARGET_HEADER, check_fields, checked, is_target_header
from dflash_model.fast.settings import warm_up_wanted
from dflash_stages.train.config import TrainConfig
from dflash_stages.train.snapshots import SnapshotPolicy


def fp8_refusal(device: str, keys: list[str]) -> str | None:
    """Why ``keys`` (train params set to fp8) cannot run on ``device`` of this host, or None: FP8
    products need FP8 tensor cores (CUDA compute capability 8.9 or newer). The CPU runs them
    (slowly, for tests). Asked by ``run`` only, which imports torch anyway."""
    if not keys or not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        return None
    return fp8_capability_refusal(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index),
                                  device, keys)


def fp8_capability_refusal(gpu: str, capability: tuple[int, int], device: str, keys: list[str]) -> str | None:
    """:func:`fp8_refusal`'s verdict for a GPU of ``capability``, with the settings to change."""
    from dflash_model.target.fp8 import FP8_COMPUTE_CAPABILITY  # imports torch: not at validate's import

    if capability >= FP8_COMPUTE_CAPABILITY:
        return None
    sets = " ".join(f"--set stages.train.params.{key}=model" for key in keys)
    need = ".".join(map(str, FP8_COMPUTE_CAPABILITY))
    return (f"{' and '.join(keys)}: fp8 needs a GPU with FP8 tensor cores (compute capability {need} or newer: "
            f"Ada, Hopper, Blackwell); {device} is {gpu} ({capability[0]}.{capability[1]}). Train in the "
            f"drafter's dtype instead: {sets}")


class DFlashTrain(Stage):
    kind = "train"
    name = "dflash"
    Config = TrainConfig
    inputs = {"features": FEATURE_ROW}
    output = TRAIN_STATE
    needs_torch = True
    stops_at_interrupt = True
    # imported before the stage threads start: extract's thread imports dflash_model.drafter
    # (through dflash_model.target) while this one would, and two threads importing one package can deadlock
    preload = ("dflash_stages.train.trainer",)
    cache_ignore = ("log_every", "warm_up")

    @classmethod
    def check(cls, pipeline: Pipeline, name: str) -> Iterable[Problem]:
        """FP8 products on a GPU without FP8 tensor cores (when ``run`` checks this host's devices),
        and snapshots that would not fall between rows: both would stop the run at its first step,
        hours in on a large target."""
        cfg: TrainConfig = pipeline.stages[name].config
        fp8 = [key for key in ("lm_head_dtype", "mlp_dtype") if getattr(cfg, key) == "fp8"]
        refusal = fp8_refusal(pipeline.stages[name].device, fp8) if pipeline.devices_checked else None
        return [*([Problem(name, refusal, ("params", fp8[0]))] if refusal else []),
                *cls._check_snapshots(pipeline, name, cfg)]

    @classmethod
    def _check_snapshots(cls, pipeline: Pipeline, name: str, cfg: TrainConfig) -> Iterable[Problem]:
        """Snapshots must fall between rows (``steps_per_row``) where every producer rank of a
        fan-in has sent as many rows: the trainer would refuse the cadence at its first step."""
        consumers = pipeline.consumer_facts(name)
        try:
            SnapshotPolicy.for_trainer(cfg.checkpoint_every, consumers, pipeline.fan_in(name).get("features", 1),
                                       cfg.rows_per_step, cfg.steps_per_row)
        except ValueError as exc:
            if cfg.checkpoint_every:  # reported where the cadence is set, the line to change
                every, owner, at = cfg.checkpoint_every, "its checkpoint_every", (name, "checkpoint_every")
            else:
                every = snapshot_cadence(consumers)[0]
                asker = next(c for c, f in consumers.items() if f.get(SNAPSHOT_EVERY) == every)
                owner, at = f"the cadence {asker!r} asks for", (asker, "every_steps")
            return [Problem(at[0], f"'{name}' snapshots every {every} steps ({owner}), but {exc}",
                            ("params", at[1]))]
        return ()

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        if "steps" not in summary:
            return None
        line = (f"train: {summary['steps']} steps, loss {summary.get('loss', float('nan')):.4f}, "
                f"accuracy {summary.get('acc', float('nan')):.4f}, "
                f"tau_sim {summary.get('tau_sim', float('nan')):.3f}")
        if summary.get("peak_gib") is not None:
            line += f", peak {summary['peak_gib']:.1f} GiB"
        if "replicas" in summary:
            line += f", {summary['replicas']} replicas {'equal' if summary['replicas_equal'] else 'DIFFER'}"
        if "drafter" in summary:
            line += f"; drafter {summary['drafter']} ({summary['drafter_source']})"
        if "interrupted_at" in summary:
            line += f"; interrupted at step {summary['interrupted_at']}"
        return line

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        from dflash_stages.train.trainer import Trainer

        trainer = Trainer(self.config, ctx)
        rows = checked(inputs["features"], FEATURE_ROW, ctx.stage, ctx.upstream("features"))
        header = next(rows, None)
        if not is_target_header(header):
            raise ValueError("train expects the extract stage's target header as its first item")
        check_fields(header, TARGET_HEADER, ctx.stage, ctx.upstream("features"))
        trainer.setup(header)
        length = ctx.upstream_facts.get(ROW_TOKENS)
        if length and warm_up_wanted(self.config.warm_up, trainer.compiled):
            trainer.warm_up(int(length))
        # fed by several extract ranks (fan-in), each sends its own copy of the header
        yield from trainer.fit(r for r in rows if not is_target_header(r))
