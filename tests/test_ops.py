"""repro.components.ops against PyTorch's ops: the values (to a tolerance: the backward's summation order
differs), the bits (twice identical), and, on CUDA, strict mode (PyTorch's ops raise or
sort; these run). The CPU tests run everywhere; the `cuda` ones on the GPU machine."""

import pytest
import torch
import torch.nn.functional as F

from conftest import cuda
from repro.components.ops import Upsample2x, dense_cross_entropy, replacement_for, upsample2x
from repro.defense.determinism import flags_restored

SHAPES = [(2, 3, 5, 7), (1, 1, 1, 1), (1, 2, 1, 6), (2, 4, 16, 16)]


def stock_upsample(x):
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


def forward_backward(fn, x, grad):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def upsample_case(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=dtype).to(device)
    n, c, h, w = shape
    grad = torch.randn(n, c, 2 * h, 2 * w, generator=g, dtype=dtype).to(device)
    return x, grad


@pytest.mark.parametrize("shape", SHAPES)
def test_upsample2x_is_pytorchs_bilinear_upsampling_and_its_transpose(shape):
    x, grad = upsample_case(shape, torch.float64)
    y, gx = forward_backward(upsample2x, x, grad)
    y_ref, gx_ref = forward_backward(stock_upsample, x, grad)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-14)


def test_upsample2x_float32_is_within_rounding_of_pytorchs_and_repeats_bit_exactly():
    x, grad = upsample_case((4, 8, 32, 32), torch.float32, seed=1)
    y, gx = forward_backward(upsample2x, x, grad)
    y_ref, gx_ref = forward_backward(stock_upsample, x, grad)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=2 * torch.finfo(torch.float32).eps * 4)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-6)
    y2, gx2 = forward_backward(upsample2x, x, grad)
    assert torch.equal(y2, y) and torch.equal(gx2, gx)


def test_upsample2x_keeps_edges_exact_and_computes_low_precision_in_float32():
    x = torch.randn(2, 3, 4, 5).bfloat16()
    exact = upsample2x(x.float())
    y = upsample2x(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, exact.bfloat16())  # one rounding
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert upsample2x(x).dtype == torch.float32  # as autocast runs upsampling
    assert torch.equal(exact[..., 0, 0], x[..., 0, 0].float())  # the corner is copied


def test_upsample2x_is_a_module_and_refuses_other_ranks():
    x = torch.randn(1, 2, 3, 3)
    assert torch.equal(Upsample2x()(x), upsample2x(x))
    with pytest.raises(ValueError, match="N×C×H×W"):
        upsample2x(torch.randn(2, 3, 4))


def test_the_replacement_is_offered_only_where_it_fits():
    bilinear = torch.nn.Upsample(scale_factor=2, mode="bilinear")
    assert "Upsample2x" in replacement_for(bilinear)
    assert replacement_for(torch.nn.Upsample(scale_factor=2, mode="nearest")) is None
    assert replacement_for(torch.nn.Upsample(scale_factor=4, mode="bilinear")) is None
    assert "mean" in replacement_for(torch.nn.AdaptiveAvgPool2d(1))
    assert replacement_for(torch.nn.AdaptiveAvgPool2d(7)) is None


def cross_entropy_case(device="cpu", classes=5, weight=False):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, classes, 9, 11, generator=g).to(device)
    target = torch.randint(0, classes, (3, 9, 11), generator=g).to(device)
    target[0, :2] = 255  # ignored
    w = (torch.rand(classes, generator=g) + 0.5).to(device) if weight else None
    return logits, target, w


@pytest.mark.parametrize("weight", [False, True])
def test_dense_cross_entropy_is_pytorchs_value_and_gradient(weight):
    logits, target, w = cross_entropy_case(weight=weight)
    x1 = logits.clone().requires_grad_(True)
    ours = dense_cross_entropy(x1, target, w, ignore_index=255)
    ours.sum().backward()
    x2 = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(x2, target, w, ignore_index=255, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7)
    assert bool((ours[0, :2] == 0).all())  # ignored pixels cost nothing


def test_dense_cross_entropy_scores_nothing_outside_the_classes():
    logits, target, _ = cross_entropy_case()
    target[1] = 7  # not a class (a crop's padding with another ignore_index, say)
    loss = dense_cross_entropy(logits, target, ignore_index=-100)
    assert bool((loss[1] == 0).all()) and bool((loss[2] > 0).all())


# ------------------------------------------------------------------------------ CUDA


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upsample2x_on_cuda_is_close_to_pytorchs_and_repeats_in_both_modes(dtype):
    x, grad = upsample_case((8, 32, 64, 64), torch.float32, seed=3)
    x, grad = x.cuda().to(dtype), grad.cuda()
    results = {}
    with flags_restored():
        for strict in (False, True):
            torch.use_deterministic_algorithms(strict)
            results[strict] = [forward_backward(upsample2x, x, grad) for _ in range(2)]
        y_ref, gx_ref = forward_backward(stock_upsample, x.float(), grad)  # strict: no atomics
    (y, gx), (y2, gx2) = results[True]
    assert torch.equal(y, y2) and torch.equal(gx, gx2)  # bits repeat ...
    for y3, gx3 in results[False]:  # ... and do not depend on the mode
        assert torch.equal(y3, y) and torch.equal(gx3, gx)
    # bf16: computed in float32, rounded once to bf16 (within half a bf16 ulp: 2**-9 relative)
    rtol = 0 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.float(), y_ref, rtol=rtol, atol=1e-5)
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gx.float(), gx_ref, rtol=tol, atol=tol)


@cuda
@pytest.mark.cuda
def test_upsample2x_under_autocast_gives_pytorchs_dtype_and_values():
    x, grad = upsample_case((4, 16, 32, 32), torch.float32, seed=4)
    x = x.cuda().bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours, ref = upsample2x(x), stock_upsample(x)
    assert ours.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


@cuda
@pytest.mark.cuda
def test_dense_cross_entropy_runs_in_strict_mode_on_cuda_where_pytorchs_raises():
    logits, target, w = cross_entropy_case("cuda", weight=True)
    with flags_restored():
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
            F.cross_entropy(logits.requires_grad_(True), target, w, ignore_index=255)
        grads = []
        for _ in range(2):
            x = logits.detach().clone().requires_grad_(True)
            dense_cross_entropy(x, target, w, ignore_index=255).sum().backward()
            grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    x = logits.detach().clone().requires_grad_(True)
    F.cross_entropy(x, target, w, ignore_index=255, reduction="none").sum().backward()
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-5, atol=1e-6)
