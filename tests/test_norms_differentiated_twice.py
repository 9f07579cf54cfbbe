"""Specs: norms differentiated twice (:mod:`pyhvp._norms`).

* A norm with a bias and no weight: torch's double backward of layer, batch, instance and group
  norms drops the bias when the weight is None (torch 2.5.1 to 2.14.1: the bias's Hessian came out
  all zeros in ``pyhvp.hvp`` and every route of ``sub_hessian``, and ``joint`` raised). pyhvp runs
  such a norm as the norm plus the bias; the reference is the same function with the bias added
  outside the norm, by ``torch.func.hessian`` (no weight: nothing of torch's that is wrong there).
* Group norm's batched double backward (``is_grads_batched``) is wrong where a group's channels
  number its spatial size, and raises elsewhere; pyhvp runs group norm written out. The reference
  is ``torch.func.hessian`` (whose batching of it is right) or the seed's loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dense import dense_hessian, instance_hvp, loop_sub_hessian

import pyhvp
from pyhvp._norms import batched_double_backward, twice_differentiable_norms

INPUT = torch.randn(4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
MEAN, VARIANCE = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5

NORMS = {  # a norm of h with the bias b and no weight, and the same with b added outside it
    "layer_norm": (lambda h, b: F.layer_norm(h, (5,), None, b),
                   lambda h, b: F.layer_norm(h, (5,)) + b),
    "batch_norm in eval": (lambda h, b: F.batch_norm(h, MEAN, VARIANCE, None, b[:3]),
                           lambda h, b: F.batch_norm(h, MEAN, VARIANCE) + b[:3, None]),
    "batch_norm in training": (lambda h, b: F.batch_norm(h, None, None, None, b[:3], True),
                               lambda h, b: F.batch_norm(h, None, None, training=True)
                               + b[:3, None]),
    "instance_norm": (lambda h, b: F.instance_norm(h, bias=b[:3]),
                      lambda h, b: F.instance_norm(h) + b[:3, None]),
    "group_norm": (lambda h, b: F.group_norm(h, 3, None, b[:3]),
                   lambda h, b: F.group_norm(h, 3) + b[:3, None]),
    "torch.layer_norm, the bias by keyword": (
        lambda h, b: torch.layer_norm(h, (5,), bias=b), lambda h, b: F.layer_norm(h, (5,)) + b),
}  # fmt: skip


def loss(norm):
    """A loss of ``x``: 5 scales of the input, then the norm's 5 biases."""
    return lambda x: (torch.tanh(norm(INPUT.to(x.device) * x[:5], x[5:])) ** 2).sum()


INDEX = torch.tensor([9, 5, 2, 7, 7, 0])  # biases and scales, unsorted, one repeated
BIASES = torch.tensor([9, 5, 7, 7])
OPERATORS = {  # an operator's matrix (or product) over the loss's 10 variables, and the dense one
    "hvp": (lambda f, x, v: pyhvp.hvp(f, x, v), lambda h, v: h @ v),
    "grad_and_hvp": (lambda f, x, v: pyhvp.grad_and_hvp(f, x, v)[1], lambda h, v: h @ v),
    **{
        f"sub_hessian, method={method!r}": (
            lambda f, x, v, m=method: pyhvp.sub_hessian(f, x, INDEX.to(x.device), method=m),
            lambda h, v: h[INDEX][:, INDEX],
        )
        for method in ("auto", "reverse", "sparse", "forward")
    },
    "sub_hessian per tensor, its bias's block": (
        lambda f, x, v: pyhvp.sub_hessian(
            lambda p: f(torch.cat([p["w"], p["b"]])), {"w": x[:5], "b": x[5:]},
            {"b": BIASES.to(x.device) - 5})["b"],
        lambda h, v: h[BIASES][:, BIASES],
    ),
}  # fmt: skip


@pytest.mark.parametrize("operator", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize("norms", NORMS.values(), ids=NORMS.keys())
def test_the_biases_second_derivatives_are_those_of_the_bias_added_outside(norms, operator,
                                                                           device):  # fmt: skip
    inside, outside = norms
    computed, expected = operator
    generator = torch.Generator().manual_seed(1)
    x, v = (torch.randn(10, dtype=torch.float64, generator=generator).to(device) for _ in "xv")
    reference = expected(dense_hessian(loss(outside), x), v)
    torch.testing.assert_close(computed(loss(inside), x, v), reference, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm", "group_norm", "instance_norm"])
def test_a_float32_bias_on_a_bfloat16_input_keeps_its_second_derivatives(norm):
    """Torch's mixed kernels take a bfloat16 input with a float32 bias (a bfloat16 output): its
    Hessian came out all zeros (batch norm) or raised (layer norm) where the dtypes differ."""
    h = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1)).bfloat16()
    b = torch.randn(5 if norm == "layer_norm" else 3, generator=torch.Generator().manual_seed(2))
    written, outside = {
        "batch_norm": (lambda b: F.batch_norm(h, None, None, None, b, True),
                       lambda b: F.batch_norm(h.float(), None, None, training=True) + b[:, None]),
        "layer_norm": (lambda b: F.layer_norm(h, (5,), None, b),
                       lambda b: F.layer_norm(h.float(), (5,)) + b),
        "group_norm": (lambda b: F.group_norm(h, 1, None, b),
                       lambda b: F.group_norm(h.float(), 1) + b[:, None]),
        "instance_norm": (lambda b: F.instance_norm(h, bias=b),
                          lambda b: F.instance_norm(h.float()) + b[:, None]),
    }[norm]  # fmt: skip
    assert written(b).dtype == torch.bfloat16
    got = pyhvp.sub_hessian(lambda b: torch.tanh(written(b).float()).pow(3).sum(), b,
                            torch.arange(b.numel()), method="reverse")  # fmt: skip
    expected = torch.func.hessian(lambda b: torch.tanh(outside(b).bfloat16().float()).pow(3).sum())(
        b
    )
    assert expected.abs().max() > 1
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


