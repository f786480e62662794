"""The few-row linear kernel (pdserve_kernels/cpu/linear.cpp: AMX bf16, AVX512-BF16 pair dot
products for bf16 without AMX, or AVX2 + FMA bf16 and float32) against a float64 product, and the model's Linear choosing it for decode-sized inputs
only."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models import llama
from pdserve.kernels.cpu import cpu_ops


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops()
    assert module is not None, "the CPU kernels must build on this machine (gcc + ninja)"
    if not module.linear_small_m_available():
        pytest.skip("this CPU has neither AMX (granted) nor AVX2: oneDNN serves every row")
    return module


def reference(x, w, bias):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 11, 12, 13, 16, 17, 33, 64, 128, 1100])
@pytest.mark.parametrize("n,k", [(960, 576), (5, 32), (576, 1536), (130, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float64_product_rounded_once(ops, rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    out = ops.linear_small_m(x, ops.pack_linear_weight(w), n, bias)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    want = reference(x, w, bias)
    # fp32 sums rounded once to bf16: within one bf16 ulp (2^-8 relative) plus fp32 noise
    err = (out.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-3 * k**0.5).all(), err.max()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 8, 9, 11, 12, 13, 24, 25, 48, 1100])
@pytest.mark.parametrize("n", [200, 16, 24, 40])
def test_float32_on_every_build(ops, rows, n):
    """Every build the kernel runs on multiplies float32 weights (float32 models' decode steps):
    AVX2's ymm loop, or with AVX-512 two panels x 12 rows a pass (n: an odd number of 16-column
    panels, one, a pair whose second is partial, three); x in another dtype is refused."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, bias = torch.randn(n, 96, generator=g), torch.randn(n, generator=g)
    packed = ops.pack_linear_weight(w)
    assert llama.pack_small_rows(w) is not None
    x = torch.randn(rows, 96, generator=g)
    out = ops.linear_small_m(x, packed, n, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), reference(x, w, bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.linear_small_m(x.bfloat16(), packed, n)


def test_strided_rows_and_a_view_of_a_wider_tensor(ops):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 96, generator=g).bfloat16()
    x = wide[:, :64]  # rows 96 apart
    w = torch.randn(40, 64, generator=g).bfloat16()
    out = ops.linear_small_m(x, ops.pack_linear_weight(w), 40)
    torch.testing.assert_close(out.double(), reference(x, w, None), rtol=2**-7, atol=1e-2)


def test_float32_rows_read_in_place_or_copied_when_strided(ops):
    """Float32 x with rows K apart is read as it is; a view of a wider tensor is packed first:
    both give the product."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g)
    packed = ops.pack_linear_weight(w)
    wide = torch.randn(7, 96, generator=g)
    for x in (wide[:, :64], wide[:, :64].contiguous()):
        out = ops.linear_small_m(x, packed, 40)
        torch.testing.assert_close(out.double(), reference(x, w, None), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_with_an_error(ops):
    w = torch.randn(64, 48).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_linear_weight(w)
    packed = ops.pack_linear_weight(torch.randn(64, 64).bfloat16())
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        ops.linear_small_m(torch.randn(2, 32).bfloat16(), packed, 64)  # K differs
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        ops.linear_small_m(torch.randn(2, 64).bfloat16(), packed, 65)  # N differs
    with pytest.raises(RuntimeError, match="bf16"):
        ops.linear_small_m(torch.randn(2, 64), packed, 64)


def test_linear_uses_the_kernel_for_few_rows_and_onednn_for_many(ops):
    """On AVX2 without AVX-512 the kernel takes every row count and no oneDNN copy is made
    (small_rows_take_all); elsewhere oneDNN takes the products past SMALL_ROWS_MAX."""
    g = torch.Generator().manual_seed(2)
    layer = llama.Linear(256, (96, 32), bias=True, dtype=torch.bfloat16)
    layer.weight.copy_(torch.randn(128, 256, generator=g))
    layer.bias.copy_(torch.randn(128, generator=g))
    layer.pack()
    assert layer.small is not None
    take_all = ops.linear_small_m_all_rows() or ops.kernel_pool_enabled()
    assert take_all == llama.small_rows_take_all()
    assert (layer.packed is None) == take_all
    calls = []
    real = ops.linear_small_m

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def linear_small_m(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    layer.fused_ops = Spy()
    for rows in (1, 3, llama.SMALL_ROWS_MAX, llama.SMALL_ROWS_MAX + 8, 512):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        want = reference(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x).double(), want, rtol=2**-7, atol=0.05)
    kernel_rows = [1, 3, llama.SMALL_ROWS_MAX]
    if take_all:
        kernel_rows += [llama.SMALL_ROWS_MAX + 8, 512]
    assert calls == kernel_rows
    layer.fused_ops = None  # compiled layers off: oneDNN / F.linear only
    x = torch.randn(2, 256).bfloat16()
    torch.testing.assert_close(
        layer(x).double(), reference(x, layer.weight, layer.bias), rtol=2**-7, atol=0.05
    )
    assert calls == kernel_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [200, 24, 40, 960])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ops, dtype, n):
    """Every row's sums run over k in order, whatever pass takes it (full passes of 6 fp32 /
    4 bf16 rows on AVX2, 12 fp32 or (AVX512-BF16 without AMX) bf16 rows on AVX-512, 16 on AMX
    tiles, or the shorter pass of the
    rows left over): the same bits as the row multiplied alone, and the float64 product within
    rounding. (A request's logits must not change with the batch it decodes in; any faster
    split of the rows must keep this.)"""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, 96, generator=g).to(dtype)
    packed = ops.pack_linear_weight(w)
    bias = torch.randn(n, generator=g).to(dtype)
    for rows in (5, 6, 7, 8, 12, 13, 14, 17, 25):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        out = ops.linear_small_m(x, packed, n, bias)
        for i in range(rows):
            alone = ops.linear_small_m(x[i : i + 1].contiguous(), packed, n, bias)
            assert torch.equal(out[i], alone[0]), (rows, i)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(out.double(), reference(x, w, bias), **tol)
