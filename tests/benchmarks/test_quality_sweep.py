"""benchmarks/quality_sweep.py: a data-size point's records (a fraction in prompt-file order, prompt
files, samples per prompt), and the data curve's table and PNG from made-up runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.quality_sweep import write_records


def test_a_fraction_of_the_records_follows_the_prompt_files_not_the_shards(tmp_path: Path) -> None:
    # generate's shards are sorted by prompt length: shard 0 holds the longest prompts
    shards = [[("b.jsonl", 2), ("a.jsonl", 9)], [("a.jsonl", 1), ("b.jsonl", 1), ("a.jsonl", 10)]]
    paths = []
    for k, shard in enumerate(shards):
        path = tmp_path / f"shard-{k:05d}.jsonl"
        # as generate writes them (ensure_ascii=False): a text may hold U+2028, which is no line end
        path.write_text("".join(json.dumps({"source": s, "line": n, "text": f"{n}\u2028next"}, ensure_ascii=False)
                                + "\n" for s, n in shard), encoding="utf-8")
        paths.append(str(path))
    out = tmp_path / "records.jsonl"
    assert write_records(paths, 0.6, out) == 3
    kept = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x]
    assert [(r["source"], r["line"], r["text"]) for r in kept] == [
        ("a.jsonl", 1, "1\u2028next"), ("a.jsonl", 9, "9\u2028next"), ("a.jsonl", 10, "10\u2028next")]


def test_a_data_point_takes_prompt_files_and_samples_by_the_lowest_seeds(tmp_path: Path) -> None:
    """``prompts=GLOB`` keeps the prompt files it matches; ``samples=K`` the K samples of lowest seed
    of each prompt (a lone completion, with no ``sample`` field, counts as one)."""
    recs = [("d/train.jsonl", 2, 5), ("d/train.jsonl", 1, 6), ("d/train_later.jsonl", 1, 4),
            ("d/train.jsonl", 1, 4), ("d/train.jsonl", 2, 4), ("d/train.jsonl", 1, 5), ("d/train_later.jsonl", 1, 5),
            ("d/train.jsonl", 3, None)]
    shard = tmp_path / "shard-00000.s4.jsonl"
    shard.write_text("".join(json.dumps({"source": s, "line": n, **({} if k is None else {"sample": k})}) + "\n"
                             for s, n, k in recs), encoding="utf-8")
    out = tmp_path / "records.jsonl"

    def kept(**choose: object) -> list[tuple]:
        write_records([str(shard)], 1.0, out, **choose)
        return [(r["source"], r["line"], r.get("sample")) for r in map(json.loads, out.read_text().split("\n")[:-1])]

    assert kept(prompts="*train.jsonl", samples=2) == [
        ("d/train.jsonl", 1, 4), ("d/train.jsonl", 1, 5), ("d/train.jsonl", 2, 4), ("d/train.jsonl", 2, 5),
        ("d/train.jsonl", 3, None)]
    assert kept(samples=1) == [("d/train.jsonl", 1, 4), ("d/train.jsonl", 2, 4), ("d/train.jsonl", 3, None),
                               ("d/train_later.jsonl", 1, 4)]
    assert len(kept()) == len(recs)


def made_up_runs(root: Path) -> list[tuple[str, Path]]:
    """Three finished runs' folders as a point leaves them: two tokenize manifests (the later one is
    what it trained on), a training log and an evaluate report."""
    runs = []
    for name, supervised, tau in (("x1", 2_364_184, 1.95), ("x3", 7_092_552, 2.2), ("x10", 23_641_840, 2.4)):
        run = root / name / "run"
        for key, docs, when in (("old", 1, 1e9), ("new", supervised // 300, 2e9)):  # the latest tokenize is read
            manifest = run / "artifacts" / "tokenize" / key / "_manifest.json"
            manifest.parent.mkdir(parents=True)
            manifest.write_text(json.dumps({"summary": {"samples_out": docs, "loss_tokens": docs * 300}}))
            os.utime(manifest, (when, when))
        log = ({"step": s, "tokens": s * 8192, "loss": 3.0, "acc": 0.3, "tau_sim": 4.0} for s in (10, 20))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
        report = run / "work" / "evaluate" / "step-0000020" / "report.json"
        report.parent.mkdir(parents=True)
        lead = {"vs_ngram": {"diff": tau - 2.29, "se": 0.11, "n": 64, "wins": 40, "losses": 24}} if tau > 2 else {}
        report.write_text(json.dumps({"tau": tau, "tau_ngram": 2.29, "tau_sim": tau, "tau_serve_all": 1.6,
                                      "lossless": True, "num_prompts": 64, **lead}))
        runs.append((name, run))
    return runs


def test_the_data_curve_table_and_png_from_made_up_runs(tmp_path: Path) -> None:
    """Each point's row reads the supervised tokens of its tokenize stage, the training log and the
    evaluate report; the table gives the data scale against the first point, the PNG is written."""
    from benchmarks.quality_sweep import plot, summarize, table

    rows = [summarize(name, {}, run, 0, 100.0) for name, run in made_up_runs(tmp_path)]
    rows.append(summarize("failed", {}, tmp_path / "none", 1, 5.0))

    assert [(r.get("documents"), r.get("supervised"), r.get("steps"), r.get("tau")) for r in rows] == [
        (7880, 2_364_000, 20, 1.95), (23641, 7_092_300, 20, 2.2), (78806, 23_641_800, 20, 2.4),
        (None, None, None, None)]
    lines = table(rows).splitlines()
    assert lines[0].split()[:6] == ["point", "rc", "docs", "supervised", "×", "steps"]
    assert [line.split()[:5] for line in lines[1:]] == [
        ["x1", "0", "7880", "2,364,000", "1.00"], ["x3", "0", "23641", "7,092,300", "3.00"],
        ["x10", "0", "78806", "23,641,800", "10.00"], ["failed", "1", "-", "-", "-"]]
    assert lines[0].split()[-3:] == ["s.e.", "wall", "s"]  # the lead's standard error, where the report has it
    assert [line.split()[-2] for line in lines[1:]] == ["-", "0.11", "0.11", "-"]
    png = tmp_path / "curve.png"
    plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_sweep_resumes_each_point_and_keeps_its_log(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.quality_sweep as sweep

    started: list[tuple[list[str], str]] = []
    monkeypatch.setattr(sweep.subprocess, "Popen", lambda cmd, stdout, **kw: started.append((cmd, stdout.mode)))
    log = tmp_path / "log.txt"
    sweep.launch("x1", tmp_path / "pipeline.yaml", {"stages.pack.params.epochs": "3"}, log)
    sweep.launch("x1", tmp_path / "pipeline.yaml", {"stages.pack.params.epochs": "3"}, log, resume=True)
    assert [(cmd[3:], mode) for cmd, mode in started] == [
        (["run", str(tmp_path / "pipeline.yaml"), "--set", "stages.pack.params.epochs=3"], "w"),
        (["run", str(tmp_path / "pipeline.yaml"), "--resume", "--set", "stages.pack.params.epochs=3"], "a")]


def test_included_runs_are_tabulated_without_running_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--include NAME=RUN_DIR`` alone: the rows of finished runs (brought back from another machine),
    in the order given, their wall time unknown ("-"), sweep.json and the PNG written, no process
    started; a folder without a training log, or no points and no runs, is refused."""
    import sys

    import benchmarks.quality_sweep as sweep

    monkeypatch.setattr(sweep.subprocess, "Popen", lambda *a, **kw: pytest.fail("nothing is to be run"))
    runs = made_up_runs(tmp_path / "back")
    out, png = tmp_path / "curve", tmp_path / "curve.png"
    argv = ["quality_sweep.py", "--out", str(out), "--plot", str(png)]
    monkeypatch.setattr(sys, "argv", argv + [f"--include={n}={r}" for n, r in reversed(runs)])
    assert sweep.main() == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split() for ln in lines if ln.split()[:1] in (["x1"], ["x3"], ["x10"])]
    assert [(r[0], r[4], r[-4], r[-1]) for r in rows] == [
        ("x10", "1.00", "2.40", "-"), ("x3", "0.30", "2.20", "-"), ("x1", "0.10", "1.95", "-")]
    assert [r["point"] for r in json.loads((out / "sweep.json").read_text())] == ["x10", "x3", "x1"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for bad in ([f"--include=x1={tmp_path}"], []):
        monkeypatch.setattr(sys, "argv", argv + bad)
        with pytest.raises(SystemExit):
            sweep.main()

