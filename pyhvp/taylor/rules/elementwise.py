"""Elementwise functions ``y = g(u)`` by ``g'`` and ``g''``, and elementwise selection
(``where``, ``masked_fill``, dropout)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch

from pyhvp.taylor.jets import (
    Context,
    Jet,
    chain,
    coefficient_of,
    linear,
)
from pyhvp.taylor.registry import RULES, Rule, rule

aten = torch.ops.aten
Tensor = torch.Tensor


def _unary(derivatives: Callable[..., tuple[Tensor, Tensor | None]]) -> Rule:
    """The rule of an elementwise op whose only tensor input is the first."""

    def unary_rule(ctx: Context, out: Tensor, u: Jet, *args: object, **kwargs: object) -> Jet:
        d1, d2 = derivatives(u.value, out, *args, **kwargs)
        return chain(ctx, out, u, d1, d2)

    return unary_rule


SQRT_2PI = math.sqrt(2 * math.pi)
UNARY: dict[torch._ops.OpOverload, Callable[..., tuple[Tensor, Tensor | None]]] = {
    aten.exp.default: lambda u, y: (y, y),
    aten.exp2.default: lambda u, y: (y * math.log(2), y * math.log(2) ** 2),
    aten.expm1.default: lambda u, y: (y + 1, y + 1),
    aten.log.default: lambda u, y: (1 / u, -1 / (u * u)),
    aten.log2.default: lambda u, y: (1 / (u * math.log(2)), -1 / (u * u * math.log(2))),
    aten.log10.default: lambda u, y: (1 / (u * math.log(10)), -1 / (u * u * math.log(10))),
    aten.log1p.default: lambda u, y: (1 / (1 + u), -1 / ((1 + u) * (1 + u))),
    aten.sqrt.default: lambda u, y: (0.5 / y, -0.25 / (y * y * y)),
    aten.rsqrt.default: lambda u, y: (-0.5 * y**3, 0.75 * y**5),
    aten.reciprocal.default: lambda u, y: (-y * y, 2 * y * y * y),
    aten.sin.default: lambda u, y: (torch.cos(u), -y),
    aten.cos.default: lambda u, y: (-torch.sin(u), -y),
    aten.tan.default: lambda u, y: _and_next(1 + y * y, 2 * y),
    aten.tanh.default: lambda u, y: _and_next(1 - y * y, -2 * y),
    aten.sigmoid.default: lambda u, y: _and_next(y * (1 - y), 1 - 2 * y),
    aten.sinh.default: lambda u, y: (torch.cosh(u), y),
    aten.cosh.default: lambda u, y: (torch.sinh(u), y),
    aten.atan.default: lambda u, y: (1 / (1 + u * u), -2 * u / (1 + u * u) ** 2),
    aten.asinh.default: lambda u, y: ((1 + u * u).rsqrt(), -u * (1 + u * u).rsqrt() ** 3),
    aten.atanh.default: lambda u, y: (1 / (1 - u * u), 2 * u / (1 - u * u) ** 2),
    aten.erf.default: lambda u, y: (
        2 / math.sqrt(math.pi) * torch.exp(-u * u),
        -4 / math.sqrt(math.pi) * u * torch.exp(-u * u),
    ),
    aten.abs.default: lambda u, y: (torch.sign(u), None),
    aten.relu.default: lambda u, y: ((u > 0).to(u.dtype), None),
    aten.silu.default: lambda u, y: _silu(u),
    aten.gelu.default: lambda u, y, approximate="none": _gelu(u, approximate),
    aten.softplus.default: lambda u, y, beta=1, threshold=20: _softplus(u, beta, threshold),
    aten.leaky_relu.default: lambda u, y, slope=0.01: (torch.where(u > 0, 1.0, slope).to(u), None),
    aten.elu.default: lambda u, y, alpha=1, scale=1, input_scale=1: _elu(
        u, alpha, scale, input_scale
    ),
    aten.hardtanh.default: lambda u, y, lo=-1, hi=1: (((u > lo) & (u < hi)).to(u.dtype), None),
    aten.clamp.default: lambda u, y, lo=None, hi=None: (_inside(u, lo, hi), None),
    aten.clamp_min.default: lambda u, y, lo: (_inside(u, lo, None), None),
    aten.clamp_max.default: lambda u, y, hi: (_inside(u, None, hi), None),
    aten.pow.Tensor_Scalar: lambda u, y, p: _power(u, p),
}


def _and_next(d1: Tensor, factor: Tensor) -> tuple[Tensor, Tensor]:
    """``(d1, d1 * factor)``: ``g'`` computed once where ``g'' = g' * factor`` (tanh: ``1 - y^2``
    and ``-2 y (1 - y^2)``; the eager kernel would otherwise compute ``g'`` twice)."""
    return d1, d1 * factor


def _silu(u: Tensor) -> tuple[Tensor, Tensor]:
    s = torch.sigmoid(u)
    return s * (1 + u * (1 - s)), s * (1 - s) * (2 + u * (1 - 2 * s))


def _gelu(u: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    if approximate == "tanh":  # 0.5 u (1 + tanh(c (u + 0.044715 u^3)))
        c = math.sqrt(2 / math.pi)
        z = c * (u + 0.044715 * u**3)
        dz, ddz = c * (1 + 3 * 0.044715 * u * u), c * 6 * 0.044715 * u
        t = torch.tanh(z)
        dt = 1 - t * t
        d1 = 0.5 * (1 + t) + 0.5 * u * dt * dz
        d2 = dt * dz + 0.5 * u * (-2 * t * dt * dz * dz + dt * ddz)
        return d1, d2
    phi = torch.exp(-0.5 * u * u) / SQRT_2PI
    return 0.5 * (1 + torch.erf(u / math.sqrt(2))) + u * phi, phi * (2 - u * u)


def _softplus(u: Tensor, beta: float, threshold: float) -> tuple[Tensor, Tensor]:
    s = torch.sigmoid(beta * u)
    linear_part = beta * u > threshold  # torch returns u there
    return torch.where(linear_part, 1.0, s), torch.where(linear_part, 0.0, beta * s * (1 - s))


def _elu(u: Tensor, alpha: float, scale: float, input_scale: float) -> tuple[Tensor, Tensor]:
    negative = scale * alpha * input_scale * torch.exp(input_scale * u)
    return (
        torch.where(u > 0, scale, negative),
        torch.where(u > 0, 0.0, negative * input_scale),
    )


def _inside(u: Tensor, lo: Tensor | float | None, hi: Tensor | float | None) -> Tensor:
    """clamp's derivative: 1 where min <= u <= max (autograd's convention at the bounds)."""
    mask = torch.ones_like(u, dtype=torch.bool)
    if lo is not None:
        mask = mask & (u >= lo)
    if hi is not None:
        mask = mask & (u <= hi)
    return mask.to(u.dtype)


def _power(u: Tensor, p: float) -> tuple[Tensor, Tensor | None]:
    if p == 0:
        return torch.zeros_like(u), None
    if p == 1:
        return torch.ones_like(u), None
    if p == 2:
        return 2 * u, torch.full_like(u, 2)
    return p * u ** (p - 1), p * (p - 1) * u ** (p - 2)


for _op, _derivatives in UNARY.items():
    RULES[_op] = _unary(_derivatives)


@rule(aten.pow.Scalar)
def _scalar_power(ctx: Context, out: Tensor, base: float, u: Jet) -> Jet:
    """``base ** u``: ``out log(base)`` and ``out log(base)^2``. Autograd's conventions where
    the logarithm is not finite: a zero base has zero derivatives where ``u >= 0`` (infinite
    ones where ``u < 0``), a negative base NaN ones (``log`` of a negative number)."""
    if base > 0:
        log_base = math.log(base)
        return chain(ctx, out, u, out * log_base, out * log_base**2)
    if base < 0:
        return chain(ctx, out, u, out * math.nan, out * math.nan)
    flat = u.value >= 0  # out is 0 there, and inf elsewhere: out log(0) = -inf, its square inf
    infinite = out.new_full((), math.inf)  # not out * inf: 0 * inf, NaN in the kernel's backward
    return chain(ctx, out, u, torch.where(flat, 0.0, -infinite), torch.where(flat, 0.0, infinite))


@rule(aten.where.self)
def _where(ctx: Context, out: Tensor, condition: Tensor, a: object, b: object) -> Jet:
    nd = out.ndim

    def select(order: int) -> Tensor | None:
        ta, tb = coefficient_of(a, nd, order), coefficient_of(b, nd, order)
        if ta is None and tb is None:
            return None
        zero = cast(Tensor, ta if ta is not None else tb).new_zeros(())  # one is not None
        return torch.where(condition, zero if ta is None else ta, zero if tb is None else tb)

    return Jet(out, cast(Tensor, select(1)), select(2))  # a or b is a jet: not None


@rule(aten.masked_fill.Scalar)
def _masked_fill(ctx: Context, out: Tensor, u: Jet, mask: Tensor, value: float) -> Jet:
    return linear(out, u, lambda t: torch.where(mask, t.new_zeros(()), t))


@rule(aten.native_dropout.default)
def _dropout(
    ctx: Context, out: tuple[Tensor, Tensor], u: Jet, p: float, train: bool | None
) -> tuple[Jet, Tensor]:
    value, mask = out
    if not train:
        return Jet(value, u.first, u.second), mask
    scale = mask.to(value.dtype) / (1 - p)
    return linear(value, u, lambda t: t * scale), mask
