"""Jets: a value with its Taylor coefficients of orders 1..K, and the algebra of coefficients
that every rule shares.

A tensor that depends on ``x`` is a :class:`Jet`; one that does not stays a plain tensor (a
constant: no coefficients are stored or computed for it). Coefficients are *tangent-like*
tensors: a leading axis (the ``K`` directions, or size 1) followed by the value's dims, where any
dim may have size 1 while the value's is larger -- the coefficient is then the same along that dim
(**broadcast-shaped**). Directions shared by every instance enter as ``(K, 1, ..., 1, *event)``,
so ``W e_i`` of a first linear layer is computed once, not once per instance; each rule keeps a
size-1 dim where that is exact and expands it (a free view) where the op needs the full dim.

The order-k coefficient of ``y`` along a direction ``u`` is ``d^k/dt^k y(x + t u)`` at ``t = 0``
(derivatives, not Taylor coefficients divided by ``k!``). One algebra serves every order
(:class:`Context`): Leibniz's rule for products (:func:`leibniz`), Faa di Bruno's formula for
elementwise functions (:func:`chain`), linear ops coefficient by coefficient (:func:`linear`).
Second order is its fast specialization: the same functions, with structured first-order
coefficients (:class:`FactoredCoefficient`, :class:`DiagonalCoefficient`) kept through them.

The top order comes in two modes: *per direction* (every coefficient has the K directions on its
leading axis: Hessian diagonals, directional derivatives) and *collapsed* (the top coefficient is
summed over the directions, optionally with a weight per direction, leading axis 1: Laplacians,
bi-Laplacians, any linear differential operator by interpolation; the lower orders stay per
direction). Rules are written once for both: they combine coefficients of two operands only
through :meth:`Context.pair` (or :func:`leibniz`, :func:`chain`), which know the mode.

**Strong zeros.** A coefficient times a factor (a derivative, a value) is :func:`times`. Where a
derivative is not finite -- ``log`` or ``sqrt`` at 0, ``logaddexp`` at ``-inf``, a masked entry
-- IEEE's ``0 * inf`` is NaN, and a sum over the event spreads it from the entries that never
moved along a direction to every entry of the instance; autograd's reverse mode selects (``where``)
where forward mode multiplies, and stays finite. Traced under :func:`strong_zeros`, :func:`times`
gives zero wherever the coefficient is zero, whatever the factor, so a non-finite derivative
reaches only the directions that pass through it. That costs a selection per product (3-14x a
product, eagerly), so kernels are traced twice: plainly, and under :func:`strong_zeros`. The two
differ only where a zero met a non-finite factor, where the plain kernel has NaN, and no
coefficient op turns a NaN finite but a selection (the same in both): a plain result whose
derivatives are all finite is the strong kernel's, and the backend runs the strong kernel only
for a call whose plain result is not (:mod:`pyhvp.backends.torch`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeAlias, cast, overload

import torch

Tensor = torch.Tensor

ENGINE = (
    "the Taylor engine (pyhvp.laplacian, grad_and_laplacian, hessian_diagonal's exact method, "
    "bilaplacian, directional_derivatives, differential_operator)"
)
"""How errors name the engine: the operators that run on it (the higher-order ones too: their
refusals named only the second-order operators, not the one called)."""


def dense_only(what: str, kind: type[Exception] = TypeError) -> Exception:
    """The refusal of a sparse (non-strided) tensor; ``what`` says where ``f`` has it."""
    return kind(f"{what}: {ENGINE} supports dense (strided) tensors only; convert it with "
                f".to_dense()")  # fmt: skip


@dataclass(frozen=True)
class FactoredCoefficient:
    """First-order coefficients kept as the product ``factor * shared``.

    ``factor`` broadcasts to the value's shape (no leading axis: an elementwise derivative);
    ``shared`` is a coefficient ``(K, *S)`` that is shared (size 1) along dims where ``factor``
    varies -- directions shared by every instance, after an elementwise function. Multiplied out
    it is K times the value's size; kept factored, its square is ``factor^2 * square(shared)``, a
    following linear layer is one wide matrix product and a sum is one matrix product.
    """

    factor: Tensor
    shared: Tensor

    def dense(self) -> Tensor:
        return broadcast_times(lifted(self.shared, self.factor.ndim), self.factor)


@dataclass(frozen=True)
class DiagonalCoefficient:
    """First-order coefficients along the basis directions of x's event, kept as their diagonal.

    The directions are ``basis`` = e_k for the N elements k of the event (``(N, 1, ..., 1,
    *event)``: the identity, as the exact Laplacian pushes them), and the value has the event's
    ``len(event)`` dims last, elementwise in x so far: its coefficient is ``delta(k, e) *
    diagonal[..., e]``. ``diagonal`` broadcasts to the value's shape from the right (a float for
    a constant one: x itself is 1.0); ``ndim`` is the value's. Multiplied out it is N times the
    value's size; kept, an elementwise rule scales the diagonal, the collapsed square
    ``sum_k t_k^2`` is ``diagonal^2`` and a sum over the event moves the diagonal onto the
    direction axis (:func:`diagonal_summed`) -- what folx's sparsity tracking gives functions that
    act elementwise before they mix.
    """

    diagonal: Tensor | float
    basis: Tensor
    event: tuple[int, ...]
    ndim: int

    def dense(self) -> Tensor:
        basis = lifted(self.basis, self.ndim)
        return basis if _is_one(self.diagonal) else broadcast_times(basis, self.diagonal)

    def times(self, d: Tensor | float, shape: Sequence[int],
              dtype: torch.dtype) -> DiagonalCoefficient | None:  # fmt: skip
        """The coefficient times an elementwise factor ``d`` for a value of ``shape`` and
        ``dtype``, in ``dtype`` as the value's coefficients are (``1 * G`` was ``G`` itself: a
        bfloat16 factor kept its dtype, and the diagonal's square was rounded to it); None when
        the event dims would not stay the value's last (a broadcast that grows them)."""
        if not on_event(self.event, shape):
            return None
        diagonal = multiplied(self.diagonal, promoted(d, dtype))
        return DiagonalCoefficient(diagonal, self.basis, self.event, len(shape))


