"""Specification of the higher-order operators (directional_derivatives, bilaplacian,
differential_operator) and of operators nested in one another, against nested
``torch.autograd.grad`` in float64 (tests/dense.py)."""

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dense import (
    nested_bilaplacian,
    nested_directional_derivatives,
    nested_mixed_partial,
)
from test_taylor_engine import softsign
from torch import nn

import pyhvp
from pyhvp import TorchBackend
from pyhvp.backends import nested

EAGER = TorchBackend(compile=False)


def _weights(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mlp(x):
    w1, w2 = _weights(6, 8, seed=1).to(x), _weights(8, 2, seed=2).to(x)
    return torch.sin(torch.tanh(x @ w1) @ w2)


def _linalg(x):
    a = x.reshape(*x.shape[:-1], 2, 2)[..., :2, :2] if x.shape[-1] == 4 else None
    a = x[..., :4].reshape(*x.shape[:-1], 2, 2) + 3 * torch.eye(2, dtype=x.dtype)
    b = x[..., 4:6]
    return torch.stack(
        [
            torch.linalg.det(a),
            torch.linalg.inv(a).sum((-2, -1)),
            torch.linalg.solve(a, b).sum(-1),
            torch.linalg.slogdet(a)[1],
        ],
        -1,
    )


def _views(x):
    m = x.reshape(*x.shape[:-1], 2, 3).permute(*range(x.ndim - 1), -1, -2)  # (.., 3, 2)
    picked = torch.index_select(m, -2, torch.tensor([2, 0])).flip(-1)
    gathered = torch.gather(x, -1, torch.tensor([[5, 1, 1]]).expand(*x.shape[:-1], 3))
    joined = torch.cat([picked.reshape(*x.shape[:-1], 4), gathered, x[..., 1:3] ** 2], -1)
    return torch.where(joined > 0, joined**3, torch.sin(joined)).sum(-1)


def _conv(x):
    kernel = _weights(2, 1, 3, seed=5).to(x)
    return torch.tanh(F.conv1d(x[..., None, :], kernel, padding=1)).pow(2).sum((-2, -1))


CASES = {
    "polynomials and products": lambda x: (x**4).sum(-1) + x.prod(-1) + x[..., 0] * x[..., 1] ** 3,
    "exp, sin, cos, tanh, sigmoid": lambda x: (torch.exp(0.3 * x) * torch.sin(x)
                                               + torch.cos(x) * torch.tanh(x)
                                               + torch.sigmoid(2 * x)).sum(-1),
    "log, sqrt, rsqrt, reciprocal, pow": lambda x: (torch.log(2 + x) + torch.sqrt(2 + x)
                                                    + torch.rsqrt(3 + x) + 1 / (2 + x)
                                                    + (2 + x) ** 2.5).sum(-1),
    "erf, softplus, gelu, silu, elu, atan, asinh, atanh": lambda x: (
        torch.erf(x) + F.softplus(2 * x) + F.gelu(x) + F.gelu(x, approximate="tanh")
        + F.silu(x) + F.elu(x + 3) + torch.atan(x) + torch.asinh(x) + torch.atanh(x / 3)
    ).sum(-1),
    "quotients and tensor powers": lambda x: x[..., 0] * x[..., 1] / (1 + x[..., 2] ** 2)
                                             + (2 + x[..., 3]) ** (1 + x[..., 4] ** 2),
    "tanh MLP, vector output": _mlp,
    "softmax, log_softmax, logsumexp": lambda x: torch.stack([
        (torch.softmax(x, -1) * torch.arange(6.0)).sum(-1),
        torch.log_softmax(x, -1)[..., 2], torch.logsumexp(x, -1)], -1),
    "var, std, norm, mean": lambda x: torch.stack([x.var(-1), x.std(-1),
                                                   torch.linalg.vector_norm(x, dim=-1),
                                                   x.mean(-1) ** 3], -1),
    "views, indexing, where": _views,
    "det, inverse, solve, slogdet": _linalg,
    "two-input pointwise ops (fallback)": lambda x: (
        torch.atan2(x[..., :3], 2 + x[..., 3:]) + torch.hypot(x[..., :3], x[..., 3:])
        + torch.addcmul(x[..., :3], x[..., 3:], torch.sin(x[..., :3]))
        + torch.lerp(x[..., :3], x[..., 3:] ** 2, torch.sigmoid(x[..., 3:]))
        + torch.xlogy(x[..., :3], 2 + x[..., 3:]) + torch.maximum(x[..., :3] ** 3, x[..., 3:])
    ).sum(-1),
    "prod keeping a middle dim, logaddexp of broadcast operands": lambda x: (
        (x.reshape(*x.shape[:-1], 3, 2).prod(-2, keepdim=True) * torch.tensor([1.0, -2.0],
                                                                            dtype=x.dtype)
         ).sum((-2, -1))
        + torch.logaddexp(x.sum(-1), torch.tensor(0.0, dtype=x.dtype))
        + torch.logaddexp2(x[..., :1], x).pow(2).sum(-1)
    ),
    "lgamma, digamma (pointwise fallback)": lambda x: (torch.lgamma(3 + x)
                                                       + torch.digamma(3 + x)).sum(-1),
    "eigvalsh (general fallback)": lambda x: torch.linalg.eigvalsh(
        x[..., :4].reshape(*x.shape[:-1], 2, 2) + x[..., :4].reshape(*x.shape[:-1], 2, 2).mT
        + torch.diag(torch.tensor([0.0, 3.0], dtype=x.dtype))) @ torch.tensor([1.0, -2.0],
                                                                            dtype=x.dtype),
    "conv1d": _conv,
}  # fmt: skip
"""Every op family of the Taylor engine, on 6 variables per instance."""


def point(device, dtype=torch.float64, batch=3):
    x = 0.5 * torch.randn(batch, 6, generator=torch.Generator().manual_seed(7), dtype=dtype)
    return x.to(device)


def tolerance(order):
    return {"rtol": 1e-8, "atol": 1e-8 * 10**order}


DENSE_FALLBACK = {"eigvalsh (general fallback)"}
"""Cases on the dense reverse-mode fallback, which carries orders up to 4."""


FAST = {"tanh MLP, vector output", "softmax, log_softmax, logsumexp", "det, inverse, solve, slogdet",
        "two-input pointwise ops (fallback)", "views, indexing, where",
        "prod keeping a middle dim, logaddexp of broadcast operands"}  # fmt: skip
"""The families whose fourth order runs in the fast tier (``make test``); every family at
orders 3, 4 and 6 runs in ``make test-all``."""


def tiered(name, order):
    fast = name in FAST and order == 4
    return pytest.param(name, order, marks=() if fast else pytest.mark.slow, id=f"{name}-{order}")


@pytest.mark.parametrize(("name", "order"), [tiered(n, k) for n in CASES for k in (3, 4, 6)])
def test_directional_derivatives_match_nested_autograd(name, order, device):
    if name in DENSE_FALLBACK and order > 4:
        pytest.skip("the dense fallback carries orders up to 4 (refused above: a spec below)")
    f, x = CASES[name], point(device)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype).to(device)
    got = pyhvp.directional_derivatives(f, x, v, order=order, backend=EAGER)
    expected = nested_directional_derivatives(f, x.cpu(), v.cpu(), order)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(order))


def test_eighth_order_coefficients_match_closed_forms(device):
    """d^k/dt^k of exp(a.x) sin(b.x) along v, k = 0..8: Im((a.v + i b.v)^k e^{a.x + i b.x})."""
    x = point(device)
    a, b = (
        torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype, device=device) * s for s in (0.7, 1.3)
    )
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype).to(device)
    got = pyhvp.directional_derivatives(
        lambda y: torch.exp(y @ a) * torch.sin(y @ b), x, v, order=8, backend=EAGER
    )
    rate = torch.complex(v @ a, v @ b)
    expected = torch.stack([(rate**k * torch.exp(torch.complex(x @ a, x @ b))).imag
                            for k in range(9)])  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_sinc_has_its_own_derivatives_at_zero_and_near_it(device):
    """d^k/dx^k sinc(x) = int_0^1 (pi s)^k cos(pi x s + k pi / 2) ds (sinc is the mean of
    cos(pi x s) over s), by Gauss-Legendre quadrature. torch's decomposition, which the engine
    took, gave NaN at 0 and a fourth derivative of 12.1 for 19.5 at 1e-4."""
    x = torch.tensor([0.0, 1e-9, 1e-4, 0.3, -0.7, 3 / math.pi - 1e-6, 3 / math.pi + 1e-6, 1.5,
                      -12.25], dtype=torch.float64, device=device)[:, None]  # fmt: skip
    got = pyhvp.directional_derivatives(lambda y: torch.sinc(y).sum(-1), x,
                                        torch.ones(1, dtype=x.dtype, device=device), order=6,
                                        backend=EAGER)  # fmt: skip
    expected = torch.stack([sinc_derivative(x, k) for k in range(7)])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def sinc_derivative(x, k):
    """d^k/dx^k sinc(x) = int_0^1 (pi s)^k cos(pi x s + k pi / 2) ds, by Gauss-Legendre
    quadrature, in x's dtype (x: (B, 1), the quadrature along its last dim)."""
    nodes, weights = np.polynomial.legendre.leggauss(60)
    s, w = (torch.from_numpy(a).to(x.device, x.dtype) for a in ((nodes + 1) / 2, weights / 2))
    return ((math.pi * s) ** k * torch.cos(math.pi * x * s + k * math.pi / 2) * w).sum(-1)


