"""``device="cuda"`` is the current CUDA device wherever an API takes a device: ``torch.cuda.set_device``
takes an indexed device only, so the APIs that make their device current (``load_feature_target``, the
trainer) raised on a plain ``cuda``. Without a GPU: torch.cuda's current device is a stand-in (1), and
so is ``set_device``, which checks its argument as torch does and records the index it was given.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._utils import _get_device_index  # what torch.cuda.set_device reads its argument with

from dflash_core.devices import torch_device, use_device
from dflash_core.stage import StageContext


@pytest.fixture
def current_is_1(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CUDA device 1 is current; returns the indexes ``set_device`` is given."""
    made: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: made.append(_get_device_index(device)))
    return made


def test_cuda_is_the_current_device(current_is_1: list[int]) -> None:
    for plain in ("cuda", torch.device("cuda")):
        assert torch_device(plain) == torch.device("cuda", 1)
    assert torch_device("cuda:0") == torch.device("cuda", 0)
    assert torch_device("cpu") == torch.device("cpu")
    assert current_is_1 == []

    assert use_device("cuda") == torch.device("cuda", 1)
    assert use_device("cuda:0") == torch.device("cuda", 0)
    assert use_device("cpu") == torch.device("cpu")
    assert current_is_1 == [1, 0]


class Loaded(Exception):
    """Stands in for loading a model: the test ends there, on the device it was asked for."""


def test_load_feature_target_on_cuda(current_is_1: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_model.target import features

    def load_target(model: str, device: str, *args: object) -> None:
        raise Loaded(device)

    monkeypatch.setattr(features, "load_target", load_target)
    with pytest.raises(Loaded, match="^cuda:1$"):
        features.load_feature_target("random:qwen3-8b", "cuda", attn_implementation="sdpa")
    assert current_is_1 == [1]


def test_trainer_on_cuda(current_is_1: list[int], tmp_path: Path) -> None:
    from dflash_stages.train.config import TrainConfig
    from dflash_stages.train.trainer import Trainer

    cfg = TrainConfig()
    trainer = Trainer(cfg, StageContext(stage="train", config=cfg, device="cuda", run_dir=str(tmp_path)))
    assert trainer.device == torch.device("cuda", 1)
    assert current_is_1 == [1]
