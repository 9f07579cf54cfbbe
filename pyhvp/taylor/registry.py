"""Which rule carries an op's jets: the rule table, the ops with zero derivatives, and
:func:`apply`, which runs an op on values and its rule on coefficients -- a dedicated rule where
one is registered, the fallbacks of :mod:`.fallbacks` otherwise."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils import _pytree as pytree

from pyhvp.taylor.custom_ops import DET_BY_SVD, STOP_GRADIENT, WITH_DERIVATIVES_OF
from pyhvp.taylor.fallbacks import (
    UnsupportedOpError,
    general_fallback,
    linear_rule,
    pointwise_fallback,
    substitute,
)
from pyhvp.taylor.jets import (
    ENGINE,
    Context,
    DiagonalCoefficient,
    FactoredCoefficient,
    Jet,
    NotAtThisOrder,
    dense_only,
    value_of,
)

aten = torch.ops.aten
Tensor = torch.Tensor


Rule = Callable[..., Any]
RULES: dict[torch._ops.OpOverload, Rule] = {}
R = TypeVar("R", bound=Rule)


def rule(*ops: torch._ops.OpOverload) -> Callable[[R], R]:
    """Register ``fn(ctx, out, *args, **kwargs)`` for ``ops``: ``out`` is the op's value, args
    hold :class:`Jet` where the op's input depends on x; it returns the output jet(s)."""

    def register(fn: R) -> R:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def apply(ctx: Context, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``op`` on the values, and its rule on the coefficients when an input is a jet."""
    if op is STOP_GRADIENT:  # the value, as a constant
        return value_of(args[0]).detach()
    out = VALUE_FORMS.get(op, op)(*pytree.tree_map(value_of, args),
                                  **pytree.tree_map(value_of, kwargs))  # fmt: skip
    if not any(isinstance(a, Jet) for a in pytree.tree_leaves((args, kwargs))):
        return out
    results = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
    complex_result = next((t for t in results if t.is_complex()), None)
    if complex_result is not None:
        raise TypeError(
            f"complex intermediates are not supported by {ENGINE}: f computes a "
            f"{complex_result.dtype} tensor from x ({op}), whose jets would need complex "
            f"coefficients. Write f in real arithmetic (real and imaginary parts as real "
            f"tensors), or, for one scalar per instance, use an estimator built on "
            f"Hessian-vector products: laplacian(..., method='hutch++'), "
            f"hessian_diagonal(..., method='hutchinson' or 'diag++')"
        )
    sparse_result = next((t for t in results if t.layout != torch.strided), None)
    if sparse_result is not None:
        raise dense_only(f"f computes a {sparse_result.layout} tensor from x ({op})")
    if not any(t.is_floating_point() for t in results):
        return out  # integer or boolean results do not vary smoothly with x
    if op in ZERO_DERIVATIVE:
        return out
    pointwise = torch.Tag.pointwise in getattr(op, "tags", ()) and isinstance(out, Tensor)
    if op in RULES and (pointwise or op in SCALAR_SAFE or not _on_scalars(args, kwargs, results)):
        try:
            return _checked_order(ctx, op, RULES[op](ctx, out, *args, **kwargs))
        except NotAtThisOrder as lower:  # a rule of a lower order: the op's exact fallback
            try:
                return _fallback(ctx, op, out, args, kwargs, pointwise)
            except UnsupportedOpError as error:
                raise UnsupportedOpError(f"{error} (its jet rule: {lower})") from error
    return _fallback(ctx, op, out, args, kwargs, pointwise)


def _fallback(ctx: Context, op: Callable[..., Any], out: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any], pointwise: bool) -> Any:  # fmt: skip
    if pointwise:
        return pointwise_fallback(ctx, op, out, args, kwargs)
    return general_fallback(ctx, op, out, args, kwargs)


def _checked_order(ctx: Context, op: object, out: Any) -> Any:
    """A rule's result, each jet of which must carry the kernel's order: a user's rule written
    for second order that returns two coefficients at fourth would leave the others missing
    (silently zero), so it is refused, naming the op."""
    for jet in pytree.tree_leaves(out):
        if isinstance(jet, Jet) and len(jet.coefficients) != ctx.order:
            raise UnsupportedOpError(
                f"pyhvp: the jet rule of {op} returned {len(jet.coefficients)} Taylor "
                f"coefficients where the kernel carries {ctx.order}: a rule must return one "
                f"per order up to ctx.order (pyhvp.taylor.chain takes the derivatives of "
                f"every order), or raise pyhvp.taylor.NotAtThisOrder for orders it does not "
                f"carry, and the engine falls back"
            )
    return out


SCALAR_SAFE = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.expand.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten._to_copy.default,
    aten.copy.default,
    aten.stack.default,  # (0-d jets stacked: a 1-d jet; the dense fallback stops at order 4)
}
"""Rules that hold for 0-d jets too (a dense fallback would multiply a NaN first derivative,
which autograd has at a pole, by the zero second derivative of the view)."""


def _on_scalars(args: tuple[Any, ...], kwargs: dict[str, Any], results: list[Tensor]) -> bool:
    """Whether every jet input is 0-d and the op makes no more floating elements than it takes:
    reductions, cumulative and softmax-like ops along the dim of a 0-d tensor then take the
    dense fallback (exact, and of one element), rather than rules written for tensors' dims."""
    jets = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Jet)]
    made = sum(t.numel() for t in results if t.is_floating_point())
    return made <= len(jets) and all(j.value.ndim == 0 for j in jets)