BOUND_SINC = torch.sinc  # bound before any call: pyhvp's replacement cannot reach it
SINCS = {  # as f calls them
    "torch.sinc": lambda y: torch.sinc(y),  # (looked up at the call: replaced for the run)
    "torch.special.sinc": lambda y: torch.special.sinc(y),
    "x.sinc()": lambda y: y.sinc(),
    "bound before": lambda y: BOUND_SINC(y),
}
SECOND_DERIVATIVES_OF_A_SUM = {  # each call's diagonal of f(x) = sum_i g(x_i) over x's (B, 1)
    "hvp": lambda f, x: pyhvp.hvp(f, x, torch.ones_like(x), backend=EAGER)[:, 0],
    **{f"sub_hessian {method}": lambda f, x, method=method: pyhvp.sub_hessian(
        lambda p: f(p[:, None]).sum(), x[:, 0], torch.arange(len(x), device=x.device),
        method=method).diagonal() for method in ("auto", "reverse", "forward", "sparse")},
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("call", SECOND_DERIVATIVES_OF_A_SUM.values(),
                         ids=SECOND_DERIVATIVES_OF_A_SUM.keys())  # fmt: skip
@pytest.mark.parametrize("sinc", SINCS.values(), ids=SINCS.keys())
def test_sinc_has_its_second_derivative_at_zero_and_near_it_outside_transforms(sinc, call,
                                                                             dtype, device):  # fmt: skip
    """HVPs and sub-Hessians of a plain x took autograd's second derivative of sinc: NaN at 0,
    +5.96 for -3.29 at 1e-4 in float32, 0 at 1e-9 in float64 (until 2026-12-07; the Taylor
    operators and the calls inside transforms had it right). ``x.sinc()`` and a ``torch.sinc``
    bound before the call stayed torch's own on every route until later that day (warned of where
    autograd differentiated them: their sub-Hessians were 0 for -19 at ``1e-5`` in float32)."""
    x = torch.tensor([0.0, 1e-9, 1e-4, 1e-2, 0.3, -1.7], dtype=dtype, device=device)[:, None]
    got = call(lambda y: sinc(y).sum(-1), x)
    expected = sinc_derivative(x.double(), 2).to(dtype)
    torch.testing.assert_close(got, expected, **({} if dtype == torch.float64 else
                                                 {"rtol": 1e-5, "atol": 1e-5}))  # fmt: skip


TINY_NORMS = {  # f of a norm, its exact HVP, and a scale where float32 sums of |x|^p underflow
    "x.norm(p=3) ** 3": (lambda y: y.norm(p=3, dim=-1) ** 3,
                         lambda x, v: 6 * x.abs() * v, 1e-9),
    "vector_norm(x)": (lambda y: torch.linalg.vector_norm(y, dim=-1),
                       lambda x, v: (v - x * (x * v).sum(-1, keepdim=True) / (x * x).sum(
                           -1, keepdim=True)) / x.norm(dim=-1, keepdim=True), 1e-14),
}  # fmt: skip
WRITTEN_OUT_ROUTES = {  # where the HVPs take the norms written out
    "x that requires grad": lambda f, x, v: pyhvp.hvp(f, x.requires_grad_(), v).detach(),
    "inside vmap": lambda f, x, v: torch.func.vmap(lambda y, u: pyhvp.hvp(f, y, u))(
        x[None], v[None])[0],
}  # fmt: skip


@pytest.mark.parametrize("route", WRITTEN_OUT_ROUTES.values(), ids=WRITTEN_OUT_ROUTES.keys())
@pytest.mark.parametrize("case", TINY_NORMS.values(), ids=TINY_NORMS.keys())
def test_a_written_out_norm_of_a_tiny_vector_keeps_its_derivatives(case, route):
    """The written-out norm summed ``|x| ** p`` as they come: in float32 that underflowed at
    ``|x|`` of 1e-9 for p = 3, and the HVPs were -inf where torch's own op is exact (until
    2026-12-07). Against the closed form in float64."""
    f, exact, scale = case
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64) * scale
    v = torch.tensor([[1.0, -1.0, 0.5]], dtype=torch.float64)
    got = route(f, x.float(), v.float())
    torch.testing.assert_close(got.double(), exact(x, v), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("route", WRITTEN_OUT_ROUTES.values(), ids=WRITTEN_OUT_ROUTES.keys())
def test_a_written_out_norm_of_entries_spanning_float32s_range_keeps_its_derivatives(route):
    """Divided by its largest entry, 1e10, the entry 1e-30 became subnormal, and the HVP of
    ``|x|_1.5 ** 3`` there was inf (2026-12-07, before the scaling was kept to sums out of
    range). Against autograd in float64."""
    x = torch.tensor([[1e-30, 1.0, 1e10, 1.0]], dtype=torch.float64)
    v = torch.ones_like(x)

    def f(y):
        return torch.linalg.vector_norm(y, ord=1.5, dim=-1) ** 3

    expected = torch.func.hessian(lambda y: f(y[None])[0])(x[0]) @ v[0]
    got = route(f, x.float(), v.float())
    torch.testing.assert_close(got.double()[0], expected, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("flushed", [False, True], ids=["subnormals kept", "subnormals flushed"])
@pytest.mark.parametrize("scale", [1e-20, 1e-15, 1e18, 1e19, 1e22])
def test_the_laplacian_of_a_float32_norm_far_from_one_keeps_its_accuracy(scale, flushed):
    """The Taylor engine summed powers of the entries as they came: in float32 the Laplacian of
    ``|x|`` was -inf at ``|x|`` of 1e-15 and 1e-18, and 9% off at 1e18; then, divided by the
    largest entry, NaN at 1e-20, 27% off at 1e22, and 0 at 1e19 where subnormals are flushed to
    zero (torch 2.5's compiled kernels turn that on; until 2026-12-07). Against the closed form
    ``(n - 1) / |x|`` in float64."""
    torch.set_flush_denormal(flushed)
    x = torch.randn(2, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x = x * scale
    got = pyhvp.laplacian(lambda y: torch.linalg.vector_norm(y, dim=-1), x.float())
    torch.testing.assert_close(got.double(), 11 / x.norm(dim=-1), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("at_zero", [True, False], ids=["x = 0", "random x"])
def test_a_zero_gradient_reaching_logcumsumexp_is_warned_of(at_zero):
    """Torch's backward of logcumsumexp takes the log of its gradient, constant where it is 0:
    the second derivative drops that entry's term, and until 2026-12-07 the HVP of
    ``logcumsumexp(x) ** 2`` at ``x = 0`` was -0.61 for -0.91 without a word. Elsewhere it is
    right, and nothing is said."""
    x = torch.zeros(2, 6) if at_zero else torch.randn(2, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pyhvp.hvp(lambda y: (torch.logcumsumexp(y, -1) ** 2).sum(-1), x.double(),
                  torch.ones(2, 6, dtype=torch.float64))  # fmt: skip
    said = [w for w in caught if "reaching a logcumsumexp" in str(w.message)]
    assert len(said) == at_zero


def gelu_tanh_in_elementary_ops(u):
    return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))


def test_tanh_approximated_gelu_is_finite_where_its_argument_saturates(device):
    """Above second order the engine took autograd's derivatives of ``aten.gelu``, NaN for
    ``|u| > 21`` (0 there to double precision): a plate PINN's bi-Laplacian of a GELU network
    was NaN wherever one pre-activation got that large. Against nested autograd of the same
    function in elementary ops, whose derivatives stay finite."""
    x = torch.tensor([-40.0, -25.0, -3.1, -0.6, 0.0, 0.3, 2.2, 7.5, 25.0, 40.0],
                     dtype=torch.float64, device=device)[:, None]  # fmt: skip
    v = torch.ones_like(x)
    got = pyhvp.directional_derivatives(lambda y: F.gelu(y, approximate="tanh").sum(-1), x, v,
                                        order=6, backend=EAGER)  # fmt: skip
    f = lambda y: gelu_tanh_in_elementary_ops(y).sum(-1)  # noqa: E731
    expected = nested_directional_derivatives(f, x.cpu(), v.cpu(), 6)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-10, atol=1e-10)
    plate = torch.tensor([[30.0, 0.5], [0.1, -0.2]], dtype=torch.float64, device=device)
    got = pyhvp.bilaplacian(lambda y: F.gelu(y, approximate="tanh").prod(-1), plate,
                            backend=EAGER)  # fmt: skip
    expected = nested_bilaplacian(lambda y: gelu_tanh_in_elementary_ops(y).prod(-1), plate.cpu())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-10, atol=1e-10)


WRITTEN_OUT_IN_TRANSFORMS = {  # an activation whose nested reverse-mode derivatives torch
    # gets wrong at some points, and such points among others
    "gelu's tanh approximation, saturated": (
        lambda z: F.gelu(z, approximate="tanh"), [[30.0, 0.5], [0.1, -0.2]]),
    "sinc at and near 0": (lambda z: torch.sinc(z), [[0.0, 0.5], [1e-9, 2.0]]),
}  # fmt: skip


@pytest.mark.parametrize(
    ("g", "points"), WRITTEN_OUT_IN_TRANSFORMS.values(), ids=WRITTEN_OUT_IN_TRANSFORMS.keys()
)
def test_an_activation_inside_a_transform_has_the_derivatives_it_has_outside(g, points, device):
    """Inside ``torch.func`` transforms the operators differentiate ``f`` by nested reverse
    mode: torch's third and higher derivatives of ``aten.gelu``'s tanh approximation are NaN
    where ``|u| > 21``, and its derivatives of ``sinc`` NaN at 0 and digitless near it. The
    parameter gradient of a bi-Laplacian by ``torch.func.grad`` was NaN, ``vmap`` of it NaN or
    wrong (-3839 for 11.66 at ``[1e-9, 2]``). As the operator outside the transform gives them."""
    plate = torch.tensor(points, dtype=torch.float64, device=device)

    def bilaplacian(y, w):
        return pyhvp.bilaplacian(lambda z: g(z * w).prod(-1), y)

    w = torch.ones(2, dtype=torch.float64, device=device, requires_grad=True)
    (expected,) = torch.autograd.grad(bilaplacian(plate, w).sum(), w)
    got = torch.func.grad(lambda w: bilaplacian(plate, w).sum())(w.detach())
    torch.testing.assert_close(got, expected)
    got = torch.func.vmap(lambda y: bilaplacian(y, w.detach()))(plate[None])[0]
    torch.testing.assert_close(got, bilaplacian(plate, w.detach()))


HALF_POINTS = {  # points where a half activation's written-out intermediates overflowed
    "sinc": (lambda z: torch.sinc(z), [0.5, 0.8]),  # (its series' gradient: t ** 31 for t = pi u > 1.43)
    "gelu's tanh approximation": (lambda z: F.gelu(z, approximate="tanh"), [160.0, -0.5]),
}  # fmt: skip


@pytest.mark.parametrize(("g", "points"), HALF_POINTS.values(), ids=HALF_POINTS.keys())
def test_a_half_activation_inside_a_transform_has_finite_derivatives(g, points, device):
    """Written out inside transforms in half precision, sinc's power series and gelu's cube
    overflowed in their gradients: ``vmap`` of a half sinc's HVP at 0.5 was NaN for -1.19. In
    float32 at least, as torch's own kernels compute a half activation."""
    x = torch.tensor([points], dtype=torch.float16, device=device)
    v = torch.ones_like(x)
    got = torch.func.vmap(lambda y: pyhvp.hvp(lambda z: g(z).sum(-1), y, v))(x[None])[0]
    expected = pyhvp.hvp(lambda z: g(z).sum(-1), x.double(), v.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2)


SATURATING = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus}


