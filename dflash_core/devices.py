"""Resolve ``device:`` annotations before anything starts, and devices for torch at run time.

``validate`` must not import torch (it is slow and may not match the GPU driver), so the
number of visible CUDA devices is read from the driver's view of the system first and only
confirmed with torch at run time; :func:`torch_device` and :func:`use_device` import it when called.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DEVICE_RE = re.compile(r"^(cpu|mps|cuda)(?::(\d+))?$")
_RANK_RE = re.compile(r"\{local_rank(?:\s*\+\s*(\d+))?\}")


def expand_rank(spec: str) -> str:
    """``cuda:{local_rank}`` / ``cuda:{local_rank+2}`` -> this torchrun worker's device, so one
    pipeline file places every data-parallel rank (LOCAL_RANK, 0 outside torchrun)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return _RANK_RE.sub(lambda m: str(local + int(m.group(1) or 0)), spec)


@lru_cache(maxsize=1)
def visible_cuda_devices() -> int:
    """How many CUDA devices this process may use, without importing torch."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [x for x in env.split(",") if x.strip() and x.strip() != "-1"]
        if not ids:
            return 0
    driver = "/proc/driver/nvidia/gpus"
    count = len(os.listdir(driver)) if os.path.isdir(driver) else 0
    if count == 0 and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
            count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            count = 0
    return min(count, len(ids)) if env is not None else count


def resolve_device(spec: str, hook: object | None = None, check_available: bool = True) -> str:
    """Return a torch device string for ``spec`` or raise ``ValueError`` saying why not.

    Plugins get the first word through ``dflash_pipe_resolve_device``; the built-in rule
    accepts ``cpu``, ``mps``, ``cuda`` (= ``cuda:0``) and ``cuda:N`` for a visible N.
    ``check_available=False`` checks the syntax only: a GPU job is validated and planned on a
    host that cannot run it.
    """
    if hook is not None:
        resolved = hook.dflash_pipe_resolve_device(spec=spec)  # type: ignore[attr-defined]
        if resolved is not None:
            return str(resolved)
    m = _DEVICE_RE.match(expand_rank(spec.strip()))
    if not m:
        raise ValueError(f"unknown device '{spec}' (expected cpu, cuda, cuda:N or mps)")
    kind, index = m.group(1), m.group(2)
    if kind == "cuda":
        idx = int(index or 0)
        n = visible_cuda_devices() if check_available else None
        if n is not None and idx >= n:
            seen = f"{n} CUDA device{'s' if n != 1 else ''} visible"
            raise ValueError(f"device '{spec}' is not available ({seen})")
        return f"cuda:{idx}"
    return kind if index is None else f"{kind}:{index}"


def torch_device(device: str | torch.device) -> torch.device:
    """``device`` with its CUDA index: ``cuda`` is the current CUDA device, as for torch's tensor
    calls, but ``torch.cuda.set_device``, RNG forks and NVML take an index only."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def use_device(device: str | torch.device) -> torch.device:
    """:func:`torch_device`, made this thread's current CUDA device when it is one (a stage's or a
    benchmark's work, its streams and caches then land on it)."""
    import torch

    dev = torch_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev
