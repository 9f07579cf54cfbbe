"""Rules for ops that have no dedicated one, built from ``torch.func`` on that op alone:
elementwise ops (``Tag.pointwise``) by their elementwise derivatives; every other op by its
Jacobian and Hessian in reverse mode (one matrix at a time for batched ``torch.linalg`` ops) --
exact, or refused with :class:`UnsupportedOpError`, which names the op. PyTorch's nested forward
mode (``jvp`` of ``jvp``) is not used for whole ops: it segfaulted on ``mse_loss`` and got
``cholesky_inverse`` wrong; an elementwise op without a double backward takes forward over
forward on its elements only. Ops linear in their inputs go through the op itself
(:func:`linear_rule`)."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.func import grad, jacrev, jvp, vmap
from torch.utils import _pytree as pytree

from pyhvp._torch_warnings import forward_mode_decompositions_loaded
from pyhvp.taylor.custom_ops import WITHOUT_THIRD_DERIVATIVES
from pyhvp.taylor.jets import (
    Context,
    Jet,
    broadcast_times,
    chain,
    coefficient_of,
    dense_coefficients,
    expanded,
    lifted,
    plus,
    rearrange,
    strong,
    value_of,
)

Tensor = torch.Tensor


class UnsupportedOpError(RuntimeError):
    """An op of ``f`` that the Taylor engine cannot carry exactly; the message names it and says
    what to do instead."""


def substitute(
    op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    zero_constants: bool = False,
) -> tuple[Callable[..., Any], tuple[Tensor, ...], list[Jet]]:  # fmt: skip
    """``op`` as a function of its jet inputs' values (everything else fixed; floating tensors
    that are not jets replaced by zeros with ``zero_constants``)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Jet)]
    jets = [leaves[i] for i in positions]
    fixed = [
        torch.zeros_like(leaf)
        if zero_constants and isinstance(leaf, Tensor) and leaf.is_floating_point()
        else value_of(leaf)
        for leaf in leaves
    ]

    def fn(*values: Tensor) -> Any:
        current = list(fixed)
        for i, v in zip(positions, values, strict=True):
            current[i] = v
        a, k = pytree.tree_unflatten(current, spec)
        return op(*a, **k)

    return fn, tuple(j.value for j in jets), jets


def _refuse_undifferentiated(op: object, fn: Callable[..., Any], primals: tuple[Tensor, ...]
                             ) -> None:  # fmt: skip
    """Raise where torch marks ``op`` non-differentiable (``special.bessel_j0``, the Airy and
    orthogonal-polynomial functions): its output carries no gradient, and ``torch.func`` takes
    its derivatives as zeros, which the fallbacks returned as the op's (the Laplacian of
    ``legendre_polynomial_p(x, 3)``: 0 for 15 x)."""
    with torch.enable_grad():
        outputs = pytree.tree_leaves(fn(*(p.detach().requires_grad_() for p in primals)))
    floating = [o for o in outputs if isinstance(o, Tensor) and o.is_floating_point()]
    if floating and not any(o.requires_grad for o in floating):
        raise UnsupportedOpError(
            f"pyhvp: torch does not differentiate {op} (autograd and torch.func take its "
            f"derivatives as 0, which are not its own). Register a jet rule for it "
            f"(pyhvp.register_jet_rule), or write f without it"
        )


def _elementwise_derivatives(
    fn: Callable[..., Tensor], primals: tuple[Tensor, ...], shape: Sequence[int]
) -> tuple[list[Tensor], dict[tuple[int, int], Tensor]]:
    """An elementwise ``fn``'s partial derivatives ``g_i`` and ``h_ij`` (i <= j), each of the
    output's shape: reverse over reverse, or forward over forward where a double backward is
    missing (each output element depends on one element of each input)."""
    spread = tuple(p.expand(shape) for p in primals)
    every = tuple(range(len(primals)))

    def total(*p: Tensor) -> Tensor:
        return fn(*p).sum()

    try:
        gradient = list(grad(total, argnums=every)(*spread))
        hessian = {}
        for i in every:
            row = grad(lambda *p, i=i: grad(total, argnums=i)(*p).sum(), argnums=every[i:])(*spread)
            hessian.update({(i, j): h for j, h in zip(every[i:], row, strict=True)})
        return gradient, hessian
    except NotImplementedError:
        pass
    forward_mode_decompositions_loaded()
    units = [tuple(torch.ones_like(p) if j == i else torch.zeros_like(p) for j, p in
                   enumerate(spread)) for i in every]  # fmt: skip

    def along(i: int) -> Callable[..., Tensor]:
        return lambda *p: jvp(fn, p, units[i])[1]

    gradient = [along(i)(*spread) for i in every]
    hessian = {(i, j): jvp(along(i), spread, units[j])[1] for i in every for j in every[i:]}
    return gradient, hessian


