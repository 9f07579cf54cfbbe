"""Specs: weight normalisation, differentiated twice.

Torch's double backward of ``torch._weight_norm`` (its fused kernel, on the first or last dim) is
wrong (torch 2.5.1 to 2.14.1: the Hessian over ``v`` and ``g`` came out asymmetric and up to 3.2
off, on every route of ``sub_hessian`` and in ``pyhvp.hvp``). pyhvp runs it as its formula
(:mod:`pyhvp._weight_norms`); the reference is the formula written out, by ``torch.func.hessian``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dense import dense_hessian
from torch import nn

import pyhvp
from pyhvp._weight_norms import weight_norms_written_out

INPUT = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
V_SHAPE, G_SHAPES = (4, 3), {0: (4, 1), 1: (1, 3), -1: ()}  # -1: over every entry


def written_out(v, g, dim):
    return v * (g / (v.norm() if dim == -1 else torch.norm_except_dim(v, 2, dim)))


def _layers(weight_norm, *names):
    """A bias-free ``Linear(3, 4)`` normalised by ``weight_norm`` on each dim (-1: ``dim=None``),
    and its parameter names of ``g`` and ``v``; built once (construction writes ``.data``, which
    no transform allows)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (nn.utils.weight_norm's deprecation)
        layers = {-1 if dim is None else dim: weight_norm(nn.Linear(3, 4, bias=False).double(),
                                                          dim=dim) for dim in (0, 1, None)}  # fmt: skip
    return lambda v, g, dim: (
        torch.func.functional_call(
            layers[dim], dict(zip(names, (g, v), strict=True)), (torch.eye(3).to(v),)
        ).T
    )


WEIGHT_NORMS = {  # (v, g, dim) -> the weight, each as a user writes it
    "torch._weight_norm": lambda v, g, dim: torch._weight_norm(v, g, dim),
    "nn.utils.parametrizations.weight_norm": _layers(
        nn.utils.parametrizations.weight_norm,
        "parametrizations.weight.original0",
        "parametrizations.weight.original1",
    ),
    # (the fused op, on the first or last dim, reads g flat: a custom layer's g of shape (out,))
    "torch._weight_norm, g flat": lambda v, g, dim: torch._weight_norm(v, g.flatten(), dim),
    # (its pre-hook calls the torch._weight_norm its module bound at import)
    "nn.utils.weight_norm": _layers(nn.utils.weight_norm, "weight_g", "weight_v"),
}


def loss(weight_norm, dim):
    """A loss of ``x``: ``v`` (12 entries) then ``g`` (4 or 3), through a tanh layer."""

    def f(x):
        v, g = x[:12].reshape(V_SHAPE), x[12:].reshape(G_SHAPES[dim])
        return torch.tanh(INPUT.to(x.device) @ weight_norm(v, g, dim).T).square().sum()

    return f


INDEX = torch.tensor([13, 2, 12, 7, 7, 0])  # g's and v's, unsorted, one repeated


def _index(x):
    """The entries of ``INDEX`` that ``x`` has (a scalar ``g``: 13 in all)."""
    return INDEX[len(x) > INDEX]


OPERATORS = {  # an operator's matrix (or product) over the loss's variables, and the dense one
    "hvp": (lambda f, x, v: pyhvp.hvp(f, x, v), lambda h, v: h @ v),
    **{
        f"sub_hessian, method={method!r}": (
            lambda f, x, v, m=method: pyhvp.sub_hessian(f, x, _index(x).to(x.device), method=m),
            lambda h, v: h[_index(h)][:, _index(h)],
        )
        for method in ("auto", "reverse", "sparse", "forward")
    },
}


@pytest.mark.parametrize("operator", OPERATORS.values(), ids=OPERATORS.keys())
@pytest.mark.parametrize("dim", [0, 1, -1], ids=["dim 0", "dim 1 (the last)", "every entry"])
@pytest.mark.parametrize("weight_norm", WEIGHT_NORMS.values(), ids=WEIGHT_NORMS.keys())
def test_second_derivatives_are_those_of_the_formula_written_out(weight_norm, dim, operator,
                                                                 device):  # fmt: skip
    computed, expected = operator
    generator = torch.Generator().manual_seed(1)
    n = 12 + torch.Size(G_SHAPES[dim]).numel()
    x, v = (torch.randn(n, dtype=torch.float64, generator=generator).to(device) for _ in "xv")
    reference = expected(dense_hessian(loss(written_out, dim), x), v)
    torch.testing.assert_close(computed(loss(weight_norm, dim), x, v), reference, rtol=1e-9,
                               atol=1e-10)  # fmt: skip


def test_a_weight_normalised_models_sub_hessian_is_the_dense_one():
    """``module_loss`` of a model with a weight-normalised layer, its ``original0`` (g) and
    ``original1`` (v) selected jointly."""
    torch.manual_seed(0)
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(3, 4)).double()
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 1)).double()
    targets = torch.randn(6, 1, dtype=torch.float64)
    loss_of, params = pyhvp.module_loss(model, nn.MSELoss(reduction="sum"), INPUT, targets)
    names = ["0.parametrizations.weight.original0", "0.parametrizations.weight.original1"]
    index = {name: torch.arange(params[name].numel()) for name in names}

    def by_vector(x):
        g, v = x[:4].reshape(4, 1), x[4:].reshape(V_SHAPE)
        hidden = torch.tanh(INPUT @ written_out(v, g, 0).T + params["0.bias"])
        out = hidden @ params["2.weight"].T + params["2.bias"]
        return (out - targets).square().sum()

    expected = dense_hessian(by_vector, torch.cat([params[name].reshape(-1) for name in names]))
    got = pyhvp.sub_hessian(loss_of, params, index, joint=True)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dim", [0, 1], ids=["dim 0", "dim 1 (the last)"])
def test_a_flat_g_scales_each_slice_by_its_own_entry(dim):
    """Torch's fused op reads ``g`` flat on the first or last dim: written out, a ``g`` of shape
    ``(out,)`` broadcast against the norm's ``(out, 1)`` instead, which raised for a non-square
    ``v`` and, for a square one, scaled column ``j`` of every row by ``g[j]``, with no error."""
    generator = torch.Generator().manual_seed(2)
    v = torch.randn(4, 4, dtype=torch.float64, generator=generator)
    g = torch.rand(4, dtype=torch.float64, generator=generator)
    expected = torch._weight_norm(v, g, dim)  # (torch's own, outside the context)
    with weight_norms_written_out:
        got = torch._weight_norm(v, g, dim)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
