"""SIGINT/SIGTERM at every phase end a real ``dflash-pipe`` process with 128 + the signal and its
message, never by aborting (SIGABRT, ``terminate called without an active exception``): before
the trainer's first step, after training while the evaluate stage decodes, a second signal while
the first waits for the trainer, and the ``evaluate`` command. A signal during training:
test_stop_and_resume.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import REPO, cli_env
from tests.stages.online_fixtures import TINY_TRAIN, online_pipeline, tiny_target
from tests.stages.test_online_train import BIN, PLUGIN, dflash_pipe, kill_all, launch, metrics, write

ROWS = 4
EVALUATE = ("  evaluate: {{uses: spec_decode, after: checkpoint, params: {{prompts: '{prompts}', "
            "num_prompts: 64, max_new_tokens: 512, batch_size: 1, baseline: false}}}}\n")
"""Decodes far longer than a test waits: the signal comes while it runs."""
EVALUATE_SHORT = EVALUATE.replace("num_prompts: 64, max_new_tokens: 512", "num_prompts: 8, max_new_tokens: 64")
"""Long enough that a signal sent as it starts lands while it decodes; short enough to run twice."""
ABORT = "terminate called"


@pytest.fixture(scope="module")
def served_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target with the real vocabulary, so that evaluate can decode tokenized prompts."""
    return tiny_target(tmp_path_factory.getbasetemp(), hidden=32, vocab=151936)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Count to {n}.", "completion": "1 2 3"}) + "\n"
                            for n in range(64)))
    return path


def pipeline(tmp_path: Path, target: Path, prompts: Path, rows: str, evaluate: str = EVALUATE,
             **pack: str) -> tuple[Path, Path]:
    """pack:``rows`` -> extract -> train -> checkpoint -> evaluate; (pipeline file, run dir)."""
    run_dir = tmp_path / "run"
    text = online_pipeline(run_dir, target, pack=dict(rows=ROWS, tokens_per_row=64, **pack),
                           train=dict(TINY_TRAIN, log_every=1), checkpoint=dict(every_steps=1000),
                           extra=evaluate.format(prompts=prompts), rows=rows)
    return write(tmp_path / "p.yaml", text), run_dir


def send(proc: subprocess.Popen, sig: int) -> None:
    """SIGTERM to the process, as a scheduler; SIGINT to its process group, as a terminal's Ctrl-C."""
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.time() + 120
    while not ready():
        assert proc.poll() is None, f"ended before {what}:\n{log.read_text()}"
        assert time.time() < deadline, f"timed out waiting for {what}:\n{log.read_text()}"
        time.sleep(0.01)


def ended(proc: subprocess.Popen, log: Path, within: float = 60) -> str:
    """The process's output once it has ended (killed, and the test failed, if it does not)."""
    try:
        proc.wait(timeout=within)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    return log.read_text()


def test_a_signal_before_the_first_step_saves_that_step(tmp_path: Path, served_target: Path,
                                                        prompts: Path) -> None:
    """The rows are held back until the run is interrupted: the trainer takes its first step on
    them, saves it and the run exits 130 with the resume command."""
    path, run_dir = pipeline(tmp_path, served_target, prompts, "held", until="interrupt")
    log = tmp_path / "run.log"
    proc = launch(dflash_pipe(path), log)
    wait_for((run_dir / "held").exists, proc, log, "the rows were held")
    send(proc, signal.SIGINT)
    text = ended(proc, log)
    assert proc.returncode == 130, text
    assert f"SIGINT: interrupted at step 1, checkpoint saved: {run_dir / 'checkpoints' / 'step-0000001'}" in text
    assert "resume with: dflash-pipe run" in text and ABORT not in text


def test_a_signal_after_training_stops_evaluate(tmp_path: Path, served_target: Path, prompts: Path) -> None:
    """Training has ended (final checkpoint) and evaluate is decoding in its thread, inside torch
    calls that cannot be interrupted: the run still exits 143, saying training had finished, and
    leaves evaluate stopped."""
    path, run_dir = pipeline(tmp_path, served_target, prompts, "synthetic")
    log = tmp_path / "run.log"
    proc = launch(dflash_pipe(path), log)
    wait_for(lambda: "[evaluate] 0 checkpoints" in log.read_text(), proc, log, "evaluate decoding")
    send(proc, signal.SIGTERM)
    text = ended(proc, log)
    assert proc.returncode == 143, text
    assert f"SIGTERM: training had finished at step {ROWS} ({run_dir / 'checkpoints' / f'step-{ROWS:07d}'})" in text
    assert [ln for ln in text.splitlines() if ln.startswith("│ evaluate ") and " stopped " in ln], text
    assert f"evaluate had not finished; resume with: {shlex.join(dflash_pipe(path, '--resume'))[len(str(BIN)) + 1:]}" \
        in text.replace("\n", ""), text
    assert ABORT not in text