def _copied(dst: Tensor, src: Tensor, non_blocking: bool = False) -> Tensor:
    return src.to(dtype=dst.dtype, device=dst.device).expand(dst.shape).clone()


def _with_derivatives_of(value: Tensor, source: Tensor) -> Tensor:
    return value.detach() + (source - source.detach())


VALUE_FORMS: dict[object, Callable[..., Any]] = {
    aten.copy.default: _copied,
    aten.copy_.default: _copied,  # left by a decomposition of an op that writes in place
    WITH_DERIVATIVES_OF: _with_derivatives_of,
    DET_BY_SVD: aten._linalg_det.default,
}
"""Ops computed in the kernel by an equivalent that autograd differentiates, so that gradients
reach parameters through the kernel's values: ``aten.copy`` (what functionalized in-place writes
become) has no derivative formula, and the program's own ops none either. A ``copy_`` that a
decomposition leaves (running statistics of a legacy batch-norm op) runs out of place: the kernel
writes nothing."""


ZERO_DERIVATIVE = {
    aten.sign.default,
    aten.sgn.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.round.decimals,
    aten.trunc.default,
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
    aten.fill.Scalar,
    aten._new_zeros_with_same_feature_meta.default,  # make_dual's, for a tangent laid out
    # unlike its primal (torch.func.jvp along an expanded direction inside f)
}
"""Ops whose floating output is locally constant in their inputs (or ignores their values)."""


