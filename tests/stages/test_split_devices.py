"""Target and drafter apart: extract:hf_hooks in a process of its own (``executor: process``),
train:dflash in the main process — the two-process layout of "target on one device, drafter on
another" — trains exactly the drafter that the all-threads layout trains.

Both runs use the same tiny random-init Qwen3 target (tests/stages/online_fixtures.py), the
same synthetic rows, ``device: cpu`` for every stage and one torch thread on each side (the
spawned extract process gets ``OMP_NUM_THREADS=1``), so they do the same floating-point work
and the comparison can be exact: torch.equal on every tensor of the final train_state.pt and
byte equality of the exported model.safetensors.

A probe stage (``debug:feature_probe``, a second consumer of extract, in the main process)
records what arrived: the header's embedding / LM head (dtype, shape, bytes digest, still one
tensor when the target ties them) and each row's features (dtype, shape, bytes digest), so a
tensor damaged or re-typed on its way across the process boundary is named directly. The pair
of runs is repeated with the target in bf16 (``extract.params.dtype: bfloat16``), whose
features and verifier weights cross as bf16 tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_core import Stage, StageContext, hookimpl
from dflash_core.pipeline_file import load_pipeline
from dflash_core.plugins import PluginManager
from dflash_core.runner import Runner
from tests.stages import online_fixtures
from tests.stages.online_fixtures import TINY_TRAIN

ROWS, TOKENS = 6, 64
H, LAYERS = 64, (0, 1, 2)


# --------------------------------------------------------------------------- the probe
@dataclass
class FeatureProbeConfig:
    out: str = "probe.jsonl"


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype), "shape": list(t.shape), "sha256": _digest(t),
            "shared": t.is_shared()}  # True when it came through a process queue


class FeatureProbe(Stage):
    """Writes one JSON line per extract item to ``<run_dir>/<out>``: what a consumer got."""

    kind = "debug"
    name = "feature_probe"
    Config = FeatureProbeConfig
    inputs = ("features",)

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        with open(os.path.join(ctx.run_dir, self.config.out), "w") as f:
            for item in inputs["features"]:
                if item["kind"] == "target":
                    embed, head = item["embed_weight"], item["lm_head_weight"]
                    rec = {"kind": "target", "layers": item["target_layer_ids"],
                           "embed": _describe(embed), "head": _describe(head),
                           "tied": head is embed or head.data_ptr() == embed.data_ptr()}
                else:
                    rec = {"kind": "row", "features": _describe(item["features"]),
                           "last_hidden": item["last_hidden"], "tokens": len(item["input_ids"]),
                           "doc_lengths": list(item["doc_lengths"])}
                f.write(json.dumps(rec) + "\n")
        yield from ()


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(FeatureProbe)


# ---------------------------------------------------------------------------- helpers
def pipeline_yaml(run_dir: Path, target: Path, extract_executor: str, dtype: str) -> str:
    """pack -> extract (its own device and executor) -> train -> checkpoint, + the probe."""
    pack = {"rows": ROWS, "tokens_per_row": TOKENS}
    train = dict(TINY_TRAIN, log_every=1)
    return (
        f"version: 1\nrun_dir: {run_dir}\nstages:\n"
        f"  pack: {{uses: 'pack:synthetic', params: {json.dumps(pack)}}}\n"
        f"  extract: {{uses: 'extract:hf_hooks', after: pack, device: cpu, "
        f"executor: {extract_executor}, params: {{model: '{target}', layers: {list(LAYERS)}, "
        f"dtype: {dtype}}}}}\n"
        f"  train: {{uses: 'train:dflash', after: extract, device: cpu, executor: thread, "
        f"params: {json.dumps(train)}}}\n"
        f"  checkpoint: {{uses: 'checkpoint:fsspec', after: train, params: {{every_steps: 100}}}}\n"
        f"  probe: {{uses: 'debug:feature_probe', after: extract}}\n")


def run_pipeline(tmp_path: Path, target: Path, name: str, extract_executor: str,
                 dtype: str) -> tuple[dict[str, Any], Path, float]:
    run_dir = tmp_path / name
    path = tmp_path / f"{name}.yaml"
    path.write_text(pipeline_yaml(run_dir, target, extract_executor, dtype))
    pm = PluginManager(autoload=True)
    pm.add_plugin(online_fixtures, "tests.stages.online_fixtures")
    pm.add_plugin(sys.modules[__name__], __name__)
    t0 = time.perf_counter()
    results = Runner(load_pipeline(str(path), pm), pm).run()
    elapsed = time.perf_counter() - t0
    assert all(r.status == "done" for r in results.values()), results
    return results, run_dir, elapsed


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_checkpoint(run_dir: Path) -> Path:
    name = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["name"]
    return run_dir / "checkpoints" / name


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch):
    """One torch thread here and in spawned stage processes (they read OMP_NUM_THREADS when
    torch loads): both layouts then do the same floating-point work, bit for bit."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extract_in_its_own_process_trains_the_same_drafter(tmp_path: Path, target: Path,
                                                            one_thread, dtype: str) -> None:
    """The two-process layout (extract ``executor: process``) against all threads:

    - the probe saw the same items in both: header embedding / LM head with the target's dtype,
      shape [vocab, H] and the same bytes, still tied after crossing; ROWS rows whose features
      have the target's dtype, shape [TOKENS, 3*H] and the same bytes;
    - the items really crossed a process boundary in the process layout only (torch moves a
      tensor it sends through a process queue to shared memory: ``is_shared()``), and extract
      counted the same rows and tokens in both;
    - the trainer saw the same rows and tokens (metrics.jsonl: one record per step, same
      running token count) and took the same number of steps;
    - the final drafter weights, optimizer state and RNG (train_state.pt, torch.equal on every
      tensor) and the exported model.safetensors (bytes) are identical.
    """
    expected = getattr(torch, dtype)
    threads, t_dir, t_s = run_pipeline(tmp_path, target, "threads", "thread", dtype)
    procs, p_dir, p_s = run_pipeline(tmp_path, target, "process", "process", dtype)
    print(f"\n{dtype}: all threads {t_s:.1f} s, extract in a process {p_s:.1f} s")

    # what crossed the process boundary arrived intact
    a, b = jsonl(t_dir / "probe.jsonl"), jsonl(p_dir / "probe.jsonl")
    for i, (x, y) in enumerate(zip(a, b)):  # same process / crossed one
        for key in ("embed", "head", "features"):
            if key in x:
                assert not x[key].pop("shared") and y[key].pop("shared"), (i, key)
    for header in (a[0], b[0]):
        assert header["kind"] == "target" and header["layers"] == list(LAYERS)
        assert header["tied"], "the tied embedding / LM head arrived as two tensors"
        for key in ("embed", "head"):
            assert header[key]["dtype"] == str(expected) and header[key]["shape"] == [6000, H]
    assert a[0]["embed"] == b[0]["embed"] and a[0]["head"] == b[0]["head"]
    assert len(a) == len(b) == 1 + ROWS
    for i, (x, y) in enumerate(zip(a[1:], b[1:])):
        assert x["features"]["dtype"] == str(expected), (i, x)
        assert x["features"]["shape"] == [TOKENS, len(LAYERS) * H], (i, x)
        assert x == y, f"row {i} differs after crossing the process boundary: {x} vs {y}"

    # the extract stage really ran elsewhere in the process layout; both counted the same (the
    # forwards' time apart)
    counted = [{k: v for k, v in r["extract"].summary.items() if k != "forward_ms"} for r in (threads, procs)]
    assert counted[0] == counted[1] and procs["extract"].summary["forward_ms"] > 0
    assert procs["extract"].summary["rows"] == ROWS
    assert procs["extract"].summary["tokens"] == ROWS * TOKENS

    # the trainer saw the same rows and tokens
    ma, mb = jsonl(t_dir / "metrics.jsonl"), jsonl(p_dir / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, ROWS + 1))
    assert [m["tokens"] for m in ma] == [m["tokens"] for m in mb] \
        == [TOKENS * s for s in range(1, ROWS + 1)]
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]
    assert threads["train"].summary["steps"] == procs["train"].summary["steps"] == ROWS

    # the same drafter, bit for bit
    ca, cb = final_checkpoint(t_dir), final_checkpoint(p_dir)
    assert ca.name == cb.name == f"step-{ROWS:07d}"
    sa = flat(torch.load(ca / "train_state.pt", weights_only=True))
    sb = flat(torch.load(cb / "train_state.pt", weights_only=True))
    assert sa.keys() == sb.keys() and any(k.startswith("model/") for k in sa)
    for key in sa:
        if isinstance(sa[key], torch.Tensor):
            assert torch.equal(sa[key], sb[key]), f"{key} differs"
        else:
            assert sa[key] == sb[key], key
    assert ((ca / "export" / "model.safetensors").read_bytes()
            == (cb / "export" / "model.safetensors").read_bytes())


def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested dict/list, keyed by its path."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items()
                for k, v in flat(val, f"{prefix}{key}/").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj)
                for k, v in flat(val, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): obj}
