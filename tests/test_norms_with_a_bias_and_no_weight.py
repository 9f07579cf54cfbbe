"""Specs: a norm with a bias and no weight, differentiated twice.

Torch's double backward of layer, batch, instance and group norms drops the bias when the weight
is None (torch 2.5.1 to 2.14.1: the bias's Hessian came out all zeros in ``pyhvp.hvp`` and every
route of ``sub_hessian``, and ``joint`` raised). pyhvp runs such a norm as the norm plus the bias
(:mod:`pyhvp._norm_biases`); the reference is the same function with the bias added outside the
norm, by ``torch.func.hessian`` (no weight: nothing of torch's that is wrong there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dense import dense_hessian

import pyhvp

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
