"""What moves τ: train the quality pipeline's drafter under several settings on one set of
generated records, side by side on one GPU, and print served τ for each.

    python benchmarks/quality_sweep.py --records 'runs/quality_gpu/cache/generate/*/*.jsonl' \
        --out runs/sweep --parallel 5 \
        lr1e-3:stages.train.params.lr=1e-3 \
        anchors1024:stages.train.params.num_anchors=1024 \
        half-16ep:records=0.5,stages.pack.params.epochs=16

Each point is ``NAME:KEY=VALUE,KEY=VALUE``. Keys are dotted paths into the pipeline file (as
``--set`` takes them), plus three that choose the point's records (data size):

* ``records=F``: the first fraction F of the records;
* ``prompts=GLOB``: only the records of prompt files whose name matches GLOB (e.g. ``*train.jsonl``:
  train.jsonl without train_later.jsonl);
* ``samples=K``: at most K completions per prompt, those of the lowest sample seeds (generate's
  ``samples``; a lone completion counts as one).

Every point runs the pipeline file (default pipelines/quality_gpu.yaml) without its generate stage:
download reads the records that generate already wrote (``--records``, a glob of its shards), so
the points differ only in what they set, and no point waits for the target to generate again.

Points run as separate processes, ``--parallel`` at a time: timings of overlapping points are not
the pipeline's speed (that is the pipeline's own run), only τ is compared here. Prints one row per
point (records, supervised tokens, steps, tokens, final loss / accuracy / τ_sim of the training
log, served τ and n-gram τ of the evaluate report with the standard error of τ's lead over n-gram),
and writes ``sweep.json`` beside the points' run
folders; ``--plot PNG`` also draws served τ and n-gram τ against the supervised tokens.
``--include NAME=RUN_DIR`` adds the row of a run that is already done (a pipeline file's own run, or a
point's run folder brought back from another machine) without running it; with only ``--include``
the command prints the table of those runs. The same
command with ``--resume``, after it was stopped, runs each point with ``dflash-pipe run --resume``.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def parse_point(text: str) -> tuple[str, dict[str, str]]:
    name, _, spec = text.partition(":")
    sets = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    if not name or "=" in name:
        raise SystemExit(f"a point is NAME:KEY=VALUE,...: {text!r}")
    return name, sets


def write_records(paths: list[str], fraction: float, out: Path, prompts: str | None = None,
                  samples: int | None = None) -> int:
    """The first ``fraction`` of the records in prompt-file order (``source``, ``line``; a prompt's
    samples by seed): shards are cut from the length-sorted prompts, so their own order would keep
    the longest ones. Only prompt files matching ``prompts``, and at most ``samples`` per prompt."""
    # split at "\n" only: splitlines also cuts at U+2028 and the like, which a completion's text may hold
    lines = [ln for p in paths for ln in Path(p).read_text(encoding="utf-8").split("\n") if ln.strip()]
    keyed = sorted((_file_order(ln), ln) for ln in lines)
    if prompts is not None:
        keyed = [(k, ln) for k, ln in keyed if fnmatch.fnmatch(k[0], prompts)]
    if samples is not None:
        keyed = [(k, ln) for i, (k, ln) in enumerate(keyed) if i < samples or keyed[i - samples][0][:2] != k[:2]]
    keep = [ln for _, ln in keyed[:max(1, round(len(keyed) * fraction))]]
    out.write_text("\n".join(keep) + "\n", encoding="utf-8")
    return len(keep)


def _file_order(line: str) -> tuple[str, int, int]:
    record = json.loads(line)
    return str(record["source"]), int(record["line"]), int(record.get("sample", 0))


def sweep_inputs(records: str, pipeline: str, out: str) -> tuple[list[str], Path, dict[str, Any], Path]:
    """generate's shards matching the glob ``records``, the base pipeline file's path and contents,
    and the output folder (made)."""
    shards = sorted(glob.glob(records))
    if not shards:
        raise SystemExit(f"no records match {records!r}")
    base_path = Path(pipeline).resolve()
    folder = Path(out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return shards, base_path, yaml.safe_load(base_path.read_text()), folder


def point_pipeline(base: dict[str, Any], base_dir: Path, records: Path, run_dir: Path) -> dict[str, Any]:
    """The pipeline without generate: download reads ``records``, tokenize follows download."""
    doc = json.loads(json.dumps(base))
    stages = doc["stages"]
    gen = stages.pop("generate")
    for spec in stages.values():
        if spec.get("after") == "generate":
            spec["after"] = gen.get("after", "download")
    stages["download"]["params"]["source"] = str(records)
    doc["run_dir"] = str(run_dir)
    train = stages["train"]["params"]
    if train.get("heldout"):
        train["heldout"] = str((base_dir / train["heldout"]).resolve())
    return doc


def launch(name: str, pipeline: Path, sets: dict[str, str], log: Path, resume: bool = False) -> subprocess.Popen:
    """The point's ``dflash-pipe run``; ``resume``: ``--resume`` (a point not started starts, an
    interrupted one goes on from its latest checkpoint, one stopped while evaluating its final checkpoint
    evaluates it, a finished one runs nothing) and the log
    appended to."""
    cmd = [sys.executable, "-m", "dflash_core.cli.main", "run", str(pipeline)] + (["--resume"] if resume else [])
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    print(f"[{time.strftime('%H:%M:%S')}] start {name}: {' '.join(cmd[3:])}", flush=True)
    return subprocess.Popen(cmd, stdout=log.open("a" if resume else "w"), stderr=subprocess.STDOUT, cwd=REPO)


def summarize(name: str, sets: dict[str, str], run_dir: Path, rc: int, wall: float | None) -> dict[str, Any]:
    """A point's row; ``wall``: seconds its run took here, None for a run done elsewhere."""
    row: dict[str, Any] = {"point": name, "sets": sets, "rc": rc, "wall_s": None if wall is None else round(wall, 1)}
    manifests = sorted(glob.glob(str(run_dir / "artifacts" / "tokenize" / "*" / "_manifest.json")),
                       key=lambda m: Path(m).stat().st_mtime)
    if manifests:  # the tokenize stage that ran last: what the point trained on
        summary = json.loads(Path(manifests[-1]).read_text()).get("summary", {})
        row.update(documents=summary.get("samples_out"), supervised=summary.get("loss_tokens"))
    metrics = run_dir / "metrics.jsonl"
    log = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    log = [r for r in log if "step" in r and "loss" in r]
    if log:
        tail = log[-5:]  # the last few logged steps: one step's figures are noisy
        row.update(steps=log[-1]["step"], tokens=log[-1]["tokens"],
                   loss=sum(r["loss"] for r in tail) / len(tail), acc=sum(r["acc"] for r in tail) / len(tail),
                   tau_sim_train=sum(r["tau_sim"] for r in tail) / len(tail))
    reports = sorted(glob.glob(str(run_dir / "work" / "evaluate" / "step-*" / "report.json")))
    if reports:
        rep = json.loads(Path(reports[-1]).read_text())
        row.update({k: rep.get(k) for k in ("tau", "tau_ngram", "tau_sim", "tau_serve_all", "lossless", "num_prompts")})
        row["lead_se"] = (rep.get("vs_ngram") or {}).get("se")  # how sure τ's lead over n-gram is
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("points", nargs="*", help="NAME:KEY=VALUE,... (see above)")
    ap.add_argument("--records", help="glob of generate's shards (JSONL records); needed to run points")
    ap.add_argument("--include", action="append", default=[], metavar="NAME=RUN_DIR",
                    help="a finished run's row, read from its run folder, not run")
    ap.add_argument("--pipeline", default=str(REPO / "pipelines" / "quality_gpu.yaml"))
    ap.add_argument("--out", required=True, help="folder for the points' pipelines, runs and logs")
    ap.add_argument("--parallel", type=int, default=1, help="points running at once")
    ap.add_argument("--plot", help="PNG to write: served τ and n-gram τ against supervised tokens")
    ap.add_argument("--resume", action="store_true",
                    help="the same command again after it was stopped: each point's run goes on where it stopped")
    args = ap.parse_args()
    included = [included_run(text) for text in args.include]
    if not args.points and not included:
        ap.error("give points to run, or --include runs to tabulate")
    if args.points and not args.records:
        ap.error("--records is needed to run points")

    shards, base_path, base, out = (sweep_inputs(args.records, args.pipeline, args.out) if args.points
                                    else ([], Path(), {}, Path(args.out).resolve()))
    out.mkdir(parents=True, exist_ok=True)

    jobs = []
    for text in args.points:
        name, sets = parse_point(text)
        chosen = {k: sets.pop(k) for k in ("records", "prompts", "samples") if k in sets}
        folder = out / name
        folder.mkdir(exist_ok=True)
        records = folder / "records.jsonl"
        count = write_records(shards, float(chosen.get("records", 1)), records, chosen.get("prompts"),
                              int(chosen["samples"]) if "samples" in chosen else None)
        pipeline = folder / "pipeline.yaml"
        pipeline.write_text(yaml.safe_dump(point_pipeline(base, base_path.parent, records, folder / "run"),
                                           sort_keys=False))
        jobs.append((name, {**sets, **chosen, "records": str(count)} if chosen else sets, pipeline, sets, folder))

    rows = [summarize(name, {"run": str(run_dir)}, run_dir, 0, None) for name, run_dir in included]
    running: list[tuple[Any, ...]] = []
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < args.parallel:
            name, shown, pipeline, sets, folder = pending.pop(0)
            running.append((name, shown, folder, time.time(),
                            launch(name, pipeline, sets, folder / "log.txt", args.resume)))
        time.sleep(2)
        for job in [j for j in running if j[4].poll() is not None]:
            running.remove(job)
            name, shown, folder, started, proc = job
            rows.append(summarize(name, shown, folder / "run", proc.returncode, time.time() - started))
            print(f"[{time.strftime('%H:%M:%S')}] done {name}: {json.dumps(rows[-1])}", flush=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    print("\n" + table(rows))
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def included_run(text: str) -> tuple[str, Path]:
    """``NAME=RUN_DIR`` of ``--include``: the name and the run folder, which must hold a training log."""
    name, _, run_dir = text.partition("=")
    if not name or not run_dir:
        raise SystemExit(f"--include takes NAME=RUN_DIR: {text!r}")
    path = Path(run_dir).resolve()
    if not (path / "metrics.jsonl").exists():
        raise SystemExit(f"--include {text}: no metrics.jsonl in {path} (a run folder holds one)")
    return name, path


def table(rows: list[dict[str, Any]]) -> str:
    """One line per point; supervised tokens also as a multiple of the first point's (the data scale)."""
    base = next((r["supervised"] for r in rows if r.get("supervised")), None)
    lines = [f"{'point':<16} {'rc':>3} {'docs':>7} {'supervised':>10} {'×':>5} {'steps':>6} {'tokens':>8} "
             f"{'loss':>6} {'acc':>5} {'τ_sim tr':>8} {'τ_sim':>6} {'τ_serve':>7} {'τ':>6} {'n-gram':>6} "
             f"{'± s.e.':>6} {'wall s':>7}"]
    for r in rows:
        def f(key: str, fmt: str) -> str:
            return format(r[key], fmt) if r.get(key) is not None else "-"
        scale = format(r["supervised"] / base, ".2f") if base and r.get("supervised") else "-"
        lines.append(f"{r['point']:<16} {r['rc']:>3} {f('documents', 'd'):>7} {f('supervised', ',d'):>10} {scale:>5} "
                     f"{f('steps', 'd'):>6} {f('tokens', '.2e'):>8} {f('loss', '.3f'):>6} {f('acc', '.3f'):>5} "
                     f"{f('tau_sim_train', '.2f'):>8} {f('tau_sim', '.2f'):>6} {f('tau_serve_all', '.2f'):>7} "
                     f"{f('tau', '.2f'):>6} {f('tau_ngram', '.2f'):>6} {f('lead_se', '.2f'):>6} "
                     f"{f('wall_s', '.1f'):>7}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Served τ and n-gram τ of each point that has both a report and a token count, against its
    supervised tokens (log scale: the points are multiples of each other), each point named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = sorted((r for r in rows if r.get("tau") is not None and r.get("supervised")),
                  key=lambda r: r["supervised"])
    x = [r["supervised"] / 1e6 for r in done]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r["tau"] for r in done], "o-", color="C1", label="DFlash τ served (held-out prompts)")
    ax.plot(x, [r.get("tau_ngram") or float("nan") for r in done], "s--", color="C2", label="n-gram τ (same prompts)")
    for xi, r in zip(x, done):
        ax.annotate(r["point"], (xi, r["tau"]), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("supervised tokens (millions)")
    ax.set_ylabel("τ (accepted drafts + 1 per cycle)")
    ax.set_title("served τ against training data")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
