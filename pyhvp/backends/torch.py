"""The torch backend: the primitives, eager and compiled.

Methods: Hessian-vector products run reverse-over-reverse. Eagerly with ``torch.autograd`` (one
forward, one first backward that keeps its graph, then a batched second backward per leaf),
which has the lowest per-call overhead; compiled as ``vjp(grad(f))`` in torch.func, vmapped over
the tangents, which inductor fuses into a few kernels.
``second_directional`` and ``collapsed_jet`` run second-order Taylor mode (:mod:`pyhvp.taylor`):
``f`` is recorded as a program of aten ops at every call (the guard of a cache of programs), and
a flat jet kernel of plain aten ops, traced once per program and directions layout, runs it --
eagerly or compiled, like the other kernels.

``grad_and_block_hvps`` is the multi-leaf primitive: for a scalar ``f(*leaves, *args)`` it gives
every leaf's gradient and, per leaf, its own diagonal Hessian block times that leaf's tangents
(``d^2 f / d leaf_i^2 @ v_i``), from ONE forward and ONE first backward shared by all leaves; each
leaf's second pass is pruned to that leaf (autograd differentiates only towards it).
``grad_and_hvp`` is its one-leaf case over ``sum_b f(x)[b]``. ``restricted_hessian`` is the
sparse sub-Hessian kernel of ``pyhvp.restricted``, a torch-only technique kept here as a kernel
so that it compiles under the same policy.

Compilation (``TorchBackend(compile=...)``; the rule itself is :mod:`.compile_policy`):

* ``"auto"`` (default): a signature (primitive, function, options, shapes, dtypes, devices) runs
  eagerly until the eager time spent on it reaches the expected compile cost, then runs a
  ``torch.compile``-d kernel cached for it (ski rental: never much worse than the better of
  always-eager and always-compiled). A function rebuilt per call from the same code and captured
  objects shares its signature. The first compile in a process is announced on the
  ``pyhvp.compile`` logger (WARNING), with its expected duration and how to choose instead.
* ``True``: compile from the first call. ``False``: always eager.
* Results are differentiable when an input requires grad with grad mode on, detached otherwise
  (no-grad calls run under ``no_grad``: a compiled kernel is then an inference graph). Under
  autograd, jet kernels compile too (``_Detour``: AOTAutograd's compiled forward
  and backward, an eager rerun for backwards that keep or create a graph), under a signature
  that says which inputs need grad; HVP kernels, and calls inside ``torch.func`` transforms or
  forward-mode AD, run eagerly (inside a ``torch.func`` transform, Taylor coefficients by nested
  reverse mode -- :mod:`pyhvp.backends.nested` -- and HVPs by their ``torch.func`` kernel, which compose). HVP kernels treat tensors that ``f`` captures (module
  parameters) as constants: pass them as args to differentiate through them (jet kernels take
  them as inputs). Inference tensors and calls inside ``torch.inference_mode()`` are accepted.
* Jet kernels compile on the CPU too: they hold no nested forward-mode AD, which inductor's CPU
  code segfaults on in torch 2.13 (pytorch#190856, #197067; ``jvp`` of ``jvp`` is therefore no
  longer used). Their compile key is the kernel, shared by every call that records the same
  program.
* Inductor runs with :mod:`.inductor`'s pass: on torch 2.5-2.13 its reinplace pass wrote
  indexed updates into expanded destinations (``vmap``'s batched backward of ``index_select``)
  in place, summing every row's writes (pytorch#183986): silently wrong compiled HVPs. And the
  first result of every compiled kernel is checked against an eager run, and so are the first
  gradients of its compiled backward in a training step; one that disagrees never serves
  (``compile_policy.disagreement``). The eager run comes first, under a mode that notes what
  ``f`` changes beyond its values (a batch norm's running statistics, a generator of its own:
  ``pyhvp.restricted.state``), which is put back before each further run: the call makes
  those changes once, as one eager call does.
* If compilation or a compiled run fails while the eager run succeeds, pyhvp warns once per
  signature and runs that signature eagerly from then on; errors of ``f`` itself are raised as
  they would be eagerly, and out-of-memory errors are re-raised.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import types
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal, TypeVar, cast

import torch
from torch import fx
from torch.autograd import forward_ad
from torch.func import grad, vjp, vmap
from torch.utils import _pytree as pytree

from pyhvp import _random_state as random_states
from pyhvp import _vector_norms as vector_norms
from pyhvp import restricted, taylor
from pyhvp._attention import math_attention
from pyhvp._batched_backward import batched_grad
from pyhvp._checks import check_output, fmt_shape, plain_tensor
from pyhvp._differentiated_twice import differentiated_twice
from pyhvp._keys import version_of, wrapped
from pyhvp._norms import batched_double_backward
from pyhvp._public import operator_depth
from pyhvp._sinc import sinc_backward
from pyhvp._user_errors import note, quiet_tracing, stacklevel_outside_pyhvp
from pyhvp.backends import Blocks, compile_policy, inductor, nested
from pyhvp.backends.compile_policy import CompileCache
from pyhvp.restricted.state import Recording, Snapshot

CompileMode = Literal["auto"] | bool

_CACHE = CompileCache()

_unsettled = 0
"""Calls of compiled kernels served outside the compile policy's steady state, so far: a first
call (its compile and its check against eager), an eager call of its trial of the compiled
kernel against eager, a graph traced anew (:func:`unsettled_calls`)."""


def unsettled_calls() -> int:
    """How many kernel calls were served outside the compile policy's steady state so far: a
    run that made one is not timed as its plan's (``sub_hessian``'s trial of routes, which
    timed the seed's loop against routes compiling their kernels, kept the loop at 1.5x the
    compiled sparse route on the transformer block at k = 128 per tensor)."""
    return _unsettled


def _unsettle() -> None:
    global _unsettled
    _unsettled += 1


@dataclass(frozen=True)
class InstanceSum:
    """``(y, *args) -> f(y, *args).sum()``, checking that f returns one value per instance."""

    f: Callable[..., torch.Tensor]
    event_dims: int

    @property
    def __name__(self) -> str:  # what warnings print
        return getattr(self.f, "__name__", type(self.f).__name__)

    def __call__(self, y: torch.Tensor, *args: object) -> torch.Tensor:
        out = self.f(y, *args)
        batch_shape = y.shape[: y.ndim - self.event_dims]
        try:
            check_output("f", out, batch_shape, "one value per instance: x.shape[:-event_dims]")
        except ValueError as error:  # a per_instance f's (B,) arg that went whole to each
            whole = getattr(self.f, "whole_arg_hint", None)  # (PerInstance's: no import cycle)
            hint = whole(y, args) if whole is not None else None
            if hint is not None:
                note(error, hint)
            raise
        return out.sum()


Result = TypeVar("Result")


def _grad_and_block_hvps_traced(
    f: Callable[..., torch.Tensor], n_leaves: int, chunk_size: int | None, *inputs: object
) -> Blocks:
    """Reverse-over-reverse in torch.func, per leaf ``vjp(grad_i f)`` vmapped over that leaf's
    tangents (the Hessian is symmetric, so its vjp is its product): what gets compiled. The
    primal forward of every leaf's pass is one graph, which the compiler shares. Measured on the
    CPU (torch 2.13, compiled): as fast as ``jvp(grad f)`` on the seed-000 particles and 1.1-1.9x
    faster on the sub-Hessian models, where forward-over-reverse pushes every tangent through
    the whole forward."""
    leaves, tangents, args = _split(n_leaves, inputs)
    passes = [
        _reverse_over_reverse(f, leaves, i, tangents[i], args, chunk_size) for i in range(n_leaves)
    ]
    return tuple(g for g, _ in passes), tuple(hv for _, hv in passes)


def _reverse_over_reverse(
    f: Callable[..., torch.Tensor],
    leaves: list[torch.Tensor],
    i: int,
    tangents: torch.Tensor,
    args: tuple[object, ...],
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leaf ``i``'s gradient and its block's products with ``tangents`` (k, *leaf.shape)."""

    def of_leaf(y: torch.Tensor) -> torch.Tensor:
        return f(*leaves[:i], y, *leaves[i + 1 :], *args)

    # torch annotates vjp's result as a pair or, with has_aux=True, a triple: here it is a pair
    g, product = vjp(grad(of_leaf), leaves[i])  # type: ignore[misc]
    if len(tangents) <= 1:  # no vmap for one tangent (nor for none)
        return g, torch.stack([product(t)[0] for t in tangents]) if len(tangents) else tangents
    return g, vmap(lambda t: product(t)[0], chunk_size=chunk_size)(tangents)