@pytest.mark.parametrize("g", SATURATING.values(), ids=SATURATING.keys())
def test_an_activation_keeps_float32_accuracy_at_every_order(g, device):
    """Where tanh or sigmoid is within rounding of 1, its derivatives written as polynomials in
    its value cancelled: in float32 the sixth derivative of tanh at 9 was 31 times its own
    value, sigmoid's and silu's off by 9 and 17 times theirs at 12 (autograd's relative errors:
    0.96 for tanh, 1e-4 for the others); and sigmoid's own polynomials, of alternating
    coefficients up to 3360, lost 1e-5 of the largest sixth derivative elsewhere (autograd:
    2.5e-7). Against float64, each order scaled by its largest value over the points."""
    points = [-12.0, -9.0, -5.0, -2.0, -0.7, 0.3, 1.5, 4.0, 9.0, 12.0]
    x = torch.tensor(points, device=device)[:, None]
    one = torch.ones(1, device=device)
    got, expected = (pyhvp.directional_derivatives(lambda y: g(y).sum(-1), x.to(dtype),
                                                   one.to(dtype), order=6, backend=EAGER)
                     for dtype in (torch.float32, torch.float64))  # fmt: skip
    scale = expected.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(got.double() / scale, expected / scale, rtol=1e-5, atol=1e-6)


def test_an_op_without_a_rule_and_with_an_empty_output_adds_nothing(device):
    """``pdist`` of one row is empty: the fallback above second order has nothing to
    differentiate (it refused before: autograd's nested derivatives cannot reshape 0 entries)."""
    x = point(device)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype).to(device)
    got = pyhvp.directional_derivatives(
        lambda y: (y**4).sum(-1) + torch.pdist(y[:1]).sum(), x, v, order=4, backend=EAGER
    )
    torch.testing.assert_close(got[4], 24 * (v**4).sum(-1))


def test_a_shared_direction_is_each_instance_s_direction(device):
    x = point(device)
    v = torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=x.dtype, device=device)  # u_xxxx
    got = pyhvp.directional_derivatives(_mlp, x, v, order=4, backend=EAGER)
    expected = nested_directional_derivatives(_mlp, x.cpu(), v.cpu().expand(x.shape), 4)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(4))


@pytest.mark.parametrize("name", ["tanh MLP, vector output", "two-input pointwise ops (fallback)",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in (
                                      "polynomials and products", "softmax, log_softmax, logsumexp",
                                      "conv1d"))])  # fmt: skip
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_the_exact_bilaplacian_matches_nested_autograd(name, chunk_size, device):
    f, x = CASES[name], point(device)
    got = pyhvp.bilaplacian(f, x, chunk_size=chunk_size, backend=EAGER)
    torch.testing.assert_close(got.cpu(), nested_bilaplacian(f, x.cpu()), **tolerance(4))


def _group_norm_plate(affine, device):
    """A 2-D plate's network with ``nn.GroupNorm`` (on CPU torch decomposes its affine form
    through ``as_strided``), and the same network with the norm in elementary ops."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 8), nn.Unflatten(-1, (4, 2)), nn.GroupNorm(2, 4, affine=affine),
                        nn.Tanh(), nn.Flatten(-2), nn.Linear(8, 1)).double().to(device)  # fmt: skip
    if affine:
        nn.init.normal_(net[2].weight), nn.init.normal_(net[2].bias)

    def written_out(x):
        groups = net[0](x).reshape(-1, 2, 4)
        centred = groups - groups.mean(-1, keepdim=True)
        h = (centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(-1, 4, 2)
        if affine:
            h = h * net[2].weight[:, None] + net[2].bias[:, None]
        return net[5](net[4](net[3](h)))[..., 0]

    return (lambda x: net(x)[..., 0]), written_out


GROUP_NORM_OPERATORS = {  # operator, a batch its dense whole-batch fallback refused, reference
    "laplacian, 128 instances": (lambda f, x: pyhvp.laplacian(f, x, backend=EAGER), 128,
                                 lambda f, x: nested_mixed_partial(f, x, (0, 0))
                                 + nested_mixed_partial(f, x, (1, 1))),
    "bilaplacian, 8 instances": (lambda f, x: pyhvp.bilaplacian(f, x, backend=EAGER), 8,
                                 nested_bilaplacian),
}  # fmt: skip


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "not affine"])
@pytest.mark.parametrize("case", GROUP_NORM_OPERATORS.values(), ids=GROUP_NORM_OPERATORS.keys())
def test_group_norm_carries_jets_per_instance_at_any_batch(case, affine, device):
    """``aten.as_strided`` had no rule: the dense fallback over the whole batch refused a
    Laplacian past about 100 instances and a bi-Laplacian past 2."""
    operator, batch, reference = case
    f, written_out = _group_norm_plate(affine, device)
    x = point(device, batch=batch)[:, :2]
    torch.testing.assert_close(operator(f, x), reference(written_out, x), **tolerance(4))


def _windows(x):
    return torch.sin(x).as_strided((x.shape[0], 3, 4), (6, 1, 1)).prod(-1).sum(-1)


STRIDED_VIEWS = {  # f reading x's elements through as_strided
    "overlapping windows": _windows,
    "a transposed tensor, from an offset": lambda x: torch.tanh(x.reshape(-1, 2, 3).mT).as_strided(
        (x.shape[0], 2, 2), (6, 1, 3), 1).pow(3).sum((-2, -1)),
    "a contiguous slice, from an offset": lambda x: torch.cos(x).reshape(-1)[1:].as_strided(
        (x.shape[0], 2, 2), (6, 2, 1), 2).pow(3).prod(-1).sum(-1),
    "a repeated row (stride 0)": lambda x: (x * x.flip(-1)).as_strided(
        (x.shape[0], 3, 2), (6, 0, 2)).pow(3).prod(-1).sum(-1),
    "x itself": lambda x: x.as_strided((x.shape[0], 2, 3), (6, 2, 1)).prod(-1).sum(-1),
}  # fmt: skip
STRIDED_OPERATORS = {
    "laplacian": (lambda f, x: pyhvp.laplacian(f, x, backend=EAGER),
                  lambda f, x: sum(nested_mixed_partial(f, x, (i, i)) for i in range(6))),
    "fourth-order directional derivatives": (
        lambda f, x: pyhvp.directional_derivatives(f, x, torch.ones_like(x), order=4,
                                                   backend=EAGER),
        lambda f, x: nested_directional_derivatives(f, x, torch.ones_like(x), 4)),
}  # fmt: skip


@pytest.mark.parametrize("operator", STRIDED_OPERATORS.values(), ids=STRIDED_OPERATORS.keys())
@pytest.mark.parametrize("f", STRIDED_VIEWS.values(), ids=STRIDED_VIEWS.keys())
def test_an_as_strided_view_carries_the_coefficients_of_the_elements_it_reads(f, operator, device):
    """Each coefficient has a leading axis and may be broadcast: the rule gathers the view's
    elements from the value's storage order rather than applying the strides to it."""
    run, reference = operator
    x = point(device)
    torch.testing.assert_close(run(f, x).cpu(), reference(f, x.cpu()), **tolerance(4))


def test_an_as_strided_view_of_a_tensor_not_dense_in_memory_is_refused():
    """Its elements are not the value's in storage order, and the dense fallback's substitute
    tensor is laid out otherwise: refused, naming the view and the tensor's layout."""
    f = lambda y: torch.sin(y)[:, ::2].as_strided((y.shape[0], 2), (6, 2)).pow(3).sum(-1)  # noqa: E731
    with pytest.raises(pyhvp.UnsupportedOpError, match=r"as_strided view .* strides \(6, 2\)"):
        pyhvp.laplacian(f, point("cpu"), backend=EAGER)


TERMS = {
    "2-D bi-Laplacian": {(0, 0, 0, 0): 1.0, (0, 0, 1, 1): 2.0, (1, 1, 1, 1): 1.0},
    "KdV-like, three orders": {(0, 0, 0): 1.0, (1,): -0.5, (0, 1): 3.0},
    "sixth order along an axis": {(2, 2, 2, 2, 2, 2): 1.0},
    "mixed sixth order, three variables": {(0, 0, 1, 1, 2, 2): 1.0, (0, 1, 1, 1, 1, 1): -2.0},
    "f itself and a gradient term": {(): 2.0, (4,): 1.5},
    "unsorted keys add up": {(1, 0, 0): 1.0, (0, 1, 0): 2.0},
}


def operator_case(name, key):
    """The MLP in the fast tier; the collapsed fallback of two-input ops below sixth order too
    (its sixth-order references take seconds each)."""
    fast = name == "tanh MLP, vector output" or (
        name == "two-input pointwise ops (fallback)" and max(map(len, TERMS[key])) < 6
    )
    return pytest.param(name, TERMS[key], marks=() if fast else pytest.mark.slow,
                        id=f"{name}-{key}")  # fmt: skip


