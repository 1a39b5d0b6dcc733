"""Hybrid targets (Qwen3.5 / 3.6: Gated DeltaNet + full attention) through the extract stage:
each document of a packed row gets exactly the features it has alone, in the linear and the
full-attention layers, for the text model and for a checkpoint saved from the vision-language
model; and the varlen mixer (the CUDA path, fla's kernels) is the layers' own math."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_model.target import compat
from dflash_model.target.linear_attention import Kernels, fla_kernels, linear_mixers, varlen_mixer
from dflash_model.target.packed_attention import layer_windows, row_attention_mask
from tests.assets import unpack_qwen3_tokenizer
from tests.stages.test_extract import extract, packed_alone_joined, packed_row
from tests.transformers_versions import hybrid_on_cpu, needs_hybrid

pytestmark = needs_hybrid
H = 64
TYPES = ["linear_attention", "linear_attention", "full_attention",
         "linear_attention", "linear_attention", "full_attention", "linear_attention"]
"""The last layer is not a readable feature layer (serving reads it after the final norm)."""
LINEAR, FULL = [0, 3], [2, 5]
DOCS = (70, 33, 101)  # the first and last cross the recurrence's 64-token chunks
PAD = 12
FLA_FP32_TOL = 2e-4
"""fla's Triton kernels round differently from transformers' torch code in fp32 (checked on an H200)."""


def text_config() -> dict:
    """A tiny Qwen3.5 text model: 7 layers mixing both kinds, more value heads than key heads
    (as in Qwen3.6-27B), partial rotary; initializer_range 0.1 keeps hidden states ~1."""
    return dict(vocab_size=6000, hidden_size=H, intermediate_size=128, num_hidden_layers=len(TYPES),
                layer_types=TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, initializer_range=0.1,
                tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved Qwen3_5ForCausalLM, or a Qwen3_5ForConditionalGeneration with a small vision tower
    (the form of the Qwen3.6 checkpoints), with the Qwen3 tokenizer."""
    import transformers

    torch.manual_seed(0)
    if request.param == "text":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text_config()))
    else:
        cfg = transformers.Qwen3_5Config(
            text_config=text_config(), tie_word_embeddings=False,
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H))
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    path = tmp_path_factory.mktemp(f"qwen3_5-{request.param}")
    model.save_pretrained(path)
    return unpack_qwen3_tokenizer(path)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def per_layer(feats: torch.Tensor, layers: list[int], wanted: list[int]) -> torch.Tensor:
    """The columns of ``wanted`` layer ids in features taken for ``layers``."""
    return torch.cat([feats[:, layers.index(t) * H:(layers.index(t) + 1) * H] for t in wanted], dim=-1)


@hybrid_on_cpu
@pytest.mark.parametrize(("hybrid", "attn"), [("text", "sdpa"), ("text", "packed_flex"),
                                              ("vision_language", "sdpa")], indirect=["hybrid"])
def test_each_document_of_a_packed_row_gets_its_features_alone(hybrid: Path, attn: str, tmp_path: Path) -> None:
    """Three documents of different lengths and trailing padding in one row: in every linear and
    full-attention layer read, and in the last hidden state, each document's features equal the
    same document extracted alone (relative 1e-5, fp32); the same tokens as one document differ."""
    layers = LINEAR + FULL
    packed, alone, joined = packed_alone_joined(hybrid, DOCS, PAD, tmp_path, layers=layers, last_hidden=True,
                                                attn_implementation=attn)
    assert packed["features"].shape == (sum(DOCS) + PAD, len(layers) * H)
    assert torch.isfinite(packed["features"]).all()
    start = 0
    for n, item in zip(DOCS, alone):
        span = slice(start, start + n)
        for kind in (LINEAR, FULL):
            got = per_layer(packed["features"][span], layers, kind)
            assert rel(got, per_layer(item["features"], layers, kind)) <= 1e-5, (kind, start)
        assert rel(packed["last_hidden"][span], item["last_hidden"]) <= 1e-5
        start += n
    later = slice(DOCS[0], sum(DOCS))  # documents after the first: what crossing boundaries spoils
    for kind in (LINEAR, FULL):
        mixed = per_layer(joined["features"][later], layers, kind)
        assert rel(mixed, per_layer(packed["features"][later], layers, kind)) > 1e-2


@hybrid_on_cpu
@pytest.mark.parametrize("hybrid", ["text"], indirect=True)
def test_compiled_layers_keep_documents_apart(hybrid: Path, tmp_path: Path) -> None:
    """``compile: on``: decoder layers compiled around the replaced linear mixers still cut each
    row at its own documents (two rows of one length, cut differently, share the graphs): every
    document's features equal its features alone (a row of the same length, padded)."""
    rng = np.random.default_rng(1)
    total = 84
    cuts = [(40, 24), (30, 50)]
    docs = [[rng.integers(0, 5999, n) for n in cut] for cut in cuts]
    rows = [packed_row(d, pad=total - sum(cut)) for d, cut in zip(docs, cuts)]
    rows += [packed_row([d], pad=total - len(d)) for row_docs in docs for d in row_docs]
    torch._dynamo.reset()
    items = extract(hybrid, rows, tmp_path, layers=LINEAR + FULL, compile="on")[1:]
    torch._dynamo.reset()
    alone = iter(items[len(cuts):])
    for packed, cut in zip(items, cuts):
        start = 0
        for n in cut:
            # Inductor's fused norms round differently from eager: 1e-4, far below a crossed cut
            assert rel(packed["features"][start:start + n], next(alone)["features"][:n]) <= 1e-4
            start += n


