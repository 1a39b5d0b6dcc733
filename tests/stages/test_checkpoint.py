"""checkpoint:fsspec uploading to S3 (a moto server behind a fault-injecting proxy, see
tests/s3_fixtures.py) during a real online-training run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from dflash_core.pipeline_file import load_pipeline
from dflash_core.plugins import PluginManager
from dflash_core.runner import Runner
from tests.stages import online_fixtures
from tests.stages.online_fixtures import CKPT_FILES, TINY_TRAIN, online_pipeline

TRAIN = dict(TINY_TRAIN, log_every=4)


class LatestWatcher(threading.Thread):
    """Polls ``latest.json`` under ``prefix`` (straight to moto, no faults) and records, each
    time, which files of the checkpoint it names are missing."""

    def __init__(self, fs, prefix: str) -> None:
        super().__init__(daemon=True)
        self.fs, self.prefix = fs, prefix
        self.seen: dict[str, list[str]] = {}  # checkpoint name -> files missing when named
        self.polls = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.check()
            time.sleep(0.05)

    def check(self) -> None:
        self.polls += 1
        try:
            name = json.loads(self.fs.cat_file(f"{self.prefix}/latest.json"))["name"]
        except FileNotFoundError:
            return
        present = {p.split(f"{self.prefix}/{name}/", 1)[1]
                   for p in self.fs.find(f"{self.prefix}/{name}")}
        missing = [f for f in CKPT_FILES if f not in present]
        self.seen.setdefault(name, [])
        self.seen[name] += missing


@pytest.mark.parametrize("fault_proxy", [0.25], indirect=True)
def test_upload_through_faults_and_latest_always_complete(tmp_path: Path, target: Path, s3_env,
                                                          fault_proxy) -> None:
    """Checkpoints every 4 steps of a 12-step run go to ``s3://bucket/drafter/`` through a proxy
    failing 25% of requests (5xx or dropped connections); the run completes, the checkpoints
    keep_last keeps are on S3 with the same bytes as the local ones and the older one is gone,
    and ``latest.json`` on S3 — written with the dest's storage_options like the files — names
    a checkpoint whose files are all present whenever it is read."""
    s3 = s3_env.fs()
    s3.mkdir("bucket")
    run_dir = tmp_path / "run"
    path = tmp_path / "p.yaml"
    path.write_text(online_pipeline(
        run_dir, target, pack=dict(rows=12, tokens_per_row=64), train=TRAIN,
        checkpoint=dict(every_steps=4, keep_last=2, dest="s3://bucket/drafter/", backoff=0.05,
                        retries=8, storage_options={"endpoint_url": fault_proxy.url,
                                                    "skip_instance_cache": True})))
    watcher = LatestWatcher(s3, "bucket/drafter")
    watcher.start()
    try:
        pm = PluginManager(autoload=True)
        pm.add_plugin(online_fixtures, "tests.stages.online_fixtures")
        results = Runner(load_pipeline(str(path), pm), pm).run()
    finally:
        watcher.stop.set()
        watcher.join()
    watcher.check()
    assert all(r.status == "done" for r in results.values()), results
    assert fault_proxy.counts["error_5xx"] + fault_proxy.counts["dropped"] > 0, fault_proxy.counts

    names = [f"step-{s:07d}" for s in (4, 8, 12)]
    remote = json.loads(s3.cat_file("bucket/drafter/latest.json"))
    assert remote == {"name": names[-1], "step": 12, "final": True}
    assert not any(watcher.seen.values()), (
        f"latest.json named an incomplete checkpoint: {watcher.seen}")
    assert names[-1] in watcher.seen
    for name in names[-2:]:  # keep_last 2 on the destination too
        for f in CKPT_FILES:
            assert s3.exists(f"bucket/drafter/{name}/{f}"), f"{name}/{f} missing on S3"
    assert s3.find(f"bucket/drafter/{names[0]}") == []
    local = run_dir / "checkpoints" / names[-1]
    for f in (*CKPT_FILES, "metrics.jsonl"):
        assert s3.cat_file(f"bucket/drafter/{names[-1]}/{f}") == (local / f).read_bytes(), f
    # locally, keep_last 2: the two newest complete checkpoints, latest.json on the newest
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if ".tmp-" not in p.name)
    assert kept == names[-2:]
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["name"] == names[-1]
