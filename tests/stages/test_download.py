"""download:fsspec against a real moto S3 server over HTTP (and a fault-injecting proxy)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

# fixtures moto_server, s3_env, fault_proxy, moto_auth: tests/s3_fixtures.py via tests/conftest.py
from dflash_core.stage import StageContext  # noqa: E402
from dflash_stages.download import DownloadConfig, DownloadError, FsspecDownload  # noqa: E402

N_OBJECTS = 200


def _run(tmp_path: Path, **params) -> tuple[list[dict], dict]:
    cfg = DownloadConfig(**params)
    ctx = StageContext(stage="download", config=cfg, run_dir=str(tmp_path),
                       work_dir=str(tmp_path / "work"), cache_dir=str(tmp_path / "cache"))
    items = list(FsspecDownload(cfg).run({}, ctx))
    return items, ctx.summary


def _content(i: int) -> bytes:
    return (f'{{"id": {i}, "text": "' + "x" * (i * 37 % 5000) + '"}\n').encode() * (1 + i % 7)


@pytest.fixture
def bucket(s3_env) -> dict[str, bytes]:
    fs = s3_env.fs()
    fs.mkdir("data")
    objects = {f"data/completions/part-{i:04d}.jsonl": _content(i) for i in range(N_OBJECTS)}
    fs.pipe(objects)
    fs.pipe("data/completions/README.txt", b"not jsonl")
    return objects


@pytest.fixture
def small_bucket(s3_env) -> dict[str, bytes]:
    fs = s3_env.fs()
    fs.mkdir("data")
    objects = {f"data/completions/part-{i:04d}.jsonl": _content(i) for i in range(3)}
    fs.pipe(objects)
    return objects


def _check(items: list[dict], objects: dict[str, bytes]) -> None:
    assert [it["source"] for it in items] == sorted(f"s3://{k}" for k in objects)
    for it in items:
        data = objects[it["source"][len("s3://"):]]
        assert Path(it["path"]).read_bytes() == data
        assert it["size"] == len(data)
        assert it["etag"] == hashlib.md5(data).hexdigest()


def test_parallel_download_identical_bytes_and_rerun_skips(tmp_path, s3_env, bucket):
    t0 = time.perf_counter()
    items, summary = _run(tmp_path, source="s3://data/completions/*.jsonl",
                          storage_options=s3_env.storage_options, workers=8)
    secs = time.perf_counter() - t0
    _check(items, bucket)
    assert summary["files"] == N_OBJECTS and summary["fetched"] == N_OBJECTS
    assert summary["skipped"] == 0 and summary["bytes"] == sum(map(len, bucket.values()))
    assert Path(items[0]["path"]).is_relative_to(tmp_path / "cache" / "s3" / "data" / "completions")
    print(f"\n[download] {N_OBJECTS} files {summary['bytes'] / 1e6:.1f} MB in {secs:.2f} s "
          f"({summary['bytes'] / 1e6 / secs:.1f} MB/s, {N_OBJECTS / secs:.0f} files/s)")

    # re-run: everything verified from the cache, same items
    items2, summary2 = _run(tmp_path, source="s3://data/completions/*.jsonl",
                            storage_options=s3_env.storage_options)
    assert summary2["fetched"] == 0 and summary2["skipped"] == N_OBJECTS
    assert items2 == items

    # one object changes: only it is fetched again, and its etag (so the digest) changes
    fs = s3_env.fs()
    key = "data/completions/part-0007.jsonl"
    bucket[key] = b'{"id": 7, "text": "changed"}\n'
    fs.pipe(key, bucket[key])
    items3, summary3 = _run(tmp_path, source="s3://data/completions/*.jsonl",
                            storage_options=s3_env.storage_options)
    assert summary3["fetched"] == 1 and summary3["skipped"] == N_OBJECTS - 1
    _check(items3, bucket)
    changed = [(a, b) for a, b in zip(items, items3) if a != b]
    assert len(changed) == 1 and changed[0][0]["source"] == f"s3://{key}"
    assert changed[0][0]["etag"] != changed[0][1]["etag"]

    # a corrupted cached copy (size differs from its sidecar) is fetched again
    Path(items3[3]["path"]).write_bytes(b"garbage")
    _, summary4 = _run(tmp_path, source="s3://data/completions/*.jsonl",
                       storage_options=s3_env.storage_options)
    assert summary4["fetched"] == 1
    assert Path(items3[3]["path"]).read_bytes() == bucket[items3[3]["source"][5:]]


def test_download_through_faults(tmp_path, s3_env, bucket, fault_proxy):
    opts = {"endpoint_url": fault_proxy.url}
    t0 = time.perf_counter()
    items, summary = _run(tmp_path, source="s3://data/completions/*.jsonl", storage_options=opts,
                          workers=8, retries=12, backoff=0.01, timeout=10)
    secs = time.perf_counter() - t0
    _check(items, bucket)
    counts = fault_proxy.counts
    assert counts["error_5xx"] > 0 and counts["dropped"] > 0
    assert summary["retries"] > 0 and summary["fetched"] == N_OBJECTS
    print(f"\n[download+faults] {counts} -> {summary['retries']} retries; "
          f"{summary['bytes'] / 1e6:.1f} MB in {secs:.2f} s ({summary['bytes'] / 1e6 / secs:.1f} MB/s)")


@pytest.mark.parametrize("fault_proxy", [1.0], indirect=True)
def test_download_gives_up_after_retries(tmp_path, s3_env, small_bucket, fault_proxy):
    with pytest.raises(DownloadError, match=r"after 2 retries") as e:
        _run(tmp_path, source="s3://data/completions/*.jsonl",
             storage_options={"endpoint_url": fault_proxy.url}, retries=2, backoff=0.001, timeout=5)
    assert "\n" not in str(e.value)


def test_glob_matching_nothing(tmp_path, s3_env, small_bucket):
    with pytest.raises(DownloadError, match=r"no files match 's3://data/nothing/\*\.jsonl'"):
        _run(tmp_path, source="s3://data/nothing/*.jsonl", storage_options=s3_env.storage_options)


def test_missing_bucket(tmp_path, s3_env, small_bucket):
    with pytest.raises(DownloadError, match=r"bucket 'no-such-bucket' does not exist"):
        _run(tmp_path, source="s3://no-such-bucket/*.jsonl", storage_options=s3_env.storage_options)
    with pytest.raises(DownloadError, match=r"bucket"):
        _run(tmp_path, source="s3://no-such-bucket/a.jsonl", storage_options=s3_env.storage_options)


def test_missing_object_404(tmp_path, s3_env, small_bucket):
    with pytest.raises(DownloadError, match=r"not found \(404\): s3://data/completions/nope\.jsonl"):
        _run(tmp_path, source=["s3://data/completions/part-0001.jsonl",
                               "s3://data/completions/nope.jsonl"],
             storage_options=s3_env.storage_options)


def test_bad_credentials_are_reported_and_redacted(tmp_path, s3_env, small_bucket, moto_auth):
    secret = "SuperSecretValue123"
    opts = dict(s3_env.storage_options, key="AKIABADKEY", secret=secret)
    t0 = time.perf_counter()
    with pytest.raises(DownloadError, match=r"access denied for s3://data/completions/\*\.jsonl") as e:
        _run(tmp_path, source="s3://data/completions/*.jsonl", storage_options=opts, backoff=1.0)
    assert time.perf_counter() - t0 < 5  # not retried
    assert secret not in str(e.value) and "\n" not in str(e.value)


def test_local_paths_and_file_urls(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {src / f"a{i}.jsonl": _content(i) for i in range(5)}
    files[src / "sub" / "b.jsonl"] = b"{}\n"
    for p, data in files.items():
        p.write_bytes(data)
    items, summary = _run(tmp_path, source=str(src / "*.jsonl"))
    assert [Path(it["path"]) for it in items] == sorted(p for p in files if p.parent == src)
    assert all(it["etag"] == hashlib.md5(Path(it["path"]).read_bytes()).hexdigest() for it in items)
    assert summary["local"] == 5 and summary["fetched"] == 0

    items2, _ = _run(tmp_path, source=[f"file://{src}/**/*.jsonl", str(src / "a0.jsonl")])
    assert {Path(it["path"]) for it in items2} == set(files)
    assert all(it["source"].startswith("file://") for it in items2)
    # a directory source means every file under it
    items3, _ = _run(tmp_path, source=str(src))
    assert len(items3) == len(files)

    (src / "a1.jsonl").write_bytes(b"changed\n")
    os.utime(src / "a1.jsonl", ns=(time.time_ns(), time.time_ns() + 10**9))
    items4, _ = _run(tmp_path, source=str(src / "*.jsonl"))
    assert items4[1]["etag"] == hashlib.md5(b"changed\n").hexdigest() != items[1]["etag"]

    with pytest.raises(DownloadError, match=r"no files match '.*\*\.parquet'"):
        _run(tmp_path, source=str(src / "*.parquet"))
    with pytest.raises(DownloadError, match=r"not found \(404\)"):
        _run(tmp_path, source=str(src / "missing.jsonl"))


def test_config_validation():
    with pytest.raises(ValueError):
        DownloadConfig(source="")
    with pytest.raises(ValueError):
        DownloadConfig(source=["s3://a/b"], workers=0)


def test_top_level_storage_options_reach_every_stage(tmp_path, s3_env, small_bucket):
    """One ``storage_options:`` at the top of the pipeline file: the download stage fetches from
    the moto endpoint with it, the checkpoint stage uploads with it, a stage's own replaces it."""
    from dflash_core.pipeline_file import load_pipeline
    from dflash_core.plugins import PluginManager
    from dflash_core.runner import Runner
    from tests.conftest import REPO

    pm = PluginManager()
    path = tmp_path / "p.yaml"
    path.write_text(f"version: 1\nrun_dir: run\nstorage_options: {{endpoint_url: '{s3_env.endpoint_url}'}}\n"
                    "stages:\n  download: {uses: fsspec, params: {source: 's3://data/completions/*.jsonl'}}\n")
    results = Runner(load_pipeline(path, pm), pm).run()
    assert results["download"].status == "done" and results["download"].items == 3

    top = "storage_options={client_kwargs: {endpoint_url: 'https://s3.example.com'}}"
    p = load_pipeline(REPO / "pipelines" / "s3_example.yaml", pm, [top], check_devices=False)
    opts = {"client_kwargs": {"endpoint_url": "https://s3.example.com"}}
    assert p.stages["download"].config.storage_options == opts
    assert p.stages["checkpoint"].config.storage_options == opts
    p = load_pipeline(REPO / "pipelines" / "s3_example.yaml", pm,
                      [top, "stages.checkpoint.params.storage_options={anon: true}"], check_devices=False)
    assert p.stages["download"].config.storage_options == opts
    assert p.stages["checkpoint"].config.storage_options == {"anon": True}
