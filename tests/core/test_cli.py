"""The ``dflash-pipe`` CLI: run / --only / --from / --dry-run / status, and its exit codes
(0 ok, 1 a stage failed, 2 config error, 4 refused).

Most calls go through ``main()`` in this process (the ``cli`` fixture); the ones that must see
a real interpreter exit (a killed stage process) run ``python -m dflash_core.cli.main``.
"""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from dflash_core import devices
from tests.conftest import REPO, STAGES

CHAIN = """
    stages:
      src:    {uses: numbers, params: {n: 5}}
      double: {uses: scale, after: src, link: materialize}
      sink:   {uses: collect, after: double, link: materialize}
"""
STAGE_NAMES = ("src", "double", "sink")


@pytest.fixture
def chain(write_pipeline):
    return write_pipeline(CHAIN)


def run(cli, path, *extra):
    return cli("run", "-p", STAGES, path, *extra)


def test_run_then_rerun_reports_every_stage_cached(cli, chain, tmp_path):
    first = run(cli, chain)
    assert first.code == 0, first.text
    for stage in STAGE_NAMES:
        assert first.lines_with(f"[{stage}] started"), first.out
        assert first.lines_with(f"[{stage}] done"), first.out
    assert (tmp_path / "run" / "state.json").is_file()

    second = run(cli, chain)
    assert second.code == 0, second.text
    for stage in STAGE_NAMES:
        assert second.lines_with(f"[{stage}] cached"), second.out
        assert not second.lines_with(f"[{stage}] started"), second.out
        assert second.lines_with(f"│ {stage} ", "cached"), second.out  # the summary table row


def test_only_runs_from_stored_inputs_and_refuses_when_it_cannot(cli, chain, tmp_path):
    # never materialized: a fresh run dir
    res = run(cli, chain, "--only", "double")
    assert res.code == 4, res.text
    assert "refused: cannot run 'double': its input 'src' is missing: never materialized" in res.err

    assert run(cli, chain).code == 0
    res = run(cli, chain, "--only", "double")
    assert res.code == 0, res.text
    assert res.lines_with("[double] started") and res.lines_with("[double] done")
    assert "[src]" not in res.out and "[sink]" not in res.out  # src was read back, not run

    # stale: an upstream param differs from the one its artifact was made with
    res = run(cli, chain, "--only", "double", "--set", "stages.src.params.n=7")
    assert res.code == 4, res.text
    assert "its input 'src' is stale: param 'n' changed: 5 -> 7" in res.err

    # the input edge is a stream: nothing stored to start from
    res = run(cli, chain, "--only", "double", "--set", "stages.double.link=stream")
    assert res.code == 4, res.text
    assert "its input 'src' is streamed" in res.err

    res = run(cli, chain, "--only", "nope")
    assert res.code == 4 and "no such stage" in res.err


def test_from_runs_the_stage_and_its_descendants(cli, chain):
    assert run(cli, chain).code == 0
    res = run(cli, chain, "--from", "double")
    assert res.code == 0, res.text
    assert res.lines_with("[double] done") and res.lines_with("[sink] done"), res.out
    assert "[src]" not in res.out


def test_dry_run_prints_what_would_run_with_reasons_and_runs_nothing(cli, chain, tmp_path):
    run_dir = tmp_path / "run"
    res = run(cli, chain, "--dry-run")
    assert res.code == 0, res.text
    assert res.lines_with("dry run of", str(chain)), res.out
    for stage in STAGE_NAMES:
        assert res.lines_with(stage, " run ", "never materialized in this run dir"), res.out
    assert not run_dir.exists()  # nothing ran, nothing was written

    assert run(cli, chain).code == 0
    state = (run_dir / "state.json").read_bytes()
    res = run(cli, chain, "--dry-run", "--set", "stages.double.params.factor=3")
    assert res.code == 0, res.text
    assert res.lines_with("src", "cached", "fresh artifact"), res.out
    assert res.lines_with("double", " run ", "param 'factor' changed: 2 -> 3"), res.out
    assert res.lines_with("sink", " run ", "upstream 'double' is stale"), res.out
    assert "[double] started" not in res.out
    assert (run_dir / "state.json").read_bytes() == state

    res = run(cli, chain, "--dry-run", "--only", "sink")
    assert res.code == 0, res.text
    assert res.lines_with("double", "from-artifact"), res.out
    assert res.lines_with("sink", " run ", "--only"), res.out

    res = run(cli, chain, "--dry-run", "--from", "double")
    assert res.code == 0, res.text
    assert res.lines_with("src", "from-artifact"), res.out
    assert res.lines_with("double", " run ", "--from double"), res.out
    assert res.lines_with("sink", " run ", "--from double"), res.out
    assert (run_dir / "state.json").read_bytes() == state

    # `status` says the same from the run dir
    res = cli("status", "-p", STAGES, chain, "--set", "stages.double.params.factor=3")
    assert res.code == 0, res.text
    assert res.lines_with("src", "fresh") and res.lines_with("double", "stale", "param 'factor'")


