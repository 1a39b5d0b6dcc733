"""fp8_quant_triton.quantize_columns (the FP8 target's activation quantization as one Triton kernel)
against fp8.quantize_groups' math. Without a GPU the kernel runs through Triton's interpreter
(tests/conftest.py), whose cast to e4m3 is wrong (it rounded -126.53 to -64, not -128): there
the kernel writes float32 (the values clamped, before the rounding), which must be exactly
x / scale, and torch rounds them. With a GPU the e4m3 bytes are compared with torch's. The H200
timing is benchmarks/fp8_quantize.py."""

import pytest
import torch

from dflash_model.target import fp8

pytest.importorskip("triton", reason="the kernel is Triton code (the test extra installs triton)")
from dflash_model.fast import fp8_quant_triton as kernel  # noqa: E402  (imports triton)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = pytest.mark.skipif(DEV != "cuda", reason="compares e4m3 bytes written on a GPU")
M, K = 37, 512  # 3 programs of 16 rows down (the last one 5 rows), 4 groups across
INV_448 = torch.tensor(1.0).div(448.0)  # float32's 1/448
TINY = torch.tensor([1], dtype=torch.int16).view(torch.bfloat16).item()  # bf16's least subnormal, 2^-133


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_groups' math as torch runs it on CUDA, before the rounding to e4m3: (x / scale
    clamped to ±448 [M, K], scales [M, K/128]). On CUDA ``amax / 448.0`` is amax times the float32
    reciprocal of 448 (ATen divides by a Python number so, and Inductor by a constant); the CPU
    divides, which rounds differently (``test_the_reference_is_torch_on_cuda``)."""
    g = x.float().unflatten(-1, (-1, fp8.BLOCK))
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax * INV_448.to(x.device), torch.ones_like(amax))
    return (g / scale[..., None]).clamp(-448, 448).flatten(-2), scale


def _inputs(dtype: torch.dtype, m: int = M, k: int = K) -> torch.Tensor:
    """Gaussian groups of very different sizes, some all zero (one in the last, partial program)."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([1e-3, 1.0, 30.0, 1e4]).repeat(k // 512 + 1)[:k // 128]
    x = torch.randn(m, k, generator=g) * sizes.repeat_interleave(128)
    x[5, 128:256] = 0.0
    x[m - 1, 256:384] = 0.0
    x[7] = 0.0
    return x.to(DEV, dtype)