def register_jet_rule(
    op: object, rule: Rule | None = None, *, linear: bool = False, indexing: bool = False
) -> Any:
    """Tell the Taylor engine how ``op`` carries jets: a rule of your own, or one derived from a
    flag; the engine otherwise reduces ``op`` by PyTorch's decompositions or falls back to
    autograd's dense derivatives of it (slow for large inputs, refused past a size limit).

    ``op``: an aten op (``torch.ops.aten.foo.default``, or its packet ``torch.ops.aten.foo`` for
    every overload) or an op made with ``torch.library.custom_op`` -- what ``f`` calls must be an
    op, which the recorder sees (wrap a Python function as a custom op first).

    * ``linear=True``: ``op`` is linear in its tensor inputs that depend on ``x``, the other
      arguments held fixed (a kernel or weight that does not depend on ``x`` is fine; an
      additive constant such as a bias, or a product of two inputs that depend on ``x``, is
      not): each coefficient goes through ``op`` itself, batched over directions with ``vmap``
      (once per direction where ``op`` has no batching rule).
    * ``indexing=True``: linear, and ``op`` only moves, selects or repeats the elements of its
      one floating input, so the engine can keep coefficients factored. Either flag is checked
      where a kernel is traced: doubling the op's inputs that depend on ``x`` must double its
      output there, else ``UnsupportedOpError`` (it cannot tell where the output is zero).
    * ``rule(ctx, out, *args, **kwargs)``: ``out`` is the op's value, ``args`` / ``kwargs`` the
      op's arguments with a ``pyhvp.taylor.Jet`` wherever an input depends on ``x``; it
      returns the output's jet(s) (constants where an output does not depend on ``x``). A jet
      holds ``value`` and ``coefficients``, one per order up to ``ctx.order`` (``(K, *S)``,
      ``S`` broadcasting to the value's shape; the top order summed over directions in collapsed
      mode: combine coefficients of two operands only through ``ctx.pair`` / ``ctx.product``,
      which know the mode; ``None`` is zero; ``jet.first`` and ``jet.second`` read the first
      two). ``pyhvp.taylor.chain(ctx, out, u, g1, ..., gK)`` writes an elementwise rule from its
      derivatives; a rule that carries a lower order than ``ctx.order`` raises
      ``pyhvp.taylor.NotAtThisOrder`` (``chain`` does, given too few derivatives) and the op
      takes its exact fallback.

    A rule's results are checked: one per output, a jet's value the output itself, its first
    coefficient present, its coefficients shaped as above; else ``UnsupportedOpError`` names the
    op and the fault, as it names the rule for a torch error raised inside it (a derivative
    given to ``chain`` that does not broadcast to the op's output). A constant returned for an
    output that does depend on ``x``, or a coefficient of size 1 along a dim where it varies,
    cannot be told from a correct rule: test a rule against autograd on a small problem.

    Without ``rule`` or a flag it returns a decorator. Registration replaces an earlier rule;
    jet kernels traced with the earlier one are not used again (each is traced anew, and
    compiled anew where it was). Inside a ``torch.func`` transform (``grad``, ``vmap``, ...
    around an operator) the operators differentiate ``f`` by nested reverse mode, not by jet
    rules: there a custom op needs autograd's formula of its own
    (``torch.library.register_autograd`` with ``setup_context``), twice differentiable; so does
    differentiating an operator's result with autograd (w.r.t. parameters), which runs autograd
    through the jet kernel's calls of the op.

    >>> import torch, pyhvp
    >>> @torch.library.custom_op("example::cube", mutates_args=())
    ... def cube(t: torch.Tensor) -> torch.Tensor:
    ...     return t ** 3
    >>> @cube.register_fake
    ... def _(t):
    ...     return torch.empty_like(t)
    >>> @pyhvp.register_jet_rule(cube)
    ... def _(ctx, out, u):  # d/du u^3 = 3 u^2, d2/du2 = 6 u
    ...     return pyhvp.taylor.chain(ctx, out, u, 3 * u.value ** 2, 6 * u.value)
    >>> pyhvp.hessian_diagonal(lambda x: cube(x).sum(-1), torch.tensor([[1.0, 2.0]]))
    tensor([[ 6., 12.]])
    """
    if sum((rule is not None, linear, indexing)) > 1:
        raise ValueError("register_jet_rule takes one of rule=, linear=True and indexing=True")
    if rule is not None and not callable(rule):
        raise TypeError(
            f"rule must be a function (ctx, out, *args, **kwargs) -> jet, got {type(rule).__name__}"
        )
    ops = _overloads(op)

    def register(fn: Rule) -> Rule:
        _register(ops, lambda overload: _checked(overload, fn))
        return fn

    if linear or indexing:
        flag = "indexing" if indexing else "linear"
        _register(
            ops, lambda overload: _homogeneous(overload, flag, linear_rule(overload, indexing))
        )
        return None
    return register if rule is None else register(rule)


_generation = 0
"""How many registrations have happened: part of a jet kernel's cache key, so that kernels
traced with an earlier rule are not used again."""


def rules_generation() -> int:
    return _generation


def _register(ops: list[Any], make: Callable[[Any], Rule]) -> None:
    global _generation
    for overload in ops:
        RULES[overload] = make(overload)
    _generation += 1