def _grad_and_block_hvps_functional(
    f: Callable[..., torch.Tensor], n_leaves: int, chunk_size: int | None, *inputs: object
) -> Blocks:
    """Reverse-over-reverse inside ``torch.func.grad`` alone, ``H t = grad(<grad f, t>)``
    vmapped over the tangents: what runs nested in ``f`` of a Taylor-engine operator, whose
    recorder follows ``torch.func.grad`` but not ``vjp``'s pullback (autograd's backward pass
    run outside any transform)."""
    leaves, tangents, args = _split(n_leaves, inputs)
    grads, products = [], []
    for i, leaf_tangents in enumerate(tangents):

        def of_leaf(y: torch.Tensor, i: int = i) -> torch.Tensor:
            return f(*leaves[:i], y, *leaves[i + 1 :], *args)

        def along(t: torch.Tensor, of_leaf: Callable[..., torch.Tensor] = of_leaf,
                  i: int = i) -> torch.Tensor:  # fmt: skip
            return cast(torch.Tensor, grad(lambda y: (grad(of_leaf)(y) * t).sum())(leaves[i]))

        grads.append(cast(torch.Tensor, grad(of_leaf)(leaves[i])))
        products.append(vmap(along, chunk_size=chunk_size)(leaf_tangents) if len(leaf_tangents)
                        else leaf_tangents)  # fmt: skip
    return tuple(grads), tuple(products)


def _grad_and_block_hvps_eager(
    f: Callable[..., torch.Tensor], n_leaves: int, chunk_size: int | None, *inputs: object
) -> Blocks:
    """Reverse-over-reverse with torch.autograd: one forward and one backward that keeps its graph
    for all leaves, then per leaf one (batched) backward per chunk of its tangents, towards that
    leaf only. Eagerly this has the least per-call overhead, and results stay differentiable when
    the inputs carry autograd history. A leaf ``f`` ignores, or enters linearly, has a zero block."""
    leaves, tangents, args = _split(n_leaves, inputs)
    keep_graph = _needs_autograd(inputs) or _nested_under_grad()
    with torch.enable_grad():
        # aliases, not the leaves themselves: partial derivatives, never through args made from
        # a leaf
        ys = [_differentiable_alias(y) for y in leaves]
        # (group norms written out where their double backward takes several cotangents)
        batched = any(min(len(t), chunk_size or len(t)) > 1 for t in tangents)
        with batched_double_backward if batched else contextlib.nullcontext():
            total = f(*ys, *args)
        if not total.requires_grad:  # f is constant in every leaf
            return tuple(map(torch.zeros_like, leaves)), tuple(map(torch.zeros_like, tangents))
        check_twice_differentiable(total)
        grads = torch.autograd.grad(
            total, ys, create_graph=True, allow_unused=True, materialize_grads=True
        )
        passes = [  # (leaf, its gradient, one chunk of its tangents); last one frees the graph
            (y, g, part)
            for y, g, leaf_tangents in zip(ys, grads, tangents, strict=True)
            if g.requires_grad and len(leaf_tangents)  # not requiring grad: f affine in leaf
            for part in torch.split(leaf_tangents, chunk_size or len(leaf_tangents))
        ]
        products: dict[int, list[torch.Tensor]] = {}
        for n, (y, g, part) in enumerate(passes):
            (hv,) = batched_grad(
                g,
                y,
                part,
                retain_graph=keep_graph or n < len(passes) - 1,
                create_graph=keep_graph,
                allow_unused=True,
                materialize_grads=True,
            )
            # expand: a leaf's unbatched zeros when f's gradient in it does not depend on it
            products.setdefault(id(y), []).append(cast(torch.Tensor, hv).expand_as(part))
    hvs = tuple(
        torch.cat(products[id(y)]) if id(y) in products else torch.zeros_like(t)
        for y, t in zip(ys, tangents, strict=True)
    )
    return tuple(g if keep_graph else g.detach() for g in grads), hvs


_REFUSED_WRITES = (
    "a leaf Variable that requires grad is being used in an in-place operation",
    "is a view and is being modified inplace. This view is the output of a function that "
    "returns multiple views",
)
"""autograd's refusals, before any write, of a write to a leaf that requires grad (pyhvp's alias
of an ``x`` that does not, or a parameter of ``f``'s) and of one to an output of ``unbind``
(pyhvp's alias of an ``x`` that does)."""


def write_to_x_refusal(
    error: RuntimeError, f: Callable[..., torch.Tensor], x: torch.Tensor, args: Sequence[object]
) -> taylor.InPlaceInputError | None:
    """Autograd's refusal of a write (:data:`_REFUSED_WRITES`), said as the Taylor engine says
    it where ``f`` writes to ``x`` (not to a parameter of its own), or None."""
    if not any(write in str(error) for write in _REFUSED_WRITES) or not _writes_x(f, x, args):
        return None
    return taylor.InPlaceInputError(
        "f modifies x in place: pyhvp differentiates f w.r.t. x, which autograd does not let f "
        "write to (write to a copy: x.clone())"
    )


def _writes_x(f: Callable[..., torch.Tensor], x: torch.Tensor, args: Sequence[object]) -> bool:
    """Whether ``f`` writes to its input: run once more on a copy of ``x`` that does not require
    grad (a write to a parameter that does is refused by autograd again, before any write)."""
    copy = x.detach().clone()
    watched = Watched(copy)  # (under vmap a wrapper, which keeps no counter of its own)
    with contextlib.suppress(Exception), torch.enable_grad():
        f(copy, *args)
    return watched.written()


WRITTEN_UNDER_NO_GRAD = (
    "f modifies x in place under torch.no_grad() or through x.data (x now holds the written "
    "values -- pyhvp's copy of it, for an inference tensor -- and the derivatives would be at "
    "them); pyhvp differentiates f w.r.t. the x it is given: write to a copy (x.clone())"
)


WRITTEN_INSIDE_TRANSFORM = (
    "f modifies x in place (under torch.no_grad() or through x.data, inside a torch.func "
    "transform); the Taylor engine needs x to stay unchanged (write to a copy: x.clone())"
)


class Watched:
    """Whether ``f`` wrote to ``x`` during a call: its version counter moved, or its values
    changed. A view's counter is its base's (a write to another row moves it): its values tell.
    A write through ``x.data`` moves no counter: on the CPU the values tell (elsewhere comparing
    them would synchronise every call with the device). Until 2026-12-06 an ``f`` doubling
    ``x.data`` gave the HVPs at the doubled values, as one doubling a transposed or sliced ``x``
    under ``no_grad`` did before. Under ``vmap`` (or another ``torch.func`` transform) ``x`` is a
    wrapper, which keeps no counter: the tensor it wraps, which a write through it writes, is
    watched (until 2026-12-07 such a write went unseen, and the HVPs were at the written
    values)."""

    def __init__(self, x: torch.Tensor) -> None:
        x = wrapped(x)
        self.x, self.version, self.view = x, version_of(x), x._is_view()
        self.always = x.device.type == "cpu"  # (values compared whether or not the counter moved)
        watched = self.version is not None and (self.always or self.view)
        self.values = x.detach().clone() if watched else None

    def written(self) -> bool:
        moved = version_of(self.x) != self.version
        if self.values is None or (moved and not self.view) or not (moved or self.always):
            return moved  # the counter tells
        now, before = self.x.detach(), self.values
        unchanged = torch.equal(now, before) or bool(
            ((now == before) | (now.isnan() & before.isnan())).all()
        )
        return not unchanged


