"""What moves τ: train the quality pipeline's drafter under several settings on one set of
generated records, side by side on one GPU, and print served τ for each.

    python benchmarks/quality_sweep.py --records 'runs/quality_gpu/cache/generate/*/*.jsonl' \
        --out runs/sweep --parallel 5 \
        lr1e-3:stages.train.params.lr=1e-3 \
        anchors1024:stages.train.params.num_anchors=1024 \
        half-16ep:records=0.5,stages.pack.params.epochs=16

Each point is ``NAME:KEY=VALUE,KEY=VALUE``. Keys are dotted paths into the pipeline file (as
``--set`` takes them), plus ``records=F``: train on the first fraction F of the records (data size).
Every point runs the pipeline file (default pipelines/quality_gpu.yaml) without its generate stage:
download reads the records that generate already wrote (``--records``, a glob of its shards), so
the points differ only in what they set, and no point waits for the target to generate again.

Points run as separate processes, ``--parallel`` at a time: timings of overlapping points are not
the pipeline's speed (that is the pipeline's own run), only τ is compared here. Prints one row per
point (steps, tokens, final loss / accuracy / τ_sim of the training log, served τ and n-gram τ of
the evaluate report), and writes ``sweep.json`` beside the points' run folders.
"""

from __future__ import annotations

import argparse
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


def write_records(paths: list[str], fraction: float, out: Path) -> int:
    """The first ``fraction`` of the records in prompt-file order (``source``, ``line``): shards are
    cut from the length-sorted prompts, so their own order would keep the longest ones."""
    # split at "\n" only: splitlines also cuts at U+2028 and the like, which a completion's text may hold
    lines = [ln for p in paths for ln in Path(p).read_text(encoding="utf-8").split("\n") if ln.strip()]
    lines.sort(key=_file_order)
    keep = lines[:max(1, round(len(lines) * fraction))]
    out.write_text("\n".join(keep) + "\n", encoding="utf-8")
    return len(keep)


def _file_order(line: str) -> tuple[str, int]:
    record = json.loads(line)
    return str(record["source"]), int(record["line"])


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


def launch(name: str, pipeline: Path, sets: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash_core.cli.main", "run", str(pipeline)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    print(f"[{time.strftime('%H:%M:%S')}] start {name}: {' '.join(cmd[3:])}", flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)


def summarize(name: str, sets: dict[str, str], run_dir: Path, rc: int, wall: float) -> dict[str, Any]:
    row: dict[str, Any] = {"point": name, "sets": sets, "rc": rc, "wall_s": round(wall, 1)}
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
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("points", nargs="+", help="NAME:KEY=VALUE,... (see above)")
    ap.add_argument("--records", required=True, help="glob of generate's shards (JSONL records)")
    ap.add_argument("--pipeline", default=str(REPO / "pipelines" / "quality_gpu.yaml"))
    ap.add_argument("--out", required=True, help="folder for the points' pipelines, runs and logs")
    ap.add_argument("--parallel", type=int, default=1, help="points running at once")
    args = ap.parse_args()

    shards, base_path, base, out = sweep_inputs(args.records, args.pipeline, args.out)

    jobs = []
    for text in args.points:
        name, sets = parse_point(text)
        fraction = float(sets.pop("records", "1"))
        folder = out / name
        folder.mkdir(exist_ok=True)
        records = folder / "records.jsonl"
        count = write_records(shards, fraction, records)
        pipeline = folder / "pipeline.yaml"
        pipeline.write_text(yaml.safe_dump(point_pipeline(base, base_path.parent, records, folder / "run"),
                                           sort_keys=False))
        jobs.append((name, {**sets, "records": str(count)} if fraction != 1 else sets, pipeline, sets, folder))

    rows, running = [], []
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < args.parallel:
            name, shown, pipeline, sets, folder = pending.pop(0)
            running.append((name, shown, folder, time.time(), launch(name, pipeline, sets, folder / "log.txt")))
        time.sleep(2)
        for job in [j for j in running if j[4].poll() is not None]:
            running.remove(job)
            name, shown, folder, started, proc = job
            rows.append(summarize(name, shown, folder / "run", proc.returncode, time.time() - started))
            print(f"[{time.strftime('%H:%M:%S')}] done {name}: {json.dumps(rows[-1])}", flush=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))

    print(f"\n{'point':<16} {'rc':>3} {'steps':>6} {'tokens':>8} {'loss':>6} {'acc':>5} "
          f"{'τ_sim tr':>8} {'τ_sim':>6} {'τ_serve':>7} {'τ':>6} {'n-gram':>6} {'wall s':>7}")
    for r in rows:
        def f(key: str, fmt: str) -> str:
            return format(r[key], fmt) if r.get(key) is not None else "-"
        print(f"{r['point']:<16} {r['rc']:>3} {f('steps', 'd'):>6} {f('tokens', '.2e'):>8} {f('loss', '.3f'):>6} "
              f"{f('acc', '.3f'):>5} {f('tau_sim_train', '.2f'):>8} {f('tau_sim', '.2f'):>6} {f('tau_serve_all', '.2f'):>7} "
              f"{f('tau', '.2f'):>6} "
              f"{f('tau_ngram', '.2f'):>6} {r['wall_s']:>7}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
