"""The artifact store and run record: on a real S3 API (moto's server over HTTP on loopback) and
on local disk; atomic commits, content keys, JSON-only materialized items."""

from __future__ import annotations

import json

import pytest

from dflash_core.artifacts import MANIFEST, ArtifactStore
from dflash_core.pipeline_file import load_pipeline
from dflash_core.plugins import PluginManager
from dflash_core.runner import Runner, RunFailed
from dflash_core.runstate import RunRecord, analyse
from tests.conftest import REPO, STAGES

BUCKET = "dflash-test"
S3_CHAIN = """
    run_dir: s3://dflash-test/run
    stages:
      src:    {uses: numbers, params: {n: 20, start: 7}}
      double: {uses: scale, after: src, link: materialize, executor: process}
      sink:   {uses: collect, after: double, link: materialize}
"""
EXPECTED = [{"i": k, "v": 2 * (7 + k)} for k in range(20)]
NAMES = ("src", "double", "sink")


def _pm() -> PluginManager:
    return PluginManager(autoload=False, extra_plugins=[STAGES])


def _run(path, **kw):
    pm = _pm()
    return Runner(load_pipeline(path, pm), pm, **kw).run()


def test_s3_run_dir_round_trip(s3_env, monkeypatch, write_pipeline, cli_batch, tmp_path):
    """A pipeline whose run_dir is s3://…: artifacts, manifests and state.json go to S3 (the
    endpoint comes from the environment: AWS_ENDPOINT_URL, or fsspec's FSSPEC_S3_ENDPOINT_URL;
    no engine option needed), a second run finds everything cached, items read back equal."""
    fs = s3_env.fs()
    fs.mkdir(BUCKET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint_url)
    path = write_pipeline(S3_CHAIN)
    run_dir = f"s3://{BUCKET}/run"

    first = _run(path)  # `double` runs in a spawned process: it reads and writes S3 too
    assert {s: r.status for s, r in first.items()} == dict.fromkeys(NAMES, "done")
    store = ArtifactStore(run_dir)
    assert list(store.items("sink", first["sink"].key)) == EXPECTED
    assert list(store.items("src", first["src"].key)) == [
        {"i": k, "v": 7 + k} for k in range(20)]

    # what is really on the server, seen through a fresh client
    fresh = s3_env.fs()
    for stage in NAMES:
        prefix = f"{BUCKET}/run/artifacts/{stage}/{first[stage].key}"
        names = {p.rsplit("/", 1)[1] for p in fresh.ls(prefix)}
        assert {"items.jsonl", MANIFEST} <= names, names
        manifest = json.loads(fresh.cat(f"{prefix}/{MANIFEST}"))
        assert manifest["digest"] == first[stage].digest and manifest["items"] == 20
    state = json.loads(fresh.cat(f"{BUCKET}/run/state.json"))
    assert set(state["stages"]) == set(NAMES)
    assert not fresh.exists(f"{BUCKET}/run/.lock")  # the run lock was released
    assert not (REPO / "s3:").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "pipeline.yaml"]  # nothing landed on local disk

    # second run, from the CLI in a fresh interpreter that only has fsspec's variable
    (rerun,) = cli_batch([["run", "-p", STAGES, path]], env={
        "AWS_ENDPOINT_URL": None, "FSSPEC_S3_ENDPOINT_URL": s3_env.endpoint_url})
    assert rerun.code == 0, rerun.text
    for stage in NAMES:
        assert rerun.lines_with(f"[{stage}] cached"), rerun.out

    # and in this process: cached again, and --only re-runs a stage from its S3 inputs
    again = _run(path)
    assert {s: r.status for s, r in again.items()} == dict.fromkeys(NAMES, "cached")
    only = _run(path, only="sink")
    assert only["sink"].status == "done" and only["sink"].digest == first["sink"].digest
    assert list(ArtifactStore(run_dir).items("sink", only["sink"].key)) == EXPECTED


LOCAL_CHAIN = """
    stages:
      src:    {uses: numbers, params: {n: 6}}
      double: {uses: scale, after: src, link: materialize}
      sink:   {uses: collect, after: double, link: materialize}
"""


def test_an_artifact_without_manifest_is_incomplete_and_rebuilt(write_pipeline, tmp_path):
    path = write_pipeline(LOCAL_CHAIN)
    first = _run(path)
    store = ArtifactStore(str(tmp_path / "run"))
    manifest = tmp_path / "run" / "artifacts" / "double" / first["double"].key / MANIFEST
    manifest.unlink()  # as if the run died between writing items and committing

    assert not store.exists("double", first["double"].key)
    with pytest.raises(FileNotFoundError, match="missing or incomplete"):
        list(store.items("double", first["double"].key))
    pm = _pm()
    statuses = analyse(load_pipeline(path, pm), store, RunRecord(str(tmp_path / "run")))
    assert statuses["double"].state == "missing" and "incomplete" in statuses["double"].cause

    again = _run(path)
    # double is rebuilt; its content is the same, so sink's key is the same and sink stays cached
    assert {s: r.status for s, r in again.items()} == {
        "src": "cached", "double": "done", "sink": "cached"}
    assert again["double"].key == first["double"].key and manifest.is_file()


def test_cache_key_ignores_non_semantic_params(write_pipeline):
    path = write_pipeline(LOCAL_CHAIN)
    first = _run(path)
    pm = _pm()
    # `delay` is in Numbers.cache_ignore: changing it keeps the artifact
    slower = Runner(load_pipeline(path, pm, overrides=["stages.src.params.delay=0.001"]), pm).run()
    assert slower["src"].status == "cached" and slower["src"].key == first["src"].key
    other = Runner(load_pipeline(path, pm, overrides=["stages.src.params.start=1"]), pm).run()
    assert [other[s].status for s in NAMES] == ["done", "done", "done"]
    assert other["src"].key != first["src"].key


def test_materialized_items_must_be_json(write_pipeline):
    path = write_pipeline("""
        stages:
          src:  {uses: numbers, params: {n: 3, json_safe: false}}
          sink: {uses: collect, after: src, link: materialize}
    """)
    with pytest.raises(RunFailed) as info:
        _run(path)
    assert info.value.stage == "src"
    assert "cannot store as JSON" in info.value.message and "link: stream" in info.value.message
    # streamed, the same items are fine (sink re-yields them into its own artifact: not JSON
    # either, so it is the sink that fails now)
    stream = path.with_name("stream.yaml")
    stream.write_text(path.read_text().replace("link: materialize", "link: stream"))
    with pytest.raises(RunFailed) as info:
        _run(stream)
    assert info.value.stage == "sink"