@pytest.mark.parametrize(("name", "terms"), [
    operator_case(n, key) for n in ("tanh MLP, vector output", "two-input pointwise ops (fallback)",
                                    "polynomials and products", "exp, sin, cos, tanh, sigmoid")
    for key in TERMS])  # fmt: skip
def test_differential_operators_match_nested_autograd(name, terms, device):
    f, x = CASES[name], point(device)
    got = pyhvp.differential_operator(f, x, terms, backend=EAGER)
    expected = sum(c * nested_mixed_partial(f, x.cpu(), alpha) for alpha, c in terms.items())
    torch.testing.assert_close(got.cpu(), expected, **tolerance(6))


def _symmetric_of(x):
    a = x[..., :4].reshape(*x.shape[:-1], 2, 2)
    return a @ a.mT + 2 * torch.eye(2, dtype=x.dtype, device=x.device)


REVERSE_FALLBACK_OPS = {  # ops whose second order the reverse-mode fallback computes (cumprod
    # until it had a rule, a scan of products: kept as a weighted check of that rule)
    "cumprod": lambda x: torch.cumprod(x, -1).sum(-1),
    "eigvalsh": lambda x: (torch.linalg.eigvalsh(_symmetric_of(x)) ** 2).sum(-1),
    "cholesky": lambda x: torch.linalg.cholesky(_symmetric_of(x)).sum((-2, -1)),
}


@pytest.mark.parametrize("f", REVERSE_FALLBACK_OPS.values(), ids=REVERSE_FALLBACK_OPS.keys())
def test_a_weighted_second_order_operator_weighs_the_reverse_fallbacks_terms(f, device):
    """The fallback summed its interpolation directions unweighted: the mixed partial of
    ``cumprod`` came out twice the right one, ``eigvalsh``'s arbitrary."""
    x = point(device)
    terms = {(0, 1): 1.0, (2, 2): 0.5, (1, 3): -2.0}
    got = pyhvp.differential_operator(f, x, terms, backend=EAGER)
    expected = sum(c * nested_mixed_partial(f, x.cpu(), alpha) for alpha, c in terms.items())
    torch.testing.assert_close(got.cpu(), expected)


def test_numpy_integers_index_the_variables_of_terms():
    x = point("cpu")
    i, j = np.int64(0), np.int64(1)
    f = CASES["polynomials and products"]
    got = pyhvp.differential_operator(f, x, {(i, j): 1.0}, backend=EAGER)
    torch.testing.assert_close(got, pyhvp.differential_operator(f, x, {(0, 1): 1.0}))


def test_first_order_terms_at_a_zero_norm_do_not_depend_on_the_other_terms():
    """A norm of a zero vector takes its one-sided jet along each direction where first orders
    are read per direction (under a higher-order top, grad_and_laplacian's gradient); a
    first-order top was summed over the directions first: u_x + u_y of |x| at 0 was 0 alone,
    2 beside a second-order term."""
    x = torch.zeros(1, 3, dtype=torch.float64)

    def f(y):
        return torch.linalg.vector_norm(y, dim=-1)

    alone = pyhvp.differential_operator(f, x, {(0,): 1.0, (1,): 1.0})
    beside = (pyhvp.differential_operator(f, x, {(0,): 1.0, (1,): 1.0, (2, 2): 1.0})
              - pyhvp.differential_operator(f, x, {(2, 2): 1.0}))  # fmt: skip
    torch.testing.assert_close(alone, beside)
    torch.testing.assert_close(alone, pyhvp.grad_and_laplacian(f, x).grad[..., :2].sum(-1))


def _rotation_scaling_exp(x):
    """``exp([[a, b], [-b, a]])`` summed: ``2 e^a cos b``."""
    a, b = x[..., 0], x[..., 1]
    m = torch.stack([torch.stack([a, b], -1), torch.stack([-b, a], -1)], -2)
    return torch.linalg.matrix_exp(m).sum((-2, -1))


def test_a_matrix_exponential_carries_jets_of_fourth_order_and_more():
    """``matrix_exp`` had no jet rule: its dense fallback nested ``jacrev`` of autograd's
    formula (a matrix exponential of twice the size, per order), whose fourth order asked for
    8.6 GB for one 2x2 matrix -- an out-of-memory kill where memory is overcommitted."""
    x = torch.tensor([[0.3, -0.7], [-0.2, 1.1]], dtype=torch.float64)
    v = torch.tensor([[1.0, 0.5], [-0.4, 2.0]], dtype=torch.float64)

    def closed_form(y):
        return 2 * torch.exp(y[..., 0]) * torch.cos(y[..., 1])

    got = pyhvp.directional_derivatives(_rotation_scaling_exp, x, v, order=5)
    torch.testing.assert_close(got, nested_directional_derivatives(closed_form, x, v, 5),
                               **tolerance(5))  # fmt: skip
    torch.testing.assert_close(pyhvp.bilaplacian(_rotation_scaling_exp, x),
                               nested_bilaplacian(closed_form, x), **tolerance(4))  # fmt: skip


def test_the_bilaplacian_is_a_differential_operator(device):
    x = point(device)
    n = x.shape[-1]
    terms = {(i, i, j, j): 1.0 for i in range(n) for j in range(n)}
    torch.testing.assert_close(pyhvp.differential_operator(_mlp, x, terms, backend=EAGER),
                               pyhvp.bilaplacian(_mlp, x, backend=EAGER), **tolerance(4))  # fmt: skip


def _plate(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1)).double()  # fmt: skip


OPERATORS = {
    "bilaplacian": lambda f, x: pyhvp.bilaplacian(f, x, backend=EAGER),
    "u_xxxx": lambda f, x: pyhvp.directional_derivatives(
        f, x, torch.tensor([1.0, 0.0], dtype=x.dtype), order=4, backend=EAGER)[4],
    "differential operator": lambda f, x: pyhvp.differential_operator(
        f, x, {(0, 0, 0): 1.0, (0, 1, 1, 1): 2.0}, backend=EAGER),
}  # fmt: skip
REFERENCES = {
    "bilaplacian": lambda f, x: nested_bilaplacian(f, x, create_graph=True),
    "u_xxxx": lambda f, x: nested_mixed_partial(f, x, (0, 0, 0, 0), create_graph=True),
    "differential operator": lambda f, x: (
        nested_mixed_partial(f, x, (0, 0, 0), create_graph=True)
        + 2 * nested_mixed_partial(f, x, (0, 1, 1, 1), create_graph=True)
    ),
}


def whole_directional_derivatives(f, x):
    return pyhvp.directional_derivatives(
        f, x, torch.tensor([1.0, 0.0], dtype=x.dtype), order=3, backend=EAGER
    )


def value_only(f, x):
    return pyhvp.differential_operator(f, x, {(): 2.0}, backend=EAGER)


def value_and_derivatives(f, x):
    return pyhvp.differential_operator(f, x, {(): 2.0, (0, 0): 1.0}, backend=EAGER)


@pytest.mark.parametrize("operator",
                         [*OPERATORS.values(), whole_directional_derivatives, value_only,
                          value_and_derivatives],
                         ids=[*OPERATORS, "directional derivatives, value included",
                              "a differential operator of f itself",
                              "a differential operator of f and its derivatives"])  # fmt: skip
def test_results_have_xs_dtype_whatever_f_computes_in(operator):
    """A derivative w.r.t. ``x`` has ``x``'s dtype (the contract): also where ``f`` computes in
    float64 from a float32 ``x``, and the value ``f(x)`` stacked with the derivatives."""
    x = point("cpu", batch=3)[:, :2].float()
    assert operator(lambda y: (y.double() ** 3).sum(-1), x).dtype == torch.float32


W32 = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("operator", OPERATORS.values(), ids=OPERATORS.keys())
def test_f_computing_in_float32_from_a_float64_x_gives_its_float32_values_in_float64(operator):
    """The weighted collapsed jets (bi-Laplacian, differential operators) multiplied f's
    float32 coefficients by x's float64 weights: the next product with a float32 weight failed
    ("expected m1 and m2 to have the same dtype")."""
    x = point("cpu", batch=3)[:, :2]
    in_float32 = operator(lambda y: torch.tanh(y.float() @ W32) @ W32[0], x)
    in_float64 = operator(lambda y: torch.tanh(y @ W32.double()) @ W32[0].double(), x)
    torch.testing.assert_close(in_float32, in_float64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("operator", OPERATORS)
def test_results_are_differentiable_in_parameters_and_x(operator):
    """What a plate PINN's training step needs: the gradient of a loss on the operator in the
    network's parameters (and in x)."""
    net = _plate()
    x = point("cpu", batch=5)[:, :2].clone().requires_grad_()
    f = lambda y: net(y)[..., 0]  # noqa: E731
    params = [x, *net.parameters()]
    unused = {"allow_unused": True, "materialize_grads": True}  # the last bias: a shift
    got = torch.autograd.grad(OPERATORS[operator](f, x).pow(2).sum(), params, **unused)
    expected = torch.autograd.grad(REFERENCES[operator](f, x).pow(2).sum(), params, **unused)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-10)


def test_the_bilaplacian_estimator_is_unbiased_and_reproducible():
    x = point("cpu")
    exact = nested_bilaplacian(_mlp, x)
    estimate = pyhvp.bilaplacian(_mlp, x, method="hutchinson", samples=20000,
                                 generator=torch.Generator().manual_seed(0), backend=EAGER)  # fmt: skip
    again = pyhvp.bilaplacian(_mlp, x, method="hutchinson", samples=20000,
                              generator=torch.Generator().manual_seed(0), backend=EAGER)  # fmt: skip
    assert torch.equal(estimate, again)
    relative = ((estimate - exact).norm() / exact.norm()).item()
    assert relative < 0.05, relative


# --- operators nested in operators: exact, or refused -----------------------------------------

QUARTIC = lambda x: (x**4).sum(-1)  # noqa: E731
"""Per instance: Delta f = 12 |x|^2, Delta^2 f = 24 N, d_i^2 Delta f = 24."""

