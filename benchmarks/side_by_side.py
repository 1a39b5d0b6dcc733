"""Our trainer against a public one: train:dflash and SpecForge's DFlash trainer (train:specforge)
on the same generated records, target and drafter shape, each served by ``dflash-pipe evaluate``
on the same held-out prompts.

    python benchmarks/side_by_side.py --records 'runs/quality_gpu/cache/generate/*/shard-*.jsonl' \
        --specforge /path/to/SpecForge --out runs/side_by_side \
        ours: specforge:trainer=specforge,stages.train.params.batch_size=8

Each point is ``NAME:KEY=VALUE,...``: dotted keys set the point's pipeline as ``--set`` does, and
``trainer=specforge`` makes it a reference point (default: ours), and ``serve_target=MODEL`` serves
its export against MODEL (``evaluate --target``; e.g. a drafter trained on an FP8 target's features,
served against the bf16 one) instead of the target it trained on, and ``gpu=N`` runs its training
and evaluations on GPU N alone (``CUDA_VISIBLE_DEVICES``; default: what the environment sets), so
that on a machine of several GPUs a slow reference point need not share one with ours; the pipeline
values are written into the point's pipeline file (``NAME/pipeline.yaml`` in ``--out``).

``reuse=DIR`` (alone, or with ``serve_target`` and ``gpu``) trains nothing: DIR is a point's folder from an
earlier run (its ``pipeline.yaml``, ``train.log``, metrics and export), whose export is served again
in this run beside the new points, so that a reference trainer's deterministic run need not be
repeated to be served with them. ``--bundle DIR`` writes, as each training ends,
``DIR/NAME.tar.gz``: what ``reuse`` reads from the point's folder, to carry it off the machine
(unpacked, it is a folder ``NAME``).

Every point runs the quality pipeline file (default pipelines/quality_gpu.yaml) without its
generate stage, from the same records (``--records``, generate's shards), through the same
tokenize, pack and extract. Ours keep the file's train and checkpoint stages. A reference point
replaces train with ``train:specforge`` (benchmarks/specforge_train.py: SpecForge's own draft
model, loss, anchors, optimizer and schedule, its small-target recipe), sets pack to one epoch and
runs the file's epochs itself (set them with ``stages.train.params.epochs``). As soon as a point's
training ends, its final export is served with ``dflash-pipe evaluate`` (``--num-prompts``,
``--max-new-tokens``) on the file's held-out prompts, beside the trainings still running. Before
any point starts, each one to train is checked with ``dflash-pipe validate`` (its pipeline file and
plugins): if one is refused, the script prints why and exits 2 with nothing started.

The points train at once (``--parallel N``: at most N at a time, in the order given), so with
several on one GPU each wall clock is its own under that load. ``--train-prompts N`` also serves
each export on the first N prompts it was trained on. Prints one table (steps, anchors, drafter
compute, training time, peak memory, served τ, τ_ref, n-gram τ, lossless, and τ on training
prompts), then where τ is lost (evaluate's n-gram split), then each of our points against the
first reference point prompt by prompt, and writes ``side_by_side.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.quality_sweep import parse_point, point_pipeline, sweep_inputs, write_records  # noqa: E402


@dataclass
class Point:
    """One side of the comparison. ``home`` holds its run (``run/``, ``train.log``, a reference's
    ``export/``): its folder in --out, or the earlier run's folder it reuses, in which case ``cmd``
    is None and it is only served. ``gpu``: the GPU its processes see alone, or None."""
    reference: bool
    doc: dict[str, Any]
    home: Path
    cmd: list[str] | None
    gpu: str | None = None


class PointSpec(NamedTuple):
    """A ``NAME:KEY=VALUE,...`` argument taken apart: the keys that are no pipeline keys
    (``trainer``, ``serve_target``, ``reuse``, ``gpu``) out of ``sets``."""
    name: str
    sets: dict[str, str]
    reference: bool
    serve_target: str | None
    reuse: str | None
    gpu: str | None


def reused_pipeline(home: Path) -> tuple[bool, dict[str, Any]]:
    """(is a reference point, its pipeline) of an earlier run's point folder, from the pipeline file
    the side-by-side wrote there: train:specforge in it makes it a reference point."""
    path = home / "pipeline.yaml"
    if not path.is_file():
        raise SystemExit(f"reuse={home}: no pipeline.yaml there; reuse takes a point's folder of an earlier "
                         "side_by_side run (its --out/NAME)")
    doc = yaml.safe_load(path.read_text())
    return doc["stages"]["train"]["uses"] == "train:specforge", doc


def reuse_files(home: Path) -> list[Path]:
    """What ``reuse`` reads from a point's folder: its pipeline file, training log, metrics and final
    export (ours: the last checkpoint's; a reference point's: ``export/``), without the checkpoints'
    trainer state."""
    files = [home / "pipeline.yaml", home / "train.log",
             *(home / "run" / n for n in ("metrics.jsonl", "specforge_metrics.jsonl"))]
    exports = sorted(glob.glob(str(home / "run" / "checkpoints" / "step-*" / "export")))
    return [f for f in files + [Path(exports[-1]) if exports else home / "export"] if f.exists()]


def write_bundle(home: Path, path: Path) -> Path:
    """``reuse_files`` of ``home`` in a gzipped tar whose members sit under the point's name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for f in reuse_files(home):
            tar.add(f, arcname=str(f.relative_to(home.parent)))
    return path


