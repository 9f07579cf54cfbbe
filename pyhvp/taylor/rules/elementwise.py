"""Elementwise functions ``y = g(u)`` by their derivatives of any order, and elementwise
selection (``where``, ``masked_fill``, dropout)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import cast

import torch

from pyhvp.taylor.fallbacks import elementwise_derivatives
from pyhvp.taylor.jets import (
    Context,
    Jet,
    chain,
    coefficient_of,
    faa_di_bruno,
    linear,
)
from pyhvp.taylor.registry import RULES, Rule, rule

aten = torch.ops.aten
Tensor = torch.Tensor


Derivatives = Callable[..., Sequence[Tensor | None]]
"""``(u, y, *op_args, order=K) -> [g'(u), ..., g^(K)(u)]`` of an elementwise ``y = g(u)`` (more
than K are allowed; ``None``: zero)."""


def _unary(derivatives: Derivatives) -> Rule:
    """The rule of an elementwise op whose only tensor input is the first."""

    def unary_rule(ctx: Context, out: Tensor, u: Jet, *args: object, **kwargs: object) -> Jet:
        return chain(ctx, out, u, *derivatives(u.value, out, *args, order=ctx.order, **kwargs))

    return unary_rule


def _periodic(*cycle: Callable[[Tensor, Tensor], Tensor]) -> Derivatives:
    """Derivatives that repeat with the cycle's period (``sin``: cos, -sin, -cos, sin)."""

    def derivatives(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
        made = [f(u, y) for f in cycle[: min(order, len(cycle))]]
        return [made[j % len(cycle)] for j in range(order)]

    return derivatives


def _scaled(base: Derivatives, factor: Callable[[int], float]) -> Derivatives:
    """``base``'s j-th derivative times ``factor(j)``."""

    def derivatives(u: Tensor, y: Tensor, *args: object, order: int) -> Sequence[Tensor | None]:
        return [None if d is None else d * factor(j + 1)
                for j, d in enumerate(base(u, y, *args, order=order))]  # fmt: skip

    return derivatives


def _exp(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    return [y] * order


def _expm1(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    return [y + 1] * order


def _log(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    """``(-1)^(j-1) (j-1)! / u^j``."""
    if order <= 2:  # (the second-order kernel's own forms)
        return [1 / u, -1 / (u * u)][:order]
    inverse = 1 / u
    return [(-1) ** (j - 1) * math.factorial(j - 1) * inverse**j for j in range(1, order + 1)]


def _log1p(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    return _log(1 + u, y, order=order)


def _falling(p: float, j: int) -> float:
    """``p (p - 1) ... (p - j + 1)``."""
    return math.prod(p - i for i in range(j))


def _power_of_root(root: Tensor, exponent: float, order: int) -> Sequence[Tensor | None]:
    """Derivatives of ``u^p = root^(2p)`` for ``root = sqrt(u)`` (sqrt, rsqrt): ``(p)_j
    root^(2 (p - j))``, in powers of ``root``, finite where ``u`` is."""
    return [_falling(exponent, j) * root ** (2 * (exponent - j)) for j in range(1, order + 1)]


def _polynomial(derivative: Sequence[float], fast: Callable[[Tensor], tuple[Tensor, Tensor]],
                slope: Callable[[Tensor, Tensor], Tensor] | None = None) -> Derivatives:  # fmt: skip
    """Derivatives of a ``y`` whose derivative is a polynomial ``P`` in ``y`` (coefficients from
    the constant up): ``g^(j+1) = P_j'(y) P(y)`` with ``P_1 = P``, each ``P_j'`` a polynomial in
    ``y`` made once per order and evaluated by Horner's rule, times ``g' = P(y)`` (tanh:
    ``1 - y^2``, sigmoid: ``y - y^2``, tan: ``1 + y^2``). ``slope(u, y)``: ``g'`` without the
    cancellation of ``P(y)`` where ``P`` has a root that ``y`` nears (a saturated tanh or
    sigmoid, ``y`` within rounding of 1): the ``P_j'`` do not vanish there, so every order keeps
    ``g'``'s relative accuracy. Before, each ``g^(j)`` was a polynomial in ``y`` whose terms
    cancelled there: in float32 the sixth derivative of tanh at 9 was 31 times its value, and
    that of a two-layer MLP of sigmoids or SiLUs 2e-4 of its largest value off (now 4e-6 at
    most; autograd's 4e-7). ``fast(y)``: ``g'`` and ``g''`` in the fewest ops, for the
    second-order kernels (autograd's own forms)."""

    def derivatives(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
        if order <= 2:
            return list(fast(y))[:order]
        first = _horner(derivative, y) if slope is None else slope(u, y)
        return [first] + [_horner(p, y) * first
                          for p in _derivative_slopes(tuple(derivative), order)]  # fmt: skip

    return derivatives


@functools.cache
def _derivative_slopes(derivative: tuple[float, ...], order: int) -> list[list[float]]:
    """``P_1', ..., P_(order-1)'`` for ``P_1 = P``, ``P_(j+1) = P_j' P``."""
    polynomial, slopes = list(derivative), []
    for _ in range(order - 1):
        slopes.append([i * c for i, c in enumerate(polynomial)][1:])
        polynomial = [0.0] * max(len(slopes[-1]) + len(derivative) - 1, 1)
        for i, a in enumerate(slopes[-1]):
            for j, b in enumerate(derivative):
                polynomial[i + j] += a * b
    return slopes


def _horner(coefficients: Sequence[float], y: Tensor) -> Tensor:
    """``sum_i c_i y^i`` by Horner's rule."""
    c = list(coefficients)
    while c and c[-1] == 0:
        c.pop()
    if not c:
        return torch.zeros_like(y)
    result: Tensor | float = c[-1]
    for a in reversed(c[:-1]):
        result = y if isinstance(result, float) and result == 1 else result * y
        if a != 0:
            result = result + a
    return result if isinstance(result, Tensor) else torch.full_like(y, result)


def _and_next(d1: Tensor, factor: Tensor) -> tuple[Tensor, Tensor]:
    """``(d1, d1 * factor)``: ``g'`` computed once where ``g'' = g' * factor`` (tanh: ``1 - y^2``
    and ``-2 y (1 - y^2)``; the eager kernel would otherwise compute ``g'`` twice)."""
    return d1, d1 * factor


def _by_autograd(op: torch._ops.OpOverload, first: Derivatives) -> Derivatives:
    """Closed forms up to second order (``first``), higher orders by autograd's own derivatives
    of the op (``grad`` of ``grad``, elementwise: the op maps each element alone)."""

    def derivatives(u: Tensor, y: Tensor, *args: object, order: int,
                    **kwargs: object) -> Sequence[Tensor | None]:  # fmt: skip
        low = list(first(u, y, *args, order=min(order, 2), **kwargs))
        if order <= 2:
            return low
        higher = elementwise_derivatives(lambda t: cast(Tensor, op(t, *args, **kwargs)), u, order)
        return low + list(higher[2:])

    return derivatives


def _hermite(u: Tensor, order: int) -> list[Tensor]:
    """Probabilists' Hermite polynomials ``He_0..He_order`` at ``u``: ``phi^(m) = (-1)^m He_m
    phi`` for the standard normal density ``phi``."""
    polynomials = [torch.ones_like(u), u]
    for m in range(1, order):
        polynomials.append(u * polynomials[m] - m * polynomials[m - 1])
    return polynomials[: order + 1]


def _erf(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    """``erf' = 2/sqrt(pi) exp(-u^2)``; ``erf^(j) = 2/sqrt(pi) (-1)^(j-1) H_{j-1}(u)
    exp(-u^2)`` with the physicists' ``H_m(u) = 2^(m/2) He_m(sqrt(2) u)``."""
    gauss = 2 / math.sqrt(math.pi) * torch.exp(-u * u)
    if order <= 2:
        return [gauss, -2 * u * gauss][:order]
    he = _hermite(math.sqrt(2) * u, order - 1)
    return [(-1) ** m * 2 ** (m / 2) * he[m] * gauss for m in range(order)]


def _gelu(
    u: Tensor, y: Tensor, approximate: str = "none", *, order: int
) -> Sequence[Tensor | None]:
    """``u Phi(u)``: ``Phi' = phi`` and ``gelu^(j) = u phi^(j-1) + j phi^(j-2)`` with
    ``phi^(m) = (-1)^m He_m phi``; the tanh approximation by :func:`_gelu_tanh`."""
    if approximate == "tanh":
        return _gelu_tanh(u, y, approximate, order=order)
    phi = torch.exp(-0.5 * u * u) / SQRT_2PI
    if order <= 2:
        return [0.5 * (1 + torch.erf(u / math.sqrt(2))) + u * phi, phi * (2 - u * u)][:order]
    he = _hermite(u, order)
    density = [(-1) ** m * he[m] * phi for m in range(order)]  # phi^(m)
    first = 0.5 * (1 + torch.erf(u / math.sqrt(2))) + u * phi
    return [first] + [u * density[j - 1] + j * density[j - 2] for j in range(2, order + 1)]


def _gelu_tanh(u: Tensor, y: Tensor, approximate: str, *, order: int) -> Sequence[Tensor | None]:
    """``0.5 u (1 + T)`` with ``T = tanh(z)``, ``z = c (u + 0.044715 u^3)``: ``gelu^(j) = (u
    T^(j) + j T^(j-1)) / 2``, ``T^(j)`` by Faa di Bruno's formula from tanh's derivatives at
    ``z`` and z's three. Above second order these were autograd's derivatives of ``aten.gelu``,
    NaN where ``|u| > 21`` (its double backward overflows; they are 0 there to double
    precision): a bi-Laplacian of a network with such a pre-activation was NaN."""
    c = math.sqrt(2 / math.pi)
    z = c * (u + 0.044715 * u**3)
    dz, ddz = c * (1 + 3 * 0.044715 * u * u), c * 6 * 0.044715 * u
    t = torch.tanh(z)
    if order > 2:
        inner = [dz, ddz, torch.full_like(u, c * 6 * 0.044715), *(None,) * (order - 3)]
        outer = _TANH(z, t, order=order)
        ts = [t, *cast(list[Tensor], faa_di_bruno(Context(False, order), inner, outer))]
        return [0.5 * (1 + t + u * ts[1])] + [0.5 * (u * ts[j] + j * ts[j - 1])
                                              for j in range(2, order + 1)]  # fmt: skip
    dt = 1 - t * t
    d1 = 0.5 * (1 + t) + 0.5 * u * dt * dz
    d2 = dt * dz + 0.5 * u * (-2 * t * dt * dz * dz + dt * ddz)
    return [d1, d2][:order]


_TANH = _polynomial(
    (1.0, 0.0, -1.0),
    lambda y: _and_next(1 - y * y, -2 * y),
    lambda u, y: 4 * torch.sigmoid(2 * u) * torch.sigmoid(-2 * u),
)
"""tanh' = 1 - y^2 = 4 sigmoid(2u) sigmoid(-2u)."""


def _sigmoid(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    """``sigmoid' = y - y^2``; above second order ``sigmoid(u) = (1 + tanh(u / 2)) / 2``, so
    ``sigmoid^(j)(u) = tanh^(j)(u / 2) / 2^(j+1)``: tanh's polynomials, odd or even in
    ``tanh(u / 2)``, cancel less than sigmoid's own in ``y`` (whose sixth has coefficients up to
    3360 of alternating sign: in float32 1e-5 of the largest sixth derivative off, against
    autograd's 2.5e-7)."""
    if order <= 2:
        return list(_and_next(y * (1 - y), 1 - 2 * y))[:order]
    half = u / 2
    derivatives = cast(Sequence[Tensor], _TANH(half, torch.tanh(half), order=order))
    return [d / 2 ** (j + 1) for j, d in enumerate(derivatives, start=1)]


def _silu(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    """``u s(u)``: ``silu^(j) = u s^(j) + j s^(j-1)`` with the sigmoid's ``s``."""
    s = torch.sigmoid(u)
    if order <= 2:
        return [s * (1 + u * (1 - s)), s * (1 - s) * (2 + u * (1 - s * 2))][:order]
    ds = [s, *cast(Sequence[Tensor], _sigmoid(u, s, order=order))]
    return [u * ds[j] + j * ds[j - 1] for j in range(1, order + 1)]


def _softplus(u: Tensor, y: Tensor, beta: float = 1, threshold: float = 20, *,
              order: int) -> Sequence[Tensor | None]:  # fmt: skip
    """``log(1 + exp(beta u)) / beta``: ``softplus^(j) = beta^(j-1) s^(j-1)(beta u)``, and
    ``u`` itself where ``beta u > threshold`` (as torch computes it)."""
    s = torch.sigmoid(beta * u)
    ds = [s, *cast(Sequence[Tensor], _sigmoid(beta * u, s, order=order - 1))] if order > 1 else [s]
    out: list[Tensor | None] = [torch.where(beta * u > threshold, 1.0, s)]
    # at beta u = threshold autograd's double backward is the linear part's, 0 (it was s')
    out += [torch.where(beta * u >= threshold, 0.0, beta ** (j - 1) * ds[j - 1])
            for j in range(2, order + 1)]  # fmt: skip
    return out


def _hardswish(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    """``u relu6(u + 3) / 6``: slope ``u / 3 + 1 / 2`` and curvature ``1 / 3`` strictly inside
    ``(-3, 3)``; at the kinks autograd's sides, slope 0 at -3 and 1 at 3 and curvature 0 (torch's
    decomposition, which the engine took, gave the inner side's -1/2, 3/2 and 1/3)."""
    inside = (u > -3) & (u < 3)
    slope = torch.where(inside, u / 3 + 0.5, (u >= 3).to(u.dtype))
    curvature = torch.where(inside, u.new_full((), 1 / 3), u.new_zeros(()))  # (u's dtype)
    return [slope, *([curvature] if order > 1 else []),
            *[None] * (order - 2)]  # fmt: skip


def _elu(u: Tensor, y: Tensor, alpha: float = 1, scale: float = 1, input_scale: float = 1, *,
         order: int) -> Sequence[Tensor | None]:  # fmt: skip
    """At the kink ``u = 0`` autograd's convention: the slope of the exponential side, higher
    derivatives zero (``elu_double_backward`` masks ``u < 0``). They were the exponential side's,
    so ``elu`` and ``selu`` at 0 had a second derivative of ``alpha * scale * input_scale ** 2``
    where autograd has 0."""
    negative = scale * alpha * input_scale * torch.exp(input_scale * u)
    return [torch.where(u > 0, scale, negative)] + [
        torch.where(u < 0, negative * input_scale ** (j - 1), 0.0) for j in range(2, order + 1)
    ]


def _celu(u: Tensor, y: Tensor, alpha: float = 1.0, *, order: int) -> Sequence[Tensor | None]:
    """``elu(u, alpha, 1, 1 / alpha)``, as torch defines it: the same convention at 0 on every
    torch (torch 2.5's forward-mode derivatives of ``celu``, which the fallback took, differed
    from its reverse-mode ones there)."""
    return _elu(u, y, alpha, 1, 1 / alpha, order=order)


def _piecewise_linear(slope: Callable[..., Tensor]) -> Derivatives:
    """An op linear between kinks: its slope, then zeros (autograd's convention at the kinks)."""

    def derivatives(u: Tensor, y: Tensor, *args: object, order: int) -> Sequence[Tensor | None]:
        return [slope(u, *args)] + [None] * (order - 1)

    return derivatives


def _power(u: Tensor, y: Tensor, p: float, *, order: int) -> Sequence[Tensor | None]:
    """``(p)_j u^(p - j)``, zero beyond a non-negative integer ``p``."""
    if p == 0:
        return [torch.zeros_like(u)] + [None] * (order - 1)
    if p == 1:
        return [torch.ones_like(u)] + [None] * (order - 1)
    if p == 2:
        return [2 * u, torch.full_like(u, 2)] + [None] * (order - 2)
    out: list[Tensor | None] = []
    for j in range(1, order + 1):
        c = _falling(p, j)
        out.append(None if c == 0 else (torch.full_like(u, c) if p == j else c * u ** (p - j)))
    return out


def _atan(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    return [1 / (1 + u * u), -2 * u / (1 + u * u) ** 2][:order]


def _asinh(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    return [(1 + u * u).rsqrt(), -u * (1 + u * u).rsqrt() ** 3][:order]


def _atanh(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    return [1 / (1 - u * u), 2 * u / (1 - u * u) ** 2][:order]


def _inside(
    u: Tensor, lo: Tensor | float | None = None, hi: Tensor | float | None = None
) -> Tensor:
    """clamp's derivative: 1 where min <= u <= max (autograd's convention at the bounds)."""
    mask = torch.ones_like(u, dtype=torch.bool)
    if lo is not None:
        mask = mask & (u >= lo)
    if hi is not None:
        mask = mask & (u <= hi)
    return mask.to(u.dtype)


def _sqrt(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    if order <= 2:
        return [0.5 / y, -0.25 / (y * y * y)][:order]
    return _power_of_root(y, 0.5, order)


def _rsqrt(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    if order <= 2:
        return [-0.5 * y**3, 0.75 * y**5][:order]
    return [_falling(-0.5, j) * y ** (2 * j + 1) for j in range(1, order + 1)]


def _reciprocal(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    """``(-1)^j j! y^(j+1)``."""
    if order <= 2:
        return [-y * y, 2 * y * y * y][:order]
    return [(-1) ** j * math.factorial(j) * y ** (j + 1) for j in range(1, order + 1)]


SINC_SERIES_BELOW = 3.0
"""``|pi u|`` below which ``sinc``'s derivatives come from its power series (above: Leibniz)."""


@functools.cache
def _sinc_series(j: int) -> list[float]:
    """Coefficients of ``s^(j)(t)``, ``s(t) = sin(t) / t = sum_m (-1)^m t^(2m) / (2m + 1)!``, in
    powers of ``t`` from the constant up, to a degree whose terms are below 1e-18 at ``|t| = 3``."""
    degree = 32
    series = [0.0 if n % 2 else (-1) ** (n // 2) / math.factorial(n + 1)
              for n in range(degree + j + 1)]  # fmt: skip
    return [series[n + j] * math.factorial(n + j) / math.factorial(n) for n in range(degree + 1)]


def _sinc_branches(u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where ``t = pi u`` takes the power series (``|t| <`` :data:`SINC_SERIES_BELOW`), and
    ``t`` made safe for each branch: 0 off the series' entries, the bound off the others'."""
    t = math.pi * u
    near = t.abs() < SINC_SERIES_BELOW
    return near, torch.where(near, t, 0.0), torch.where(near, SINC_SERIES_BELOW, t)


def at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 at least, as torch's kernels compute a half one: a written-out op's
    intermediates overflow in half -- a norm's sums, the gradient of sinc's power series
    (``t ** 31``) and of gelu's cube (``3 u ** 2``) --, so that its derivatives were NaN (a half
    sinc's Hessian-vector product at 0.5 in ``vmap``) where torch's own are finite."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def sinc_written_out(u: Tensor) -> Tensor:
    """``sinc(u)`` in elementary ops whose nested reverse-mode derivatives are right at and
    near 0 (torch's own are NaN at 0 and lose every digit near it): the power series of
    ``s(t) = sin(t) / t`` near 0, ``sin(t) / t`` elsewhere, each on a safe ``t``;
    :func:`at_least_float32`, rounded back to ``u``'s dtype.

    >>> sinc_written_out(torch.tensor([0.0, 0.5]))  # 1, sin(pi / 2) / (pi / 2)
    tensor([1.0000, 0.6366])
    """
    near, t_near, t_far = _sinc_branches(at_least_float32(u))
    value = torch.where(near, _horner(_SINC_VALUE_SERIES, t_near), torch.sin(t_far) / t_far)
    return value.to(u.dtype)


def sinc_slope_written_out(u: Tensor) -> Tensor:
    """``d sinc(u) / du`` in elementary ops whose derivatives are right at and near 0, computed
    as :func:`sinc_written_out` is: what autograd's node of ``x.sinc()`` is made to return.

    >>> sinc_slope_written_out(torch.tensor([0.5, 1.0]))  # -4 / pi, (cos(pi) - sinc(1)) / 1
    tensor([-1.2732, -1.0000])
    """
    wide = at_least_float32(u)
    return cast(Tensor, _sinc(wide, wide, order=1)[0]).to(u.dtype)


_SINC_VALUE_SERIES = tuple(_sinc_series(0))
""":func:`_sinc_series` of ``s`` itself, a constant: what dynamo reads in a compiled kernel that
runs :func:`sinc_written_out` (a call of the cached function there is warned about)."""


def _sinc(u: Tensor, y: Tensor, *, order: int) -> Sequence[Tensor | None]:
    """``sin(pi u) / (pi u)``: ``pi^j s^(j)(pi u)`` with ``s(t) = sin(t) / t``, by Leibniz,
    ``s^(j)(t) = sum_i C(j, i) sin^(i)(t) (-1)^(j-i) (j-i)! / t^(j-i+1)``, where ``|t| >= 3``
    and by the power series of ``s`` nearer 0, where Leibniz's terms cancel (each branch on a
    safe ``t``, so that neither is inf or NaN where it is not taken, nor its gradient). Before,
    torch's decomposition ``where(t == 0, 1, sin(t) / t)`` gave NaN derivatives at 0 and lost
    every digit near it: the fourth derivative 12.1 for 19.5 at ``u = 1e-4``, 4e19 at 1e-9."""
    near, t_near, t_far = _sinc_branches(u)
    inverse = 1 / t_far
    sin_far, cos_far = torch.sin(t_far), torch.cos(t_far)
    cycle = [sin_far, cos_far, -sin_far, -cos_far]
    out: list[Tensor | None] = []
    for j in range(1, order + 1):
        far = sum(math.comb(j, i) * (-1) ** (j - i) * math.factorial(j - i) * cycle[i % 4]
                  * inverse ** (j - i + 1) for i in range(j + 1))  # fmt: skip
        out.append(math.pi**j * torch.where(near, _horner(_sinc_series(j), t_near), far))
    return out


SQRT_2PI = math.sqrt(2 * math.pi)
LN2, LN10 = math.log(2), math.log(10)
UNARY: dict[torch._ops.OpOverload, Derivatives] = {
    aten.exp.default: _exp,
    aten.exp2.default: _scaled(_exp, lambda j: LN2**j),
    aten.expm1.default: _expm1,
    aten.log.default: _log,
    aten.log2.default: _scaled(_log, lambda j: 1 / LN2),
    aten.log10.default: _scaled(_log, lambda j: 1 / LN10),
    aten.log1p.default: _log1p,
    aten.sqrt.default: _sqrt,
    aten.rsqrt.default: _rsqrt,
    aten.reciprocal.default: _reciprocal,
    aten.sin.default: _periodic(
        lambda u, y: torch.cos(u), lambda u, y: -y, lambda u, y: -torch.cos(u), lambda u, y: y
    ),
    aten.cos.default: _periodic(
        lambda u, y: -torch.sin(u), lambda u, y: -y, lambda u, y: torch.sin(u), lambda u, y: y
    ),
    aten.tan.default: _polynomial((1.0, 0.0, 1.0), lambda y: _and_next(1 + y * y, 2 * y)),
    aten.tanh.default: _TANH,
    aten.sigmoid.default: _sigmoid,
    aten.sinh.default: _periodic(lambda u, y: torch.cosh(u), lambda u, y: y),
    aten.cosh.default: _periodic(lambda u, y: torch.sinh(u), lambda u, y: y),
    aten.atan.default: _by_autograd(aten.atan.default, _atan),
    aten.asinh.default: _by_autograd(aten.asinh.default, _asinh),
    aten.atanh.default: _by_autograd(aten.atanh.default, _atanh),
    aten.erf.default: _erf,
    aten.sinc.default: _sinc,
    # NaN at NaN, as the value: sign(nan) is 0, an exact zero that dropped the NaN from every
    # derivative downstream (autograd's are NaN there, sum(|x| ** 1.5)'s Laplacian included)
    aten.abs.default: _piecewise_linear(lambda u: torch.where(u.isnan(), u, torch.sign(u))),
    aten.relu.default: _piecewise_linear(lambda u: (u > 0).to(u.dtype)),
    aten.silu.default: _silu,
    aten.gelu.default: _gelu,
    aten.softplus.default: _softplus,
    aten.hardswish.default: _hardswish,
    aten.leaky_relu.default: _piecewise_linear(
        lambda u, slope=0.01: torch.where(u > 0, u.new_ones(()), u.new_full((), slope))
    ),
    aten.elu.default: _elu,
    aten.celu.default: _celu,
    aten.hardtanh.default: _piecewise_linear(
        lambda u, lo=-1, hi=1: ((u > lo) & (u < hi)).to(u.dtype)
    ),
    aten.clamp.default: _piecewise_linear(_inside),
    aten.clamp_min.default: _piecewise_linear(lambda u, lo: _inside(u, lo, None)),
    aten.clamp_max.default: _piecewise_linear(lambda u, hi: _inside(u, None, hi)),
    aten.pow.Tensor_Scalar: _power,
}
"""Each elementwise op's derivatives of any order (closed forms; autograd's own for the orders
above 2 of atan, asinh and atanh)."""


for _op, _derivatives in UNARY.items():
    RULES[_op] = _unary(_derivatives)


@rule(aten.pow.Scalar)
def _scalar_power(ctx: Context, out: Tensor, base: float, u: Jet) -> Jet:
    """``base ** u``: ``out log(base)^j``. Autograd's conventions where the logarithm is not
    finite: a zero base has zero derivatives where ``u >= 0`` (infinite ones, of alternating
    sign, where ``u < 0``), a negative base NaN ones (``log`` of a negative number)."""
    if base > 0:
        log_base = math.log(base)
        return chain(ctx, out, u, *(out * log_base**j for j in range(1, ctx.order + 1)))
    if base < 0:
        return chain(ctx, out, u, *[out * math.nan] * ctx.order)
    flat = u.value >= 0  # out is 0 there, and inf elsewhere: out log(0) = -inf, its square inf
    infinite = out.new_full((), math.inf)  # not out * inf: 0 * inf, NaN in the kernel's backward
    return chain(ctx, out, u, *(torch.where(flat, 0.0, -infinite if j % 2 else infinite)
                                for j in range(1, ctx.order + 1)))  # fmt: skip


def selected(out: Tensor, condition: Tensor, a: object, b: object, order: int) -> Jet:
    """``where(condition, a, b)``'s jet: each coefficient selected as the value is (a constant
    branch has zero coefficients; what the other branch's coefficients hold where it is not
    selected never reaches the result)."""
    nd = out.ndim

    def select(k: int) -> Tensor | None:
        ta, tb = coefficient_of(a, nd, k), coefficient_of(b, nd, k)
        if ta is None and tb is None:
            return None
        zero = cast(Tensor, ta if ta is not None else tb).new_zeros(())  # one is not None
        return torch.where(condition, zero if ta is None else ta, zero if tb is None else tb)

    return Jet(out, tuple(select(k) for k in range(1, order + 1)))  # a or b is a jet


@rule(aten.where.self)
def _where(ctx: Context, out: Tensor, condition: Tensor, a: object, b: object) -> Jet:
    return selected(out, condition, a, b, ctx.order)


@rule(aten.masked_fill.Scalar)
def _masked_fill(ctx: Context, out: Tensor, u: Jet, mask: Tensor, value: float) -> Jet:
    return linear(out, u, lambda t: torch.where(mask, t.new_zeros(()), t))


@rule(aten.native_dropout.default)
def _dropout(
    ctx: Context, out: tuple[Tensor, Tensor], u: Jet, p: float, train: bool | None
) -> tuple[Jet, Tensor]:
    value, mask = out
    if not train:
        return Jet(value, u.coefficients), mask
    scale = mask.to(value.dtype) / (1 - p)
    return linear(value, u, lambda t: t * scale), mask
