"""A compile cache that travels: torch's "mega-cache" artifacts kept at a local path or URL.

Inductor already caches compiled kernels on the local disk, which makes a second run on the same
machine start fast; a fresh node (a new pod, a new cluster) starts cold and compiles for minutes.
``torch.compiler.save_cache_artifacts`` packs everything compiled so far (FX graphs, AOTAutograd
entries, Triton kernels) into one blob; loading it into a fresh process before the first step
turns that cold start into a warm one. One file per torch version and GPU model, since kernels are
specific to both; a stale or foreign blob is harmless (its entries simply never match).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from dflash_core.artifacts import join, write_bytes

DEFAULT_ROOT = os.path.join("~", ".cache", "dflash-pipe", "compile")


def cache_url(root: str, device: torch.device) -> str:
    """``<root>/torch-<version>-<gpu>.bin`` (spaces and slashes in names made safe)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = f"torch-{torch.__version__}-{gpu}".replace(" ", "_").replace("/", "_").replace("+", "_")
    base = os.path.expanduser(root) if "://" not in root else root
    return join(base, f"{name}.bin")


def load(url: str, logger: logging.Logger | Any) -> bool:
    """Pre-load the cache from ``url`` if it exists; True when something was loaded."""
    import fsspec

    try:
        with fsspec.open(url, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return False
    try:
        info = torch.compiler.load_cache_artifacts(blob)  # None: torch rejected the blob (and said why)
    except Exception as e:  # a damaged blob costs a cold compile, never the run
        logger.warning("compile cache %s not loaded (%s: %s); compiling from scratch", url, type(e).__name__, e)
        return False
    if info is None:
        logger.warning("compile cache %s not loaded (unreadable); compiling from scratch", url)
        return False
    logger.info("compile cache loaded from %s (%.1f MB)", url, len(blob) / 1e6)
    return True


def save(url: str, logger: logging.Logger | Any) -> bool:
    """Write everything compiled in this process so far to ``url``; True when written."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    blob = saved[0]
    write_bytes(url, blob)
    logger.info("compile cache saved to %s (%.1f MB)", url, len(blob) / 1e6)
    return True