def test_validate_and_graph_show_the_dag(cli, chain):
    res = cli("validate", "-p", STAGES, chain)
    assert res.code == 0, res.text
    assert res.lines_with(f"{chain}: ok", "3 stages")
    assert res.lines_with("double: map:scale on cpu [thread]", "items<-src (materialize)"), res.out
    res = cli("graph", "-p", STAGES, chain, "--set", "stages.sink.executor=process")
    assert res.code == 0, res.text
    assert res.lines_with("double [map:scale @ cpu, thread] -> sink (materialize)"), res.out
    assert res.lines_with("sink [sink:collect @ cpu, process]"), res.out
    res = cli("graph", "--dot", "-p", STAGES, chain)
    assert res.code == 0 and '"src" -> "double" [label="materialize", style=dashed];' in res.out


def test_exit_codes(cli, write_pipeline, tmp_path):
    ok = write_pipeline(CHAIN, name="ok.yaml")
    assert run(cli, ok).code == 0

    failing = write_pipeline("""
        stages:
          src:   {uses: numbers, params: {n: 10}}
          scale: {uses: scale, after: src, link: stream, params: {fail_at: 2}}
          sink:  {uses: collect, after: scale, link: stream}
    """, name="failing.yaml", run_dir=str(tmp_path / "run-failing"))
    res = run(cli, failing)
    assert res.code == 1, res.text
    assert "error: stage 'scale' failed: ValueError: scale refuses item 2" in res.err
    assert "Traceback" not in res.err
    log = tmp_path / "run-failing" / "failures.log"  # the traceback the screen left out, kept
    assert f"its traceback: {log}" in res.err
    first = log.read_text()
    assert first.startswith("== ") and "-- stage 'scale': ValueError: scale refuses item 2\nTraceback" in first
    res = cli("run", "--traceback", "-p", STAGES, failing)
    assert res.code == 1 and "Traceback" in res.err and "scale refuses item 2" in res.err
    assert "its traceback:" not in res.err  # on the screen already
    again = log.read_text()  # a second failure is added below the first
    assert again.startswith(first) and again.count("-- stage 'scale': ValueError") == 2

    bad = write_pipeline("""
        stages:
          src:   {uses: numbers, params: {n: many}}
          scale: {uses: scalee, after: src}
    """, name="bad.yaml")
    for command in ("run", "validate"):
        res = cli(command, "-p", STAGES, bad)
        assert res.code == 2, res.text
        # (write_pipeline put version/run_dir and a blank line above `stages:`)
        assert f"{bad}:6:17: unknown stage implementation 'scalee'" in res.err
        assert f"{bad}:5:38: param 'n' must be int" in res.err  # …both reported at once
        assert "Traceback" not in res.err

    res = run(cli, ok, "--only", "double", "--set", "stages.src.params.n=6")
    assert res.code == 4, res.text


def test_killed_process_stage_with_big_items_exits_instead_of_hanging(cli_subprocess,
                                                                      write_pipeline, tmp_path):
    """The consumer process dies while the main process still feeds it 200 kB items: the run
    must fail naming it and the interpreter must exit (a queue feeder thread blocked on the
    dead pipe used to keep it alive forever)."""
    path = write_pipeline("""
        stages:
          src:   {uses: numbers, params: {forever: true, pad: 200000}}
          scale: {uses: scale, after: src, link: stream, executor: process, params: {kill_at: 1}}
          sink:  {uses: collect, after: scale, link: stream}
    """)
    res = cli_subprocess("run", "-q", "-p", STAGES, path, timeout=90)
    ended = time.time()
    assert res.code == 1, res.text
    assert "stage 'scale' failed" in res.err and "SIGKILL" in res.err
    killed = float((tmp_path / "run" / "killed_at").read_text())
    assert ended - killed < 10, f"exit came {ended - killed:.1f}s after the kill"


GPU_PIPELINES = sorted(p for p in (REPO / "pipelines").rglob("*.yaml")
                       if re.search(r"^[^#]*device: \"?cuda", p.read_text(), re.M))


@pytest.fixture
def no_gpu(monkeypatch):
    """A host without CUDA devices, whatever this machine has."""
    monkeypatch.setattr(devices, "visible_cuda_devices", lambda: 0)


def test_the_gpu_pipelines_are_found():
    names = {p.relative_to(REPO).as_posix() for p in GPU_PIPELINES}
    assert {"pipelines/two_gpu.yaml", "pipelines/qwen3_6_27b.yaml", "pipelines/quality_gpu.yaml",
            "pipelines/quality_long.yaml", "pipelines/layouts_h200x4/pairs.yaml"} <= names