def _homogeneous(op: Callable[..., Any], flag: str, rule: Rule) -> Rule:
    """The rule of a flag (``linear=True``, ``indexing=True``), which first checks at the values
    it is traced at that ``op`` is linear in its inputs that depend on ``x``: doubling them
    doubles its floating outputs. A product of two such inputs (4 times) or an additive constant
    (a bias) declared linear gave silently wrong derivatives (0 for a product's curvature)."""

    def checked(ctx: Context, out: Any, *args: Any, **kwargs: Any) -> Any:
        with disable_proxy_modes_tracing():  # (a check at trace time, not part of the kernel)
            of_jets, values, _ = substitute(op, args, kwargs)
            doubled = of_jets(*(2 * value for value in values))
            for twice, once in zip(pytree.tree_leaves(doubled), pytree.tree_leaves(out),
                                   strict=True):  # fmt: skip
                if not (isinstance(once, Tensor) and once.is_floating_point()):
                    continue
                tolerance = 16 * torch.finfo(once.dtype).eps
                scale = float(once.abs().nan_to_num(0.0, 0.0, 0.0).amax()) if once.numel() else 0.0
                if not torch.allclose(twice, 2 * once, rtol=tolerance, atol=tolerance * scale,
                                      equal_nan=True):  # fmt: skip
                    raise UnsupportedOpError(
                        f"pyhvp: {op} was registered with {flag}=True, but it is not linear in "
                        f"its inputs that depend on x: doubling them does not double its output "
                        f"at this input (a product of two such inputs, or an added constant "
                        f"such as a bias, is not linear); register a rule= for it"
                    )
        return rule(ctx, out, *args, **kwargs)

    return checked


