"""Switches of the fast paths: whether to compile, whether our Triton kernels can run, and the
peak memory a stage reports; and the choices stage configs offer for them, as ``Literal`` types.
Torch is imported only inside ``peak_gib``, so stage configs are checked without it."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal, get_args

Switch = Literal["auto", "on", "off"]
"""A stage's switch for a fast path: on, off, or auto (the stage decides by where it runs)."""
CompileSetting = Switch
"""``compile:`` of a stage: auto compiles on CUDA only (see :func:`compile_wanted`)."""
WarmUpSetting = Switch
"""``warm_up:`` of extract and train: auto warms up where the stage compiles (see :func:`warm_up_wanted`)."""
DtypeName = Literal["auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"]
"""``dtype:`` of a stage's model: auto is bf16 on CUDA, float32 elsewhere."""
AttnImplementation = Literal["auto", "sdpa", "eager", "packed_flex"]
"""The target's attention in extract: auto is packed_flex on CUDA, sdpa elsewhere
(:mod:`dflash_model.target.packed_attention`)."""
AttnBackend = Literal["auto", "flex", "sdpa"]
"""The drafter's attention: auto is flex on CUDA, sdpa elsewhere (:mod:`dflash_model.drafter.attention`)."""


def check_switch(name: str, setting: str) -> None:
    """A stage config's switch ``name`` (``compile``, ``warm_up``) must be auto, on or off (checked
    before anything runs)."""
    if setting not in get_args(Switch):
        raise ValueError(f"{name} must be auto, on or off, got {setting!r}")


def compile_wanted(setting: str, device: object) -> bool:
    """A ``compile: auto | on | off`` setting on ``device``: auto compiles on CUDA only, where
    Inductor's fused kernels repay the compile time (on CPU it mostly costs start-up)."""
    return setting == "on" or (setting == "auto" and str(device).startswith("cuda"))


def warm_up_wanted(setting: str, compiles: bool) -> bool:
    """A ``warm_up: auto | on | off`` setting of a stage whose first call at a row length does or
    does not compile: auto warms up where it does, since then the first row would wait for the
    compile (seconds to minutes), and elsewhere a warm-up only costs a forward."""
    return setting == "on" or (setting == "auto" and compiles)


def triton_installed() -> bool:
    """Whether our Triton kernels (AdamW, the loss chunk) can be used on CUDA: triton is importable
    (CUDA builds of torch bring it; checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def peak_gib(device: Any) -> float | None:
    """Peak memory torch allocated on ``device`` so far, in GiB (None off CUDA): the figure to
    compare with the GPU's size when placing stages (the CUDA context and the allocator's cache
    come on top)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