def promoted(d: Tensor | float, dtype: torch.dtype) -> Tensor | float:
    """A constant factor ``d`` in the ``dtype`` of the result it enters, before it multiplies, as
    torch promotes operands (a Python float stays one)."""
    return d.to(dtype) if isinstance(d, Tensor) else d


def _is_one(t: Tensor | float) -> bool:
    return not isinstance(t, Tensor) and t == 1


def multiplied(a: Tensor | float, b: Tensor | float) -> Tensor | float:
    """``a * b`` without multiplying by a constant 1; a tensor ``a`` is a coefficient's part
    (:func:`times`)."""
    if _is_one(a) or _is_one(b):
        return b if _is_one(a) else a
    return times(a, b) if isinstance(a, Tensor) else a * b


_STRONG_ZEROS: ContextVar[bool] = ContextVar("strong_zeros", default=False)


@contextlib.contextmanager
def strong_zeros() -> Iterator[None]:
    """Rules run in this block multiply coefficients with strong zeros (:func:`times`) and take
    no path that hides a product in a matrix product (factored sums)."""
    token = _STRONG_ZEROS.set(True)
    try:
        yield
    finally:
        _STRONG_ZEROS.reset(token)


def strong() -> bool:
    """Whether rules run under :func:`strong_zeros`."""
    return _STRONG_ZEROS.get()


def times(t: Tensor, c: Tensor | float) -> Tensor:
    """``t * c`` for a coefficient (or its elementwise part) ``t`` and a factor ``c``; under
    :func:`strong_zeros`, zero wherever ``t`` is zero, even where ``c`` is infinite or NaN --
    and so is its gradient in ``c`` there (``c`` is selected before it is multiplied: no
    ``0 * inf`` in the kernel's backward either)."""
    if not strong() or (not isinstance(c, Tensor) and math.isfinite(c)):
        return t * c
    if not isinstance(c, Tensor):
        c = torch.as_tensor(c, dtype=t.dtype, device=t.device)
    zero = t == 0
    return torch.where(zero, 0.0, t * torch.where(zero, 1.0, c))