@pytest.mark.parametrize("path", GPU_PIPELINES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_gpu_pipelines_validate_and_plan_on_a_host_without_gpus(cli, no_gpu, path):
    res = cli("validate", path)
    assert res.code == 0, res.text
    assert res.lines_with(f"{path}: ok")
    res = cli("plan", path, "--rates", "5851,23076", "--gpus", "4")
    assert res.code == 0, res.text
    assert res.lines_with("recommended: "), res.out


def test_only_run_needs_the_devices(cli, no_gpu, tmp_path):
    gpu = REPO / "pipelines" / "two_gpu.yaml"
    assert cli("validate", gpu).code == 0
    res = cli("run", gpu, "--set", f"run_dir={tmp_path / 'run'}")
    assert res.code == 2, res.text
    assert f"{gpu}:9:50: device 'cuda:0' is not available (0 CUDA devices visible)" in res.err
    assert f"{gpu}:10:49: device 'cuda:1' is not available" in res.err
    assert not (tmp_path / "run").exists()
    # validate still checks how a device is written, at its file:line:col
    bad = tmp_path / "bad.yaml"
    bad.write_text(gpu.read_text().replace("device: cuda:1", "device: cuda:one"))
    res = cli("validate", bad)
    assert res.code == 2, res.text
    assert f"{bad}:10:49: unknown device 'cuda:one' (expected cpu, cuda, cuda:N or mps)" in res.err


def test_list_stages_never_cuts_the_names_to_type(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    res = cli("list-stages")
    assert res.code == 0, res.text
    assert max(len(line) for line in res.out.splitlines()) <= 80
    for uses in ("tokenize:chat_template", "evaluate:spec_decode", "checkpoint:fsspec"):
        assert res.lines_with(f"│ {uses} "), res.out


def test_list_stages_of_an_unknown_kind_is_an_error(cli):
    res = cli("list-stages", "tokenise")
    assert res.code == 2, res.text
    assert res.err.startswith("error: unknown kind 'tokenise' (did you mean 'tokenize'?); kinds: "
                              "checkpoint, download, evaluate, extract, generate, pack, tokenize, train"), res.err
    assert res.out == ""
    res = cli("list-stages", "pack")
    assert res.code == 0 and res.lines_with("pack:best_fit") and not res.lines_with("train:dflash")



def test_list_stages_verbose_shows_each_params_help(cli):
    from dflash_stages.generate.openai_api import OpenAIGenerateConfig
    from dflash_stages.generate.stage import GenerateConfig

    res = cli("list-stages", "generate", "-v")
    assert res.code == 0, res.text
    for uses, config in (("generate:hf", GenerateConfig), ("generate:openai", OpenAIGenerateConfig)):
        table = res.out[res.out.index(f"{uses} params"):]
        for f in dataclasses.fields(config):
            opening = " ".join(f.metadata["help"].split()[:4])
            assert re.search(rf"│ {f.name} +│.*│ {re.escape(opening)}", table), (uses, f.name)
    nested = cli("list-stages", "train", "-v").out  # a nested dataclass's params follow their parent
    assert re.search(r"│ drafter_attention\.rope_theta +│ float \| None +│ None +│ plain full-rotary", nested)


def test_validate_names_a_choice_params_allowed_values_and_its_help(cli, write_pipeline):
    path = write_pipeline("""
        stages:
          train: {uses: dflash, params: {loss_target: argmax}}
    """)
    res = cli("validate", path)
    assert res.code == 2, res.text
    assert (f"{path}:5:47: param 'loss_target' must be one of 'data', 'target_argmax', 'kl', "
            "got str 'argmax'") in res.err
    assert "    help: what each slot learns: data = the row's own tokens;" in res.err

FOREIGN = '''
from dataclasses import dataclass

from dflash_core import Stage, hookimpl


@dataclass
class Params:
    n: int = 1


class Foreign(Stage):
    kind = "foreign"
    name = "thing"
    Config = Params
    inputs = ()


@hookimpl
def dflash_pipe_register_stages(registry):
    registry.add(Foreign)
'''


def test_the_cli_fixtures_load_only_the_plugins_the_test_names(cli, cli_batch, tmp_path, monkeypatch):
    """A third-party plugin installed in the environment (a distribution with a ``dflash_pipe``
    entry point, found on sys.path / PYTHONPATH) stays out of what the CLI fixtures show, so that
    the tests that count kinds, stages or plugins hold beside any plugin; asked for, it loads."""
    site = tmp_path / "site"
    (site / "dflash_test_foreign-1.0.dist-info").mkdir(parents=True)
    (site / "dflash_test_foreign-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: dflash-test-foreign\nVersion: 1.0\n")
    (site / "dflash_test_foreign-1.0.dist-info" / "entry_points.txt").write_text(
        "[dflash_pipe]\nforeign = dflash_test_foreign\n")
    (site / "dflash_test_foreign.py").write_text(FOREIGN)
    monkeypatch.syspath_prepend(str(site))  # entry points follow sys.path

    for res in (cli("list-stages"), cli("plugins"), *cli_batch([["list-stages"], ["plugins"]], pythonpath=[site])):
        assert res.code == 0, res.text
        assert "foreign" not in res.out, res.out
    listed, plugins = cli_batch([["list-stages"], ["plugins"]], pythonpath=[site], autoload=True)
    assert listed.lines_with("foreign:thing"), listed.text
    assert plugins.lines_with("foreign", "dflash_test_foreign", "loaded"), plugins.text
    res = cli("list-stages", "tokenise")  # the kinds it offers instead are the built-in ones
    assert res.code == 2 and "foreign" not in res.err, res.err
