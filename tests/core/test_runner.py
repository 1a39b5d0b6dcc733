"""The runner through the ``dflash_run`` fixture (dflash_core/testing.py): hooks, caching,
``--only``/``--from`` selection and the dry run's decisions, in process."""

from __future__ import annotations

import logging

import pytest

from dflash_core.artifacts import ArtifactStore
from dflash_core.events import Failure, StageError, root_cause
from dflash_core.links import PeerDied, StopRun
from dflash_core.plugins import PluginManager
from dflash_core.runner import Refused, Runner, RunFailed
from dflash_core.runstate import RunRecord
from tests.core import engine_stages
from tests.core.engine_stages import Recorder

CHAIN = """
    stages:
      src:    {uses: numbers, params: {n: 5}}
      double: {uses: scale, after: src, link: materialize}
      sink:   {uses: collect, after: double, link: materialize}
"""


def _items(run, stage):
    return list(ArtifactStore(str(run.run_dir)).items(stage, run.results[stage].key))


def test_dflash_run_fixture_runs_and_caches(dflash_run):
    first = dflash_run(CHAIN, plugins=(engine_stages,), autoload=False)
    assert {s: r.status for s, r in first.results.items()} == dict.fromkeys(
        ("src", "double", "sink"), "done")
    assert _items(first, "sink") == [{"i": k, "v": 2 * k} for k in range(5)]
    assert (first.run_dir / "state.json").is_file()
    # the same pipeline again in the same run dir: nothing runs
    again = dflash_run(CHAIN, plugins=(engine_stages,), autoload=False)
    assert {s: r.status for s, r in again.results.items()} == dict.fromkeys(
        ("src", "double", "sink"), "cached")
    assert [again.results[s].key for s in again.results] == [first.results[s].key for s in first.results]
    # a changed param re-runs that stage and what depends on it, not its upstream
    changed = dflash_run(CHAIN, plugins=(engine_stages,), autoload=False,
                         overrides=("stages.double.params.factor=3",))
    assert {s: r.status for s, r in changed.results.items()} == {
        "src": "cached", "double": "done", "sink": "done"}
    assert _items(changed, "sink") == [{"i": k, "v": 3 * k} for k in range(5)]


@pytest.mark.parametrize("executor", ["thread", "inline", "process"])
def test_hooks_fire_for_every_stage(dflash_run, executor):
    rec = Recorder()
    text = f"""
        stages:
          src:   {{uses: numbers, params: {{n: 4}}}}
          scale: {{uses: scale, after: src, executor: {executor}}}
          sink:  {{uses: collect, after: scale, link: stream}}
    """  # src -> scale materialized (numbers' default), scale -> sink streamed
    run = dflash_run(text, plugins=(engine_stages, rec), autoload=False)
    assert all(r.status == "done" for r in run.results.values())

    before = rec.of("before_stage")
    assert sorted(b["stage"] for b in before) == ["scale", "sink", "src"]
    assert {b["stage"]: b["impl"] for b in before} == {
        "src": "source:numbers", "scale": "map:scale", "sink": "sink:collect"}
    assert all(b["device"] == "cpu" for b in before)
    after = {a["stage"]: a for a in rec.of("after_stage")}
    assert {s: a["status"] for s, a in after.items()} == dict.fromkeys(("src", "scale", "sink"), "done")
    assert after["sink"]["summary"]["count"] == 4
    # each stage's before comes before its after
    order = [(name, kw["stage"]) for name, kw in rec.calls if name in ("before_stage", "after_stage")]
    for stage in ("src", "scale", "sink"):
        assert order.index(("before_stage", stage)) < order.index(("after_stage", stage))

    events = rec.of("on_event")
    progress = [e for e in events if e["stage"] == "scale" and e["event"]["type"] == "progress"]
    assert len(progress) == 4 and all(e["event"]["advance"] == 1 for e in progress)
    assert {"stage": "sink", "event": {"type": "metrics", "count": 4}} in events
    # the runner's own bookkeeping events (_start, _done, …) are not plugin events
    assert not [e for e in events if e["event"]["type"].startswith("_")]
    assert rec.of("on_stage_error") == []

    if executor != "thread":
        return
    # a second run: src is materialized and fresh -> "cached" and never started
    rec2 = Recorder()
    dflash_run(text, plugins=(engine_stages, rec2), autoload=False)
    assert {a["stage"]: a["status"] for a in rec2.of("after_stage")}["src"] == "cached"
    assert "src" not in [b["stage"] for b in rec2.of("before_stage")]