def check_twice_differentiable(total: torch.Tensor) -> None:
    """Check autograd's graph of ``total`` before it is differentiated twice: raise
    ``ValueError`` where it holds a backward compiled by ``torch.compile`` (aot_autograd's
    ``CompiledFunctionBackward``, a function the caller compiled itself), which autograd cannot
    differentiate again (a second backward that allows unused inputs reads its second
    derivatives as zero, silently); have torch's own ``sinc``, which
    :data:`~pyhvp._sinc.twice_differentiable_sinc` did not replace (``x.sinc()``, or a function
    bound before the call), differentiate by its written-out slope
    (:func:`~pyhvp._sinc.sinc_backward`: torch's second derivative is NaN at 0 and loses its
    digits near it); have vector norms and ``cdist`` differentiate by their written-out slope
    (:mod:`pyhvp._vector_norms`: torch's second derivatives are NaN at a zero vector, and
    ``cdist`` has none), each node once (:func:`_written_out`); and have a ``logcumsumexp`` warn where its
    gradient has an entry exactly 0 (the first backward, next, tells): torch's backward takes
    the log of the gradient, constant there, so its second derivative drops that entry's
    term."""
    stack = [total.grad_fn] if total.grad_fn is not None else []
    seen = set(stack)
    while stack:
        node = stack.pop()
        name = type(node).__name__
        if name == "CompiledFunctionBackward":
            raise ValueError(
                "the function differentiated calls one compiled by torch.compile, whose "
                "backward autograd cannot differentiate again (its second derivatives would "
                "read as zero): pass it uncompiled (pyhvp compiles the whole function: "
                "backend=pyhvp.TorchBackend(compile=True))"
            )
        hook_of = _WRITTEN_OUT_BACKWARDS.get(name)
        if hook_of is not None and _written_out(node, hook_of):
            _WRITTEN_OUT.nodes += 1
        if name == "LogcumsumexpBackward0":
            node.register_prehook(_warn_of_zero_gradients)
        for child, _ in node.next_functions:  # (a loop: 60% of a generator's time)
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)


_WRITTEN_OUT_BACKWARDS: dict[str, Callable[[Any], vector_norms.Hook | None]] = {
    "SincBackward0": sinc_backward,
    "LinalgVectorNormBackward0": vector_norms.vector_norm_backward,
    "CdistBackward0": vector_norms.cdist_backward,
}
"""Autograd's nodes whose backward pyhvp writes out, by type name: the hook for a node (None:
torch's backward, right for that node's arguments)."""

_HOOKED = "pyhvp: backward written out"
"""The key of a node's ``metadata`` that says :func:`_written_out` hooked it."""


def _written_out(node: Any, hook_of: Callable[[Any], vector_norms.Hook | None]) -> bool:
    """Whether ``node`` differentiates by its backward written out (``hook_of``'s hook), hooked
    now or before. Once per node: a graph the caller built before the call (``x = z.sinc()``,
    ``x`` requiring grad) is walked by every call that differentiates through it, and a hook per
    call recomputed the slope once per call in the caller's own backward. A node whose saved
    tensors a backward freed (no ``retain_graph``) is left alone: nothing differentiates through
    it again (reading them raised, and an HVP of such an ``x`` failed, 2026-12-07 to 12-08)."""
    if node.metadata.get(_HOOKED):
        return True
    try:
        hook = hook_of(node)
    except RuntimeError:  # (its saved tensors freed)
        return False
    if hook is None:
        return False
    node.metadata[_HOOKED] = True
    node.register_hook(hook)
    return True


class _WrittenOutNodes(threading.local):
    nodes = 0
    """How many nodes whose backward pyhvp writes out this thread's graph walks have met, which
    :func:`_declining_written_out` watches."""


_WRITTEN_OUT = _WrittenOutNodes()


def _declining_written_out(
    eager: Callable[..., Result], entry: compile_policy.Entry
) -> Callable[..., Result]:
    """``eager``, which declines ``entry``'s compiled kernel for good, without a warning (a known
    limit), once a run of it differentiated a backward pyhvp writes out (sinc's, a vector
    norm's, cdist's: :func:`check_twice_differentiable`): the compiled kernel takes torch's own
    second derivatives (NaN at a zero vector, none for cdist), as ``torch.func`` does: until
    2026-12-08 it compiled, disagreed with eager on its first call and was dropped with a
    warning asking for a report."""

    def run(*inputs: object) -> Result:
        before = _WRITTEN_OUT.nodes
        out = eager(*inputs)
        if _WRITTEN_OUT.nodes != before:
            entry.failed = True
        return out

    return run


def _warn_of_zero_gradients(gradients: tuple[torch.Tensor | None, ...]) -> None:
    """A ``logcumsumexp``'s backward pre-hook (:func:`check_twice_differentiable`): warn where
    its gradient has an entry exactly 0, whose term torch's second derivative drops
    (``logcumsumexp(x) ** 2`` at ``x = 0``: an HVP entry -0.61 for -0.91, torch 2.5.1 to
    2.14.1)."""
    if any(g is not None and bool((g == 0).any()) for g in gradients):
        warnings.warn(
            "pyhvp: the gradient reaching a logcumsumexp of the function differentiated has "
            "entries exactly 0, where torch's second derivative of logcumsumexp is wrong (its "
            "backward takes the log of the gradient and drops the term there: at x = 0, "
            "logcumsumexp(x) ** 2 gave an HVP entry -0.61 for -0.91); write it as "
            "torch.logsumexp over the prefixes, or call the operator inside torch.func.vmap, "
            "which does",
            RuntimeWarning,
            stacklevel=stacklevel_outside_pyhvp(through_torch=True),
        )


def _differentiable_alias(y: torch.Tensor) -> torch.Tensor:
    """An alias of ``y`` that requires grad and keeps ``y``'s autograd history and forward-mode
    tangent (forward over reverse, under ``torch.autograd.forward_ad``), and that ``f`` cannot
    write to: autograd refuses, before it happens, a write to a leaf and one to (a view of) an
    output of ``unbind``. A plain view would let ``f`` write to the caller's ``y`` and rebase the
    alias's history onto the write (derivatives in the written value, not in ``y``)."""
    if y.requires_grad:
        return y.unsqueeze(0).unbind()[0]
    tangent = _tangent(y)
    alias = y.detach().requires_grad_()
    make_dual = cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], forward_ad.make_dual)
    return alias if tangent is None else make_dual(alias, tangent)