QUINTIC = lambda x: (x**5).sum(-1)  # noqa: E731
"""Per instance: Delta f = 20 sum x_i^3, whose gradient 60 x_i^2 has Laplacians 120."""

NESTED = {
    "laplacian of laplacian": (lambda x: pyhvp.laplacian(lambda y: pyhvp.laplacian(QUARTIC, y), x),
                               lambda x: torch.full(x.shape[:-1], 24.0 * x.shape[-1])),
    "hessian_diagonal of laplacian": (
        lambda x: pyhvp.hessian_diagonal(lambda y: pyhvp.laplacian(QUARTIC, y), x),
        lambda x: torch.full(x.shape, 24.0)),
    "laplacian of a summed hessian_diagonal": (
        lambda x: pyhvp.laplacian(lambda y: pyhvp.hessian_diagonal(QUARTIC, y).sum(-1), x),
        lambda x: torch.full(x.shape[:-1], 24.0 * x.shape[-1])),
    "laplacian of grad_and_laplacian's gradient": (
        lambda x: pyhvp.laplacian(lambda y: pyhvp.grad_and_laplacian(QUARTIC, y).grad, x),
        lambda x: 24 * x),
    "laplacian of an hvp": (
        lambda x: pyhvp.laplacian(lambda y: pyhvp.hvp(QUARTIC, y, torch.ones_like(y)), x),
        lambda x: torch.full(x.shape, 24.0)),
    "directional derivative of a laplacian": (
        lambda x: pyhvp.directional_derivatives(lambda y: pyhvp.laplacian(QUARTIC, y), x,
                                                torch.ones(x.shape[-1], dtype=x.dtype), order=2)[2],
        lambda x: torch.full(x.shape[:-1], 24.0 * x.shape[-1])),
    "laplacian of torch.func.grad of a laplacian": (
        lambda x: pyhvp.laplacian(lambda y: torch.func.grad(
            lambda z: pyhvp.laplacian(QUINTIC, z).sum())(y), x),
        lambda x: torch.full(x.shape, 120.0)),
    "laplacian of torch.func.vmap of a laplacian": (
        lambda x: pyhvp.laplacian(lambda y: torch.func.vmap(
            lambda z: pyhvp.laplacian(QUINTIC, z[None])[0])(y), x),
        lambda x: 120 * x.sum(-1)),
    "laplacian inside torch.func.grad inside laplacian": (
        lambda x: pyhvp.laplacian(lambda y: torch.func.vmap(torch.func.grad(
            lambda z: pyhvp.laplacian(QUARTIC, z[None])[0]))(y).sum(-1), x),
        lambda x: torch.zeros(x.shape[:-1])),
}  # fmt: skip
"""Issue 26: each of these returned zeros before (the inner operator ran under ``no_grad`` on a
detached ``x``, which the outer recorder read as a constant); with a ``torch.func`` transform
between the two, so did the inner operator's record (the transform's unwrapped tensors)."""


@pytest.mark.parametrize("case", NESTED.values(), ids=NESTED.keys())
def test_an_operator_nested_in_another_composes_exactly(case, device):
    nested, closed_form = case
    x = point(device)[:, :3]
    torch.testing.assert_close(nested(x).cpu(), closed_form(x.cpu()).double())


def _tanh_product(x):
    return torch.tanh(x).prod(-1)


def _tanh_product_written_out(x):  # (torch's own derivatives of prod lose digits near 0)
    return torch.tanh(x[..., 0]) * torch.tanh(x[..., 1]) * torch.tanh(x[..., 2])


CUMULATIVE_PRODUCTS = {
    "laplacian of a laplacian": (
        lambda x: pyhvp.laplacian(lambda y: pyhvp.laplacian(_tanh_product, y), x),
        lambda x: nested_bilaplacian(_tanh_product_written_out, x)),
    "third directional derivative of a laplacian": (
        lambda x: pyhvp.directional_derivatives(
            lambda y: pyhvp.laplacian(_tanh_product, y), x,
            torch.ones(3, dtype=x.dtype, device=x.device), order=3)[3],
        lambda x: nested_directional_derivatives(
            lambda y: sum(nested_mixed_partial(_tanh_product_written_out, y, (i, i),
                                               create_graph=True) for i in range(3)),
            x, torch.ones(3), 3)[3]),
    "bilaplacian of a cumprod": (
        lambda x: pyhvp.bilaplacian(lambda y: torch.cumprod(torch.sin(y) + 0.5, -1).sum(-1), x),
        lambda x: nested_bilaplacian(lambda y: (torch.sin(y) + 0.5).cumprod(-1).sum(-1), x)),
    "fourth directional derivative of a cumprod along dim 0 of the event": (
        lambda x: pyhvp.directional_derivatives(
            lambda y: torch.cumprod(y[..., :, None] * y[..., None, :] + 1, -2).sum((-2, -1)),
            x, torch.tensor([1.0, -0.5, 2.0], dtype=x.dtype, device=x.device), order=4)[4],
        lambda x: nested_directional_derivatives(
            lambda y: torch.cumprod(y[..., :, None] * y[..., None, :] + 1, -2).sum((-2, -1)),
            x.cpu(), torch.tensor([1.0, -0.5, 2.0]), 4)[4]),
}  # fmt: skip
"""``cumprod`` had no jet rule: its dense fallback took the whole batch as one instance, refused
past about 90 elements at second order and 12 at fourth -- and the second-order ``prod`` rule's
kernel holds ``cumprod``, so an operator nested in another of order 3 or more (or in a
Laplacian, past 30 instances of 3 variables) over an ``f`` with a product was refused."""