def test_on_stage_error_hook(dflash_run):
    rec = Recorder()
    with pytest.raises(RunFailed) as info:
        dflash_run("""
            stages:
              src:   {uses: numbers, params: {n: 10}}
              scale: {uses: scale, after: src, link: stream, params: {fail_at: 3}}
              sink:  {uses: collect, after: scale, link: stream}
        """, plugins=(engine_stages, rec), autoload=False)
    assert info.value.stage == "scale"
    errors = rec.of("on_stage_error")
    assert [e["stage"] for e in errors][:1] == ["scale"]
    assert "scale refuses item 3" in str(errors[0]["error"])
    assert "scale" not in [a["stage"] for a in rec.of("after_stage")]


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_a_stage_logs_at_the_runs_level_from_a_process_as_from_a_thread(dflash_run, executor, level, caplog):
    """A spawned stage's records reach the run's handlers, as a thread's do, at the run's level."""
    text = f"""
        stages:
          src:   {{uses: numbers, params: {{n: 2}}}}
          scale: {{uses: scale, after: src, executor: {executor}}}
    """
    with caplog.at_level(level):
        run = dflash_run(text, plugins=(engine_stages,), autoload=False)
    assert run.results["scale"].status == "done"
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "dflash_pipe.stage.scale"]
    debug = [(logging.DEBUG, "scale: item 0"), (logging.DEBUG, "scale: item 1")] if level == logging.DEBUG else []
    assert got == debug + [(logging.INFO, "scale: factor 2")]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_on_stage_error_receives_the_exception_raised(dflash_run, executor):
    """The hook gets the stage's own exception, its type kept (across a process too)."""
    rec = Recorder()
    with pytest.raises(RunFailed) as info:
        dflash_run(f"""
            stages:
              src:   {{uses: numbers, params: {{n: 10}}}}
              scale: {{uses: scale, after: src, executor: {executor}, params: {{fail_at: 3}}}}
        """, plugins=(engine_stages, rec), autoload=False)
    error = rec.of("on_stage_error")[0]["error"]
    assert type(error) is ValueError and str(error) == "scale refuses item 3"
    assert "raise ValueError" in info.value.tb


FAILING = """
    stages:
      src:   {uses: numbers, params: {n: 10}}
      scale: {uses: scale, after: src, executor: process, params: {fail_at: 3}}
"""


def test_a_failed_run_keeps_its_tracebacks_in_the_run_dir(dflash_run, tmp_path):
    """failures.log: what the CLI's one line leaves out, from the stage's own process too."""
    with pytest.raises(RunFailed) as info:
        dflash_run(FAILING, plugins=(engine_stages,), autoload=False)
    log = tmp_path / "run" / "failures.log"
    assert info.value.log == str(log)
    text = log.read_text()
    assert "-- stage 'scale': ValueError: scale refuses item 3\n" in text
    assert 'raise ValueError(f"scale refuses item {k}")' in text  # the line in the stage's process


def test_a_run_dir_that_cannot_take_the_log_still_reports_the_failure(dflash_run, tmp_path):
    (tmp_path / "run" / "failures.log").mkdir(parents=True)  # a directory where the file would go
    with pytest.raises(RunFailed, match="scale refuses item 3") as info:
        dflash_run(FAILING, plugins=(engine_stages,), autoload=False)
    assert info.value.log is None


def test_an_exception_that_cannot_cross_processes_keeps_its_type_name_and_traceback(dflash_run):
    rec = Recorder()
    with pytest.raises(RunFailed, match="TwoPartError: scale refuses item 3"):
        dflash_run("""
            stages:
              src:   {uses: numbers, params: {n: 10}}
              scale: {uses: scale, after: src, executor: process,
                      params: {fail_at: 3, fail_with: unpicklable}}
        """, plugins=(engine_stages, rec), autoload=False)
    error = rec.of("on_stage_error")[0]["error"]
    assert isinstance(error, StageError)
    assert error.type_name == "tests.core.engine_stages.TwoPartError"
    assert str(error) == "tests.core.engine_stages.TwoPartError: scale refuses item 3"
    assert 'raise TwoPartError("scale refuses item", k)' in error.traceback