def pointwise_fallback(ctx: Context, op: Callable[..., Any], out: Tensor, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Jet:  # fmt: skip
    """An elementwise op of one or more jet inputs, by the chain rule with its elementwise
    gradient and Hessian (from ``torch.func`` on the op alone)."""
    fn, primals, jets = substitute(op, args, kwargs)
    _refuse_undifferentiated(op, fn, primals)
    if ctx.order > 2:
        if len(jets) > 1:
            try:
                return pointwise_taylor(ctx, fn, primals, jets, out)
            except Exception as error:  # autograd has no derivative of that order for it
                raise _no_derivatives(op, error, ctx.order) from error
        try:
            derivatives = elementwise_derivatives(fn, primals[0].expand(out.shape), ctx.order)
        except Exception as error:  # autograd has no derivative of that order for it
            raise _no_derivatives(op, error) from error
        return chain(ctx, out, jets[0], *derivatives)
    try:
        gradient, hessian = _elementwise_derivatives(fn, primals, out.shape)
    except Exception as error:  # autograd has no (double) derivative for it
        raise _no_derivatives(op, error) from error
    nd = out.ndim
    firsts = [lifted(j.first, nd) for j in jets]
    first = plus(*(broadcast_times(f, g) for g, f in zip(gradient, firsts, strict=True)))
    second = plus(
        *(
            broadcast_times(lifted(j.second, nd), g)
            for g, j in zip(gradient, jets, strict=True)
            if j.second is not None
        )
    )
    if ctx.order == 1:
        return Jet(out, (first,))
    for (i, j), h in hessian.items():
        term = broadcast_times(ctx.product(firsts[i], firsts[j]), h)
        second = plus(second, term if i == j else 2 * term)
    return Jet(out, (first, second))  # a sum over the jets: the first is not None


def elementwise_derivatives(fn: Callable[[Tensor], Tensor], u: Tensor,
                            order: int) -> list[Tensor | None]:  # fmt: skip
    """``fn^(1..order)(u)`` of an elementwise ``fn`` by nested ``torch.func.grad`` of its sum
    (each element's derivative is its own: the sum's gradient)."""
    derivative: Callable[[Tensor], Tensor] = fn
    out: list[Tensor | None] = []
    for _ in range(order):
        derivative = _gradient_of(derivative)
        out.append(derivative(u))
    return out


def _gradient_of(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def total(t: Tensor) -> Tensor:
        return fn(t).sum()

    return cast(Callable[[Tensor], Tensor], grad(total))


def pointwise_taylor(ctx: Context, fn: Callable[..., Tensor], primals: tuple[Tensor, ...],
                     jets: list[Jet], out: Tensor) -> Jet:  # fmt: skip
    """An elementwise op of several jet inputs at any order, per direction along its inputs'
    Taylor polynomials: ``h(t) = fn(u_1(t), ..., u_m(t))``, ``u_i(t) = sum_k u_ik t^k / k!``,
    whose derivatives at 0 are the coefficients (nested ``torch.func.grad`` of the sum over
    elements and directions: one chain of derivatives of one variable, where every mixed partial
    of ``fn`` composed by Faa di Bruno's formula traced about 25 times as many ops at sixth
    order). A collapsed top order ``K`` differentiates the polynomials truncated below ``K``
    ``K`` times, sums that over directions and adds ``fn``'s gradient times the inputs' summed
    top coefficients: the only term of ``h^(K)`` that holds an order-``K`` coefficient."""
    nd, top = out.ndim, ctx.order - 1 if ctx.collapses() else ctx.order
    coefficients = [[coefficient_of(j, nd, k) for k in range(1, ctx.order + 1)] for j in jets]
    spread = tuple(p.expand(out.shape) for p in primals)
    lead = max((c.shape[0] for cs in coefficients for c in cs[:top] if c is not None), default=1)

    def polynomial(value: Tensor, cs: list[Tensor | None], t: Tensor) -> Tensor:
        """``value + sum_k cs[k - 1] t^k / k!`` (k <= top), by Horner's rule."""
        series = None
        for k in range(top, 0, -1):
            series = plus(cs[k - 1], None if series is None else series * (t / (k + 1)))
        return value if series is None else value + t * series

    def along(t: Tensor) -> Tensor:
        return fn(*(polynomial(v, cs, t) for v, cs in zip(spread, coefficients, strict=True)))

    terms = elementwise_derivatives(along, out.new_zeros((lead, *out.shape)), ctx.order)
    if top < ctx.order:  # the top derivative of the truncated polynomials lacks only g . u_K
        gradient = grad(lambda *p: fn(*p).sum(), argnums=tuple(range(len(spread))))(*spread)
        terms[-1] = plus(ctx.summed(cast(Tensor, terms[-1])), *(
            None if cs[-1] is None else broadcast_times(cs[-1], g)
            for cs, g in zip(coefficients, gradient, strict=True)
        ))  # fmt: skip
    return Jet(out, tuple(terms))


def composed(ctx: Context, contract: Callable[[list[list[Tensor | None]]], Tensor | None],
             coefficients: list[list[Tensor | None]]) -> list[Tensor | None]:  # fmt: skip
    """Coefficients 1..K of ``g(u_1, ..., u_m)`` from the inputs' (``coefficients[i][k - 1]``:
    input ``i``'s order-``k`` one) and ``contract(vectors)``, which applies the ``p``-th
    derivative of ``g`` to ``p`` vectors (``vectors[r][i]``: position ``r``'s coefficient of
    input ``i``): the multivariate Faa di Bruno formula ``h_k = sum over compositions (j_1, ...,
    j_p) of k of k! / (p! j_1! ... j_p!) D^p g [u_{j_1}, ..., u_{j_p}]``, each term of ``p >=
    2`` factors summed over directions where its order is collapsed."""
    out: list[Tensor | None] = []
    for k in range(1, ctx.order + 1):
        terms = []
        for parts in _compositions(k):
            vectors = [[c[j - 1] for c in coefficients] for j in parts]
            term = contract(vectors)
            if term is None:
                continue
            weight = math.factorial(k) / (math.factorial(len(parts))
                                          * math.prod(math.factorial(j) for j in parts))  # fmt: skip
            term = ctx.summed(term, k) if len(parts) > 1 else term
            terms.append(term if weight == 1 else term * weight)
        out.append(plus(*terms))
    return out


@functools.cache
def _compositions(total: int) -> list[tuple[int, ...]]:
    """The ordered tuples of positive integers summing to ``total`` (``2^(total - 1)``)."""
    if total == 0:
        return [()]
    return [(first, *rest) for first in range(1, total + 1)
            for rest in _compositions(total - first)]  # fmt: skip


def general_fallback(ctx: Context, op: Callable[..., Any], out: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """Any op, from its Jacobian and Hessian by reverse mode (double backward: PyTorch's most
    tested path) -- one matrix at a time for batched matrix ops; an op whose Hessian's
    computation would hold more than :data:`REVERSE_FALLBACK_LIMIT` numbers
    (:func:`_reverse_work`) is refused, naming it."""
    fn, primals, jets = substitute(op, args, kwargs)
    _refuse_undifferentiated(op, fn, primals)
    outputs, spec = pytree.tree_flatten(out)
    smooth = [i for i, o in enumerate(outputs) if isinstance(o, Tensor) and o.is_floating_point()]

    def smooth_fn(*values: Tensor) -> tuple[Tensor, ...]:
        flat = pytree.tree_leaves(fn(*values))
        return tuple(flat[i] for i in smooth)

    firsts = [expanded(lifted(j.first, j.value.ndim), j.value.shape) for j in jets]
    seconds = None
    if any(j.second is not None for j in jets):
        lead = next(j.second.shape[0] for j in jets if j.second is not None)
        seconds = [
            j.value.new_zeros(()).expand(lead, *j.value.shape)
            if j.second is None
            else expanded(lifted(j.second, j.value.ndim), j.value.shape)
            for j in jets
        ]
    smooth_outputs = [outputs[i] for i in smooth]
    batch = _matrix_batch(op, args, kwargs, smooth_outputs)
    instances = math.prod(batch)
    if ctx.order > 2:
        return _higher_order_fallback(ctx, op, args, kwargs, out, smooth, batch)
    if all(o.numel() == 0 for o in smooth_outputs):  # no entries (an empty batch): no
        return out  # derivatives to take, and vmap over 0 matrices cannot reshape them
    each = max(instances, 1)
    needed = each * _reverse_work(sum(o.numel() for o in smooth_outputs) // each,
                                 sum(p.numel() for p in primals) // each)  # fmt: skip
    try:
        if needed <= REVERSE_FALLBACK_LIMIT and batch:
            coefficients = _reverse_per_instance(ctx, op, args, kwargs, smooth, batch, firsts,
                                                 seconds)  # fmt: skip
        elif needed <= REVERSE_FALLBACK_LIMIT:
            coefficients = _reverse_coefficients(ctx, smooth_fn, primals, firsts, seconds)
        else:
            raise UnsupportedOpError(
                f"pyhvp: {op} has no jet rule, and the reverse-mode fallback would hold about "
                f"{needed} numbers at once computing its dense Hessian (autograd's double "
                f"backward, batched over outputs x inputs x outputs cotangents), over the limit "
                f"{REVERSE_FALLBACK_LIMIT}. "
                f"Register a rule for it (pyhvp.register_jet_rule; linear=True if it is linear "
                f"in its floating inputs), apply f to fewer elements at a time, or use an "
                f"estimator built on Hessian-vector products (laplacian(..., method='hutch++'), "
                f"hessian_diagonal(..., method='hutchinson' or 'diag++'))"
            )
    except UnsupportedOpError:
        raise
    except Exception as error:  # autograd has no (double) derivative for it, or it raised
        raise _no_derivatives(op, error) from error
    first, second = coefficients
    if _packet_name(op) in WITHOUT_THIRD_ORDER:
        first = [WITHOUT_THIRD_DERIVATIVES(c, str(op)) for c in first]
        second = [WITHOUT_THIRD_DERIVATIVES(c, str(op)) for c in second]
    result = list(outputs)
    for i, f1, f2 in zip(smooth, first, second, strict=True):
        result[i] = Jet(outputs[i], (f1, f2)[: ctx.order])
    return pytree.tree_unflatten(result, spec)


def _higher_order_fallback(ctx: Context, op: Callable[..., Any], args: tuple[Any, ...],
                           kwargs: dict[str, Any], out: Any, smooth: list[int],
                           batch: tuple[int, ...]) -> Any:  # fmt: skip
    """:func:`general_fallback` above second order: the op's dense derivative tensors up to the
    order (``jacrev`` nested, reverse mode only; one matrix at a time for batched matrix ops)
    composed with the inputs' Taylor coefficients (:func:`composed`); refused past
    :data:`REVERSE_FALLBACK_LIMIT` numbers in the largest tensor."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(value_of(leaf), Tensor)]
    jets = [i for i in tensors if isinstance(leaves[i], Jet)]
    outputs = pytree.tree_leaves(out)
    count, nb = math.prod(batch), len(batch)
    if ctx.order > DENSE_FALLBACK_ORDER:
        raise UnsupportedOpError(
            f"pyhvp: {op} has no jet rule of order {ctx.order}, and its reverse-mode fallback "
            f"goes to order {DENSE_FALLBACK_ORDER} only (autograd's derivatives of that op, "
            f"nested {ctx.order} times, grow beyond what a kernel can hold). Register a rule "
            f"for it (pyhvp.register_jet_rule), or write f without it"
        )
    if all(outputs[i].numel() == 0 for i in smooth):  # no entries, no derivatives to take
        return out
    sizes_in = sum(value_of(leaves[i]).numel() for i in jets) // max(count, 1)
    sizes_out = sum(outputs[i].numel() for i in smooth) // max(count, 1)
    if _packet_name(op) in MATRIX_OPS and sizes_in > LARGEST_MATRIX_ABOVE_SECOND_ORDER:
        raise UnsupportedOpError(
            f"pyhvp: {op} has no jet rule of order {ctx.order}, and the reverse-mode fallback "
            f"carries matrix decompositions above second order for matrices of at most "
            f"{LARGEST_MATRIX_ABOVE_SECOND_ORDER} entries (autograd's derivatives of theirs, "
            f"nested {ctx.order} times, outgrow memory: a 3x3 svd over 3 GB); this one has "
            f"{sizes_in}. Register a rule for it (pyhvp.register_jet_rule), or use an operator "
            f"of second order (laplacian, hessian_diagonal), which has one"
        )
    if ctx.order > 3 and _packet_name(op) in NO_FOURTH_ORDER_FALLBACK:
        raise UnsupportedOpError(
            f"pyhvp: {op} has no jet rule of order {ctx.order}, and the reverse-mode fallback "
            f"carries matrix decompositions above second order only where it fits in memory: "
            f"it does not carry this one above third order at any size (autograd's derivatives "
            f"of its backward, nested {ctx.order} times, outgrow memory for 2x2 matrices: "
            f"over 3.5 GB for two). Register a rule for it (pyhvp.register_jet_rule), or use an "
            f"operator of order 3 or less (laplacian, directional_derivatives(order=3))"
        )
    needed = (sizes_in + sizes_out) * sizes_in**ctx.order * max(count, 1)
    if needed > HIGHER_ORDER_FALLBACK_LIMIT:
        raise UnsupportedOpError(
            f"pyhvp: {op} has no jet rule of order {ctx.order}, and the reverse-mode fallback "
            f"would go over the limit of its work: autograd's derivatives of order "
            f"{ctx.order} in all {sizes_in} inputs of each of its {max(count, 1)} "
            f"instance(s), about {needed} numbers, over {HIGHER_ORDER_FALLBACK_LIMIT}. "
            f"Register a rule for it (pyhvp.register_jet_rule), or apply f to fewer elements "
            f"at a time"
        )
    # each present coefficient, full-shaped, batch dims (of a matrix op) as one
    present = [(n, k) for n, i in enumerate(jets)
               for k, c in enumerate(dense_coefficients(leaves[i])) if c is not None]  # fmt: skip

    def instances(t: Tensor, lead: int) -> Tensor:
        return t.reshape(*t.shape[:lead], count, *t.shape[lead + nb :]) if nb else t

    values = [instances(value_of(leaves[i]), 0) for i in tensors]
    flat = []
    for n, k in present:
        jet = leaves[jets[n]]
        c = cast(Tensor, dense_coefficients(jet)[k])
        flat.append(instances(expanded(lifted(c, jet.value.ndim), jet.value.shape), 1))

    def one(values: list[Tensor], flat: list[Tensor]) -> tuple[tuple[Tensor, ...], ...]:
        fn, primals = _in_jets(op, leaves, spec, tensors, values, jets, smooth)
        coefficients: list[list[Tensor | None]] = [[None] * ctx.order for _ in jets]
        for (n, k), c in zip(present, flat, strict=True):
            coefficients[n][k] = c
        return _dense_taylor(ctx, fn, primals, coefficients)

    try:
        if nb:
            per_order = vmap(one, in_dims=(0, 1), out_dims=1)(values, flat)
            per_order = tuple(tuple(t.reshape(t.shape[0], *batch, *t.shape[2:]) for t in ts)
                              for ts in per_order)  # fmt: skip
        else:
            per_order = one(values, flat)
    except UnsupportedOpError:
        raise
    except Exception as error:  # autograd has no derivatives of that order for it
        raise _no_derivatives(op, error, ctx.order) from error
    result = list(outputs)
    for n, i in enumerate(smooth):
        result[i] = Jet(outputs[i], tuple(per_order[k][n] for k in range(ctx.order)))
    return pytree.tree_unflatten(result, pytree.tree_structure(out))


def _dense_taylor(ctx: Context, fn: Callable[..., tuple[Tensor, ...]],
                  primals: tuple[Tensor, ...], coefficients: list[list[Tensor | None]]
                  ) -> tuple[tuple[Tensor, ...], ...]:  # fmt: skip
    """Per order, per output of ``fn``: its Taylor coefficients from the dense derivative
    tensors of ``fn`` (inputs and outputs packed into one vector each) and the inputs'
    coefficients (full-shaped, ``(lead, *input)``)."""
    outputs, sizes = fn(*primals), [p.numel() for p in primals]
    packed, flat, _, outs = _packed(fn, primals, outputs)
    derivatives, derivative = [], packed
    for _ in range(ctx.order):
        derivative = cast(Callable[[Tensor], Tensor], jacrev(derivative))
        derivatives.append(derivative(flat))  # (outputs, inputs, ..., inputs)
    dtype = derivatives[0].dtype

    def contract(vectors: list[list[Tensor | None]]) -> Tensor | None:
        if any(all(c is None for c in v) for v in vectors):
            return None
        lead = max(c.shape[0] for v in vectors for c in v if c is not None)
        t = derivatives[len(vectors) - 1]
        for r, v in enumerate(reversed(vectors)):  # the last input axis with each vector
            packed_v = torch.cat([
                (p.new_zeros(()).expand(lead, n) if c is None else
                 c.reshape(c.shape[0], n).to(dtype).expand(lead, n))
                for c, p, n in zip(v, primals, sizes, strict=True)
            ], -1)  # fmt: skip
            t = torch.einsum("...a,ka->k..." if r == 0 else "k...a,ka->k...", t, packed_v)
        return t  # (lead, outputs)

    total = composed(ctx, contract, coefficients)
    per_order = []
    for t in total:
        per_order.append(tuple(
            (t[:, span] if t is not None else flat.new_zeros((1, o.numel()))).reshape(
                -1, *o.shape).to(o.dtype)
            for span, o in zip(outs, outputs, strict=True)
        ))  # fmt: skip
    return tuple(per_order)


def _no_derivatives(op: object, error: Exception, order: int = 2) -> UnsupportedOpError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, MemoryError) or "can't allocate memory" in reason:
        why = "its dense derivatives need more memory than there is"
    elif "tracing tensor" in reason or "data-dependent" in reason:
        why = "its derivatives branch on the values, which a kernel cannot trace"
    elif "setup_context" in reason:  # (torch's word for an op with no autograd formula)
        why = ("it has no derivative formula (a torch.library.custom_op without "
               "register_autograd)")  # fmt: skip
    elif order > 2:
        why = f"autograd cannot give its derivatives of order {order} here"
    else:
        why = "autograd cannot give its second derivatives here"
    return UnsupportedOpError(
        f"pyhvp: {op} has no jet rule of this order, and {why} ({type(error).__name__}: "
        f"{reason}). "
        f"Register a rule for it (pyhvp.register_jet_rule; pyhvp.taylor.chain takes "
        f"derivatives of every order), or write f without it"
    )


def _packet_name(op: object) -> str | None:
    schema = getattr(op, "_schema", None)
    return None if schema is None else schema.name.partition("::")[2]


WITHOUT_THIRD_ORDER = frozenset({"ormqr", "linalg_householder_product"})
"""Ops whose fallback coefficients autograd does not differentiate correctly (the OpInfo sweep:
their backward formulas write in place, or give wrong third derivatives once functionalized): the
gradient of a result through them is refused."""

DENSE_FALLBACK_ORDER = 4
"""The highest order the dense reverse-mode fallback carries: ``jacrev`` nested that many
times over an op's autograd formulas (the graph grows about threefold with each nesting: a 2x2
``eigvalsh`` at order 6 took over 20 GB to trace)."""

LARGEST_MATRIX_ABOVE_SECOND_ORDER = 4
"""The most entries a matrix op (:data:`MATRIX_OPS`) may have per instance for the dense
fallback above second order: 2x2 (eigvalsh, det, inverse of 2x2 blocks). Nested ``jacrev`` of
the decompositions' backward formulas outgrows memory well before the work estimate below says
so (a 3x3 ``svd``, ``lu_solve`` or ``solve_triangular`` at fourth order: over 3 GB)."""

NO_FOURTH_ORDER_FALLBACK = frozenset({"_linalg_svd", "linalg_qr", "linalg_lu"})
"""Matrix ops the dense fallback refuses above third order even at 2x2: nested ``jacrev``
through their backward formulas passed 3.5 GB for ``svd``, ``qr`` and ``lu`` of two 2x2
matrices (with 5 GB of address space: refused only when an allocation failed, after 10-20 s;
``matrix_exp`` asked for 16 GB more after holding 12.7, and has a rule of every order since).
At third order each takes under 0.6 GB."""

HIGHER_ORDER_FALLBACK_LIMIT = 2**18
"""Most numbers the dense fallback above second order may make, estimated as ``(inputs +
outputs) * inputs^order`` per instance: ``jacrev`` nested ``order`` times holds the op's
intermediates once per basis tuple, and runs their backward as often (a 5x5 ``eigvalsh`` at
order 4, 12 million by this count, took over 3 GB; a 5x5 ``svd`` over two minutes). A 3x3
matrix op at fourth order is about 150 thousand."""

REVERSE_FALLBACK_LIMIT = 2**26
"""Most numbers the reverse-mode fallback may hold at once computing one op's dense Hessian
(:func:`_reverse_work`; summed over the instances of the batched matrix ops of
:data:`MATRIX_OPS`)."""


def _reverse_work(outputs: int, inputs: int) -> int:
    """Numbers of the largest tensors ``jacrev(jacrev(op))`` holds for an op of ``inputs`` and
    ``outputs`` numbers: the outer ``jacrev`` runs the op's double backward batched over
    ``outputs * inputs`` cotangents of the Jacobian, the inner over ``outputs``, each tensor of
    the op's size -- not the Hessian's ``outputs * inputs^2``, which an ``adaptive_max_pool1d``
    of 512 inputs passed before it asked for 34 GB. Measured peaks are 1-3 such tensors
    (``sort``, ``cumprod``, ``adaptive_max_pool1d``), 11 for ``logcumsumexp``."""
    return outputs * outputs * inputs * max(inputs, outputs)


MATRIX_OPS = frozenset(
    {
        "linalg_lu", "linalg_lu_factor_ex", "linalg_lu_solve", "lu_unpack", "linalg_qr",
        "_linalg_svd", "linalg_eig", "_linalg_eigh", "linalg_eigvals", "linalg_cholesky_ex",
        "linalg_inv_ex", "linalg_matrix_exp", "linalg_solve_triangular", "triangular_solve",
        "cholesky_solve", "cholesky_inverse", "linalg_householder_product",
        "linalg_ldl_factor_ex", "linalg_ldl_solve", "_linalg_det", "_linalg_slogdet",
        "_linalg_solve_ex", "linalg_matrix_power", "geqrf", "linalg_pinv", "linalg_lstsq",
        "cholesky",
    }
)  # fmt: skip
"""Ops on ``(*, m, n)`` matrices whose leading dims ``*`` are batch dims: each matrix is
computed alone (PyTorch's documented convention for torch.linalg)."""


def _in_jets(op: Callable[..., Any], leaves: list[Any], spec: pytree.TreeSpec,
             tensors: list[int], values: list[Tensor], jets: list[int], smooth: list[int],
             ) -> tuple[Callable[..., tuple[Tensor, ...]], tuple[Tensor, ...]]:  # fmt: skip
    """``op`` as a function of its jet arguments alone, its tensor arguments (``leaves[i]`` for
    ``i`` in ``tensors``) set to ``values`` (one instance's), returning its ``smooth`` outputs;
    and the jet arguments' values, where the reverse fallbacks differentiate it."""
    fixed = [value_of(leaf) for leaf in leaves]
    for i, v in zip(tensors, values, strict=True):
        fixed[i] = v

    def fn(*primals: Tensor) -> tuple[Tensor, ...]:
        current = list(fixed)
        for i, v in zip(jets, primals, strict=True):
            current[i] = v
        a, kw = pytree.tree_unflatten(current, spec)
        results = pytree.tree_leaves(op(*a, **kw))
        return tuple(results[i] for i in smooth)

    return fn, tuple(fixed[i] for i in jets)


def _matrix_batch(op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  outputs: list[Tensor]) -> tuple[int, ...]:  # fmt: skip
    """The batch dims over which the reverse-mode fallback may run one matrix at a time: the
    leading dims of the op's first tensor argument but its last two, when ``op`` is one of
    :data:`MATRIX_OPS` and every tensor argument and output starts
    with them (no broadcasting); ``()`` otherwise."""
    if _packet_name(op) not in MATRIX_OPS:
        return ()
    tensors = [value_of(t) for t in pytree.tree_leaves((args, kwargs))]
    tensors = [t for t in tensors if isinstance(t, Tensor)]
    batch = tuple(tensors[0].shape[:-2])
    if all(tuple(t.shape[: len(batch)]) == batch for t in tensors + outputs):
        return batch
    return ()


def _reverse_per_instance(ctx: Context, op: Callable[..., Any], args: tuple[Any, ...],
                          kwargs: dict[str, Any], smooth: list[int], batch: tuple[int, ...],
                          firsts: list[Tensor], seconds: list[Tensor] | None,
                          ) -> tuple[Sequence[Tensor], Sequence[Tensor]]:  # fmt: skip
    """:func:`_reverse_coefficients` vmapped over the batch dims of a batched matrix op: one
    matrix's Jacobian and Hessian at a time, not the whole batch's (which is block-diagonal,
    and (batch size)^2 broadcast_times larger)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(value_of(leaf), Tensor)]
    jets = [i for i in tensors if isinstance(leaves[i], Jet)]
    count, nb = math.prod(batch), len(batch)

    def instances(t: Tensor, lead: int) -> Tensor:  # batch dims (after ``lead`` dims) as one
        return t.reshape(*t.shape[:lead], count, *t.shape[lead + nb :])

    def one(
        values: list[Tensor], t1: list[Tensor], t2: list[Tensor] | None
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        fn, primals = _in_jets(op, leaves, spec, tensors, values, jets, smooth)
        first, second = _reverse_coefficients(ctx, fn, primals, t1, t2)
        return tuple(first), tuple(second)

    values = [instances(value_of(leaves[i]), 0) for i in tensors]
    t1 = [instances(t, 1) for t in firsts]
    if seconds is None:
        first, second = vmap(lambda v, a: one(v, a, None), in_dims=(0, 1), out_dims=1)(values, t1)
    else:
        t2 = [instances(t, 1) for t in seconds]
        first, second = vmap(one, in_dims=(0, 1, 1), out_dims=1)(values, t1, t2)
    return (
        [f.reshape(f.shape[0], *batch, *f.shape[2:]) for f in first],
        [s.reshape(s.shape[0], *batch, *s.shape[2:]) for s in second],
    )


def _reverse_coefficients(ctx: Context, fn: Callable[..., tuple[Tensor, ...]],
                          primals: tuple[Tensor, ...], firsts: list[Tensor],
                          seconds: list[Tensor] | None,
                          ) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    """From the op's dense Jacobian and Hessian (reverse over reverse), inputs flattened."""
    outputs, sizes = fn(*primals), [p.numel() for p in primals]
    packed, flat, ins, outs = _packed(fn, primals, outputs)
    whole_jacobian = jacrev(packed)(flat)  # (outputs, inputs)
    whole_hessian = jacrev(jacrev(packed))(flat)  # (outputs, inputs, inputs)
    jacobian = [[whole_jacobian[o, i] for i in ins] for o in outs]  # [output][input]
    hessian = [[[whole_hessian[o, i, j] for j in ins] for i in ins] for o in outs]
    dtype = whole_jacobian.dtype  # the coefficients' may differ: a dtype conversion

    def flat_coefficients(c: Tensor, i: int) -> Tensor:
        return c.reshape(c.shape[0], sizes[i]).to(dtype)

    moving, curving = _moving(firsts, seconds, sizes)
    first, second = [], []
    for o, value in enumerate(outputs):
        size = value.numel()
        f: Tensor | int = 0  # sums over firsts, which is not empty: tensors once summed
        s: Tensor | int = 0
        for i, t in enumerate(firsts):
            j_oi = _where_curved(jacobian[o][i].reshape(size, sizes[i]), moving[i]).T
            f = f + flat_coefficients(t, i) @ j_oi
            if seconds is not None:
                s = s + flat_coefficients(seconds[i], i) @ j_oi
            for j, u in enumerate(firsts):
                h = hessian[o][i][j].reshape(size, sizes[i], sizes[j])
                h = _where_curved(_where_curved(h, curving[j]).mT, curving[i]).mT
                # a variable the op is linear in contributes nothing, even where its first
                # derivative is not finite (autograd's at a pole: NaN * 0 would be NaN)
                left = _where_curved(flat_coefficients(t, i), h.ne(0).any(0).any(1))
                right = _where_curved(flat_coefficients(u, j), h.ne(0).any(0).any(0))
                quad = torch.einsum("ka,oab,kb->ko", left, h, right)
                s = s + ctx.summed(quad)  # weighted: a differential operator's terms
        first.append(
            cast(Tensor, f).reshape(cast(Tensor, f).shape[0], *value.shape).to(value.dtype)
        )
        second.append(
            cast(Tensor, s).reshape(cast(Tensor, s).shape[0], *value.shape).to(value.dtype)
        )
    return first, second


def linear_rule(
    op: Callable[..., Any], indexing: bool = False, jointly: bool = False
) -> Callable[..., Any]:
    """The rule of an op that is linear in its inputs that depend on ``x`` (the others held
    fixed: a convolution's kernel) or, with ``jointly``, in all its floating tensor inputs taken
    together (a scatter into a constant tensor: the constants' coefficients are zeros): each
    coefficient goes through the op itself, batched over directions with ``vmap``. ``indexing``
    (the op only moves, selects or repeats the elements of its one floating input): a factored
    coefficient stays factored. No autograd is involved, and nothing is dense."""

    def rule(ctx: Context, out: Any, *args: object, **kwargs: object) -> Any:
        on, _, jets = substitute(op, args, kwargs, zero_constants=jointly)
        floating = [o.is_floating_point() for o in pytree.tree_leaves(out)]
        if indexing and len(jets) == 1 and isinstance(out, Tensor):
            u = jets[0]
            return rearrange(out, u, lambda t: vmap(on)(expanded(t, u.value.shape)))

        def through(order: int) -> list[Tensor | None]:
            present = [coefficient_of(j, j.value.ndim, order) for j in jets]
            if all(c is None for c in present):
                return [None] * len(floating)
            lead = max(c.shape[0] for c in present if c is not None)
            full = [
                j.value.new_zeros(()).expand(lead, *j.value.shape)
                if c is None
                else expanded(c, j.value.shape).expand(lead, *j.value.shape)
                for j, c in zip(jets, present, strict=True)
            ]
            return pytree.tree_leaves(vmap(on)(*full))

        per_order = [through(k) for k in range(1, ctx.order + 1)]
        result = [
            Jet(o, tuple(c[n] for c in per_order)) if smooth else o  # a jet input: first given
            for n, (o, smooth) in enumerate(zip(pytree.tree_leaves(out), floating, strict=True))
        ]
        return pytree.tree_unflatten(result, pytree.tree_structure(out))

    return rule


def _where_curved(coefficients: Tensor, curved: Tensor | None) -> Tensor:
    """``coefficients`` where ``curved`` (along the last dim), zero elsewhere; all where None."""
    if curved is None:
        return coefficients
    return torch.where(curved, coefficients, coefficients.new_zeros(()))


def _moving(firsts: list[Tensor], seconds: list[Tensor] | None, sizes: list[int]
            ) -> tuple[list[Tensor | None], list[Tensor | None]]:  # fmt: skip
    """Under strong zeros (:func:`~pyhvp.taylor.jets.strong_zeros`), which elements of each
    input (flattened) have a first- or second-order coefficient that is not zero in some
    direction, and which a first-order one: the op's Jacobian and Hessian are dropped at the
    others, where they may be infinite (``logcumsumexp`` at a masked ``-inf``) and meet only
    zeros. Nones (nothing dropped) otherwise: exact per element, not per direction."""
    if not strong():
        return [None] * len(firsts), [None] * len(firsts)
    curving = [t.reshape(t.shape[0], n).ne(0).any(0) for t, n in zip(firsts, sizes, strict=True)]
    if seconds is None:
        return list(curving), list(curving)
    moving = [c | s.reshape(s.shape[0], n).ne(0).any(0)
              for c, s, n in zip(curving, seconds, sizes, strict=True)]  # fmt: skip
    return list(moving), list(curving)


def _packed(fn: Callable[..., tuple[Tensor, ...]], primals: tuple[Tensor, ...],
            outputs: tuple[Tensor, ...],
            ) -> tuple[Callable[[Tensor], Tensor], Tensor, list[slice], list[slice]]:  # fmt: skip
    """``fn`` (giving ``outputs`` at ``primals``) as a function of one vector of all its inputs
    to one vector of all its outputs (jacrev of several inputs or outputs builds its basis with
    tensor-valued offsets, which make_fx cannot trace before torch 2.6); the primals packed;
    each input's and output's span in those vectors."""
    ins, outs = _spans([p.numel() for p in primals]), _spans([o.numel() for o in outputs])

    def packed(flat: Tensor) -> Tensor:
        values = (flat[i].reshape(p.shape).to(p.dtype) for i, p in zip(ins, primals, strict=True))
        return torch.cat([o.reshape(-1) for o in fn(*values)])

    return packed, torch.cat([p.reshape(-1) for p in primals]), ins, outs


def _spans(sizes: list[int]) -> list[slice]:
    """Where each of tensors of these sizes lies in their concatenation."""
    ends = list(itertools.accumulate(sizes))
    return [slice(end - n, end) for end, n in zip(ends, sizes, strict=True)]
