"""Mixed partial derivatives from pure directional ones: which directions a linear differential
operator's terms need, and with which weights their top-order Taylor coefficients sum to it.

A term ``c * d^alpha f`` of order ``k`` is a weighted sum of ``k``-th directional derivatives
``D^k_v f = d^k/dt^k f(x + t v)`` along integer directions ``v``: the interpolation identities
of Griewank, Utke & Walther (2000, "Evaluating higher derivative tensors by forward propagation
of univariate Taylor series"), in the form of Dangel et al. (2025, "Collapsing Taylor mode
automatic differentiation", eq. E17): for the exponent vector ``i`` of ``alpha`` over its ``P``
distinct variables,

    d^i f = sum_{|j| = |i|} gamma_{i,j} / |i|! * D^{|i|}_j f,
    gamma_{i,j} = sum_{0 < m <= i} (-1)^{|i| - |m|} prod_p C(i_p, m_p) C(|i| m_p / |m|, j_p)
                  (|m| / |i|)^{|i|},

with ``j`` running over the ``C(P + |i| - 1, |i|)`` exponent vectors of that degree. Exact
rational arithmetic (:class:`fractions.Fraction`) gives the weights; each direction is reduced to
its smallest integer multiple (``D^k_{g v} = g^k D^k_v``), and directions shared by several terms
are pushed once. A pure term ``d^k f / dx_i^k`` needs only ``e_i``.

>>> weights = terms_of_order({(0, 0, 1, 1): 1.0}, 2)  # d^4 / dx0^2 dx1^2
>>> sorted(weights)
[(0, 1), (1, 0), (1, 1), (1, 3), (3, 1)]

On ``f = x0^2 x1^2``, where ``D^4_v f = 24 v0^2 v1^2``, they give ``d^4 f / dx0^2 dx1^2 = 4``:

>>> sum(w * 24 * v[0] ** 2 * v[1] ** 2 for v, w in weights.items())
Fraction(4, 1)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from functools import cache

Direction = tuple[int, ...]


def terms_of_order(terms: Mapping[tuple[int, ...], float | Fraction], n_vars: int
                   ) -> dict[Direction, Fraction]:  # fmt: skip
    """Directions (integer vectors of ``n_vars`` entries, first nonzero entry positive, entries
    without a common divisor) and weights such that ``sum_v w_v D^k_v f = sum_alpha c_alpha
    d^alpha f`` for terms all of one order ``k`` (``alpha``: the flat indices of the variables
    differentiated, with repeats). Zero weights are dropped."""
    weights: dict[Direction, Fraction] = {}
    for alpha, c in terms.items():
        variables = sorted(set(alpha))
        exponents = tuple(alpha.count(v) for v in variables)
        order = len(alpha)
        for j, gamma in _gammas(exponents).items():
            if gamma == 0:
                continue
            vector = [0] * n_vars
            for v, e in zip(variables, j, strict=True):
                vector[v] = e
            direction, scale = _reduced(vector, order)
            weights[direction] = weights.get(direction, Fraction(0)) + (
                Fraction(c) * gamma * scale / math.factorial(order)
            )
    return {d: w for d, w in weights.items() if w != 0}


def biharmonic(n_vars: int) -> dict[Direction, Fraction]:
    """Directions and weights of the bi-Laplacian ``sum_{i,j} d^4 f / dx_i^2 dx_j^2``: ``e_i``
    with weight ``1 - (n - 1)/3`` and ``e_i +- e_j`` (``i < j``) with weight ``1/6`` -- ``n^2``
    directions, from ``D^4_{e_i + e_j} + D^4_{e_i - e_j} = 2 d_i^4 + 12 d_i^2 d_j^2 + 2 d_j^4``
    (the odd mixed terms cancel), fewer than the ``n + 3 n (n - 1)/2`` of the general identity.

    >>> biharmonic(2)
    {(1, 0): Fraction(2, 3), (0, 1): Fraction(2, 3), (1, 1): Fraction(1, 6), (1, -1): Fraction(1, 6)}
    """
    weights: dict[Direction, Fraction] = {}
    for i in range(n_vars):
        weights[tuple(int(k == i) for k in range(n_vars))] = 1 - Fraction(n_vars - 1, 3)
    for i, j in itertools.combinations(range(n_vars), 2):
        for sign in (1, -1):
            weights[tuple(1 if k == i else sign if k == j else 0 for k in range(n_vars))] = (
                Fraction(1, 6)
            )
    return {d: w for d, w in weights.items() if w != 0}


def _reduced(vector: Sequence[int], order: int) -> tuple[Direction, Fraction]:
    """``vector = g * direction`` with the direction's first nonzero entry positive and its
    entries coprime; returns the direction and the factor ``g^order`` its weight takes."""
    g = math.gcd(*vector)
    first = next(v for v in vector if v != 0)
    g = g if first > 0 else -g
    return tuple(v // g for v in vector), Fraction(g) ** order


@cache
def _gammas(exponents: tuple[int, ...]) -> dict[Direction, Fraction]:
    """``gamma_{i,j}`` for every ``j`` with ``|j| = |i|`` (``i = exponents``)."""
    order = sum(exponents)
    ms = [m for m in itertools.product(*(range(e + 1) for e in exponents)) if sum(m) > 0]
    out = {}
    for j in _compositions(order, len(exponents)):
        total = Fraction(0)
        for m in ms:
            size = sum(m)
            term = Fraction(-1 if (order - size) % 2 else 1)
            for e, mp, jp in zip(exponents, m, j, strict=True):
                term *= math.comb(e, mp) * _binomial(Fraction(order * mp, size), jp)
            total += term * Fraction(size, order) ** order
        out[j] = total
    return out


def _compositions(total: int, parts: int) -> list[Direction]:
    """Every vector of ``parts`` non-negative integers summing to ``total``."""
    if parts == 1:
        return [(total,)]
    return [(first, *rest) for first in range(total + 1)
            for rest in _compositions(total - first, parts - 1)]  # fmt: skip


def _binomial(a: Fraction, b: int) -> Fraction:
    """The generalised binomial coefficient ``a choose b`` for a rational ``a``."""
    out = Fraction(1)
    for i in range(b):
        out *= (a - i) / (i + 1)
    return out