def _tangent(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s forward-mode tangent at the current ``forward_ad`` level (None: not dual)."""
    unpack = cast(Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
                  forward_ad.unpack_dual)  # fmt: skip
    return unpack(t)[1]


def _split(
    n_leaves: int, inputs: tuple[Any, ...]
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[object, ...]]:
    """``(*leaves, *tangents, *args)`` -> leaves, tangents (one per leaf), args; the kernels get
    them flat (a compiled kernel takes positional tensors), as ``grad_and_block_hvps`` packs them."""
    leaves = list(inputs[:n_leaves])
    return leaves, list(inputs[n_leaves : 2 * n_leaves]), inputs[2 * n_leaves :]


def _jet_kernel(kernel: taylor.JetKernel, *inputs: torch.Tensor) -> object:
    """A flat jet kernel of :mod:`pyhvp.taylor`: plain aten ops, run eagerly or compiled."""
    return kernel(*inputs)


def _finite_derivatives(out: object, mode: taylor.JetMode) -> bool:
    """Whether a jet kernel's derivatives (its outputs of order 1 and up) are all finite, by
    their sums (at least float32's range): a reduction at memory speed (an elementwise test and
    ``all`` took as long as a vector-valued diagonal's kernel), 8 us on a small result; not
    finite where an entry is not. A sum that overflows calls finite entries not finite, and the
    strong-zero kernel runs for nothing."""
    return all(
        math.isfinite(t.detach().sum(dtype=torch.promote_types(t.dtype, torch.float32)).item())
        for t, k in zip(cast(tuple[torch.Tensor, ...], out), mode.outputs, strict=True)
        if k > 0
    )


def _compile_bound(
    kernel: Callable[..., object], f: Callable[..., object], static: tuple[Hashable, ...]
) -> Callable[..., object]:
    """``torch.compile`` of ``kernel(f, *static, *inputs)`` as a function of the inputs alone.

    Dynamo keeps its compiled graphs (and its recompile limit, 8) per code object, so each cached
    signature gets a function with a code object of its own: many functions or shapes in one
    process then never evict each other or fall back to eager. Inductor runs with
    :mod:`.inductor`'s pass (indexed writes into expanded tensors, pytorch#183986). A jet kernel
    is an aten graph already: inductor compiles it without dynamo (:class:`_InductorGraph`).
    """
    if isinstance(f, taylor.JetKernel):
        return _InductorGraph(f.graph)

    def bound(*inputs: object) -> object:
        return kernel(f, *static, *inputs)

    code = bound.__code__.replace()
    fresh = types.FunctionType(code, bound.__globals__, bound.__name__, None, bound.__closure__)
    return torch.compile(fresh, dynamic=False, backend=inductor.backend())


class _InductorGraph:
    """A jet kernel's aten graph, compiled by inductor (with :mod:`.inductor`'s pass) at its
    first call, on that call's inputs, and called without dynamo. Dynamo's guards would check at
    every call what the kernel and its compile key fix already -- its inputs' shapes, strides,
    dtypes and devices (the kernel's program and layout), and which of them autograd
    differentiates -- and its frame cost 0.1-0.4 ms a call (a sixth of a small Laplacian).
    Inductor compiles a copy: its passes may rewrite the graph, which the eager kernel runs."""

    def __init__(self, graph: fx.GraphModule) -> None:
        self.graph = graph
        self.compiled: Callable[..., Sequence[torch.Tensor]] | None = None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.compiled is None:
            module = fx.GraphModule(self.graph, copy.deepcopy(self.graph.graph))
            compile_graph = cast(Callable[..., Callable[..., Sequence[torch.Tensor]]],
                                 inductor.backend())  # fmt: skip
            with compile_policy.compiling():
                self.compiled = compile_graph(module, list(inputs))
        return tuple(self.compiled(*inputs))  # a list, where the eager kernel returns a tuple


def _with_zero_derivatives(out: object, inputs: Sequence[object]) -> object:
    """``out``, whose tensors that carry no graph where an input requires grad (the HVP of an
    ``f`` linear in ``x``: a constant to autograd) get one of zero derivatives: results are
    differentiable whenever an input requires grad, as the contract says (until 2026-12-07
    ``(hvp(f, x, v) ** 2).sum().backward()`` raised torch's "does not require grad" there)."""

    def lacking(t: object) -> bool:
        return (isinstance(t, torch.Tensor) and not t.requires_grad
                and (t.is_floating_point() or t.is_complex()))  # fmt: skip

    # (results that carry a graph, the usual case, are looked at alone)
    if not (torch.is_grad_enabled() and any(map(lacking, pytree.tree_leaves(out)))):
        return out
    sources = [t for v in inputs for t in pytree.tree_leaves(v)
               if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
    if not sources:
        return out

    def connected(t: torch.Tensor) -> torch.Tensor:
        if not lacking(t):
            return t
        return cast(torch.Tensor, _ZeroDerivatives.apply(t, *sources))  # type: ignore[no-untyped-call]

    return pytree.tree_map_only(torch.Tensor, connected, out)


class _ZeroDerivatives(torch.autograd.Function):
    """``value`` (a copy), with a zero derivative in each of ``sources``."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        ctx.sources = [(s.shape, s.dtype, s.device) for s in sources]
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = [torch.zeros(shape, dtype=dtype, device=device)
                 for shape, dtype, device in ctx.sources]  # fmt: skip
        return (None, *zeros)

    @staticmethod
    def jvp(ctx: Any, value: torch.Tensor | None, *sources: torch.Tensor | None) -> object:
        return value  # (forward mode: the value's own tangent, none from the sources)


def _needs_autograd(values: Sequence[object]) -> bool:
    """Whether a result must carry derivatives: reverse mode's graph (grad mode on and an input
    requiring grad) or forward mode's tangents (an input that is a dual tensor). Inputs are
    looked into: a dict or list of parameters passed as one arg (``functional_call``'s)."""
    tensors = [
        t
        for v in values
        for t in ((v,) if isinstance(v, torch.Tensor) else pytree.tree_leaves(v))
        if isinstance(t, torch.Tensor)
    ]  # a tensor input directly: flattening every input cost 3 us a call
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return forward_ad._current_level >= 0 and any(_tangent(t) is not None for t in tensors)


def _nested_under_grad() -> bool:
    """Whether this call runs inside ``f`` of another pyhvp operator, with grad mode on: the
    outer operator may differentiate ``f`` with autograd through a tensor that ``f``'s inner call
    reads by a closure only (``lambda y: pyhvp.hvp(lambda z: h(z, y), z0, v)``), which no input
    of the inner call shows. The autograd kernels (HVPs, the sparse sub-Hessian) then keep their
    graph: detached, their results were constants to the outer operator, which reads what it
    cannot reach as zero (silent zeros). The jet kernels take captured tensors as inputs."""
    return torch.is_grad_enabled() and operator_depth() > 1


def _plain_autograd() -> bool:
    """No functorch transform and no forward-mode AD level is active: what a compiled kernel's
    autograd supports."""
    return not nested.inside_transform() and forward_ad._current_level < 0


def _normal(inputs: tuple[object, ...]) -> tuple[object, ...]:
    """Inference tensors, also inside container inputs, cloned into normal ones (call outside
    inference mode): autograd may neither make them require grad nor save them."""
    return tuple(
        _normal_tensor(v)
        if isinstance(v, torch.Tensor)
        else pytree.tree_map_only(torch.Tensor, _normal_tensor, v)
        for v in inputs
    )  # a tensor input directly: tree_map over every input cost 20 us a call


def _normal_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.is_inference() else t


@dataclass(frozen=True)
class Hooks:
    """How a ``_Detour`` node reports: ``failed(error)`` when its kernel's backward fails
    (None: raise), ``spent(seconds)`` with the time of its kernel's backward (None: untimed),
    ``reusable``: whether the kernel's own graph may serve a backward that keeps it,
    ``checked()`` once the kernel's own backward has been compared with the eager kernel's and
    agreed (None: not compared; a compiled kernel's first backward is)."""

    failed: Callable[[Exception], None] | None = None
    spent: Callable[[float], None] | None = None
    reusable: bool = False
    checked: Callable[[], None] | None = None


class _Detour(torch.autograd.Function):
    """A kernel run as one autograd node, whose backward chooses how to differentiate it.

    The forward runs the kernel on detached aliases of the inputs, keeping that inner graph. A
    first-order backward that frees the graph (``loss.backward()``, ``torch.autograd.grad``
    without ``retain_graph`` or ``create_graph``) runs the inner graph's backward: for a compiled
    kernel AOTAutograd's compiled backward. That backward does not serve the others (torch 2.13):
    it refuses ``retain_graph=True`` when it donates buffers, and its results are not
    differentiable -- a gradient of them is silently missing (``None``, or zero with
    ``materialize_grads``). So a backward that must itself be differentiable (grad mode on while
    it runs), or keeps the graph of a compiled kernel, reruns the kernel eagerly from the saved
    inputs and differentiates that: exact, gradients of gradients included, for one more eager
    forward. The node also times the kernel's backward (``Hooks.spent``), so that the compile
    policy weighs a training step's backward, not only its forward. A compiled kernel's backward
    is a graph compiled on its own (at its first call), so it is checked as the forward is: until
    one has agreed (``Hooks.checked``), its gradients are compared with the eager kernel's, and
    one that disagrees is reported as a failure (the signature runs eagerly from then on) and
    the eager gradients are returned.
    """

    @staticmethod
    def forward(
        ctx: Any,
        eager: Callable[..., object],
        kernel: Callable[..., object],
        hooks: Hooks,
        kind: list[bool],
        *inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.eager, ctx.hooks = eager, hooks
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)
        aliases = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            out = kernel(*aliases)
        ctx.single = not isinstance(out, tuple)
        kind.append(ctx.single)
        results = (cast(torch.Tensor, out),) if ctx.single else cast(tuple[torch.Tensor, ...], out)
        ctx.inner = (aliases, results)
        return tuple(r.detach() for r in results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        inputs, hooks = ctx.saved_tensors, ctx.hooks
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        differentiable = torch.is_grad_enabled()  # create_graph=True
        keep = torch._C._autograd._get_current_graph_task_keep_graph()
        if not differentiable and ctx.inner is not None and (hooks.reusable or not keep):
            aliases, results = ctx.inner
            if not keep:  # the inner backward frees its graph
                ctx.inner = None
            try:
                start = compile_policy.clock()
                first = hooks.checked is not None  # a compiled backward loads at its first call
                with compile_policy.compiling() if first else contextlib.nullcontext():
                    got = _Detour._grads(results, grads, [aliases[i] for i in wanted], wanted,
                                         len(inputs), retain=keep)  # fmt: skip
                if hooks.spent is not None:
                    hooks.spent(compile_policy.clock() - start)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as error:  # a compiled backward compiles at its first call
                if hooks.failed is None:
                    raise
                hooks.failed(error)
            else:
                if hooks.checked is None or hooks.failed is None:
                    return (None, None, None, None, *got)
                expected = _Detour._eager_grads(ctx, inputs, grads, wanted, differentiable)
                difference = compile_policy.disagreement(got, expected)
                if difference is None:
                    hooks.checked()
                    return (None, None, None, None, *got)
                hooks.failed(CompiledKernelDisagrees(difference, "in its first compiled backward"))
                return (None, None, None, None, *expected)
        return (None, None, None, None, *_Detour._eager_grads(ctx, inputs, grads, wanted,
                                                        differentiable))  # fmt: skip

    @staticmethod
    def _eager_grads(
        ctx: Any,
        inputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        wanted: list[int],
        differentiable: bool,
    ) -> list[torch.Tensor | None]:
        """The eager kernel rerun from the saved inputs, and its vector-Jacobian products. It runs
        on views of them: they keep the inputs' history (gradients of gradients), and a gradient
        w.r.t. one is that input's own part, never also what reaches it through another input's
        history (``x = P.t().clone()`` with ``f`` capturing ``P``: that part returns to ``P``
        through ``x``'s gradient)."""
        with torch.enable_grad():
            aliases = [t.view_as(t) if t.requires_grad else t for t in inputs]
            rerun = ctx.eager(*aliases)
        results = (rerun,) if ctx.single else rerun
        return _Detour._grads(results, grads, [aliases[i] for i in wanted], wanted, len(inputs),
                              differentiable=differentiable)  # fmt: skip

    @staticmethod
    def _grads(
        results: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        sources: list[torch.Tensor],
        wanted: list[int],
        n_inputs: int,
        differentiable: bool = False,
        retain: bool = False,
    ) -> list[torch.Tensor | None]:
        """Vector-Jacobian products of ``results`` with ``grads``, per input (``None`` where not
        wanted or unused)."""
        pairs = [
            (r, g) for r, g in zip(results, grads, strict=True) if g is not None and r.requires_grad
        ]
        got: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if pairs and sources:
            got = torch.autograd.grad(
                [r for r, _ in pairs],
                sources,
                [g for _, g in pairs],
                retain_graph=retain or differentiable,
                create_graph=differentiable,
                allow_unused=True,
            )
        input_grads: list[torch.Tensor | None] = [None] * n_inputs
        for i, g in zip(wanted, got, strict=True):
            input_grads[i] = g
        return input_grads

    @staticmethod
    def run(
        eager: Callable[..., object],
        inputs: tuple[torch.Tensor, ...],
        kernel: Callable[..., object],
        hooks: Hooks,
    ) -> object:
        """``kernel(*inputs)``'s results (a tensor or a tuple, as the kernel returns them),
        differentiable in ``inputs``."""
        kind: list[bool] = []  # the forward notes whether the kernel returned one tensor
        # Function.apply carries no annotations (torch 2.13)
        out = _Detour.apply(eager, kernel, hooks, kind, *inputs)  # type: ignore[no-untyped-call]
        return out[0] if kind[0] else out


def _detached(out: object) -> object:
    if isinstance(out, tuple):
        return tuple(_detached(item) for item in out)
    return out.detach() if isinstance(out, torch.Tensor) else out


class CompiledKernelDisagrees(RuntimeError):
    """A compiled kernel's first result (of each graph dynamo traces), or its first gradients,
    differ from the eager kernel's: a compiler bug, or the ``cause`` given (:data:`RANDOM_DRAWS`,
    :data:`STATE_CHANGES`)."""

    def __init__(self, difference: str, where: str = "on its first call", cause: str | None = None
                 ) -> None:  # fmt: skip
        why = cause or "please report it with your torch version"
        super().__init__(f"the compiled kernel disagrees with the eager one {where} "
                         f"({difference}); {why}")  # fmt: skip


RANDOM_DRAWS = ("f draws random numbers (a dropout in training mode), which this compiled kernel "
                "draws otherwise than the eager one")  # fmt: skip
STATE_CHANGES = ("f changes state beyond its values (running statistics, spectral_norm's "
                 "vectors), which this compiled kernel changes otherwise than the eager one")  # fmt: skip
"""Why a compiled kernel disagrees where that is no compiler bug: the compiled reverse route
runs f once per selected tensor, the eager kernel once for all."""


def _graphs_traced() -> int:
    """How many graphs dynamo has traced in this process (its own count, ``unique_graphs``)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


KERNELS = {
    "_jet_kernel": "a Taylor-mode kernel (hessian_diagonal, laplacian)",
    "_grad_and_block_hvps_traced": "the Hessian-vector products of {f} (hvp, sub_hessian)",
    "restricted_hessian": "the sparse sub-Hessian of {f}",
}
"""What each compiled kernel computes, for the compile announcement."""


def _noting_changes(
    eager: Callable[..., object], inputs: tuple[object, ...]
) -> tuple[object, Snapshot, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``eager(*inputs)`` without grad, what it changes beyond its values (a batch norm's
    running statistics, a generator of f's own; :mod:`pyhvp.restricted.state`) as it was
    before, which is put back, and each changed tensor with its value after the eager run: the
    compiled kernel's run that follows must make those changes once (:func:`_state_after`), and
    a rerun after it starts from the snapshot again."""
    recording = Recording(inputs)
    try:
        with torch.no_grad(), recording:
            result = eager(*inputs)
        changed = [(owner, owner.detach().clone())
                   for owner, _ in recording.changes.storages.values()]  # fmt: skip
        return result, recording.changes.snapshot(), changed
    finally:
        recording.changes.undo()


def _state_after(changed: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Where the tensors the eager run changed hold other values after the compiled run than
    after the eager one, or None. A kernel that runs f more than once changes it more often:
    the compiled reverse route runs f once per selected tensor (eagerly, once for all), and
    torch.func lets ``instance_norm``'s write of its running statistics through (a compiled
    sub-Hessian over 6 tensors moved them 6 times)."""
    for owner, after in changed:
        difference = compile_policy.disagreement(owner, after)
        if difference is not None:
            return f"f's state beyond its values after it differs from eager's: {difference}"
    return None


def _describe(kernel: Callable[..., object], f: object, inputs: Sequence[object]) -> str:
    """What compiles: the kernel and its first tensor input, e.g. ``a Taylor-mode kernel
    (hessian_diagonal, laplacian) on a (4096, 2) float32 input on cpu``."""
    name = getattr(f, "__name__", type(f).__name__)
    what = KERNELS.get(kernel.__name__, kernel.__name__).format(f=name)
    x = next(t for t in inputs if isinstance(t, torch.Tensor))
    dtype = str(x.dtype).removeprefix("torch.")
    return f"{what} on a {fmt_shape(x.shape)} {dtype} input on {x.device}"


def _require_torch_function(f: object) -> None:
    if callable(f):
        return
    hint = (
        ": Julia source from pyhvp.julia_function runs with backend='julia'"
        if type(f).__name__ == "JuliaFunction"
        else ""
    )
    raise TypeError(
        f"f must be a Python function of torch tensors for backend='torch', "
        f"got {type(f).__name__}{hint}"
    )


class TorchBackend:
    """torch.func primitives; ``compile`` is ``"auto"`` (default), ``True`` or ``False``;
    ``guards``: the Taylor engine reuses a program while dynamo's guards on ``f`` hold instead
    of recording ``f`` at every call (the Taylor engine guide, "Guards")."""

    name = "torch"

    def __init__(self, compile: CompileMode = "auto", guards: bool = True) -> None:
        if not (isinstance(compile, bool) or compile == "auto"):
            raise ValueError(f"compile must be 'auto', True or False, got {compile!r}")
        if not isinstance(guards, bool):
            raise ValueError(f"guards must be True or False, got {guards!r}")
        self.compile = compile
        self.guards = guards

    def __repr__(self) -> str:
        return f"TorchBackend(compile={self.compile!r}, guards={self.guards!r})"

    def grad_and_hvp(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        tangents: torch.Tensor,
        args: Sequence[object],
        event_dims: int,
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-instance gradients (x's shape) and HVPs ``(k, *x.shape)``: the one-leaf
        ``grad_and_block_hvps`` of ``sum_b f(x)[b]``, reverse-over-reverse; where the results
        carry derivatives, of ``f`` with the ops written out whose third derivatives torch gets
        wrong (``layer_norm``: a gradient of an HVP was 45 off)."""
        _require_torch_function(f)
        summed: Callable[..., torch.Tensor] = InstanceSum(f, event_dims)
        outside = not (nested.inside_transform() or taylor.recording())  # (written out inside)
        if outside and (_needs_autograd((x, tangents, *args)) or _nested_under_grad()):
            summed = nested.written_out(summed, cumulative=False)
        with torch.inference_mode(False):  # an inference x: its copy, which f writes, watched
            x = _normal_tensor(x)
        watched = Watched(x)
        try:
            (g,), (hv,) = self.grad_and_block_hvps(summed, (x,), (tangents,), args, chunk_size)
        except RuntimeError as error:  # x written by f: said as the Taylor engine says it
            if watched.written():  # (autograd's own error about the view it wrote)
                raise taylor.InPlaceInputError(WRITTEN_UNDER_NO_GRAD) from error
            refusal = write_to_x_refusal(error, f, x, args)
            if refusal is None:
                raise
            raise refusal from error
        if watched.written():  # under no_grad, which autograd allows: found after it
            raise taylor.InPlaceInputError(WRITTEN_UNDER_NO_GRAD)
        return g, hv

    def grad_and_block_hvps(
        self,
        f: Callable[..., torch.Tensor],
        leaves: Sequence[torch.Tensor],
        tangents: Sequence[torch.Tensor],
        args: Sequence[object],
        chunk_size: int | None,
    ) -> Blocks:
        """Gradients of the scalar ``f(*leaves, *args)`` and, per leaf, ``d^2 f / d leaf_i^2``
        times ``tangents[i]`` (shape ``(k_i, *leaves[i].shape)``, ``k_i`` may be 0); inside a
        transform, of ``f`` with the ops written out whose nested derivatives torch gets wrong."""
        _require_torch_function(f)
        inside = nested.inside_transform()
        try:
            return self._run(
                _grad_and_block_hvps_eager,
                _grad_and_block_hvps_functional
                if taylor.recording()
                else _grad_and_block_hvps_traced,
                nested.written_out(f) if inside else f,
                (len(leaves), chunk_size),
                (*leaves, *tangents, *args),
            )
        except (NotImplementedError, RuntimeError) as error:  # (a refusal of the written-out f)
            if inside:
                note(error, nested.OUTSIDE)
            raise

    def restricted_hessian(
        self,
        f: Callable[..., torch.Tensor],
        tensors: Sequence[torch.Tensor],
        entries: Sequence[torch.Tensor],
        args: Sequence[object],
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, int]:
        """``(K, K)`` Hessian of the scalar ``f(*tensors, *args)`` over the selected entries of
        ``tensors`` (each one's ``pyhvp.restricted.selected_entries``) by sparse injection
        (``pyhvp.restricted.restricted_hessian``, which raises ``pyhvp.restricted.NotSparse``
        where it does not apply), and how many ``F.linear`` calls took it; eager or compiled
        like the other kernels."""
        _require_torch_function(f)
        kernel = restricted.restricted_hessian
        static = (len(tensors), chunk_size)
        inputs = (*tensors, *entries, *args)
        views = (
            contextlib.nullcontext() if self.compile is False else restricted.handed_to_the_mode()
        )
        with views:  # (W.T seen by the mode where dynamo traces the kernel)
            return self._run(kernel, kernel, f, static, inputs, compilable=restricted.compiles)

    def second_directional(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        args: Sequence[object],
        chunk_size: int | None,
    ) -> torch.Tensor:
        """``d^2/dt^2 f(x + t u)`` per direction ``(k, *out)``: see :mod:`pyhvp.backends`.
        Second-order Taylor mode; ``f`` is recorded once for all chunks of directions."""
        (second,) = self.taylor_coefficients(f, x, directions, args, chunk_size, order=2,
                                             outputs=(2,))  # fmt: skip
        return second

    def collapsed_jet(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        args: Sequence[object],
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(f(x), first (k, *out), sum over directions of second)``: see :mod:`pyhvp.backends`."""
        value, first, second = self.taylor_coefficients(f, x, directions, args, chunk_size,
                                                        order=2, outputs=(0, 1, 2),
                                                        collapsed=True)  # fmt: skip
        return value, first, second

    def collapsed_second(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        args: Sequence[object],
        chunk_size: int | None,
    ) -> torch.Tensor:
        """``collapsed_jet``'s third result alone (``out``): its kernels compute neither the
        value nor the first derivatives of f's output, which a Laplacian does not need."""
        (second,) = self.taylor_coefficients(f, x, directions, args, chunk_size, order=2,
                                             outputs=(2,), collapsed=True)  # fmt: skip
        return second

    def taylor_coefficients(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        args: Sequence[object],
        chunk_size: int | None,
        *,
        order: int,
        outputs: tuple[int, ...],
        collapsed: bool = False,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Taylor coefficients of ``f`` along ``directions``: see :mod:`pyhvp.backends`. Taylor
        mode of ``order`` (:mod:`pyhvp.taylor`); ``f`` is recorded once for all chunks, the
        per-direction outputs of the chunks concatenated, the collapsed one summed."""
        mode = taylor.JetMode(order, collapsed, outputs, weights is not None)
        x, directions = plain_tensor("x", x), plain_tensor("v", directions)
        args = tuple(
            plain_tensor(f"args[{i}]", arg)
            if isinstance(arg, torch.Tensor)
            else pytree.tree_map_only(torch.Tensor, partial(plain_tensor, f"args[{i}]"), arg)
            for i, arg in enumerate(args)
        )  # (a tensor arg directly, as _normal takes it)
        if nested.inside_transform():
            # (a stride-0 x is refused by the transforms; under vmap .contiguous() may keep it)
            x = x.clone(memory_format=torch.contiguous_format)
            watched = Watched(x)
            try:
                out = nested.taylor_coefficients(f, x, directions, args, chunk_size, mode,
                                                 weights)  # fmt: skip
            except RuntimeError as error:  # autograd's refusal of a write to x, said as ours
                refusal = write_to_x_refusal(error, f, x, args)
                if refusal is None:
                    raise
                raise refusal from error
            if watched.written():  # (the recorder refuses it outside: until 2026-12-07, the
                # coefficients inside were at the written values)
                raise taylor.InPlaceInputError(WRITTEN_INSIDE_TRANSFORM)
            return out
        size = chunk_size or len(directions)
        # one chunk: directions themselves (a split costs a few microseconds a call)
        chunks = (directions,) if size >= len(directions) else torch.split(directions, size)
        parts_of_weights = (
            [None] * len(chunks) if weights is None
            else [weights] if len(chunks) == 1 else list(torch.split(weights, size))
        )  # fmt: skip
        parts = [
            cast(tuple[torch.Tensor, ...], part)
            for part in self._jets(f, x, chunks, parts_of_weights, args, mode)
        ]
        if len(parts) == 1:
            return parts[0]
        combined = []
        for i, k in enumerate(outputs):
            pieces = [p[i] for p in parts]
            if k == 0:
                combined.append(pieces[0])
            elif mode.collapses(k):
                combined.append(sum(pieces[1:], pieces[0]))
            else:
                combined.append(torch.cat(pieces))
        return tuple(combined)

    def _capture(
        self, f: Callable[..., torch.Tensor], x: torch.Tensor, args: Sequence[object],
        guarded: bool,
    ) -> taylor.Capture:  # fmt: skip
        """``f``'s program (:func:`pyhvp.taylor.capture`: recorded, or found by dynamo's guards);
        ``x`` enters as a fresh alias, so ``x`` in ``args`` or captured by ``f`` is a constant
        there; inference tensors (``x``, ``args``) are cloned (autograd may not save them, as
        ``f``'s ops on parameters that require grad would)."""
        _require_torch_function(f)
        with torch.inference_mode(False):
            y, *rest = _normal((x, *args))
            return taylor.capture(f, cast(torch.Tensor, y), rest, guarded)

    def _jets(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        chunks: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor | None],
        args: Sequence[object],
        mode: taylor.JetMode,
    ) -> list[object]:
        """The jet kernel's results per chunk of directions (and their weights), from one
        capture: the plain kernel's, or, where its derivatives are not all finite, the
        strong-zero kernel's (:mod:`pyhvp.taylor.jets`: equal wherever the plain one is finite,
        and a non-finite derivative stays in the entries it reaches). Nested inside ``f`` of
        another Taylor-engine operator, ``f`` is recorded and the kernels traced outside the
        outer record, and the strong-zero kernel runs in it (:meth:`_run`: its ops are the outer
        ``f``'s, which a finiteness test would make depend on values)."""
        nested = taylor.recording()
        with taylor.outside_recording() if nested else contextlib.nullcontext():
            captured = self._capture(f, x, args, self.guards and not nested)
        parts = []
        for part, w in zip(chunks, weights, strict=True):
            inputs = (x, part, *([] if w is None else [w]), *captured.constants)
            out = None
            for strong in (True,) if nested else (False, True):
                outside = taylor.outside_recording() if nested else contextlib.nullcontext()
                with outside, torch.inference_mode(False):
                    kernel = captured.kernel(replace(mode, strong=strong), x, part, w)
                out = self._run(_jet_kernel, _jet_kernel, kernel, (), inputs, True)
                if strong or _finite_derivatives(out, mode):
                    break
            parts.append(out)
        return parts

    @math_attention  # fused attention kernels have no second derivative
    @differentiated_twice  # norms, weight norms, sinc: torch's double backwards are wrong
    def _run(
        self,
        eager_kernel: Callable[..., Result],
        traced_kernel: Callable[..., Result],
        f: Callable[..., object],
        static: tuple[Hashable, ...],
        inputs: tuple[object, ...],
        differentiable_compiled: bool = False,
        compilable: Callable[[], bool] | None = None,
    ) -> Result:
        """Results carry autograd history exactly when grad mode is on and an input requires
        grad; otherwise they are detached on every path, whatever f captures. With autograd
        history a kernel runs eagerly, unless ``differentiable_compiled`` (the jet kernels: plain
        aten graphs, which AOTAutograd compiles forward and backward) and no functorch transform
        or forward-mode AD is active: then it follows the compile policy too, under a key of its
        own, run as one ``_Detour`` autograd node. Inference tensors are cloned
        into normal ones outside inference mode. ``compilable()``, asked once a signature would
        compile, says whether this torch compiles the kernel faithfully (if not, it runs eagerly
        for good, without a warning: a known limit, not a compiler failure)."""
        if taylor.recording():  # nested in f of a Taylor-engine operator: its ops are f's
            return traced_kernel(f, *static, *inputs)
        if nested.inside_transform():
            # inside a torch.func transform: the torch.func kernel composes with it, where
            # autograd's batched backward (is_grads_batched) leaked its own vmap level
            return traced_kernel(f, *static, *inputs)
        eager = partial(eager_kernel, f, *static)
        if _needs_autograd(inputs) or (not differentiable_compiled and _nested_under_grad()):
            inputs = _normal(inputs)  # outside inference mode: grad mode is on
            tensors_only = all(isinstance(t, torch.Tensor) for t in inputs)
            if not (differentiable_compiled and tensors_only and _plain_autograd()):
                return cast(Result, _with_zero_derivatives(eager(*inputs), inputs))
            detour = partial(_Detour.run, eager, cast(tuple[torch.Tensor, ...], inputs))
            out = self._dispatch(eager, traced_kernel, f, static, inputs, compilable, detour)
            return cast(Result, _with_zero_derivatives(out, inputs))  # (eager there: compile
            # False, or a global module hook; a detour's results carry a graph)
        # no_grad: leaving inference mode turns grad mode on, and a kernel compiled with grad
        # mode on would be a forward-and-backward graph whose backward never runs
        with torch.inference_mode(False), torch.no_grad():
            inputs = _normal(inputs)
            out = self._dispatch(eager, traced_kernel, f, static, inputs, compilable)
        # both kernels return what eager_kernel returns; the compile cache holds them untyped
        return cast(Result, _detached(out))

    def _dispatch(
        self,
        eager: Callable[..., object],
        traced_kernel: Callable[..., object],
        f: Callable[..., object],
        static: tuple[Hashable, ...],
        inputs: tuple[object, ...],
        compilable: Callable[[], bool] | None = None,
        detour: Callable[[Callable[..., object], Hooks], object] | None = None,
    ) -> object:
        """``eager(*inputs)`` or the compiled kernel's results under the compile policy;
        ``detour`` (calls that autograd differentiates) runs the compiled kernel instead."""
        # (a global module hook: dynamo guards none, so a kernel compiled before one was
        # registered ignored it, and one compiled under it would keep it once removed)
        if self.compile is False:
            return eager(*inputs)
        if compile_policy.global_module_hooks():
            if self.compile is True:  # asked for by name: say why it is not served
                warnings.warn(
                    f"pyhvp: compile=True runs {_describe(traced_kernel, f, inputs)} eagerly "
                    "while a global module hook is registered "
                    "(torch.nn.modules.module.register_module_forward_hook or _pre_hook): "
                    "torch.compile guards none, so a compiled kernel could ignore it",
                    RuntimeWarning,
                    stacklevel=stacklevel_outside_pyhvp(),
                )
            return eager(*inputs)
        try:
            key = compile_policy.signature(traced_kernel.__name__, f, static, inputs)
            hash(key)
        except TypeError:  # an unhashable function: nothing to cache it under
            return eager(*inputs)
        entry = _CACHE.entry(key)
        eager = _declining_written_out(eager, entry)
        auto = self.compile == "auto"
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        if entry.compiled is not None and not entry.judged and not entry.on_trial():
            _CACHE.judge(entry)  # here, not after the last trial call: its backward has run
        waiting = auto and entry.compiled is None and not _CACHE.should_compile(entry)
        if not waiting and entry.compiled is None and compilable is not None:
            with quiet_tracing():
                entry.failed = not compilable()
        # compile=True times eager calls during the trial too (alternately, each one serving
        # the call): a compiled kernel slower than eager is declined, as under "auto"
        eager_turn = (
            not auto
            and entry.checked
            and entry.on_trial()
            and (len(entry.eager.recent) < len(entry.compiled_runs.recent))
        )
        if eager_turn:
            _unsettle()
        if entry.failed or entry.declined or waiting or eager_turn:
            if detour is None or entry.failed or entry.declined:
                return entry.eager.timed(lambda: eager(*inputs), device)
            # a training step: the kernel's backward counts too (on the CPU: CUDA's runs async)
            hooks = Hooks(spent=entry.eager.add_to_last if device.type == "cpu" else None,
                          reusable=True)  # fmt: skip
            return entry.eager.timed(lambda: detour(eager, hooks), device)
        # the kernel runs the function it was compiled for: an equal-keyed other one only while
        # that function still has the key (its captured state may have changed since; a key
        # without a Python function's cannot: a module_loss's)
        stale = (
            entry.compiled_for is not f
            and entry.compiled_for_may_change
            and compile_policy.function_key(entry.compiled_for) != key[1]
        )
        compiled = None if stale else entry.compiled
        if compiled is None:
            if auto:
                _CACHE.announce(entry, _describe(traced_kernel, f, inputs))
            compiled = _compile_bound(traced_kernel, f, static)
            entry.compiled, entry.compiled_for = compiled, f
            entry.compiled_for_may_change = compile_policy.may_change(key[1])
            entry.checked = entry.backward_checked = False
        # until a result was checked: a first run that raised a BaseException (the sparse
        # route's NotSparse, an interrupt) returned nothing to check, so the next run is first
        first_call = not entry.checked
        if first_call:
            _unsettle()
        random_state = random_states.save(device)
        graphs = _graphs_traced()
        # a rerun starts where the compiled run did, f's running statistics and generators
        # too: known on a first call, from its eager check (a later call's retrace, rare, notes
        # them in its check instead; copying a written buffer every call cost a 32 MB buffer
        # 5x the call)
        expected, before, after_check = None, Snapshot([], []), random_state
        changed: list[tuple[torch.Tensor, torch.Tensor]] = []
        if first_call:  # eager's result to check the compiled one by, and what f changes
            expected, before, changed = _noting_changes(eager, inputs)
            after_check = random_states.save(device)
            random_states.restore(random_state)  # random ops draw the same values

        def again() -> None:
            before.restore()
            random_states.restore(random_state)

        def eagerly() -> object:
            # the call's eager result where the compiled run cannot serve it: the first call's
            # check, where it made one whole eager call (nothing to differentiate, no tensor
            # of f's changed: its changes were put back); else a run from the state before.
            # Only the check's: f's Python state (a counter) is not put back, and a third run
            # of a counting f gave an HVP 3x the eager call's
            if first_call and detour is None and not (before.storages or before.generators):
                random_states.restore(after_check)
                return expected
            again()
            return eager(*inputs)

        def failed(error: Exception, note: str = "") -> None:  # an optimisation: say so once
            entry.failed = True
            reason = str(error).split("\n\n")[0]  # (dynamo's debug context and stack after)
            warnings.warn(
                f"pyhvp: torch.compile failed for {_describe(traced_kernel, f, inputs)} "
                f"({type(error).__name__}: {reason}); running this signature eagerly{note}",
                RuntimeWarning,
                stacklevel=stacklevel_outside_pyhvp(),
            )

        def backward_checked() -> None:
            entry.backward_checked = True

        def run(spent: Callable[[float], None] | None = None) -> object:
            if detour is None:
                return compiled(*inputs)
            check = None if entry.backward_checked else backward_checked
            return detour(compiled, Hooks(failed, spent, checked=check))

        if entry.failed:  # the check differentiated a backward pyhvp writes out
            return eagerly()
        error: Exception | None = None
        try:
            # dynamo traces f: a bug of f's is reported by eager below
            with quiet_tracing(), compile_policy.HookGuards():
                if first_call:
                    later: list[Callable[[float], None]] = []  # the backward runs after this
                    start = compile_policy.clock()
                    cpu = device.type == "cpu"
                    with compile_policy.compiling():
                        out = run((lambda s: later[0](s) if later else None) if cpu else None)
                    later.append(_CACHE.record_compile(entry, compile_policy.clock() - start))
                elif entry.on_trial():
                    account = entry.compiled_runs
                    spent = account.add_to_last if device.type == "cpu" else None
                    out = account.timed(lambda: run(spent), device)
                else:
                    out = run()
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError only exists from 2.5
            raise
        except Exception as caught:  # fall back
            error = caught
        if error is not None:  # outside the handler: an error of f's own is raised as eagerly,
            result = eagerly()  # not chained to the compiler's
            failed(error)
            return result
        # a graph dynamo traced anew in this call (a guard on f's captured state failed: a flag
        # flipped, a branch taken anew) is checked like a first one: only the first graph was
        retraced = not first_call and _graphs_traced() != graphs
        if retraced:
            compile_policy.restore_denormals(compile_policy.KeepingDenormals.last_seen)
            _unsettle()
            entry.backward_checked = False
        if first_call or retraced:  # a compiled graph serves only once its result is eager's
            checked, note = out, ""
            if retraced:  # f's state is the compiled run's now, the check's put back
                after = random_states.save(device)
                random_states.restore(random_state)  # random ops draw the same values
                expected, noted, _ = _noting_changes(eager, inputs)
                if entry.failed:  # (a backward pyhvp writes out, in the graph traced anew)
                    random_states.restore(after)
                    return eagerly()
                if noted.storages or noted.generators:
                    # f changes state (a generator first drawn from in this graph): the graph
                    # runs again from the check's state, which is then put back
                    random_states.restore(random_state)
                    try:
                        with quiet_tracing():
                            checked = run()
                    except Exception as caught:  # (a disagreement too)
                        checked = caught
                    noted.restore()
                    note = (
                        "; this call's result is eager's from the state the compiled run left "
                        "(f changes state beyond its values): one run on"
                    )
                random_states.restore(after)
            result_differs = (
                f"it raised {type(checked).__name__}: {checked}"
                if isinstance(checked, Exception)
                else compile_policy.disagreement(checked, expected)
            )
            # (also where the result differs: a kernel that runs f more often may change what
            # f computes as well as its state -- spectral_norm's vectors, which each run updates)
            state_differs = None if isinstance(checked, Exception) else _state_after(changed)
            difference = result_differs or state_differs
            if difference is not None:
                where = "on a graph traced anew" if retraced else "on its first call"
                drew = random_states.drew(random_state, after_check if first_call else after)
                cause = RANDOM_DRAWS if drew else STATE_CHANGES if state_differs else None
                failed(CompiledKernelDisagrees(difference, where, cause), note)
                return eagerly()  # with autograd history where the call needs it
            entry.checked = True
        return out
