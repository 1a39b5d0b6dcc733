"""Registers the built-in stages, and the commands that belong to them (``evaluate``, ``plan``),
through the same hooks third-party plugins use.

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
    from dflash_stages.evaluate.stage import SpecDecodeEvaluate
    from dflash_stages.extract import HFHooksExtract
    from dflash_stages.generate.openai_api import OpenAIGenerate
    from dflash_stages.generate.stage import HFGenerate
    from dflash_stages.pack.random_rows import RandomRows
    from dflash_stages.pack.stage import BestFitPack
    from dflash_stages.tokenize.stage import ChatTemplateTokenize
    from dflash_stages.train.stage import DFlashTrain

    for cls in (FsspecDownload, HFGenerate, OpenAIGenerate, ChatTemplateTokenize, BestFitPack, HFHooksExtract,
                DFlashTrain, FsspecCheckpoint, SpecDecodeEvaluate, RandomRows):
        registry.add(cls)


@hookimpl
def dflash_pipe_add_commands(subparsers: Any, common: Any) -> None:
    from dflash_stages.evaluate import cli as evaluate_cli
    from dflash_stages.layout import cli as layout_cli

    evaluate_cli.add_parser(subparsers, common)
    layout_cli.add_parser(subparsers, common)