def cli_run(argv: list[str]) -> tuple[int, str]:
    """A CLI subprocess run to its end: (exit status, stdout and stderr)."""
    done = subprocess.run(argv, cwd=REPO, env=cli_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_resume_after_a_signal_during_the_final_evaluation_evaluates_it(
        tmp_path: Path, served_target: Path, prompts: Path) -> None:
    """Stopped while evaluate decodes the final checkpoint, ``run --resume`` trains nothing, evaluates
    that checkpoint and writes the report an uninterrupted run writes; the next ``--resume`` has
    nothing left to do."""
    ref_path, ref_dir = pipeline(tmp_path / "ref", served_target, prompts, "synthetic", EVALUATE_SHORT)
    code, text = cli_run(dflash_pipe(ref_path))
    assert code == 0, text
    path, run_dir = pipeline(tmp_path, served_target, prompts, "synthetic", EVALUATE_SHORT)
    log = tmp_path / "run.log"
    proc = launch(dflash_pipe(path), log)
    wait_for(lambda: "[evaluate] 0 checkpoints" in log.read_text(), proc, log, "evaluate decoding")
    send(proc, signal.SIGTERM)
    assert ended(proc, log) and proc.returncode == 143, log.read_text()
    final = f"step-{ROWS:07d}"
    report = run_dir / "work" / "evaluate" / final / "report.json"
    assert not report.exists()
    weights = (run_dir / "checkpoints" / final / "export" / "model.safetensors").read_bytes()
    code, text = cli_run([str(BIN / "dflash-pipe"), "status", "-p", PLUGIN, str(path)])
    assert code == 0 and f"(training finished at step {ROWS}) (evaluate had not finished; finish it with: " \
        f"dflash-pipe run -p {PLUGIN} {path} --resume)" in text.replace("\n", ""), text

    code, text = cli_run(dflash_pipe(path, "--resume"))
    assert code == 0, text
    assert f"training finished at step {ROWS}; evaluate had not" in text.replace("\n", ""), text
    assert (run_dir / "checkpoints" / final / "export" / "model.safetensors").read_bytes() == weights
    assert [m["step"] for m in metrics(run_dir) if "loss" in m] == list(range(1, ROWS + 1))
    got, want = (json.loads(p.read_text()) for p in (report, ref_dir / "work" / "evaluate" / final / "report.json"))
    for key in ("step", "tau", "accepted", "drafted", "cycles", "generated_tokens", "per_prompt"):
        assert got[key] == want[key], key

    code, text = cli_run(dflash_pipe(path, "--resume"))
    assert code == 0 and f"run already complete at step {ROWS}" in text.replace("\n", ""), text


def test_a_second_signal_aborts_at_once(tmp_path: Path, served_target: Path, prompts: Path) -> None:
    """The first SIGTERM waits for the trainer's next step, which the held rows never allow; the
    second aborts the run at once, saving nothing."""
    path, run_dir = pipeline(tmp_path, served_target, prompts, "held", until="stop")
    log = tmp_path / "run.log"
    proc = launch(dflash_pipe(path), log)
    wait_for((run_dir / "held").exists, proc, log, "the rows were held")
    send(proc, signal.SIGTERM)
    wait_for(lambda: "send it again to abort at once" in log.read_text(), proc, log, "the first signal's warning")
    send(proc, signal.SIGTERM)
    text = ended(proc, log, within=15)
    assert proc.returncode == 143, text
    assert "SIGTERM: aborted, no checkpoint saved now; latest checkpoint: none" in text
    assert not (run_dir / "checkpoints").exists() and ABORT not in text


def test_sigterm_stops_the_evaluate_command(tmp_path: Path, served_target: Path, prompts: Path) -> None:
    """``dflash-pipe evaluate`` on the CPU, once it loads the target (then decodes for minutes):
    SIGTERM ends it with its name and 143 (its default action would kill it without a word)."""
    import torch
    import transformers

    from dflash_model.drafter import DFlashDrafter, export_drafter

    cfg = transformers.AutoConfig.from_pretrained(served_target)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, num_layers=1, block_size=4, target_layer_ids=[0, 1], mask_token_id=5999)
    export = export_drafter(drafter, tmp_path / "export", extra_metadata={
        "target": str(served_target), "tokenizer": str(served_target), "thinking": False,
        "chat_template_kwargs": {}})
    log = tmp_path / "evaluate.log"
    proc = launch([str(BIN / "dflash-pipe"), "evaluate", str(export), "--prompts", str(prompts),
                   "--num-prompts", "64", "--max-new-tokens", "512", "--batch-size", "1", "--device", "cpu",
                   "--no-baseline", "--out", str(tmp_path / "eval")], log)
    wait_for(lambda: "Loading weights" in log.read_text(), proc, log, "the target loaded")
    send(proc, signal.SIGTERM)
    text = ended(proc, log)
    assert proc.returncode == 143, text
    assert "SIGTERM: interrupted" in text and ABORT not in text