@pytest.mark.parametrize("case", CUMULATIVE_PRODUCTS.values(), ids=CUMULATIVE_PRODUCTS.keys())
def test_cumulative_products_carry_jets_of_any_order_at_any_batch(case, device):
    operator, reference = case
    x = 0.7 * torch.randn(64, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x[0, 0] = 0.0  # a zero factor: exact, no division
    torch.testing.assert_close(operator(x.to(device)).cpu(), reference(x), **tolerance(4))


SEXTIC_SUM = lambda x: (x**6).sum()  # noqa: E731
"""Summed over instances: Delta^2 per instance 360 |x|^2, so the Hessian of the summed
bi-Laplacian is 720 I."""

AROUND = {
    "grad of a laplacian": (
        lambda x: torch.func.grad(lambda y: pyhvp.laplacian(QUARTIC, y).sum())(x),
        lambda x: 24 * x),
    "jvp of grad_and_laplacian's laplacian": (
        lambda x: torch.func.jvp(lambda y: pyhvp.grad_and_laplacian(QUARTIC, y).laplacian, (x,),
                                 (torch.ones_like(x),))[1],
        lambda x: 24 * x.sum(-1)),
    "jacrev of a laplacian (instances independent)": (
        lambda x: torch.func.jacrev(lambda y: pyhvp.laplacian(QUARTIC, y))(x),
        lambda x: torch.eye(len(x), dtype=x.dtype)[..., None] * 24 * x),
    "hessian of a summed bilaplacian": (
        lambda x: torch.func.hessian(lambda y: pyhvp.bilaplacian(
            lambda z: (z**6).sum(-1), y).sum())(x).reshape(x.numel(), x.numel()),
        lambda x: 720 * torch.eye(x.numel(), dtype=x.dtype)),
    "vmap of a differential operator": (
        lambda x: torch.func.vmap(lambda y: pyhvp.differential_operator(
            QUARTIC, y, {(0, 0): 1.0, (1, 1, 1): 1.0}))(x[None])[0],
        lambda x: 12 * x[..., 0] ** 2 + 24 * x[..., 1]),
    "jacfwd of third directional derivatives": (
        lambda x: torch.func.jacfwd(lambda y: pyhvp.directional_derivatives(
            QUARTIC, y, torch.ones(3, dtype=y.dtype), order=3)[3].sum())(x),
        lambda x: torch.full_like(x, 24.0)),
    "grad of a Hutchinson hessian_diagonal (batched HVPs)": (
        lambda x: torch.func.grad(lambda y: pyhvp.hessian_diagonal(
            QUARTIC, y, method="hutchinson", samples=3).sum())(x),
        lambda x: 24 * x),
    "vmap of hvp with two tangents": (
        lambda x: torch.func.vmap(lambda y: pyhvp.hvp(
            QUARTIC, y, torch.stack([y, torch.ones_like(y)])))(x[None])[0],
        lambda x: 12 * x**2 * torch.stack([x, torch.ones_like(x)])),
    "vmap of a laplacian over an expanded x (stride 0)": (
        lambda x: torch.func.vmap(lambda y: pyhvp.laplacian(QUARTIC, y))(
            x[None].expand(2, *x.shape))[1],
        lambda x: 12 * (x**2).sum(-1)),
    "grad in a captured parameter of a laplacian": (
        lambda x: torch.func.grad(lambda w: pyhvp.laplacian(
            lambda z: ((z * w) ** 4).sum(-1), x).sum())(torch.full_like(x[0], 1.5)),
        lambda x: 48 * 1.5**3 * (x**2).sum(0)),
}  # fmt: skip
"""A ``torch.func`` transform around an operator: its recorder would see the transform's
unwrapped tensors (x and captured tensors constants: zeros, as before), so the operator runs by
nested reverse mode there, which composes; HVPs run their torch.func kernel there (autograd's
batched backward leaked its vmap level into the result, which could not even be printed)."""


@pytest.mark.parametrize("case", AROUND.values(), ids=AROUND.keys())
def test_an_operator_inside_a_torch_func_transform_is_differentiated(case, device):
    transformed, closed_form = case
    x = point(device)[:, :3]
    torch.testing.assert_close(transformed(x).cpu(), closed_form(x.cpu()))


def _attention(x):
    """Attention over 2 tokens of 2 features per instance."""
    q = x[..., :4].reshape(-1, 1, 2, 2)
    return F.scaled_dot_product_attention(q, q.sin(), q.cos()).pow(2).sum((-3, -2, -1))


def _laplacian_gradient(x):
    y = x.detach().requires_grad_()
    return torch.autograd.grad(pyhvp.laplacian(_attention, y).sum(), y)[0]


V = torch.tensor([0.3, -1.0, 0.7, 0.2, 0.0, 0.0], dtype=torch.float64)
ATTENTION_AROUND = {  # a transform around an operator of attention, and the operator outside it
    "grad of a laplacian": (
        lambda x: torch.func.grad(lambda y: pyhvp.laplacian(_attention, y).sum())(x),
        _laplacian_gradient),
    "vmap of a laplacian": (
        lambda x: torch.func.vmap(lambda y: pyhvp.laplacian(_attention, y))(x[None])[0],
        lambda x: pyhvp.laplacian(_attention, x)),
    "vmap of a bilaplacian": (
        lambda x: torch.func.vmap(lambda y: pyhvp.bilaplacian(_attention, y))(x[None])[0],
        lambda x: pyhvp.bilaplacian(_attention, x)),
    "vmap of directional derivatives": (
        lambda x: torch.func.vmap(lambda y: pyhvp.directional_derivatives(
            _attention, y, V.to(y), order=3))(x[None])[0],
        lambda x: pyhvp.directional_derivatives(_attention, x, V.to(x), order=3)),
}  # fmt: skip


@pytest.mark.parametrize("case", ATTENTION_AROUND.values(), ids=ATTENTION_AROUND.keys())
def test_attention_inside_an_operator_inside_a_transform_takes_its_math_path(case, device):
    """The nested reverse mode ran ``f`` with attention's fused kernel, which has no second
    derivative ("derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is
    not implemented"); the record runs it on the math path, as now the nested mode does."""
    transformed, outside = case
    x = point(device)
    torch.testing.assert_close(transformed(x), outside(x))


def _matrix(x):
    return x[..., :4].reshape(*x.shape[:-1], 2, 2) + 2 * torch.eye(2, dtype=x.dtype)


WEIGHTS = torch.tensor([0.5, -1.0, 2.0, 0.3], dtype=torch.float64)
TORCH_GETS_WRONG_NESTED = {
    "layer_norm (reverse, from the third order)": (
        lambda x: F.layer_norm(x[..., :4], (4,)) @ WEIGHTS.to(x), 4),
    "group_norm (its batched double backward fails)": (
        lambda x: F.group_norm(x[..., :4].reshape(-1, 2, 2), 1).reshape(-1, 4) @ WEIGHTS.to(x), 3),
    "instance_norm (wrong under vmap)": (
        lambda x: F.instance_norm(x[..., :4].reshape(-1, 2, 2)).reshape(-1, 4) @ WEIGHTS.to(x), 2),
    "det (forward over forward)": (lambda x: torch.linalg.det(_matrix(x)), 2),
    "slogdet (forward over forward)": (lambda x: torch.linalg.slogdet(_matrix(x))[1], 4),
    "cholesky_inverse (forward over forward)": (
        lambda x: torch.cholesky_inverse(torch.linalg.cholesky(_matrix(x) @ _matrix(x).mT)).sum(
            (-2, -1)), 3),
}  # fmt: skip
"""f, and the order whose directional derivative inside ``vmap`` was silently wrong: torch
2.13's nested forward mode and its higher reverse-mode derivatives of these ops are wrong."""


@pytest.mark.parametrize("case", TORCH_GETS_WRONG_NESTED.values(),
                         ids=TORCH_GETS_WRONG_NESTED.keys())  # fmt: skip
def test_inside_vmap_ops_torch_differentiates_wrongly_nested_give_the_operators_value(case):
    f, order = case
    x, v = point("cpu")[:, :4] + 0.5, torch.tensor([0.3, -1.0, 0.7, 0.2], dtype=torch.float64)
    outside = pyhvp.directional_derivatives(f, x, v, order=order)[order]
    inside = torch.func.vmap(lambda y: pyhvp.directional_derivatives(f, y, v, order=order)[order])
    torch.testing.assert_close(inside(x[None])[0], outside)


SCALES = torch.tensor([1.0, 2.0, -0.5, 1.5], dtype=torch.float64)


def _standardised(z, dim):
    centred = z - z.mean(dim, keepdim=True)
    return centred / ((centred * centred).mean(dim, keepdim=True) + 1e-5).sqrt()


def _differences(x):
    """Two points in the plane from x's first entries, each less each: (2, 2, 2), zero vectors on
    the diagonal (a pair potential's self-pairs)."""
    points = (x[:4] * SCALES.to(x)).reshape(2, 2)
    return points[:, None] - points[None]


def _apart(x):
    return _differences(x)[0, 1]


def _saturating(r):
    return r / (1 + r)


TORCH_GETS_WRONG_UNDER_GRAD = {
    "batch_norm in training, of the instance's own entries": (
        lambda x: F.batch_norm(x[:4].reshape(4, 1) * SCALES.to(x)[:, None], None, None,
                               training=True).exp().sum(),
        lambda x: _standardised(x[:4] * SCALES.to(x), 0).exp().sum()),
    "logcumsumexp (NaN)": (
        lambda x: torch.logcumsumexp(x[:4] * SCALES.to(x), -1)[1:].sum(),
        lambda x: sum(torch.logsumexp(x[: i + 1] * SCALES.to(x)[: i + 1], -1) for i in (1, 2, 3))),
    "layer_norm (third order)": (
        lambda x: F.layer_norm(x[:4], (4,)).pow(3).sum(),
        lambda x: _standardised(x[:4], -1).pow(3).sum()),
    "vector_norm of zero vectors (NaN)": (
        lambda x: _saturating(torch.linalg.vector_norm(_differences(x), dim=-1)).sum(),
        lambda x: 2 * _saturating(_apart(x).pow(2).sum().sqrt())),
    "Tensor.norm, p = 3, of zero vectors (NaN)": (
        lambda x: _saturating(_differences(x).norm(p=3, dim=-1)).sum(),
        lambda x: 2 * _saturating(_apart(x).abs().pow(3).sum().pow(1 / 3))),
    "cdist of points and themselves (no double backward)": (
        lambda x: _saturating(torch.cdist(_differences(x)[0], _differences(x)[0])).sum(),
        lambda x: 2 * _saturating(_apart(x).pow(2).sum().sqrt())),
    "cdist, p = 1.5 (NaN on either path)": (
        lambda x: _saturating(torch.cdist(_differences(x)[0], _differences(x)[0], p=1.5)).sum(),
        lambda x: 2 * _saturating(_apart(x).abs().pow(1.5).sum().pow(1 / 1.5))),
    "vector_norm over dim=(), every dim": (
        lambda x: x[:4].sum() * torch.linalg.vector_norm(x[:4] * SCALES.to(x), 3, dim=()),
        lambda x: x[:4].sum() * (x[:4] * SCALES.to(x)).abs().pow(3).sum().pow(1 / 3)),
    "normalize over a tuple of dims": (
        lambda x: F.normalize(x[:4].reshape(2, 2), dim=(-2, -1)).pow(3).sum(),
        lambda x: (x[:4] / x[:4].pow(2).sum().sqrt()).pow(3).sum()),
    "normalize of zero vectors (NaN)": (
        lambda x: F.normalize(_differences(x), dim=-1)[..., 0].exp().sum(),
        lambda x: (_apart(x)[0] / _apart(x).pow(2).sum().sqrt()).cosh() * 2 + 2),
}  # fmt: skip
"""f of one instance whose derivatives torch gets wrong (or NaN) from the third order on, or
cannot take (``cdist``'s second), and f written out in elementary ops: a ``grad`` around a
second-order operator of f reaches the third (1 to 95 off, or NaN). A norm of a zero vector has
zero derivatives of every order (the Taylor engine's convention), so the written-out f leaves the
zero vectors out."""
SECOND_ORDER = {
    "directional derivative": lambda f, x: pyhvp.directional_derivatives(
        f, x, V.to(x), order=2)[2],
    "laplacian": pyhvp.laplacian,
    "hvp": lambda f, x: pyhvp.hvp(f, x, V.to(x)).sum(),
    "hessian_diagonal": lambda f, x: pyhvp.hessian_diagonal(f, x).sum(),
}  # fmt: skip


@pytest.mark.parametrize("operator", SECOND_ORDER.values(), ids=SECOND_ORDER.keys())
@pytest.mark.parametrize("f", TORCH_GETS_WRONG_UNDER_GRAD.values(),
                         ids=TORCH_GETS_WRONG_UNDER_GRAD.keys())  # fmt: skip
def test_grad_around_an_operator_of_ops_torch_differentiates_wrongly_nested_is_the_written_outs(
    f, operator
):
    """The nested reverse mode differentiated these ops by torch's rules (the HVPs did not
    write them out at all): ``torch.func.grad`` of the operator now equals autograd's gradient
    of the operator of f written out."""
    f, written_out = f
    x = point("cpu")[0].requires_grad_()
    (expected,) = torch.autograd.grad(operator(written_out, x), x)
    torch.testing.assert_close(torch.func.grad(lambda y: operator(f, y))(x.detach()), expected)


OUTSIDE_TRANSFORMS = [
    pytest.param(
        case, operator, id=f"{name}-{label}",
        marks=[pytest.mark.xfail(strict=True, reason=(
            "left to torch (the per-instance guide): its third derivative of logcumsumexp is "
            "NaN, and writing it out costs n x n per row"))] if (name, label) == (
            "logcumsumexp (NaN)", "hvp") else [],
    )
    for name, case in TORCH_GETS_WRONG_UNDER_GRAD.items()
    for label, operator in SECOND_ORDER.items()
]  # fmt: skip


@pytest.mark.parametrize(("f", "operator"), OUTSIDE_TRANSFORMS)
def test_the_gradient_of_an_operator_of_ops_torch_differentiates_wrongly_is_the_written_outs(
    f, operator
):
    """Outside transforms, autograd differentiates the operator's result: the HVPs' eager
    kernel is autograd's double backward, whose derivative torch got wrong (45 off through
    ``layer_norm``); its f now runs with the norms written out where the result carries
    derivatives, and the Taylor engine writes out ``logcumsumexp`` (NaN before)."""
    f, written_out = f
    x = point("cpu")[0].requires_grad_()
    (expected,) = torch.autograd.grad(operator(written_out, x), x)
    torch.testing.assert_close(torch.autograd.grad(operator(f, x), x)[0], expected)


def test_a_cdist_of_data_inside_a_transform_is_left_to_torch(monkeypatch):
    """Written out, a cdist builds its ``(P, R, M)`` differences: for one of data, which carries
    no derivatives, that took 12x the memory and 190x the time of torch's own (3000 x 500
    points of 256 dims: 4.8 GB)."""
    written = []
    monkeypatch.setattr(nested, "zero_safe_norm", lambda *a: written.append(a))
    data = torch.randn(30, 4, dtype=torch.float64)

    def f(y):
        return (y**3).sum() * torch.exp(-torch.cdist(data, data[:5])).mean()

    torch.func.grad(lambda y: pyhvp.laplacian(f, y))(point("cpu")[0])
    assert written == []


ZERO_VECTORS = {
    **{name: case for name, case in TORCH_GETS_WRONG_UNDER_GRAD.items()
       if "zero vectors" in name or "cdist" in name},
    "cdist, p = 1, of points and themselves": (
        lambda x: _saturating(torch.cdist(_differences(x)[0], _differences(x)[0], p=1)).sum(),
        lambda x: 2 * _saturating(_apart(x).abs().sum())),
}  # fmt: skip
"""f with zero vectors under a norm or a ``cdist`` (a pair potential's self-pairs), and f
written out."""
PLAIN_SECOND_ORDER = {  # an x that carries no derivatives: autograd's double backward
    "hvp": lambda f, x: pyhvp.hvp(f, x, V.to(x), backend=EAGER),
    "hvp of three tangents": lambda f, x: pyhvp.hvp(f, x, V.to(x).expand(3, 6),
                                                    backend=EAGER)[1],
    "hvp, compile=True": lambda f, x: pyhvp.hvp(f, x, V.to(x), backend=TorchBackend(compile=True)),
    **{f"sub_hessian {method}": lambda f, x, method=method: pyhvp.sub_hessian(
        f, x, torch.arange(6), method=method) @ V.to(x) for method in ("auto", "reverse")},
}  # fmt: skip


@pytest.mark.parametrize("call", PLAIN_SECOND_ORDER.values(), ids=PLAIN_SECOND_ORDER.keys())
@pytest.mark.parametrize("f", ZERO_VECTORS.values(), ids=ZERO_VECTORS.keys())
def test_zero_vectors_under_a_norm_give_the_written_out_second_derivatives(f, call):
    """Autograd's double backward of a vector norm is NaN at a zero vector, and ``cdist`` has
    none: the HVPs and sub-Hessians of a pair potential over every pair (its self-distances 0)
    were NaN or raised on the routes that differentiate by autograd (until 2026-12-08; the
    Taylor operators and the calls inside transforms had them right). Each norm's and cdist's
    node now differentiates by its written-out slope; a compiled kernel, which would take
    torch's, is declined without a word. Against the written-out f's dense Hessian."""
    f, written_out = f
    x = point("cpu")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the compiled kernel's disagreement is not one)
        got = [call(f, x) for _ in range(3)][-1]  # (compile=True: the first runs check)
    torch.testing.assert_close(got, torch.func.hessian(written_out)(x) @ V)


MOVING_ZERO_VECTORS = {
    "vector_norm(x - c) ** 2 at x = c": lambda y: torch.exp(
        -torch.linalg.vector_norm(y - 1.0, dim=-1) ** 2),
    "cdist of two points at one place": lambda y: (
        torch.cdist(y.reshape(2, 3), y.reshape(2, 3)) ** 2).sum() / 2,
}  # fmt: skip


@pytest.mark.parametrize("call", PLAIN_SECOND_ORDER.values(), ids=PLAIN_SECOND_ORDER.keys())
@pytest.mark.parametrize("f", MOVING_ZERO_VECTORS.values(), ids=MOVING_ZERO_VECTORS.keys())
def test_a_zero_vector_that_moves_under_a_norm_gives_nan_not_a_plausible_zero(f, call):
    """Where the zero vector moves with x, the second derivative (``g'(N) / N``, 2 for ``N **
    2``) is one reverse mode cannot reach: the written-out slope's convention alone read it as
    0 (its HVPs 0 where they are -2 v), so such a vector's derivative is autograd's NaN."""
    x = torch.ones(6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [call(f, x) for _ in range(3)][-1]
    assert got.isnan().any()


MADE_THROUGH_WRITTEN_OUT_NODES = {
    "a norm": lambda z: z * z.norm(dim=-1, keepdim=True),
    "x.sinc()": lambda z: z.sinc(),
    "cdist": lambda z: torch.cdist(z, z),
}  # fmt: skip


@pytest.mark.parametrize("make", MADE_THROUGH_WRITTEN_OUT_NODES.values(),
                         ids=MADE_THROUGH_WRITTEN_OUT_NODES.keys())  # fmt: skip
def test_an_x_whose_graph_a_backward_freed_has_its_hvp(make):
    """The graph walk reads the saved input of each node it writes out: where the caller's
    backward had freed them (no ``retain_graph``), the HVP of such an ``x`` raised "Trying to
    backward through the graph a second time" (sinc since 2026-12-07, norms and cdist
    2026-12-08). Nothing differentiates through a freed graph again: it is left alone."""
    z = torch.tensor([[0.3, -1.2], [0.5, 0.1]], dtype=torch.float64, requires_grad=True)
    x = make(z)
    x.sum().backward()
    got = pyhvp.hvp(lambda y: (y**3).sum(-1), x, torch.ones_like(x))
    torch.testing.assert_close(got.detach(), 6 * x.detach())


WRITTEN_OUT_SLOPES = {  # the function each node's written-out backward calls once per run
    "a norm": (pyhvp._vector_norms, "pulled_back"),
    "x.sinc()": (pyhvp._sinc, "sinc_slope_written_out"),
    "cdist": (pyhvp._vector_norms, "pulled_back"),
}  # fmt: skip


@pytest.mark.parametrize("name", MADE_THROUGH_WRITTEN_OUT_NODES)
def test_a_node_in_the_callers_graph_gets_one_written_out_backward(name, monkeypatch):
    """The graph walk of every call reaches a sinc, norm or cdist the caller computed ``x``
    with: its node is hooked once, not once per call (each hook recomputed the slope in the
    caller's own backward)."""
    module, attribute = WRITTEN_OUT_SLOPES[name]
    calls = []
    written_out = getattr(module, attribute)
    monkeypatch.setattr(module, attribute, lambda *a: calls.append(a) or written_out(*a))
    z = torch.tensor([[0.3, -1.2], [0.0, 0.0]], requires_grad=True)
    x = MADE_THROUGH_WRITTEN_OUT_NODES[name](z)
    for _ in range(3):
        pyhvp.hvp(lambda y: (y**3).sum(-1), x, torch.ones_like(x))
    x.sum().backward(create_graph=True)
    assert len(calls) == 1


DIFFERENTIATED_THRICE = {
    "hvp inside grad": lambda f, x: torch.func.grad(lambda y: pyhvp.hvp(
        f, y, torch.ones_like(y)).sum())(x),
    "order 3 inside vmap": lambda f, x: torch.func.vmap(lambda y: pyhvp.directional_derivatives(
        f, y, torch.ones(4, dtype=y.dtype), order=3)[3])(x[None]),
    "order 2 inside grad": lambda f, x: torch.func.grad(lambda y: pyhvp.directional_derivatives(
        f, y, torch.ones(4, dtype=y.dtype), order=2)[2].sum())(x),
    "a laplacian inside vmap inside a laplacian's f": lambda f, x: pyhvp.laplacian(
        lambda z: torch.func.vmap(lambda y: pyhvp.laplacian(f, y))(z[None])[0], x),
}  # fmt: skip
"""Torch's third reverse-mode derivative of ``det`` is wrong (NaN or plausible numbers where
``grad`` or an outer operator added the third order): the order counts the transforms and the
operator around too."""


@pytest.mark.parametrize("call", DIFFERENTIATED_THRICE.values(), ids=DIFFERENTIATED_THRICE.keys())
def test_inside_a_transform_a_determinant_differentiated_thrice_is_refused(call):
    f, x = TORCH_GETS_WRONG_NESTED["det (forward over forward)"][0], point("cpu")[:, :4]
    with pytest.raises(NotImplementedError, match=r"determinant[\s\S]*outside the transform"):
        call(f, x)


DUAL = {
    "laplacian": (lambda x: pyhvp.laplacian(QUARTIC, x), lambda x: 24 * x.sum(-1)),
    "bilaplacian": (lambda x: pyhvp.bilaplacian(lambda z: (z**6).sum(-1), x),
                    lambda x: 720 * x.sum(-1)),
    "hvp": (lambda x: pyhvp.hvp(QUARTIC, x, torch.ones_like(x)), lambda x: 24 * x),
    "hessian_diagonal, hutchinson": (
        lambda x: pyhvp.hessian_diagonal(QUARTIC, x, method="hutchinson", samples=3),
        lambda x: 24 * x),
}  # fmt: skip
"""Forward-mode AD (``torch.autograd.forward_ad``) around an operator, along ones: the result's
tangent (None before: the kernels ran detached, or on detached aliases)."""


@pytest.mark.parametrize("case", DUAL.values(), ids=DUAL.keys())
def test_an_operator_carries_forward_mode_tangents(case, device):
    operator, closed_form = case
    x = point(device)[:, :3]
    with torch.autograd.forward_ad.dual_level():
        out = operator(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))
        tangent = torch.autograd.forward_ad.unpack_dual(out).tangent
    torch.testing.assert_close(tangent.detach().cpu(), closed_form(x.cpu()))


def test_a_nested_julia_call_is_refused_not_read_as_a_constant():
    """The julia backend's result is opaque to the recorder: refused before Julia starts (the
    backend object is made without starting it, so this runs where Julia does not)."""
    from pyhvp.backends.julia import JuliaBackend

    julia = object.__new__(JuliaBackend)
    jf = pyhvp.julia_function("x -> sum(abs2, x)")
    with pytest.raises(ValueError, match="inside f of a Taylor-engine operator"):
        pyhvp.laplacian(lambda y: pyhvp.hvp(jf, y, y, backend=julia), point("cpu"))


def test_a_second_order_rule_falls_back_above_second_order(monkeypatch):
    """A rule that gives two derivatives (pyhvp.taylor.chain) is not used at fourth order: the
    engine's exact fallback carries the op there (sinh's, a pointwise op's: autograd's own
    elementwise derivatives)."""
    from pyhvp.taylor import registry

    def second_order_only(ctx, out, u):
        return pyhvp.taylor.chain(ctx, out, u, torch.cosh(u.value), out)

    monkeypatch.setitem(registry.RULES, torch.ops.aten.sinh.default, second_order_only)
    x = point("cpu")
    f = lambda y: torch.sinh(y).sum(-1)  # noqa: E731
    got = pyhvp.directional_derivatives(f, x, torch.ones(6, dtype=x.dtype), order=4,
                                        backend=EAGER)  # fmt: skip
    torch.testing.assert_close(got, nested_directional_derivatives(f, x, torch.ones(6), 4),
                               **tolerance(4))  # fmt: skip


def test_a_second_order_rule_without_a_fallback_is_refused_by_name():
    """A custom op with a second-order rule and an autograd formula that torch.func cannot
    transform: at fourth order the refusal names the op, the order and its rule's limit
    (``softsign`` of the engine's specs: a rule of second order only, no autograd formula)."""
    with pytest.raises(pyhvp.UnsupportedOpError, match=r"softsign.*order 4.*its jet rule"):
        pyhvp.directional_derivatives(lambda y: softsign(y).sum(-1), point("cpu"),
                                      torch.ones(6, dtype=torch.float64), order=4, backend=EAGER)  # fmt: skip


REFUSALS = {
    "order 0": (lambda x: pyhvp.directional_derivatives(QUARTIC, x, x, order=0),
                ValueError, "order must be an int >= 1"),
    "v of another shape": (lambda x: pyhvp.directional_derivatives(QUARTIC, x, x[0, :2], order=3),
                           ValueError, r"v must have x's shape \(3, 6\)"),
    "terms not a mapping": (lambda x: pyhvp.differential_operator(QUARTIC, x, [(0, 0)]),
                            TypeError, "terms must be a non-empty mapping"),
    "a variable out of range": (lambda x: pyhvp.differential_operator(QUARTIC, x, {(0, 6): 1.0}),
                                ValueError, r"variable indices in \[0, 6\)"),
    "a coefficient that is not a number": (
        lambda x: pyhvp.differential_operator(QUARTIC, x, {(0,): "1"}),
        TypeError, "must be a finite real number"),
    "hutchinson without samples": (lambda x: pyhvp.bilaplacian(QUARTIC, x, method="hutchinson"),
                                   ValueError, "samples must be an int >= 1"),
    "an unknown method": (lambda x: pyhvp.bilaplacian(QUARTIC, x, method="hutch++"),
                          ValueError, r"method must be one of \['exact', 'hutchinson'\]"),
    "the dense fallback past order 4": (
        lambda x: pyhvp.directional_derivatives(CASES["eigvalsh (general fallback)"], x, x,
                                                order=6, backend=EAGER),
        pyhvp.UnsupportedOpError, "goes to order 4 only"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSALS.values(), ids=REFUSALS.keys())
def test_bad_input_is_refused_with_its_name(case):
    call, error, message = case
    with pytest.raises(error, match=message):
        call(point("cpu"))


@pytest.mark.slow
def test_the_sixth_derivative_of_a_network_along_an_axis():
    """Order 6 along e_0 of a tanh network: one jet of order six."""
    net = _plate()
    x = point("cpu", batch=4)[:, :2]
    f = lambda y: net(y)[..., 0]  # noqa: E731
    got = pyhvp.directional_derivatives(f, x, torch.tensor([1.0, 0.0], dtype=x.dtype), order=6,
                                        backend=EAGER)  # fmt: skip
    expected = nested_mixed_partial(f, x, (0,) * 6)
    assert math.isfinite(got[6].abs().max().item())
    torch.testing.assert_close(got[6], expected, **tolerance(6))


# --- an inner HVP whose f reads the outer operator's variable through a closure ---------------

CUBE_OF_DOT = lambda z, a: (z * a).sum(-1) ** 3  # noqa: E731


def _closure_case():
    g = torch.Generator().manual_seed(5)
    y, z0, v = (torch.randn(3, 2, generator=g, dtype=torch.float64) for _ in range(3))

    def inner(y):  # a scalar per instance: sum_i (H_z h(z0, y) v)_i, y read by closure only
        return pyhvp.hvp(lambda z: CUBE_OF_DOT(z, y), z0, v).sum(-1)

    def reference(yb, zb, vb):  # the same for one instance, by torch.func
        return (torch.func.hessian(lambda z: CUBE_OF_DOT(z, yb))(zb) @ vb).sum()

    hessians = torch.func.vmap(
        lambda yb, zb, vb: torch.func.hessian(lambda a: reference(a, zb, vb))(yb)
    )(y, z0, v)
    return y, v, inner, hessians


def test_an_hvp_of_a_function_whose_inner_hvp_captures_the_variable_is_exact():
    """The inner HVP ran detached (no input of its own required grad), so the outer HVP, which
    reads what it cannot reach as zero, returned zeros: so did a Hutchinson diagonal and a
    sub-Hessian over a tensor the inner f captured."""
    y, v, inner, hessians = _closure_case()
    torch.testing.assert_close(pyhvp.hvp(inner, y, v), torch.einsum("bij,bj->bi", hessians, v))
    w = y[0].clone()
    z0 = torch.ones(3, 2, dtype=torch.float64)
    loss = lambda p: pyhvp.hvp(lambda z: CUBE_OF_DOT(z, p), z0, z0).sum()  # noqa: E731
    expected = pyhvp.sub_hessian(lambda p: pyhvp.hvp(CUBE_OF_DOT, z0, z0, p.expand(3, 2)).sum(),
                                 w, torch.arange(2))  # fmt: skip
    torch.testing.assert_close(pyhvp.sub_hessian(loss, w, torch.arange(2)), expected)
    assert expected.abs().max() > 1


@pytest.mark.parametrize("method", ["auto", "reverse", "sparse"])
@pytest.mark.parametrize("inner", ["hutch++", "exact"])
def test_a_sub_hessian_of_a_pinn_loss_over_the_parameters_its_laplacian_captures(inner, method):
    """A PINN loss over functional_call's parameters, its Laplacian by HVPs (hutch++, exact on
    a rank-2 Hessian): the sub-Hessian was zero on the reverse routes (the inner HVPs ran
    detached); the Taylor-engine Laplacian must keep its sparse route."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
    ).double()
    points = torch.randn(6, 2, dtype=torch.float64)
    params = {k: p.detach().clone() for k, p in net.named_parameters()}
    index = {"0.weight": torch.tensor([0, 3, 7])}
    samples = {"samples": 6} if inner == "hutch++" else {}

    def loss(p):
        u = lambda y: torch.func.functional_call(net, p, (y,))[..., 0]  # noqa: E731
        return (pyhvp.laplacian(u, points, method=inner, **samples) ** 2).mean()

    def reference(w):
        u = lambda y: torch.func.functional_call(net, {**params, "0.weight": w.reshape(5, 2)},  # noqa: E731
                                                 (y[None],))[0, 0]  # fmt: skip
        return (
            torch.func.vmap(lambda y: torch.trace(torch.func.hessian(u)(y)))(points) ** 2
        ).mean()

    dense = torch.func.hessian(reference)(params["0.weight"].flatten())
    expected = dense[index["0.weight"]][:, index["0.weight"]]
    got = pyhvp.sub_hessian(loss, params, index, method=method)["0.weight"]
    torch.testing.assert_close(got, expected)
    assert expected.abs().max() > 0.01


HIGHER_ORDER_OPERATORS = {
    "bilaplacian": lambda f, x: pyhvp.bilaplacian(f, x),
    "directional_derivatives": lambda f, x: pyhvp.directional_derivatives(
        f, x, torch.ones(3, device=x.device), order=3
    ),
    "differential_operator": lambda f, x: pyhvp.differential_operator(f, x, {(0, 1, 1): 1.0}),
}


@pytest.mark.parametrize("name", HIGHER_ORDER_OPERATORS)
def test_a_refusal_of_the_taylor_engine_names_the_higher_order_operator_called(name, device):
    """The engine's refusals (here of a complex intermediate) listed laplacian,
    grad_and_laplacian and hessian_diagonal as its operators, not the bi-Laplacian, directional
    derivatives or differential operator the user had called."""
    x = torch.randn(4, 3, device=device)
    with pytest.raises(TypeError, match="complex intermediates") as raised:
        HIGHER_ORDER_OPERATORS[name](lambda y: torch.fft.fft(y).abs().sum(-1), x)
    assert name in str(raised.value)


@pytest.mark.parametrize("order", [5, 6])
def test_values_of_one_instance_stacked_have_their_high_order_derivatives(order):
    """Unbatched x: ``stack`` of 0-d values, whose jets went to the dense fallback, which stops
    at order 4 ("aten.stack.default has no jet rule of order 5"); its rule holds for them."""
    x = torch.linspace(-0.5, 0.7, 3, dtype=torch.float64)
    v = torch.tensor([1.0, 0.5, -0.2], dtype=torch.float64)

    def f(x):
        return torch.stack([x[..., 0] * x[..., 2], torch.sin(x[..., 1])], -1).pow(3).sum(-1)

    got = pyhvp.directional_derivatives(f, x, v, order=order)
    torch.testing.assert_close(got, nested_directional_derivatives(f, x, v, order, event_dims=1))