def reference_pipeline(ours: dict[str, Any], specforge: str, export: Path) -> dict[str, Any]:
    """Ours with train:specforge in place of train:dflash: the same shape params, the file's epochs
    run by SpecForge's loop over one packed epoch, no checkpoint or evaluate stage."""
    doc = json.loads(json.dumps(ours))
    stages = doc["stages"]
    ours_train = stages["train"]["params"]
    pack = stages["pack"]["params"]
    params = {"specforge": specforge, "export": str(export), "epochs": int(pack.get("epochs", 1)),
              "heldout": ours_train.get("heldout")}
    params.update({k: ours_train[k] for k in ("num_layers", "block_size", "mask_token_id") if k in ours_train})
    stages["train"] = {"uses": "train:specforge", "after": stages["train"]["after"],
                       "device": stages["train"].get("device", "cpu"), "params": params}
    pack["epochs"] = 1
    gone = {"train"}
    while True:  # what follows train (checkpoint, then evaluate) has nothing to take
        after = [n for n, s in stages.items() if n != "train" and s.get("after") in gone]
        if not after:
            return doc
        for name in after:
            del stages[name]
            gone.add(name)


def apply_sets(doc: dict[str, Any], sets: dict[str, str]) -> dict[str, Any]:
    """``doc`` with each dotted KEY set to VALUE read as YAML (``--set``'s syntax), so that the
    pipeline file a point runs, and the figures read back from it, hold what the point set."""
    doc = json.loads(json.dumps(doc))
    for key, value in sets.items():
        *path, last = key.split(".")
        node = doc
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return doc


def drop_evaluate(doc: dict[str, Any]) -> dict[str, Any]:
    """Ours without its evaluate stage: both sides are served by the same command afterwards."""
    doc = json.loads(json.dumps(doc))
    for name in [n for n, s in doc["stages"].items() if s.get("uses", "").split(":")[0] in ("evaluate", "spec_decode")]:
        del doc["stages"][name]
    return doc


def run(cmd: list[str], log: Path, gpu: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``log``, seeing GPU ``gpu`` alone when one is given."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(cmd[2:])}" + (f" (GPU {gpu})" if gpu is not None else ""),
          flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)


def pipeline_cmd(pipeline: Path, reference: bool, verb: str = "run") -> list[str]:
    """``dflash-pipe VERB PIPELINE``, with the SpecForge stage's plugin for a reference point."""
    plugin = ["-p", "benchmarks.specforge_train"] if reference else []
    return [sys.executable, "-m", "dflash_core.cli.main", verb, *plugin, str(pipeline)]