def _check(x: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's float32 output (before the e4m3 rounding) is the reference exactly, its scales
    too, in the column-major layout; on a GPU its e4m3 output is torch's byte for byte."""
    want, want_scale = _reference(x)
    q32, scale = kernel.quantize_columns(x, torch.float32, **kw)
    assert torch.equal(q32, want) and torch.equal(scale, want_scale)
    assert scale.shape == (x.shape[0], x.shape[1] // 128) and scale.stride() == (1, x.shape[0])
    assert q32.shape == x.shape and q32.is_contiguous()
    assert torch.equal(fp8.to_fp8(q32).view(torch.uint8), fp8.to_fp8(want).view(torch.uint8))
    if DEV == "cuda":
        q, scale8 = kernel.quantize_columns(x, **kw)
        q_torch, scale_torch = fp8._quantize_columns(x)
        assert q.dtype == fp8.FP8 and torch.equal(q.view(torch.uint8), q_torch.view(torch.uint8))
        assert torch.equal(scale8, scale_torch) and scale8.stride() == scale_torch.stride()
    return q32, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_is_the_reference_math(dtype):
    x = _inputs(dtype)
    q32, scale = _check(x)
    assert scale[5, 1] == scale[M - 1, 2] == 1.0 and (scale[7] == 1.0).all()  # all-zero groups: scale 1
    assert q32[5, 128:256].abs().max() == 0 and q32[7].abs().max() == 0
    assert q32.abs().max() == 448  # a group's largest value lands on e4m3's largest, none beyond


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_any_row_block(rows):
    """One row a program, 8 (the last of 5 programs holds 5 rows), and one program for all 37."""
    _check(_inputs(torch.bfloat16), rows=rows)


def test_the_clamp_of_a_group_with_a_subnormal_amax():
    """amax / (amax times float32's 1/448) is at most 448 for every normal float32 amax, so the
    clamp acts only where the scale is subnormal: a group whose largest value is bf16's least
    subnormal divides to 448.88, clamped to 448. On a GPU this also checks that the kernel keeps
    subnormals (no flush to zero), as torch's kernels do, for bf16 input too (the interpreter widens
    a bf16 subnormal wrongly: float32 input only there)."""
    x = _inputs(torch.float32, m=9, k=256)
    x[1, :128] = torch.tensor([TINY, -TINY, 0.0, TINY]).repeat(32)
    unclamped = x[1, :128].float() / (TINY * INV_448)
    assert unclamped.max() > 448 and unclamped.min() < -448  # (the input does reach past the clamp)
    for dtype in (torch.float32, torch.bfloat16) if DEV == "cuda" else (torch.float32,):
        q32, _ = _check(x.to(dtype))
        assert q32[1, :4].tolist() == [448.0, -448.0, 0.0, 448.0]


def test_nan_stays_nan():
    """A NaN in a group gives that group scale 1 (amax NaN is not > 0) and stays NaN, as in torch;
    the kernel's max keeps the NaN, which ``tl.max`` would drop on a GPU."""
    x = _inputs(torch.float32, m=9, k=256)
    x[2, 130] = float("nan")
    want, want_scale = _reference(x)
    q32, scale = kernel.quantize_columns(x, torch.float32)
    assert scale[2, 1] == 1.0 and torch.equal(scale, want_scale)
    assert torch.isnan(q32[2, 130]) and torch.isnan(q32).sum() == 1
    assert torch.equal(q32.nan_to_num(), want.nan_to_num())
    assert q32[2, 129] == want[2, 129] == x[2, 129].clamp(-448, 448)


def test_strided_rows_and_no_rows():
    """Rows of a wider tensor (a row stride beyond K) are read in place; zero rows give empty
    outputs of the same shapes and layout."""
    wide = _inputs(torch.bfloat16, k=768)
    x = wide[:, 128:640]
    assert not x.is_contiguous()
    _check(x)
    q, scale = kernel.quantize_columns(x[:0])
    assert q.shape == (0, 512) and q.dtype == fp8.FP8 and scale.shape == (0, 4)


def test_shapes_it_refuses():
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel.quantize_columns(torch.zeros(4, 200, device=DEV))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        kernel.quantize_columns(torch.zeros(2, 4, 128, device=DEV))


def test_the_reference_is_torch_on_cuda():
    """fp8.quantize_groups on CUDA is ``_reference`` exactly. On the CPU torch divides amax by 448,
    which for some groups gives the scale one float32 step away (the kernel follows CUDA's)."""
    x = _inputs(torch.bfloat16)
    want, want_scale = _reference(x)
    q, scale = fp8.quantize_groups(x)
    if DEV == "cuda":
        assert torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), fp8.to_fp8(want).view(torch.uint8))
    else:
        differ = scale != want_scale
        assert differ.any() and not differ.all()
        assert torch.equal(torch.nextafter(want_scale[differ], scale[differ]), scale[differ])
        amax = x.float().unflatten(-1, (-1, 128)).abs().amax(-1)
        assert torch.equal(scale, torch.where(amax > 0, amax / 448, 1.0))


def test_quantize_for_product_off_cuda_and_in_a_graph(monkeypatch: pytest.MonkeyPatch):
    """The FP8 linear layer's choice: a CPU tensor goes to the compiled function (replaced here:
    compiling is too slow for the CPU suite), a graph being compiled gets the plain ops to trace."""
    called = []
    monkeypatch.setattr(fp8, "_compiled_quantize", lambda: lambda x: called.append(x) or "compiled")
    x = torch.randn(4, 256)
    assert fp8._quantize_for_product(x) == "compiled" and called[0] is x
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, scale = fp8._quantize_for_product(x)
    q_eager, scale_eager = fp8._quantize_columns(x)
    assert torch.equal(q.view(torch.uint8), q_eager.view(torch.uint8)) and torch.equal(scale, scale_eager)


@GPU
def test_quantize_for_product_on_cuda_takes_the_kernel(monkeypatch: pytest.MonkeyPatch):
    """On CUDA with triton the kernel runs (not the compiled function); without triton, the compiled one."""
    monkeypatch.setattr(fp8, "_compiled_quantize", lambda: lambda x: "compiled")
    x = _inputs(torch.bfloat16)
    q, scale = fp8._quantize_for_product(x)
    q_kernel, scale_kernel = kernel.quantize_columns(x)
    assert torch.equal(q.view(torch.uint8), q_kernel.view(torch.uint8)) and torch.equal(scale, scale_kernel)
    monkeypatch.setattr(fp8, "triton_installed", lambda: False)
    assert fp8._quantize_for_product(x) == "compiled"