GROUP_NORMS = {  # (channels, groups, length): a group's channels number its length, or do not
    "GroupNorm(1, 2) on length 2 (torch's batched backward: wrong values)": (2, 1, 2),
    "GroupNorm(2, 4) on length 2 (wrong values)": (4, 2, 2),
    "GroupNorm(1, 4) on length 3 (torch's batched backward: a size error)": (4, 1, 3),
}


def group_normed(channels, groups, length, device):
    """``f(x)``: each instance's ``channels * length`` variables group-normed (an affine map of
    its own), then through tanh into a squared linear read-out; one value per instance."""
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(2, channels, dtype=torch.float64, generator=generator).to(device)
    head = torch.randn(3, channels * length, dtype=torch.float64, generator=generator).to(device)

    def f(x):
        h = F.group_norm(x.view(-1, channels, length), groups, weight, bias)
        return (torch.tanh(h).flatten(1) @ head.T).pow(2).sum(-1)

    return f


@pytest.mark.parametrize("shape", GROUP_NORMS.values(), ids=GROUP_NORMS.keys())
def test_hvps_of_several_tangents_through_a_group_norm_are_the_dense_ones(shape, device):
    f = group_normed(*shape, device)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, shape[0] * shape[2], dtype=torch.float64, generator=generator).to(device)
    tangents = torch.randn(3, *x.shape, dtype=torch.float64, generator=generator).to(device)
    expected = torch.stack([instance_hvp(f, x, v) for v in tangents])
    torch.testing.assert_close(pyhvp.hvp(f, x, tangents), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("method", ["auto", "reverse", "forward"])
@pytest.mark.parametrize("shape", GROUP_NORMS.values(), ids=GROUP_NORMS.keys())
def test_a_sub_hessian_across_a_group_norm_is_the_seed_loops(shape, method, device):
    """A weight before the norm and one after it, as a U-Net block has them: the reverse route
    pushes each tensor's tangents (more than a few: not by the seed's loop) through one batched
    backward."""
    channels, groups, length = shape
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(2, 1, length + 2, dtype=torch.float64, generator=generator).to(device)
    params = {
        "conv": torch.randn(channels, 1, 3, dtype=torch.float64, generator=generator).to(device),
        "head": torch.randn(2, channels * length, dtype=torch.float64, generator=generator).to(
            device
        ),
    }

    def loss(p):
        h = F.group_norm(F.conv1d(inputs, p["conv"]), groups)
        return F.cross_entropy(
            torch.tanh(h).flatten(1) @ p["head"].T, torch.tensor([1, 0]).to(device)
        )

    index = {"conv": torch.arange(3 * channels), "head": torch.tensor([0, 3, 5, 1, 2, 4])}
    got = pyhvp.sub_hessian(loss, params, index, joint=True, method=method)
    torch.testing.assert_close(got, loop_sub_hessian(loss, params, index), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_group_norm_written_out_keeps_torchs_values_and_dtype(dtype):
    """Computed in float32 and rounded once for a reduced-precision input, as torch's kernel
    (float32 parameters with a bfloat16 input, as torch takes them): torch's values, within a
    few ulps of the output's dtype."""
    generator = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(2, 4, generator=generator)
    x = torch.randn(3, 4, 5, generator=generator).to(dtype).requires_grad_()
    if dtype == torch.float16:
        weight, bias = weight.half(), bias.half()
    with twice_differentiable_norms, batched_double_backward:
        written = F.group_norm(x, 2, weight, bias)
    assert "GroupNorm" not in type(written.grad_fn).__name__  # written out, not torch's
    fused = F.group_norm(x, 2, weight, bias)
    assert written.dtype == fused.dtype == dtype
    ulp = torch.finfo(dtype).eps  # (a few of float32's, where a value cancels to near 0)
    scale = float(fused.detach().abs().max())
    torch.testing.assert_close(written.detach(), fused.detach(), rtol=4 * ulp, atol=4 * ulp * scale)


def test_groups_that_do_not_divide_the_channels_keep_torchs_refusal():
    f = lambda x: F.group_norm(x.view(-1, 3, 2), 2).pow(3).sum((1, 2))  # noqa: E731
    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        pyhvp.hvp(f, x, torch.stack([x, x]))
