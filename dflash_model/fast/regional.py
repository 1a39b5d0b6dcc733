"""Regional compilation: a model's repeated blocks through one torch.compile'd function each, so
that identical layers share a graph and compile once, instead of compiling the whole model.

Used for the frozen target's decoder layers (extract, ``dflash-pipe plan``, the benchmarks); the
drafter compiles its own two layer halves (``DFlashDrafter.compile_layers``, through
``tune.tune_drafter``).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

from torch import nn

from dflash_model.fast.compile_gate import compiled as compile_fn


def compile_blocks(layers: Sequence[nn.Module], dynamic: bool = False) -> None:
    """Send every block's ``forward`` through one torch.compile'd function (Inductor fuses the
    norms, RoPE, SwiGLU and residual adds that HF runs as separate kernels; blocks of one kind
    share a graph). Only ``forward`` is replaced, so forward hooks, which run in the module call
    around it, stay outside the graph and can come and go without recompiling. ``dynamic=False``
    is for fixed-length rows (extract): a forward whose length changes every call (decoding with a
    KV cache) would recompile; ``True`` compiles one graph for every shape. (``None``, dynamic once
    a shape changed, would not help a block called inside a ``dynamic=False`` graph: that setting
    holds for everything the outer call runs.)"""
    compiled = compile_fn(type(layers[0]).forward, dynamic=dynamic)
    for layer in layers:
        layer.forward = types.MethodType(compiled, layer)