def test_the_root_cause_is_the_failure_that_is_not_a_peer_dying():
    def failure(stage: str, exc: BaseException) -> Failure:
        try:
            raise exc
        except BaseException as caught:
            return Failure.of(stage, caught)

    peer = failure("sink", PeerDied("stage 'scale' died without finishing its stream"))
    try:
        raise StopRun()
    except StopRun:
        wrapped = failure("pool", RuntimeError("worker pool stopped"))  # raised while stopping
    cause = failure("scale", KeyError("v"))
    assert root_cause([peer, wrapped, cause]) is cause
    assert root_cause([peer]) is peer


# --------------------------------------------------------------- selection and decisions
def _runner(run, **kw):
    pm = PluginManager(autoload=False)
    pm.add_plugin(engine_stages, "engine_stages")
    return Runner(run.pipeline, pm, **kw)


def test_only_and_from_select_stages(dflash_run):
    run = dflash_run(CHAIN, plugins=(engine_stages,), autoload=False)
    digests = RunRecord(str(run.run_dir)).stages

    only = _runner(run, only="double").run()
    assert list(only) == ["double"] and only["double"].status == "done"
    # it ran from src's stored artifact: same input, so the same output digest
    assert only["double"].digest == digests["double"]["digest"]

    frm = _runner(run, from_stage="double").run()
    assert list(frm) == ["double", "sink"]
    # --from runs the stage and its descendants even when they are fresh
    assert [r.status for r in frm.values()] == ["done", "done"]

    decided = {e.stage: (e.action, e.reason) for e in _runner(run, only="sink").decide()}
    assert decided["double"][0] == "from-artifact" and decided["sink"] == ("run", "--only")
    assert decided["src"][0] == "skip"


def test_only_refuses_missing_stale_and_streamed_inputs(dflash_run):
    kw = {"plugins": (engine_stages,), "autoload": False}
    with pytest.raises(Refused, match=r"input 'src' is missing: never materialized"):
        dflash_run(CHAIN, only="double", **kw)
    run = dflash_run(CHAIN, **kw)
    with pytest.raises(Refused, match="no such stage"):
        _runner(run, only="nope").run()
    with pytest.raises(Refused, match=r"input 'src' is stale: param 'n' changed: 5 -> 7"):
        dflash_run(CHAIN, only="double", overrides=("stages.src.params.n=7",), **kw)
    with pytest.raises(Refused, match=r"input 'src' is streamed"):
        dflash_run(CHAIN, only="double", overrides=("stages.double.link=stream",), **kw)
    # refusing ran nothing: the record still holds the first run's artifacts
    assert RunRecord(str(run.run_dir)).stages["double"]["key"] == run.results["double"].key


def test_a_cached_stage_replays_its_artifact_to_stream_consumers(dflash_run):
    text = """
        stages:
          src:    {uses: numbers, params: {n: 6}}
          kept:   {uses: collect, after: src, link: materialize}
          live:   {uses: collect, after: src, link: stream}
          few:    {uses: collect, after: src, link: stream, params: {take: 2}}
    """
    kw = {"plugins": (engine_stages,), "autoload": False}
    first = dflash_run(text, **kw)
    assert all(r.status == "done" for r in first.results.values())
    decided = {e.stage: (e.action, e.reason) for e in _runner(first).decide()}
    assert decided["src"][0] == decided["kept"][0] == "cached"
    assert decided["live"] == decided["few"] == ("run", "input 'src' is streamed: runs with it")
    again = dflash_run(text, **kw)
    assert {s: r.status for s, r in again.results.items()} == {
        "src": "cached", "kept": "cached", "live": "done", "few": "done"}
    # the stream consumers got src's items back from its stored artifact
    assert _items(again, "live") == [{"i": k, "v": k} for k in range(6)]
    assert _items(again, "few") == [{"i": k, "v": k} for k in range(2)]