def refused(points: dict[str, Point]) -> dict[str, str]:
    """The points to train whose run ``dflash-pipe validate`` refuses, each with validate's messages.
    Checked before anything starts: a point whose overrides the run would refuse (a checkpoint
    cadence its train stage cannot snapshot at) otherwise ends in seconds while the others train on,
    spending GPU time on a comparison that can never be complete. Each is checked as its run
    reads it (the same pipeline file and plugins), all at once."""
    procs = {name: subprocess.Popen(pipeline_cmd(p.home / "pipeline.yaml", p.reference, "validate"),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
             for name, p in points.items() if p.cmd}
    outputs = {name: proc.communicate()[0] for name, proc in procs.items()}
    return {name: outputs[name].strip() for name, proc in procs.items() if proc.returncode}


def run_queued(starts: dict[Any, Callable[[], subprocess.Popen]], parallel: int = 0,
               on_exit: Callable[[Any, int, float], dict[Any, Callable[[], subprocess.Popen]] | None] | None = None,
               ) -> dict[Any, tuple[int, float]]:
    """Start the processes in order, at most ``parallel`` trainings (keys that are a point's name) at
    a time (0: all at once), each as soon as a slot frees, and return each one's return code and wall
    clock from its own start. An evaluation (a (name, evaluation) key) does not take a slot: one
    queued first starts at once. ``on_exit(key, returncode, seconds)`` is called as each ends;
    the processes it returns start at once, outside the limit, and are waited for and handed to
    ``on_exit`` in turn: a point's evaluations run beside the trainings still queued or running."""
    queue, running, done = list(starts.items()), {}, {}
    while queue or running:
        while queue and (parallel <= 0 or isinstance(queue[0][0], tuple)
                         or sum(not isinstance(key, tuple) for key in running) < parallel):
            key, start = queue.pop(0)
            running[key] = (start(), time.time())
        for key, (p, t0) in list(running.items()):
            if p.poll() is not None:
                del running[key]
                done[key] = (p.returncode, round(time.time() - t0, 1))
                label = " ".join(key) if isinstance(key, tuple) else key
                print(f"[{time.strftime('%H:%M:%S')}] {label} exited {p.returncode} after {done[key][1]} s",
                      flush=True)
                for after, start in ((on_exit(key, *done[key]) if on_exit else None) or {}).items():
                    running[after] = (start(), time.time())
        time.sleep(0.2 if running else 0)
    return done


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def ours_figures(run_dir: Path, drafter_cfg: Any, tokens_per_row: int, num_anchors: int) -> dict[str, Any]:
    """Steps, anchors, compute and training time of train:dflash, from its metrics log: every
    step is one row of ``tokens_per_row`` tokens with ``num_anchors`` blocks (padded to that). Also
    its last ``tau_serve`` (on the rows it trains on) and, with ``validation_share``, ``val_tau_serve``
    (on documents it never trains on, pooled over the last epoch as evaluate pools it): what its
    served τ is to be read against."""
    from dflash_model.drafter import training_flops
    from dflash_stages.evaluate.drafter import training_summary

    log = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r and "loss" in r]
    if not log:
        return {}
    steps, trained = log[-1]["step"], training_summary(log)
    exports = sorted(glob.glob(str(run_dir / "checkpoints" / "step-*" / "export")))
    return {"steps": steps, "anchors_per_step": num_anchors, "anchor_blocks": steps * num_anchors,
            "drafter_pflop": training_flops(drafter_cfg, tokens_per_row, num_anchors, 0)["step"] * steps / 1e15,
            "train_s": log[-1].get("elapsed_s"), "loss": log[-1]["loss"], "acc": log[-1]["acc"],
            "tau_serve": trained["tau_serve_train"], "val_tau_serve": trained.get("tau_serve_val"),
            "export": exports[-1] if exports else None}


