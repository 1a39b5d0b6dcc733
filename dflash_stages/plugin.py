"""Registers the built-in stages through the same hook third-party plugins use.

Stage modules import torch/transformers only inside their functions, so importing them here
keeps ``validate``/``list-stages`` fast.
"""

from __future__ import annotations

from typing import Any

from dflash_core import hookimpl


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    from dflash_stages.checkpoint import FsspecCheckpoint
    from dflash_stages.download import FsspecDownload
    from dflash_stages.evaluate import SpecDecodeEvaluate
    from dflash_stages.extract import HFHooksExtract
    from dflash_stages.generate import HFGenerate
    from dflash_stages.pack import BestFitPack
    from dflash_stages.random_rows import RandomRows
    from dflash_stages.tokenize import ChatTemplateTokenize
    from dflash_stages.train import DFlashTrain

    for cls in (FsspecDownload, HFGenerate, ChatTemplateTokenize, BestFitPack, HFHooksExtract, DFlashTrain,
                FsspecCheckpoint, SpecDecodeEvaluate, RandomRows):
        registry.add(cls)