def _checked(op: object, rule: Rule) -> Rule:
    """A user's ``rule`` whose results are checked against the op's output (:func:`_check`),
    and a call it fails with a ``TypeError`` against its signature (:func:`_call_refusal`): a
    malformed jet was used silently (another value, misshapen coefficients broadcast) or crashed
    inside the rules downstream, and a rule without a parameter for an argument failed in a
    bare ``TypeError`` naming neither."""

    def checked(ctx: Context, out: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = rule(ctx, out, *args, **kwargs)
        except TypeError as error:  # the rule's own, or its signature refusing the call
            refusal = _call_refusal(op, rule, (ctx, out, *args), kwargs)
            if refusal is None:
                raise
            raise refusal from error
        except (UnsupportedOpError, torch.OutOfMemoryError):
            raise
        except RuntimeError as error:  # torch's, from inside the rule: named, as _check names
            raise UnsupportedOpError(  # a malformed result (a derivative of another shape
                # given to chain failed to broadcast, naming neither the op nor the rule)
                f"pyhvp: the jet rule {getattr(rule, '__qualname__', rule)!r} of {op} raised "
                f"{type(error).__name__}: {error} (a derivative or coefficient of a shape that "
                f"does not broadcast to the op's output's? see pyhvp.register_jet_rule)"
            ) from error
        _check(ctx, op, out, result, _directions_of(args, kwargs))
        return result

    return checked


def _directions_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """K, the directions the input jets carry (the leading axis of their first-order
    coefficients); None where no input shows it (a first order summed over directions)."""
    sizes = {_leading(jet.coefficient) for jet in pytree.tree_leaves((args, kwargs))
             if isinstance(jet, Jet)}  # fmt: skip
    return max(sizes) if sizes and max(sizes) > 1 else None


def _leading(c: Any) -> int:
    """The leading (directions) axis of a first-order coefficient, dense or structured,
    without multiplying it out."""
    if isinstance(c, DiagonalCoefficient):
        return int(c.basis.shape[0])
    if isinstance(c, FactoredCoefficient):
        return int(c.shared.shape[0])
    return int(c.shape[0])


def _call_refusal(
    op: object, rule: Rule, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> UnsupportedOpError | None:
    """Where ``rule``'s signature cannot take ``rule(*args, **kwargs)`` (a parameter missing),
    the refusal naming the rule, the op, the call and the signature; else None (a builtin's
    signature is not known: None too)."""
    try:
        signature = inspect.signature(rule)
        signature.bind(*args, **kwargs)
    except ValueError:
        return None
    except TypeError as error:
        return UnsupportedOpError(
            f"pyhvp: the jet rule {getattr(rule, '__qualname__', rule)!r} of {op} cannot take "
            f"this call of the op, rule(ctx, out, *args, **kwargs) with {len(args) - 2} "
            f"positional argument(s) after ctx and out and keyword(s) {sorted(kwargs)}: {error} "
            f"(its signature: {signature}; see pyhvp.register_jet_rule)"
        )
    return None


def _check(ctx: Context, op: object, out: Any, result: Any, directions: int | None = None
           ) -> None:  # fmt: skip
    """Per output of ``op``, ``result`` holds a constant (a tensor) or a :class:`Jet` whose
    value is that output itself, whose first coefficient is not ``None``, and whose dense
    coefficients are ``(K, *S)`` (``(1, *S)`` for the collapsed top order), ``S`` broadcasting
    to the value's shape with as many dims; ``K`` is ``directions`` where the inputs show it (a
    leading axis of 1 broadcast silently: every direction given the first one's coefficient)."""
    outs, results = pytree.tree_leaves(out), pytree.tree_leaves(result)

    def refuse(what: str) -> UnsupportedOpError:
        return UnsupportedOpError(f"pyhvp: the jet rule of {op} {what} (see "
                                  f"pyhvp.register_jet_rule)")  # fmt: skip

    if len(results) != len(outs):
        raise refuse(f"returned {len(results)} jets or tensors where the op has {len(outs)} "
                     f"outputs: return one per output, in the output's structure")  # fmt: skip
    for value, got in zip(outs, results, strict=True):
        if isinstance(value, Tensor) and not isinstance(got, (Jet, Tensor)):
            raise refuse(f"returned a {type(got).__name__} for an output tensor: return a Jet, "
                         f"or the output itself (a constant) where it does not depend on x")  # fmt: skip
        if not isinstance(got, Jet):
            continue
        if got.value is not value:
            raise refuse("returned a Jet whose value is not the op's output: build it as "
                         "Jet(out, coefficients)")  # fmt: skip
        if got.coefficients[0] is None:
            raise refuse("returned a Jet without a first-order coefficient: return the output "
                         "itself (a constant) where it does not depend on x")  # fmt: skip
        for k, c in enumerate(got.coefficients, 1):
            if not isinstance(c, Tensor):
                continue
            shape, inner = tuple(c.shape), tuple(c.shape[1:])
            fits = c.ndim == value.ndim + 1 and all(
                s in (1, v) for s, v in zip(inner, value.shape, strict=True)
            )
            lead_wrong = (shape[0] != 1 if ctx.collapses(k)
                          else directions is not None and shape[0] != directions)  # fmt: skip
            if not fits or lead_wrong:
                lead = (
                    "1 (summed over directions: ctx.collapses)"
                    if ctx.collapses(k)
                    else "K"
                    if directions is None
                    else f"K = {directions}, the directions"
                )
                raise refuse(f"returned an order-{k} coefficient of shape {shape} for a value "
                             f"of shape {tuple(value.shape)}: it must be ({lead}, *S), S "
                             f"broadcasting to the value's shape with as many dims")  # fmt: skip


def _overloads(op: object) -> list[torch._ops.OpOverload]:
    """The op overloads ``op`` names: itself, a packet's every overload, a custom op's one."""
    op = getattr(op, "_opoverload", op)  # torch.library.custom_op's CustomOpDef
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]  # type: ignore[no-untyped-call]  # unannotated in torch
    raise TypeError(
        f"register_jet_rule needs an op (torch.ops.aten.foo.default, a packet torch.ops.aten.foo, "
        f"or a torch.library.custom_op), got {type(op).__name__}: the Taylor engine records "
        f"aten and custom ops, not Python functions -- wrap one with torch.library.custom_op"
    )
