"""Any linear differential operator with constant coefficients, per instance: ``sum_alpha
c_alpha d^alpha f``, from one collapsed Taylor jet.

Each term's mixed partial is a weighted sum of pure directional derivatives along integer
directions (``pyhvp.interpolation``); the directions of every term are pushed together as one
jet of the highest order present, the top order summed over them with the weights as it goes
(collapsed Taylor mode) and the lower orders read per direction at the output. ``f`` is recorded
once and one kernel runs. Runs on the backend's optional ``taylor_coefficients`` primitive.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from fractions import Fraction

import torch

from pyhvp import _estimators as est
from pyhvp._checks import check_args, check_chunk_size, require_floating
from pyhvp._public import public_operator
from pyhvp.backends import Backend, require_primitive, resolve_backend
from pyhvp.instances import check_event_dims_of
from pyhvp.interpolation import Direction, terms_of_order

Terms = Mapping[tuple[int, ...], float]
"""Keys: the flat indices (within one instance's event) of the variables differentiated, with
repeats, the order being the key's length; values: the coefficients."""


@public_operator
def differential_operator(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    terms: Terms,
    *args: object,
    event_dims: int = 1,
    chunk_size: int | None = None,
    backend: str | Backend = "torch",
) -> torch.Tensor:
    """``sum over terms of c * d^alpha f`` per instance and output: ``batch + out``.

    Shapes: ``f(x, *args)`` returns ``batch_shape + out_shape``; the result has that shape.
    ``terms`` maps each ``alpha`` -- a tuple of the event's flat variable indices differentiated,
    with repeats (its length is the order; ``()`` is ``f`` itself) -- to its coefficient:
    ``{(0, 0, 0, 0): 1.0, (0, 0, 1, 1): 2.0, (1, 1, 1, 1): 1.0}`` is the 2-D bi-Laplacian,
    ``{(0, 0, 0): 1.0, (1,): -0.5, (0, 1): 3.0}`` is ``u_xxx - u_y / 2 + 3 u_xy``.

    Mixed partials come from pure directional derivatives by the interpolation identities of
    Griewank, Utke & Walther (``pyhvp.interpolation``): a term of order ``k`` in ``P``
    distinct variables needs at most ``C(P + k - 1, k)`` directions, a pure one (``u_xxxx``)
    one; terms share directions. All directions run as one jet of the highest order ``K``
    present, its top order collapsed (summed with the weights as it goes): cost about ``K``
    times ``f``'s linear ops per direction. ``chunk_size`` bounds the directions pushed at once.
    Results are differentiable in ``x``, ``args`` and the tensors ``f`` captures.

    >>> x = torch.tensor([[1.0, 2.0]])
    >>> f = lambda x: x[..., 0] ** 3 * x[..., 1] ** 2   # u = x^3 y^2: 6 y^2 - x^3 y + 18 x^2 y
    >>> differential_operator(f, x, {(0, 0, 0): 1.0, (1,): -0.5, (0, 1): 3.0})
    tensor([58.])
    """
    x = require_floating("x", x)
    event_dims = check_event_dims_of(f, event_dims, x)
    check_args(args, x)
    chunk_size = check_chunk_size(chunk_size)
    space = est.Space(x, event_dims)
    by_order = _checked_terms(terms, space.dim)
    taylor_coefficients = require_primitive(resolve_backend(backend), "taylor_coefficients",
                                            "pyhvp.differential_operator")  # fmt: skip
    value_weight = by_order.pop(0, {}).get((), Fraction(0))
    top = max(by_order, default=0)
    weights = {k: terms_of_order(group, space.dim) for k, group in by_order.items()}
    directions = list(dict.fromkeys(d for k in sorted(weights) for d in weights[k]))
    checked = est.checked(f, space.batch)
    if not directions:  # f itself only
        (value,) = taylor_coefficients(checked, x, space.directions(space.basis()[:1]), args,
                                       chunk_size, order=1, outputs=(0,))  # fmt: skip
        return (value * float(value_weight)).to(x.dtype)  # as every term's: x's dtype
    vectors = space.directions(_as_tensor(directions, space, len(space.batch)))
    outputs = tuple(sorted({0, *weights} if value_weight else set(weights)))
    # a first-order top is read per direction, as first orders are below a higher top: summed
    # over the directions first, a norm of a zero vector could not take its one-sided jet along
    # each (u_x + u_y of |x| at 0 was 0 alone, 2 beside a second-order term)
    collapsed = top > 1
    coefficients = dict(zip(outputs, taylor_coefficients(
        checked, x, vectors, args, chunk_size, order=top, outputs=outputs, collapsed=collapsed,
        weights=_weights(weights[top], directions, x) if collapsed else None), strict=True))  # fmt: skip
    total = coefficients[top]
    if not collapsed:
        total = torch.tensordot(_weights(weights[top], directions, x), total, dims=1)
    for k in sorted(weights):
        if k != top:
            w = _weights(weights[k], directions, x)
            total = total + torch.tensordot(w, coefficients[k], dims=1)
    if value_weight:
        total = total + coefficients[0].to(x.dtype) * float(value_weight)  # x's dtype, as above
    return total


def _checked_terms(terms: object, n_vars: int) -> dict[int, dict[tuple[int, ...], Fraction]]:
    """``terms`` grouped by order, coefficients as exact fractions; refused with the entry that
    is wrong otherwise."""
    if not isinstance(terms, Mapping) or not terms:
        raise TypeError(
            f"terms must be a non-empty mapping {{(i, j, ...): coefficient}} of the variables "
            f"differentiated (flat event indices, with repeats) to a number, got {terms!r}"
        )
    grouped: dict[int, dict[tuple[int, ...], Fraction]] = {}
    for alpha, c in terms.items():
        if not isinstance(alpha, tuple) or not all(  # numbers.Integral: NumPy's ints too
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= int(i) < n_vars
            for i in alpha
        ):
            raise ValueError(
                f"each key of terms must be a tuple of variable indices in [0, {n_vars}) (the "
                f"event's {n_vars} variables, flattened), with repeats for higher orders: "
                f"(0, 0, 1) is d^3 / dx_0^2 dx_1; got {alpha!r}"
            )
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c):
            raise TypeError(f"the coefficient of {alpha} must be a finite real number, got {c!r}")
        key = tuple(sorted(int(i) for i in alpha))
        group = grouped.setdefault(len(key), {})
        group[key] = group.get(key, Fraction(0)) + Fraction(float(c))
    return grouped


def _as_tensor(directions: list[Direction], space: est.Space, n_batch: int) -> torch.Tensor:
    """Integer directions as ``(k, 1, ..., 1, N)`` coefficient vectors, shared by every
    instance."""
    table = torch.tensor(directions, dtype=space.like.dtype, device=space.like.device)
    return table.reshape(len(directions), *(1,) * n_batch, space.dim)


def _weights(weights: dict[Direction, Fraction], directions: list[Direction],
             like: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One weight per direction (0 where a direction serves another order only)."""
    return torch.tensor([float(weights.get(d, 0)) for d in directions], dtype=like.dtype,
                        device=like.device)  # fmt: skip
