"""Export to / load from the z-lab served directory format (vLLM / SGLang / transformers).

    DIR/config.json        DrafterConfig.to_export_dict() (+ our own metadata under "dflash_pipe")
    DIR/model.safetensors  bf16; exactly the drafter's parameters (export_tensor_names), no
                           embedding or LM head (the server takes them from the target)
    DIR/modeling_dflash.py hf_model.py, the model code that config.json's "auto_map" names for
                           AutoModel.from_pretrained(DIR, trust_remote_code=True)

Local destinations are written atomically (temp dir in the same parent, then rename); remote
ones (fsspec URLs such as s3://) upload the weights first and config.json last.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_model.drafter.config import DrafterConfig
from dflash_model.drafter.model import DFlashDrafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_CODE_NAME = "modeling_dflash.py"
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
METADATA_KEY = "dflash_pipe"


def export_tensor_names(cfg: DrafterConfig) -> list[str]:
    """The exact tensor names of the served format, in a stable order."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return names


def _is_remote(dest: str | os.PathLike) -> bool:
    s = str(dest)
    return "://" in s and not s.startswith("file://")


def _write_dir(model: DFlashDrafter, out: Path, extra_metadata: Mapping[str, Any] | None) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()
    names = export_tensor_names(model.config)
    if sorted(state) != sorted(names):
        raise RuntimeError(f"drafter state dict does not match the export names: {sorted(set(state) ^ set(names))}")
    tensors = {n: state[n].detach().to(device="cpu", dtype=torch.bfloat16).contiguous() for n in names}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    shutil.copyfile(Path(__file__).with_name("hf_model.py"), out / MODEL_CODE_NAME)
    cfg = model.config.to_export_dict()
    cfg["auto_map"] = dict(AUTO_MAP)
    if extra_metadata:
        cfg[METADATA_KEY] = dict(extra_metadata)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=False) + "\n")


def export_drafter(model: DFlashDrafter, dest: str | os.PathLike,
                   extra_metadata: Mapping[str, Any] | None = None) -> str:
    """Write the served directory to ``dest`` (local path or fsspec URL); returns ``dest``.

    ``extra_metadata`` (JSON-serializable, e.g. target name, data, step) goes under the top-level
    key "dflash_pipe", which servers ignore. An existing local ``dest`` is replaced atomically.
    """
    if _is_remote(dest):
        import fsspec

        fs, path = fsspec.core.url_to_fs(str(dest))
        with tempfile.TemporaryDirectory() as tmp:
            _write_dir(model, Path(tmp), extra_metadata)
            fs.makedirs(path, exist_ok=True)
            for name in (WEIGHTS_NAME, MODEL_CODE_NAME, CONFIG_NAME):  # config last: its presence means complete
                fs.put_file(os.path.join(tmp, name), f"{path.rstrip('/')}/{name}")
        return str(dest)
    out = Path(str(dest).removeprefix("file://"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_dir(model, tmp, extra_metadata)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return str(dest)


def read_export_config(src: str | os.PathLike) -> dict[str, Any]:
    """config.json of an exported drafter (including the "dflash_pipe" metadata, if any)."""
    if _is_remote(src):
        import fsspec

        with fsspec.open(f"{str(src).rstrip('/')}/{CONFIG_NAME}", "r") as f:
            return json.load(f)
    return json.loads((Path(str(src).removeprefix("file://")) / CONFIG_NAME).read_text())


def load_drafter(src: str | os.PathLike, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, attn_backend: str = "auto") -> DFlashDrafter:
    """Rebuild an exported drafter; run it with the target's embedding / LM head as usual."""
    from safetensors.torch import load_file

    cfg = DrafterConfig.from_export_dict(read_export_config(src))
    model = DFlashDrafter(cfg, attn_backend=attn_backend)
    if _is_remote(src):
        import fsspec

        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, WEIGHTS_NAME)
            fs, path = fsspec.core.url_to_fs(str(src))
            fs.get_file(f"{path.rstrip('/')}/{WEIGHTS_NAME}", local)
            state = load_file(local)
    else:
        state = load_file(str(Path(str(src).removeprefix("file://")) / WEIGHTS_NAME))
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype)
