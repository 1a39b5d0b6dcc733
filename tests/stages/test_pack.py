"""pack:best_fit — fill, no document split, determinism, exact resume, rank sharding."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dflash_core.stage import StageContext
from dflash_stages.pack.packing import BestFitPacker, PackError, SampleIndex
from dflash_stages.pack.stage import BestFitPack, PackConfig

N_SAMPLES = 2000
TPR = 16384


def _lengths(n: int, seed: int = 0, cap: int = TPR) -> np.ndarray:
    sigma = 1.0
    mu = np.log(2000) - sigma**2 / 2  # log-normal with mean 2,000 tokens
    return np.clip(np.random.default_rng(seed).lognormal(mu, sigma, n).astype(np.int64), 1, cap)


def _sample(i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample i: tokens that identify it and their position; a mask that varies."""
    ids = (i * 100_003 + np.arange(n)) % 150_000
    mask = ((np.arange(n) + i) % 3 != 0).astype(np.uint8)
    return ids.astype(np.int32), mask


def _write_shard(path: Path, ids: range, lengths: np.ndarray, *, stream: bool = False,
                 mask_type: pa.DataType = pa.uint8(), batch_rows: int = 128) -> dict:
    samples = [_sample(i, int(lengths[i])) for i in ids]
    table = pa.table({
        "input_ids": pa.array([s[0] for s in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([s[1] for s in samples], pa.list_(mask_type)),
        "source": pa.array(["data.jsonl"] * len(samples)),
        "line": pa.array(list(ids), pa.int32()),
    })
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
        writer.close()
    return {"shard": str(path), "samples": len(samples)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[list[dict], np.ndarray]:
    d = tmp_path_factory.mktemp("shards")
    lengths = _lengths(N_SAMPLES)
    bounds = [0, 600, 1100, 1700, N_SAMPLES]
    items = [_write_shard(d / f"shard-{k}.arrow", range(a, b), lengths,
                          stream=(k == 2), mask_type=pa.int8() if k == 1 else pa.uint8())
             for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return items, lengths


def _run(items, tmp_path, *, rank=0, world_size=1, resume=None, **params) -> tuple[list[dict], dict]:
    cfg = PackConfig(**params)
    ctx = StageContext(stage="pack", config=cfg, run_dir=str(tmp_path), work_dir=str(tmp_path),
                       cache_dir=str(tmp_path / "cache"), rank=rank, world_size=world_size,
                       resume_state=resume)
    rows = list(BestFitPack(cfg).run({"samples": iter(items)}, ctx))
    return rows, ctx.summary


def _same(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for k in ("input_ids", "loss_mask", "position_ids", "doc_lengths", "samples"):
            if not np.array_equal(x[k], y[k]):
                return False
        if (x["epoch"], x["index"], x["state"]) != (y["epoch"], y["index"], y["state"]):
            return False
    return True


def test_fill_and_documents_intact(shards, tmp_path):
    items, lengths = shards
    t0 = time.perf_counter()
    rows, summary = _run(items, tmp_path, tokens_per_row=TPR)
    secs = time.perf_counter() - t0
    assert summary["fill"] >= 0.95
    assert summary["tokens"] == int(lengths.sum()) and summary["rows"] == len(rows)
    print(f"\n[pack] {N_SAMPLES} samples (mean {lengths.mean():.0f} tokens) -> {len(rows)} rows, "
          f"fill {summary['fill']:.4f}, {summary['tokens'] / secs / 1e6:.1f} M tokens/s")
    seen = []
    for k, row in enumerate(rows):
        assert row["index"] == k and row["epoch"] == 0
        n = len(row["input_ids"])
        assert n <= TPR and row["input_ids"].dtype == np.int64 and row["loss_mask"].dtype == np.bool_
        assert len(row["loss_mask"]) == len(row["position_ids"]) == n == row["doc_lengths"].sum()
        start = 0
        for sid, dl in zip(row["samples"].tolist(), row["doc_lengths"].tolist()):
            ids, mask = _sample(sid, int(lengths[sid]))
            assert dl == len(ids)
            np.testing.assert_array_equal(row["input_ids"][start:start + dl], ids)
            np.testing.assert_array_equal(row["loss_mask"][start:start + dl], mask.astype(bool))
            np.testing.assert_array_equal(row["position_ids"][start:start + dl], np.arange(dl))
            start += dl
            seen.append(sid)
    assert sorted(seen) == list(range(N_SAMPLES))  # every sample once, none split


def test_deterministic_per_seed(shards, tmp_path):
    items, _ = shards
    a, _ = _run(items, tmp_path, tokens_per_row=TPR, shuffle_window=500, seed=1)
    b, _ = _run(items, tmp_path, tokens_per_row=TPR, shuffle_window=500, seed=1)
    c, _ = _run(items, tmp_path, tokens_per_row=TPR, shuffle_window=500, seed=2)
    assert _same(a, b)
    assert not _same(a, c)
    assert [r["samples"].tolist() for r in a] != [r["samples"].tolist() for r in c]


def test_epochs_reshuffle_and_resume_exactly(shards, tmp_path):
    items, _ = shards
    params = dict(tokens_per_row=TPR, shuffle_window=300, seed=3, epochs=3)
    full, summary = _run(items, tmp_path, **params)
    epochs = [r["epoch"] for r in full]
    assert sorted(set(epochs)) == [0, 1, 2] and epochs == sorted(epochs)
    per_epoch = [[r["samples"].tolist() for r in full if r["epoch"] == e] for e in range(3)]
    assert per_epoch[0] != per_epoch[1]  # reshuffled
    assert all(sorted(sum(p, [])) == list(range(N_SAMPLES)) for p in per_epoch)
    assert full[-1]["state"] == {"epoch": 3, "position": 0}

    last_of_epoch0 = epochs.index(1) - 1
    picks = [0, last_of_epoch0, last_of_epoch0 + 1, len(full) - 2] + random.Random(0).sample(
        range(len(full)), 3)
    for k in picks:
        resumed, _ = _run(items, tmp_path, resume=full[k]["state"], **params)
        assert _same(resumed, full[k + 1:]), f"resume after row {k}"
    done, _ = _run(items, tmp_path, resume=full[-1]["state"], **params)
    assert done == []


def test_packer_state_dict_roundtrip(shards):
    items, _ = shards
    index = SampleIndex.build(items)
    kw = dict(tokens_per_row=TPR, shuffle_window=250, seed=5, epochs=2)
    p = BestFitPacker(index, **kw)
    first = [next(p) for _ in range(37)]
    state = p.state_dict()
    rest = list(p)
    q = BestFitPacker(index, **kw)
    q.load_state_dict(state)
    assert _same(list(q), rest)
    assert first[-1]["state"] == state
    index.close()


@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_sharding(shards, tmp_path, drop_last):
    items, _ = shards
    params = dict(tokens_per_row=TPR, shuffle_window=700, seed=0, drop_last=drop_last)
    all_rows, _ = _run(items, tmp_path, **params)
    world = 3
    per_rank = [_run(items, tmp_path, rank=r, world_size=world, **params)[0] for r in range(world)]
    counts = {len(rows) for rows in per_rank}
    assert len(counts) == 1
    total = len(all_rows)
    key = lambda row: tuple(row["samples"].tolist())  # noqa: E731
    expected = [key(r) for r in all_rows]
    got = [key(r) for rows in per_rank for r in rows]
    if drop_last:
        assert counts == {total // world}
        assert len(set(got)) == len(got)  # disjoint
        assert set(got) == set(expected[: (total // world) * world])
    else:
        assert counts == {-(-total // world)}
        assert set(got) == set(expected)  # union = all rows
        assert len(got) - len(set(got)) == (-total) % world  # only the filler rows repeat
    for r, rows in enumerate(per_rank):  # rank r's k-th row is global row k·W + r
        for row in rows:
            assert row["global_index"] % total == (row["index"] * world + r) % total
            assert key(row) == expected[row["global_index"]]
    # resume on a rank
    k = len(per_rank[1]) // 2
    resumed, _ = _run(items, tmp_path, rank=1, world_size=world, resume=per_rank[1][k]["state"], **params)
    assert _same(resumed, per_rank[1][k + 1:])


def test_inline_samples_padding_and_errors(tmp_path):
    samples = [{"input_ids": list(range(n)), "loss_mask": [1] * n} for n in (5, 9, 3, 7, 0, 12)]
    rows, summary = _run(samples, tmp_path, tokens_per_row=16, pad_to=8, pad_token_id=99)
    assert summary["empty_samples"] == 1 and summary["tokens"] == 36
    for row in rows:
        n = len(row["input_ids"])
        assert n % 8 == 0 and n <= 16 and row["doc_lengths"].sum() == n
        pad = row["num_pad"]
        if pad:
            assert (row["input_ids"][-pad:] == 99).all() and not row["loss_mask"][-pad:].any()
            assert row["doc_lengths"][-1] == pad
            np.testing.assert_array_equal(row["position_ids"][-pad:], np.arange(pad))
    with pytest.raises(PackError, match=r"1 samples are longer than tokens_per_row=10 \(longest 12"):
        _run(samples, tmp_path, tokens_per_row=10)
    with pytest.raises(ValueError, match="multiple of pad_to"):
        PackConfig(tokens_per_row=100, pad_to=64)
    with pytest.raises(PackError, match="bad pack state"):
        _run(samples, tmp_path, tokens_per_row=16, resume={"epoch": "x"})


def test_remote_shard_is_read(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    lengths = _lengths(50, seed=1, cap=1000)
    local = _write_shard(tmp_path / "s.arrow", range(50), lengths)
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/pack-test/s.arrow", Path(local["shard"]).read_bytes())
    rows, summary = _run([{"shard": "memory://pack-test/s.arrow", "samples": 50}], tmp_path,
                         tokens_per_row=2048)
    assert summary["tokens"] == int(lengths.sum())
    assert sorted(s for r in rows for s in r["samples"].tolist()) == list(range(50))
