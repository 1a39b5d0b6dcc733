"""Load exports the ways users load them and run one block: the oracle side of test_served_loaders.py.

Loaders: "zlab" = z-lab's published ``DFlashDraftModel`` (its files, kept unmodified in
tests/assets/zlab-dflash, imported as the package ``dflash``); "auto" =
``AutoModel.from_pretrained(export, trust_remote_code=True)``, i.e. the export's own
modeling_dflash.py. Run as a script in a fresh interpreter, ``python served_loaders.py JOBS.json``,
so that the test can put transformers 4.57.1 (``.venv-tf457``) first on PYTHONPATH; it imports
nothing of dflash-pipe. JOBS.json: a list of {"loader", "export", "inputs", "out"}; inputs (a
safetensors file): target_hidden [1, T, kH], noise_embedding [1, B, H], position_ids [1, T + B],
optional attention_mask [1, 1, B, T + B] (additive), optional split [1] (a context length T1: the
"auto" loader then also drafts through a DynamicCache, first a block after T1 context rows, then,
cache cropped to T1, the block after the rest). out: "hidden" [1, B, H] (+ "cached"), float32;
metadata: the transformers version, the loaded model's per-layer sliding windows and its
missing/unexpected keys.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "assets" / "zlab-dflash"


def zlab_model_class():
    """z-lab's DFlashDraftModel, imported from its files as the package ``dflash``."""
    if "dflash" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dflash", REFERENCE / "__init__.py",
                                                      submodule_search_locations=[str(REFERENCE)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["dflash"] = module
        spec.loader.exec_module(module)
    return sys.modules["dflash"].DFlashDraftModel


def run_job(job: dict) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    if job["loader"] == "zlab":
        model, info = zlab_model_class().from_pretrained(job["export"], dtype=torch.float32, output_loading_info=True,
                                                         use_kernels=False)
        windows = [layer.self_attn.sliding_window for layer in model.layers]
    else:
        model, info = transformers.AutoModel.from_pretrained(job["export"], trust_remote_code=True, use_kernels=False,
                                                             dtype=torch.float32, output_loading_info=True)
        windows = [model.config.sliding_window if lt == "sliding_attention" else None
                   for lt in model.config.layer_types]
    x = load_file(job["inputs"])
    pos, th, noise = x["position_ids"], x["target_hidden"], x["noise_embedding"]
    out = {}
    with torch.no_grad():
        out["hidden"] = model(position_ids=pos, attention_mask=x.get("attention_mask"), noise_embedding=noise,
                              target_hidden=th)
        if "split" in x:
            t1, B = int(x["split"]), noise.shape[1]
            cache = transformers.DynamicCache()
            model(position_ids=pos[:, :t1 + B], noise_embedding=noise, target_hidden=th[:, :t1],
                  past_key_values=cache, use_cache=True)
            cache.crop(t1 if int(transformers.__version__.split(".")[0]) < 5 else -B)  # 5.x: tokens to remove
            out["cached"] = model(position_ids=pos[:, t1:], noise_embedding=noise, target_hidden=th[:, t1:],
                                  past_key_values=cache, use_cache=True)
    meta = {"transformers": transformers.__version__, "sliding_windows": windows, "type": type(model).__name__,
            "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}
    save_file({k: v.float().contiguous() for k, v in out.items()}, job["out"], metadata={"info": json.dumps(meta)})


if __name__ == "__main__":
    for job in json.loads(Path(sys.argv[1]).read_text()):
        run_job(job)