def reference_figures(run_dir: Path, export: Path) -> dict[str, Any]:
    """The same figures for train:specforge, which counts them as it trains."""
    log = read_jsonl(run_dir / "specforge_metrics.jsonl")
    if not log:
        return {}
    last = log[-1]
    return {"steps": last["step"], "anchors_per_step": round(last["anchor_blocks"] / last["step"], 1),
            "anchor_blocks": last["anchor_blocks"], "drafter_pflop": last["drafter_flop"] / 1e15,
            "train_s": last["elapsed_s"], "peak_gib": last.get("peak_gib"), "loss": last["loss"],
            "acc": last["acc"], "export": str(export) if export.exists() else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("points", nargs="*", default=["ours:", "specforge:trainer=specforge"],
                    help="NAME:KEY=VALUE,... (default: ours: specforge:trainer=specforge)")
    ap.add_argument("--records", required=True, help="glob of generate's shards (JSONL records)")
    ap.add_argument("--specforge", required=True, help="path of a SpecForge checkout")
    ap.add_argument("--pipeline", default=str(REPO / "pipelines" / "quality_gpu.yaml"))
    ap.add_argument("--out", required=True, help="folder for the points' pipelines, runs, logs and reports")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eval-batch-size", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=0, metavar="N",
                    help="train at most N points at once, in the order given, each starting as one ends (default "
                         "0: all at once; 1: one after the other). A reference trainer slows most on a shared GPU")
    ap.add_argument("--bundle", metavar="DIR",
                    help="as each training ends, write DIR/NAME.tar.gz: what reuse=DIR/NAME needs to serve the "
                         "point in a later run (pipeline file, training log, metrics, final export)")
    ap.add_argument("--train-prompts", type=int, default=0, metavar="N",
                    help="also serve each export on the first N prompts of the file's download source: "
                         "prompts it was trained on (under-fitting shows as τ there barely above held-out)")
    args = ap.parse_args()

    shards, base_path, base, out = sweep_inputs(args.records, args.pipeline, args.out)
    heldout = str((base_path.parent / base["stages"]["train"]["params"]["heldout"]).resolve())
    prompt_sets = {"eval": (heldout, args.num_prompts)}
    if args.train_prompts:
        prompt_sets["eval_train"] = (training_prompts(base, base_path.parent), args.train_prompts)
    records = out / "records.jsonl"
    print(f"{write_records(shards, 1.0, records)} records from {len(shards)} shards", flush=True)

    points: dict[str, Point] = {}
    serve_targets: dict[str, str | None] = {}
    for text in args.points:
        name, sets, reference, serve_targets[name], reuse, gpu = point_spec(text)
        folder = out / name
        folder.mkdir(exist_ok=True)
        if reuse:
            if sets:
                raise SystemExit(f"{name}: reuse= serves an earlier run's point as it was trained; it takes no "
                                 f"pipeline keys ({', '.join(sets)})")
            home = Path(reuse).resolve()
            points[name] = Point(*reused_pipeline(home), home, None, gpu)
            continue
        doc = point_pipeline(base, base_path.parent, records, folder / "run")
        doc = (reference_pipeline(doc, str(Path(args.specforge).resolve()), folder / "export") if reference
               else drop_evaluate(doc))
        doc = apply_sets(doc, sets)
        (folder / "pipeline.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        points[name] = Point(reference, doc, folder, pipeline_cmd(folder / "pipeline.yaml", reference), gpu)

    if bad := refused(points):
        for name, messages in bad.items():
            print(f"{name}: dflash-pipe validate refuses {points[name].home / 'pipeline.yaml'}\n{messages}\n")
        print(f"nothing started: {', '.join(bad)} would fail (fix the point's keys)", flush=True)
        return 2

    def point_figures(name: str, rc: int) -> dict[str, Any]:
        p = points[name]
        run_dir = p.home / "run"
        if p.reference:
            return reference_figures(run_dir, p.home / "export")
        if rc != 0:
            return {}
        f = ours_figures(run_dir, drafter_config_of(run_dir), int(p.doc["stages"]["pack"]["params"]["tokens_per_row"]),
                         int(p.doc["stages"]["train"]["params"].get("num_anchors", 512)))
        return {**f, "peak_gib": train_peak(p.home / "train.log")}

    def evaluations(name: str, export: str) -> dict[tuple[str, str], Callable[[], subprocess.Popen]]:
        return {(name, kind): (lambda kind=kind, prompts=prompts, n=n: run(
                    evaluate_cmd(export, prompts, n, out / name / kind, args.max_new_tokens, args.eval_batch_size,
                                 serve_targets[name], out / "references"),
                    out / name / f"{kind}.log", points[name].gpu))
                for kind, (prompts, n) in prompt_sets.items()}

    figures: dict[str, dict[str, Any]] = {}
    trained: dict[str, tuple[int, float]] = {}
    served: dict[tuple[str, str], int] = {}

    def rows_now() -> list[dict[str, Any]]:
        """A row per point trained so far, with the figures of the evaluations ended so far; ours are
        compared prompt by prompt with the first reference point given that has trained (``vs_ref``)."""
        rows = []
        ref_name = reference_of([name for name in points if points[name].reference], figures)
        ref = read_report(out / ref_name / "eval" / "report.json") if ref_name else {}
        for name, f in figures.items():
            rep, train_rep = (read_report(out / name / kind / "report.json") for kind in ("eval", "eval_train"))
            rows.append({"point": name, "trainer": "specforge" if points[name].reference else "ours",
                         "serve_target": serve_targets[name],
                         "reused": None if points[name].cmd else str(points[name].home),
                         "train_rc": trained[name][0], "pipeline_s": trained[name][1], **f,
                         "eval_rc": max((rc for k, rc in served.items() if k[0] == name), default=None),
                         **{k: rep.get(k) for k in ("tau", "tau_ngram", "tau_sim", "tau_ref", "lossless",
                                                    "num_prompts")},
                         "tau_train": train_rep.get("tau"), "tau_ngram_train": train_rep.get("tau_ngram"),
                         **split_figures(rep),
                         "vs_ref": None if points[name].reference or not ref_name else
                         {"ref": ref_name, **{k: paired(ref, rep, k) for k in ("tau", "tau_ref")}}})
        return rows

    def on_exit(key: str | tuple[str, str], rc: int, seconds: float) -> dict | None:
        """A training's end starts its point's evaluations; side_by_side.json is rewritten at every
        end, so a run cut short (a device's time limit) keeps what ended."""
        follow = None
        if isinstance(key, tuple):
            served[key] = rc
        else:
            trained[key] = (rc, seconds)
            figures[key] = point_figures(key, rc)
            if figures[key].get("export"):
                follow = evaluations(key, figures[key]["export"])
                if args.bundle:
                    print(f"bundle: {write_bundle(points[key].home, Path(args.bundle) / f'{key}.tar.gz')}", flush=True)
        (out / "side_by_side.json").write_text(json.dumps(rows_now(), indent=1))
        return follow

    starts: dict[Any, Callable[[], subprocess.Popen]] = {}
    for name, p in points.items():  # a reused point's evaluations first: they take no training slot
        if p.cmd is None:
            trained[name], figures[name] = (0, None), point_figures(name, 0)
            if not figures[name].get("export"):
                raise SystemExit(f"reuse={p.home}: no export there to serve")
            starts.update(evaluations(name, figures[name]["export"]))
    starts.update({name: (lambda name=name, p=p: run(p.cmd, out / name / "train.log", p.gpu))
                   for name, p in points.items() if p.cmd})
    run_queued(starts, args.parallel, on_exit)
    rows = rows_now()
    print_table(rows)
    return 0 if all(r["train_rc"] == 0 and r["eval_rc"] == 0 for r in rows) else 1


def point_spec(text: str) -> PointSpec:
    """A ``NAME:KEY=VALUE,...`` argument: its pipeline sets, whether it is a reference point, the
    target to serve against (None: the one it trained on), the earlier run's point folder it reuses
    and the GPU it runs on (None for either: none)."""
    name, sets = parse_point(text)
    reference = sets.pop("trainer", "ours") == "specforge"
    gpu = sets.pop("gpu", None)
    if gpu is not None and not gpu.isdigit():  # anything else hides every GPU from the point alone
        raise SystemExit(f"{name}: gpu={gpu!r}: give one GPU's index (gpu=0, gpu=1, ...)")
    return PointSpec(name, sets, reference, sets.pop("serve_target", None), sets.pop("reuse", None), gpu)


def evaluate_cmd(export: str, prompts: str, num_prompts: int, out: Path, max_new_tokens: int, batch_size: int,
                 target: str | None, references: Path) -> list[str]:
    """``dflash-pipe evaluate`` of one export on one prompt set, against ``target`` when given, with
    the greedy references in ``references`` that the points served on one target share (one text
    for τ_ref, as one process decodes it; docs/evaluate.md, ``--reference``)."""
    return ([sys.executable, "-m", "dflash_core.cli.main", "evaluate", export, "--prompts", prompts,
             "--num-prompts", str(num_prompts), "--max-new-tokens", str(max_new_tokens), "--batch-size",
             str(batch_size), "--out", str(out), "--reference", str(references)]
            + (["--target", target] if target else []))


def training_prompts(base: dict[str, Any], base_dir: Path) -> str:
    """The prompt file the quality pipeline generated its records from (the first, when its
    download stage reads several): each point trained on the completions of these prompts."""
    source = base["stages"]["download"]["params"]["source"]
    first = source[0] if isinstance(source, list) else source
    return str((base_dir / first).resolve())


def reference_of(references: list[str], trained: Iterable[str]) -> str | None:
    """The reference point ours are compared with: the first one given (command-line order) that has
    trained, whichever ended first, so that every comparison of a run is with the same point."""
    done = set(trained)
    return next((name for name in references if name in done), None)


def paired(ref: dict[str, Any], point: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``point`` against ``ref`` prompt by prompt on ``key`` (evaluate's per-prompt τ or τ_ref), over
    the prompts both reports hold a number for: the ratio of the pooled figures, the mean of the
    per-prompt differences (point − ref) with its standard error, and the prompts each side wins.
    On ``tau_ref`` both drafters are scored on the same text, so the pairing is exact; on ``tau``
    each is scored on its own served output. None without two such prompts."""
    theirs = {r["index"]: r.get(key) for r in ref.get("per_prompt") or []}
    d = [r[key] - theirs[r["index"]] for r in point.get("per_prompt") or []
         if _finite(r.get(key)) and _finite(theirs.get(r["index"]))]
    if len(d) < 2 or not ref.get(key) or point.get(key) is None:
        return None
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    return {"ratio": point[key] / ref[key], "diff": mean, "se": sd / math.sqrt(len(d)), "n": len(d),
            "wins": sum(x > 0 for x in d), "losses": sum(x < 0 for x in d)}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def split_figures(report: dict[str, Any]) -> dict[str, Any]:
    """evaluate's n-gram split of a report: τ of DFlash and of n-gram on the cycles where n-gram
    had a match (text it could copy) and where it had none (new text), and the share of
    DFlash's cycles with a match. Empty for a report without the split."""
    split = report.get("ngram_split") or {}
    out: dict[str, Any] = {}
    for cls, tag in (("match", "copy"), ("no_match", "new")):
        for drafter, prefix in (("dflash", "tau"), ("ngram", "tau_ngram")):
            part = (split.get(cls) or {}).get(drafter)
            if part:
                out[f"{prefix}_{tag}"] = part["tau"]
                if drafter == "dflash" and cls == "match":
                    out["copy_share"] = part["share"]
    return out


def read_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def drafter_config_of(run_dir: Path) -> Any:
    """Our side's drafter config, read back from its final export."""
    from dflash_model.drafter import DrafterConfig, read_export_config

    exports = sorted(glob.glob(str(run_dir / "checkpoints" / "step-*" / "export")))
    if not exports:
        raise SystemExit(f"{run_dir}: no export was written (see the side's train.log)")
    return DrafterConfig.from_export_dict(read_export_config(exports[-1]))


def train_peak(log: Path) -> float | None:
    """The peak GPU memory the train stage reported in its summary line."""
    import re

    found = re.findall(r"train: .*?peak ([0-9.]+) GiB", log.read_text()) if log.exists() else []
    return float(found[-1]) if found else None


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    print(f"\n{'point':<16} {'trainer':<9} {'steps':>6} {'anchors/step':>12} {'blocks':>9} {'PFLOP':>7} {'train s':>8} "
          f"{'pipeline s':>10} {'peak GiB':>8} {'loss':>6} {'acc':>5} {'τ':>5} {'τ ref':>5} {'n-gram':>6} "
          f"{'lossless':>8} {'τ train':>7} {'n-gram train':>12} {'τ_serve':>7} {'val τ_serve':>11}")
    for r in rows:
        print(f"{r['point']:<16} {r['trainer']:<9} {f(r, 'steps', 'd'):>6} {f(r, 'anchors_per_step', '.1f'):>12} "
              f"{f(r, 'anchor_blocks', '.3g'):>9} {f(r, 'drafter_pflop', '.1f'):>7} {f(r, 'train_s', '.0f'):>8} "
              f"{f(r, 'pipeline_s', '.0f'):>10} {f(r, 'peak_gib', '.1f'):>8} {f(r, 'loss', '.3f'):>6} "
              f"{f(r, 'acc', '.3f'):>5} {f(r, 'tau', '.2f'):>5} {f(r, 'tau_ref', '.2f'):>5} "
              f"{f(r, 'tau_ngram', '.2f'):>6} {str(r.get('lossless', '-')):>8} {f(r, 'tau_train', '.2f'):>7} "
              f"{f(r, 'tau_ngram_train', '.2f'):>12} {f(r, 'tau_serve', '.2f'):>7} {f(r, 'val_tau_serve', '.2f'):>11}")
    for r in rows:
        if r.get("reused"):
            print(f"{r['point']}: trained in an earlier run ({r['reused']}), served in this one")
    if any(r.get("tau_copy") is not None for r in rows):
        print("\nwhere τ is lost (evaluate's n-gram split): cycles where n-gram had a match (copy) or none (new)")
        print(f"{'point':<16} {'copy share':>10} {'τ copy':>7} {'n-gram copy':>11} {'τ new':>6} {'n-gram new':>10}")
        for r in rows:
            print(f"{r['point']:<16} {f(r, 'copy_share', '.2f'):>10} {f(r, 'tau_copy', '.2f'):>7} "
                  f"{f(r, 'tau_ngram_copy', '.2f'):>11} {f(r, 'tau_new', '.2f'):>6} {f(r, 'tau_ngram_new', '.2f'):>10}")
    measures = (("tau", "served τ"), ("tau_ref", "τ on the reference text"))
    lines = [(r["point"], what, c) for r in rows for key, what in measures if (c := (r.get("vs_ref") or {}).get(key))]
    if lines:
        ref = next(r["vs_ref"]["ref"] for r in rows if r.get("vs_ref"))
        print(f"\nagainst {ref}, prompt by prompt (difference: point − {ref}, mean ± standard error)")
        for point, what, c in lines:
            print(f"{point:<16} {what:<24} ratio {c['ratio']:.3f}  difference {c['diff']:+.3f} ± {c['se']:.3f} "
                  f"over {c['n']} prompts, {c['wins']} won, {c['losses']} lost")


if __name__ == "__main__":
    sys.exit(main())