@hybrid_on_cpu
@pytest.mark.parametrize("hybrid", ["text"], indirect=True)
def test_compile_layers_compiles_the_linear_mixers_gated_norms(hybrid: Path) -> None:
    """The mixers run outside their layers' graphs, so ``compile_layers`` compiles their gated norms
    on their own: every norm's forward is replaced and equals its eager norm beyond rounding, and
    rows cut into a dozen document lengths (the mixer runs once per document on the CPU) share one
    graph of the norm, inside the compiled layers, where torch would otherwise recompile per length
    until its limit."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from dflash_model.target.features import load_feature_target

    target = load_feature_target(str(hybrid), "cpu", dtype="float32", layers=LINEAR, compile="off")
    norms = [mixer.norm for mixer in linear_mixers(target.model)]
    assert len(norms) == TYPES.count("linear_attention")
    torch._dynamo.reset()
    with torch.no_grad():
        for norm in norms:
            norm.weight.uniform_(0.5, 1.5)  # one weight each, as trained norms have
        torch.manual_seed(0)
        x, z = torch.randn(48, 16), torch.randn(48, 16)
        eager = [norm(x, z) for norm in norms]
        target.compile_layers()
        assert all(norm.forward.__func__ is not type(norm).forward for norm in norms)
        for norm, want in zip(norms, eager):
            torch.testing.assert_close(norm(x, z), want, rtol=1e-5, atol=1e-6)
        rng = np.random.default_rng(2)
        for cut in [(40, 24, 20), (30, 50, 4), (10, 70, 4), (25, 25, 34), (12, 33, 39), (7, 77)]:
            target.capture.capture_row(packed_row([rng.integers(0, 5999, n) for n in cut]))
    assert len(_debug_get_cache_entry_list(type(norms[0]).forward.__code__)) == 1
    torch._dynamo.reset()


def reference_kernels(mixer: torch.nn.Module) -> Kernels:
    """fla's two varlen kernels done with transformers' torch code of the mixer's own module, one
    document at a time: the CPU stand-in for the CUDA path."""
    module = sys.modules[type(mixer).__module__]

    def pieces(x: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
        return list(x.split(cu.diff().tolist(), dim=1))

    def conv(x, weight, bias, activation, cu):  # noqa: ANN001, ANN202
        return torch.cat([module.causal_conv1d_fn(p.transpose(1, 2), weight, bias, activation=activation)
                          .transpose(1, 2) for p in pieces(x, cu)], dim=1)

    def rule(q, k, v, g, beta, cu):  # noqa: ANN001, ANN202
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        return torch.cat([module.torch_chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True)[0]
                          for args in zip(*(pieces(t, cu) for t in (q, k, v, g, beta)))], dim=1)

    return Kernels(conv, rule)


@hybrid_on_cpu
@pytest.mark.skipif(not compat.installed_at_least("5.15.0"),
                    reason="the reference conv is transformers' torch causal_conv1d_fn, which 5.15 brought")
def test_varlen_mixer_is_the_layers_own_forward_per_document() -> None:
    """The CUDA path's mixer (written from the math, fla's kernels swapped for transformers' torch
    code) on a packed row equals each linear layer's own forward on each document alone (and on
    the padding); without the cuts it does not."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text_config())).eval()
    lengths = [*DOCS, PAD]
    x = torch.randn(1, sum(lengths), H)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    mixers = linear_mixers(model)
    assert len(mixers) == TYPES.count("linear_attention")
    with torch.no_grad():
        for mixer in mixers:
            got = varlen_mixer(mixer, x, cu, reference_kernels(mixer))
            alone = torch.cat([mixer(part) for part in x.split(lengths, dim=1)], dim=1)
            assert rel(got, alone) <= 1e-5
            crossing = varlen_mixer(mixer, x, cu[[0, -1]], reference_kernels(mixer))
            assert rel(crossing, mixer(x)) <= 1e-5 and rel(crossing, alone) > 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or fla_kernels() is None,
                    reason="needs CUDA and flash-linear-attention (the gpu extra)")
def test_fla_kernels_cut_the_row_like_the_layers_own_forward_per_document() -> None:
    """On CUDA, fp32: the mixer with fla's varlen kernels equals each linear layer's own forward on
    each document alone (and on the padding)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text_config())).cuda().eval()
    lengths = [*DOCS, PAD]
    x = torch.randn(1, sum(lengths), H, device="cuda")
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    with torch.no_grad():
        for mixer in linear_mixers(model):
            got = varlen_mixer(mixer, x, cu, fla_kernels())
            alone = torch.cat([mixer(part) for part in x.split(lengths, dim=1)], dim=1)
            assert rel(got, alone) <= FLA_FP32_TOL


def test_masks_for_a_hybrid_model() -> None:
    """Linear layers take no attention mask: ``layer_windows`` leaves them out (packed_flex used to
    refuse the model) and the row's mask is a per-layer-type dict with None for them."""
    import transformers

    cfg = transformers.Qwen3_5TextConfig(**text_config())
    assert layer_windows(cfg) == {"full_attention": None}
    model = transformers.Qwen3_5ForCausalLM(cfg)
    mask = row_attention_mask(model, [3, 2], 6, torch.float32, "cpu")
    assert set(mask) == {"full_attention", "linear_attention"} and mask["linear_attention"] is None
    doc = [0, 0, 0, 1, 1, -1]  # the last token is padding: it sees only itself
    allowed = (mask["full_attention"][0, 0] == 0).tolist()
    assert allowed == [[j <= i and doc[i] == doc[j] and (doc[i] >= 0 or i == j) for j in range(6)]
                       for i in range(6)]