def on_event(event: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether a value of ``shape`` has the ``event``'s dims last."""
    return len(shape) >= len(event) and tuple(shape[len(shape) - len(event) :]) == tuple(event)


def diagonal_of(arg: object) -> DiagonalCoefficient | None:
    """``arg``'s first-order coefficient when it is kept diagonal; None otherwise."""
    c = arg.coefficient if isinstance(arg, Jet) else None
    return c if isinstance(c, DiagonalCoefficient) else None


def diagonal_squared(ctx: Context, c: DiagonalCoefficient) -> Tensor | float | None:
    """Collapsed ``sum_k t_k t_k`` of a diagonal coefficient, without the leading axis:
    ``diagonal^2``; None per direction (the caller multiplies out)."""
    return multiplied(c.diagonal, c.diagonal) if ctx.collapsed else None


def diagonal_summed(
    c: DiagonalCoefficient, shape: Sequence[int], dims: Sequence[int], keepdim: bool
) -> Tensor | DiagonalCoefficient | None:
    """The first-order coefficient of a sum over ``dims`` of a value of ``shape`` with a diagonal
    one: over dims before the event it stays diagonal (the diagonal summed); over the whole
    event it is the diagonal with the event flattened onto the direction axis (a reshape, not a
    product with the basis). None otherwise (part of the event: the caller multiplies out)."""
    nd, e = len(shape), len(c.event)
    inner = [d for d in dims if d >= nd - e]
    if (inner and len(inner) < e) or not isinstance(c.diagonal, Tensor):
        return None
    diagonal = c.diagonal.reshape((1,) * (nd - c.diagonal.ndim) + tuple(c.diagonal.shape))
    outer = [d for d in dims if d < nd - e]
    wide = [d for d in outer if diagonal.shape[d] != 1]
    scale = math.prod(shape[d] for d in outer if diagonal.shape[d] == 1)
    summed = diagonal.sum(wide, keepdim=True) if wide else diagonal
    summed = summed * scale if scale != 1 else summed
    if not inner:
        if keepdim or not outer:
            return DiagonalCoefficient(summed, c.basis, c.event, nd)
        # the basis loses the summed dims too (size 1 there: shared by every instance), else it
        # kept more dims than the value (x of shape (B, 1, N) summed over its size-1 dim)
        basis = lifted(c.basis, nd).squeeze([d + 1 for d in outer])
        return DiagonalCoefficient(summed.squeeze(outer), basis, c.event, nd - len(outer))
    k = math.prod(c.event)
    lead = summed.shape[: nd - e]
    first = summed.expand(*lead, *c.event).reshape(*lead, k).movedim(-1, 0)
    if not keepdim:
        return first.squeeze([d + 1 for d in outer]) if outer else first
    return first.reshape(k, *lead, *(1,) * e)


Coefficient: TypeAlias = "Tensor | FactoredCoefficient | DiagonalCoefficient"
"""A first-order coefficient, dense or structured; higher orders are dense tensors."""


@dataclass(frozen=True)
class Jet:
    """A value and its Taylor coefficients of orders 1..K along K directions.

    ``coefficients[k - 1]`` is the order-k coefficient: ``(K, *S)`` per direction or ``(1, *S)``
    collapsed (the top order only), ``S`` broadcastable to ``value.shape`` (same number of dims);
    ``None`` where it is zero. The first order is never ``None``, and may be kept factored
    (:class:`FactoredCoefficient`) or diagonal (:class:`DiagonalCoefficient`): :attr:`first`
    multiplies it out, for a rule that does not know the structure.
    """

    value: Tensor
    coefficients: tuple[Coefficient | None, ...]

    @property
    def coefficient(self) -> Coefficient:
        """The first-order coefficient as it is kept (dense or structured)."""
        return cast(Coefficient, self.coefficients[0])

    @functools.cached_property
    def first(self) -> Tensor:
        c = self.coefficient
        return c if isinstance(c, Tensor) else c.dense()

    @property
    def second(self) -> Tensor | None:
        """The order-2 coefficient (``None``: zero, or a first-order jet)."""
        return cast(Tensor | None, self.coefficients[1]) if len(self.coefficients) > 1 else None

    def dense(self, order: int) -> Tensor | None:
        """The order-``order`` coefficient multiplied out (``None``: zero)."""
        return self.first if order == 1 else cast(Tensor | None, self.coefficients[order - 1])


class NotAtThisOrder(Exception):
    """A rule that carries jets up to a lower order than the kernel's: the engine takes the
    exact fallback for the op instead (:func:`~pyhvp.taylor.fallbacks.taylor_fallback`)."""


@dataclass(frozen=True)
class Context:
    """The jets' order and mode: per direction (``collapsed=False``), or the top order summed
    over directions, each weighted by ``weights`` (``(K,)``; ``None``: all 1)."""

    collapsed: bool
    order: int = 2
    weights: Tensor | None = None

    def collapses(self, order: int | None = None) -> bool:
        """Whether coefficients of ``order`` (default: the top) are summed over directions."""
        return self.collapsed and (order is None or order == self.order)

    def summed(self, t: Tensor, order: int | None = None) -> Tensor:
        """A per-direction term of an ``order`` coefficient, summed over directions (weighted)
        where that order is collapsed."""
        if not self.collapses(order):
            return t
        if self.weights is not None:  # in t's dtype: f may compute in another than x's
            t = t * self.weights.to(t.dtype).reshape(-1, *(1,) * (t.ndim - 1))
        return t.sum(0, keepdim=True)

    def product(self, a: Tensor, b: Tensor, order: int | None = None) -> Tensor:
        """The term ``a_k * b_k`` of an ``order`` coefficient (default: the top) from two lower
        coefficients, summed over k where that order is collapsed."""
        return self.summed(a * b, order)

    def square(self, a: Tensor, order: int | None = None) -> Tensor:
        return self.product(a, a, order)

    def pair(self, op: Callable[[Tensor, Tensor], Tensor], a: Tensor, b: Tensor,
             order: int | None = None) -> Tensor:  # fmt: skip
        """``op(a_k, b_k)`` for a bilinear ``op`` that broadcasts the leading axis (summed over
        k where ``order``, default the top, is collapsed)."""
        return self.summed(op(a, b), order)

    def require(self, order: int, what: object) -> None:
        """Refuse (:class:`NotAtThisOrder`) when the jets' order exceeds what a rule carries."""
        if self.order > order:
            raise NotAtThisOrder(f"{what} carries jets up to order {order}, not {self.order}")


@overload
def value_of(arg: Jet | Tensor) -> Tensor: ...
@overload
def value_of(arg: object) -> object: ...
def value_of(arg: object) -> object:
    return arg.value if isinstance(arg, Jet) else arg


def lifted(t: Tensor, ndim: int) -> Tensor:
    """``t`` (leading axis + dims) with unit dims inserted after the leading axis up to
    ``1 + ndim`` dims: aligned for broadcasting against a value of ``ndim`` dims."""
    missing = ndim + 1 - t.ndim
    return t[(slice(None), *(None,) * missing)] if missing else t


def expanded(t: Tensor, shape: Sequence[int], dims: Sequence[int] | None = None) -> Tensor:
    """``t`` with its broadcast dims (all, or those in ``dims``) expanded to ``shape`` (a view)."""
    sizes = list(t.shape)
    for d in range(len(shape)) if dims is None else dims:
        sizes[d + 1] = shape[d]
    return t.expand(sizes)


def plus(*terms: Tensor | None) -> Tensor | None:
    """Sum of the terms that are not None (None: zero); None when all are."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    total = present[0]
    for t in present[1:]:
        total = total + t
    return total


def times_or_none(t: Tensor | None, c: Tensor | float) -> Tensor | None:
    """``t * c``; None (zero) stays None."""
    return None if t is None else t * c


def linear(out: Tensor, u: Jet, fn: Callable[[Tensor], Tensor]) -> Jet:
    """An op linear in its jet input: ``fn`` maps coefficients (leading axis kept)."""
    return Jet(out, tuple(None if c is None else fn(c) for c in dense_coefficients(u)))


def dense_coefficients(u: Jet) -> tuple[Tensor | None, ...]:
    """``u``'s coefficients of orders 1..K, the first multiplied out."""
    return (u.first, *cast(tuple[Tensor | None, ...], u.coefficients[1:]))


def rearrange(out: Tensor, u: Jet, fn: Callable[[Tensor], Tensor]) -> Jet:
    """An op that only moves, selects or repeats elements (a view, an index): ``fn`` commutes
    with elementwise products, so a :class:`FactoredCoefficient` coefficient stays factored."""
    c = u.first if isinstance(u.coefficient, DiagonalCoefficient) else u.coefficient
    if isinstance(c, FactoredCoefficient):
        full = c.factor.expand(u.value.shape)[None]  # the leading axis fn expects
        first: Coefficient = FactoredCoefficient(fn(full)[0], fn(lifted(c.shared, u.value.ndim)))
    else:
        first = fn(c)
    higher = cast(tuple[Tensor | None, ...], u.coefficients[1:])
    return Jet(out, (first, *(None if t is None else fn(t) for t in higher)))


def first_times(u: Jet, d: Tensor, ndim: int) -> Tensor | FactoredCoefficient | DiagonalCoefficient:
    """``u``'s first-order coefficient times an elementwise factor ``d`` (broadcasting to the
    ``ndim``-dim result): kept diagonal, or factored where the coefficient is shared along a dim
    where ``d`` varies (multiplying out would make it K times the value's size)."""
    c = u.coefficient
    if isinstance(c, DiagonalCoefficient):
        shape = torch.broadcast_shapes(u.value.shape, d.shape)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        kept = c.times(d, shape, torch.result_type(u.value, d))
        if kept is not None:
            return kept
        c = u.first
    if isinstance(c, FactoredCoefficient):
        return FactoredCoefficient(times(c.factor, d), lifted(c.shared, ndim))
    t = lifted(c, ndim)
    shape = (1,) * (ndim - d.ndim) + tuple(d.shape)
    if any(t.shape[i + 1] == 1 and n > 1 for i, n in enumerate(shape)):
        return FactoredCoefficient(d.reshape(shape), t)
    return broadcast_times(t, d)


def first_squared(ctx: Context, u: Jet, ndim: int) -> Tensor:
    """``ctx.square`` of ``u``'s first-order coefficient, lifted to ``ndim`` dims."""
    c = u.coefficient
    if isinstance(c, DiagonalCoefficient):
        square = diagonal_squared(ctx, c)
        if isinstance(square, Tensor):
            return lifted(square[None], ndim)
        c = u.first  # a constant diagonal, or per direction: as the dense coefficient
    if isinstance(c, FactoredCoefficient):
        return broadcast_times(
            lifted(ctx.square(lifted(c.shared, c.factor.ndim)), ndim), c.factor * c.factor
        )
    return ctx.square(lifted(c, ndim))


def broadcast_times(t: Tensor, c: Tensor | float) -> Tensor:
    """:func:`times` for a coefficient ``t``, expanded to the broadcast shape first: eagerly, torch
    picks a slow output layout when both operands broadcast along different dims (a
    (16, 1, 64) * (1024, 64) product took 1.37 ms, 0.07 ms once expanded)."""
    if isinstance(c, Tensor):
        t = t.expand(torch.broadcast_shapes(t.shape, c.shape))  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    return times(t, c)


def chain(ctx: Context, out: Tensor, u: Jet, *derivatives: Tensor | None) -> Jet:
    """An elementwise ``y = g(u)`` from ``g``'s derivatives at ``u.value``: ``derivatives[j - 1]
    = g^(j)(u)`` (``None``: zero; the first is a tensor), at least ``ctx.order`` of them (fewer:
    :class:`NotAtThisOrder`; more are not used). Faa di Bruno's formula, ``y_k = sum_j g^(j)
    B_{k,j}(u_1, ..., u_{k-j+1})`` with the partial Bell polynomials ``B``; at second order
    ``y_2 = g' u_2 + g'' u_1^2`` on structured first-order coefficients."""
    if len(derivatives) < ctx.order:
        raise NotAtThisOrder(f"it gives {len(derivatives)} derivatives, order {ctx.order} "
                             f"needs {ctx.order}")  # fmt: skip
    for j, d in enumerate(derivatives[: ctx.order], 1):
        if d is not None and not _broadcasts_to(d.shape, out.shape):
            raise RuntimeError(f"chain: derivative {j} has shape {tuple(d.shape)}, which does "
                               f"not broadcast to the output's {tuple(out.shape)}")  # fmt: skip
    d1 = cast(Tensor, derivatives[0])
    nd = d1.ndim
    first = first_times(u, d1, nd)
    if ctx.order == 1:
        return Jet(out, (first,))
    if ctx.order == 2:
        d2 = derivatives[1]
        second = plus(
            None if u.second is None else broadcast_times(lifted(u.second, nd), d1),
            None if d2 is None else _times_first_squared(ctx, u, d2),
        )
        return Jet(out, (first, second))
    terms = faa_di_bruno(ctx, [None if t is None else lifted(t, nd) for t in dense_coefficients(u)],
                         derivatives[: ctx.order])  # fmt: skip
    return Jet(out, (first, *terms[1:]))


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    try:
        broadcast = torch.broadcast_shapes(shape, target)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    except RuntimeError:
        return False
    return tuple(broadcast) == tuple(target)


def faa_di_bruno(ctx: Context, inner: Sequence[Tensor | None],
                 derivatives: Sequence[Tensor | None]) -> list[Tensor | None]:  # fmt: skip
    """Coefficients 1..K of ``g(u)`` from ``u``'s (``inner``, lifted to the value's dims) and
    ``g^(1..K)(u)``: the partial Bell polynomials by their recurrence ``B_{k,j} = sum_i
    C(k-1, i-1) u_i B_{k-i,j-1}``, per direction (they only hold orders below the top), each
    summed over directions before it meets ``g^(j)`` where its order is collapsed."""
    order = len(derivatives)
    bell: dict[tuple[int, int], Tensor | None] = {(k, 1): inner[k - 1] for k in range(1, order)}
    for k in range(2, order + 1):
        for j in range(2, k + 1):
            bell[k, j] = plus(*(
                times_or_none(_times(inner[i - 1], bell[k - i, j - 1]), math.comb(k - 1, i - 1))
                for i in range(1, k - j + 2)
            ))  # fmt: skip
    out: list[Tensor | None] = []
    for k in range(1, order + 1):
        d1 = derivatives[0]
        top = inner[k - 1]
        terms = [None if top is None or d1 is None else broadcast_times(top, d1)]
        for j in range(2, k + 1):
            b, d = bell[k, j], derivatives[j - 1]
            if b is not None and d is not None:
                terms.append(broadcast_times(ctx.summed(b, k), d))
        out.append(plus(*terms))
    return out


def _times(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return None if a is None or b is None else a * b


def leibniz(ctx: Context, op: Callable[[Any, Any], Tensor], va: object, vb: object,
            ca: Sequence[Tensor | None], cb: Sequence[Tensor | None],
            right: Callable[[Any, Any], Tensor] | None = None,
            both: Callable[[Any, Any], Tensor] | None = None) -> list[Tensor | None]:  # fmt: skip
    """Coefficients 1..K of ``op(a, b)`` for an ``op`` bilinear in ``(a, b)`` that broadcasts a
    leading axis, from the values ``va``, ``vb`` and coefficients ``ca``, ``cb`` (orders 1..K,
    ``None``: zero): ``sum_j C(k, j) op(a_j, b_{k-j})``, the cross terms through
    :meth:`Context.pair`. Coefficients come first in each product with a value (see
    :func:`broadcast_times`). An ``op`` that takes the leading axis only where it is told (a
    convolution under ``vmap``) gives its forms with a value on the left (``right(va, b_k)``)
    and between two coefficients (``both``)."""
    right = right or swap(op)
    both = both or op
    out: list[Tensor | None] = []
    for k in range(1, ctx.order + 1):
        a, b = ca[k - 1], cb[k - 1]
        terms = [None if a is None else op(a, vb), None if b is None else right(b, va)]
        for j in range(1, k):
            aj, bj = ca[j - 1], cb[k - j - 1]
            if aj is not None and bj is not None:
                terms.append(times_or_none(ctx.pair(both, aj, bj, k), math.comb(k, j)))
        out.append(plus(*terms))
    return out


def swap(op: Callable[[Any, Any], Tensor]) -> Callable[[Any, Any], Tensor]:
    """``op`` with its arguments given the other way round (``broadcast_times`` commutes)."""
    return op if op is broadcast_times else lambda b, a: op(a, b)


def _times_first_squared(ctx: Context, u: Jet, d: Tensor) -> Tensor:
    """``d`` times ``ctx.square`` of ``u``'s first-order coefficient; a constant diagonal's
    collapsed square is a number, so it takes no tensor op of its own."""
    c = u.coefficient
    if isinstance(c, DiagonalCoefficient) and ctx.collapsed and not isinstance(c.diagonal, Tensor):
        return cast(Tensor, multiplied(c.diagonal * c.diagonal, d))[None]
    return broadcast_times(first_squared(ctx, u, d.ndim), d)


def axis(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


Dims: TypeAlias = "int | Sequence[int] | None"
"""Reduction dims as aten ops take them: one, several, or None (or ``[]``) for all."""


def axes(dims: Dims, ndim: int) -> list[int]:
    """Normalised reduction dims; None or [] mean all."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({axis(d, ndim) for d in dims})


def broadcast_dims(t: Tensor, shape: Sequence[int]) -> list[int]:
    """Value dims along which the coefficient ``t`` is broadcast (size 1, value larger)."""
    return [d for d, n in enumerate(shape) if t.shape[d + 1] == 1 and n != 1]


def coefficient_of(arg: object, ndim: int, order: int) -> Tensor | None:
    """``arg``'s order-``order`` coefficient lifted to ``ndim`` value dims; None for a constant
    or a zero coefficient."""
    if not isinstance(arg, Jet):
        return None
    t = arg.dense(order)
    return None if t is None else lifted(t, ndim)


def coefficients_of(arg: object, ndim: int, order: int) -> list[Tensor | None]:
    """:func:`coefficient_of` for orders 1..``order``."""
    return [coefficient_of(arg, ndim, k) for k in range(1, order + 1)]
