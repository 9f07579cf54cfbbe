"""Backend registry and the primitive interface every backend implements.

A backend computes two batched-tangent primitives; every operator of pyhvp is built on them:

* ``grad_and_hvp(f, x, tangents, args, event_dims, chunk_size)`` -- gradients and
  Hessian-vector products (torch: reverse-over-reverse; julia: Enzyme forward-over-reverse on
  the CPU, nested ForwardDiff duals on CUDA).
  ``f(x, *args)`` returns one value per instance (shape ``x.shape[:-event_dims]``);
  ``tangents`` has shape ``(k, *x.shape)``. Returns the gradient of ``f(x).sum()`` (x's shape) and
  the k Hessian-vector products ``(k, *x.shape)``. Instances are independent, so the Hessian of
  the sum is block-diagonal and these are exactly the per-instance gradients and HVPs.
* ``second_directional(f, x, directions, args, chunk_size)`` -- second directional
  derivatives. ``f(x, *args)`` may return any shape ``out``; ``directions`` has shape
  ``(k, *x.shape)``, or is broadcast over instances: size 1 in any batch dim
  (``(k, 1, ..., 1, *event)``: the same direction in every instance, e.g. a basis vector
  ``e_i``), which a backend may exploit or expand. Returns ``d^2/dt^2 f(x + t u)`` at ``t=0``
  for every direction ``u``: shape ``(k, *out)``, at most ``chunk_size`` directions pushed at
  once. How is the backend's choice: the torch backend runs second-order Taylor mode
  (:mod:`pyhvp.taylor`: value, first- and second-order coefficients in one forward pass, ``f``
  recorded once per call), not nested forward-mode AD; a backend without it raises
  ``NotImplementedError`` (julia), and scalar diagonals then use ``grad_and_hvp``.

Two primitives are optional (:func:`require_primitive` checks for them and names the backend
that has them):

* ``grad_and_block_hvps(f, leaves, tangents, args, chunk_size)`` -- the multi-leaf primitive
  of :func:`pyhvp.sub_hessian`. ``f(*leaves, *args)`` is a scalar; ``tangents[i]`` has shape
  ``(k_i, *leaves[i].shape)`` (``k_i`` may be 0). Returns every leaf's gradient and, per leaf,
  its own diagonal Hessian block times its tangents, ``d^2 f / d leaf_i^2 @ v``, from one forward
  and one first backward shared by all leaves (the torch backend prunes each second pass to its
  leaf). ``grad_and_hvp`` is its one-leaf case over the sum of instances.

* ``collapsed_jet(f, x, directions, args, chunk_size)`` -- collapsed second-order Taylor mode.
  Same inputs as ``second_directional``; returns ``(value, first, second)``: ``f(x, *args)``
  (shape ``out``), the first derivatives along each direction ``(k, *out)``, and the SUM over
  directions of the second derivatives ``sum_u d^2/dt^2 f(x + t u)`` (shape ``out``). With the
  basis ``e_i`` that is each instance's gradient and Laplacian; with columns of ``S`` it is
  ``tr(S^T H S)``; with random probes a Hutchinson sum. The torch backend runs it in the same
  Taylor mode, summing the second-order coefficients as it goes (a forward Laplacian).
  A backend may also have ``collapsed_second`` (same inputs, returns ``second`` alone, as the
  torch backend does): :func:`pyhvp.laplacian` then calls it instead, and nothing computes the
  first derivatives of the output that it would drop.

* ``taylor_coefficients(f, x, directions, args, chunk_size, *, order, outputs, collapsed=False,
  weights=None)`` -- Taylor mode of any order, what the higher-order operators
  (:func:`pyhvp.directional_derivatives`, :func:`pyhvp.bilaplacian`,
  :func:`pyhvp.differential_operator`) run on. Same inputs as ``second_directional``; returns
  one tensor per order in ``outputs``: order 0 is ``f(x, *args)`` (``out``), order ``k`` the
  ``d^k/dt^k f(x + t u)`` per direction ``(k_dirs, *out)`` -- except, with ``collapsed``, the
  top order ``order``, summed over the directions, each weighted by ``weights`` (``(k_dirs,)``;
  None: all 1), shape ``out``. The three primitives above are its second-order cases.

Every derivative a primitive returns has the dtype of what it differentiates with respect to
(``x``'s; a leaf's for ``grad_and_block_hvps``), whatever dtype ``f`` computes in, as autograd's
gradients do; ``collapsed_jet``'s value has ``f``'s (docs/guide/contract.md).

Backends are chosen by name (``backend="torch"``) or passed as a value
(``backend=TorchBackend(compile=True)``), as in DifferentiationInterface.jl.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, overload, runtime_checkable

import torch


class BackendUnavailableError(RuntimeError):
    """A backend was requested that cannot start here; the message says what to install."""


@runtime_checkable
class Backend(Protocol):
    """The primitive interface (see the module docstring for the shape contract)."""

    name: str

    def grad_and_hvp(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        tangents: torch.Tensor,
        args: Sequence[object],
        event_dims: int,
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient of ``f(x, *args).sum()`` (x's shape) and its products with ``tangents``
        ``(k, *x.shape)``: per instance, its own gradient and ``H_i v_i``."""
        ...

    def second_directional(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        args: Sequence[object],
        chunk_size: int | None,
    ) -> torch.Tensor:
        """``d^2/dt^2 f(x + t u)`` at ``t = 0`` for each of the ``k`` directions ``u``:
        ``(k, *out)``; raises ``NotImplementedError`` on a backend without it."""
        ...


BACKEND_NAMES = ("torch", "julia")

OPTIONAL_PRIMITIVES = {
    "collapsed_jet": "torch",
    "grad_and_block_hvps": "torch",
    "taylor_coefficients": "torch",
}
"""Optional primitive -> a backend that implements it."""


Blocks = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
"""``grad_and_block_hvps``' result: every leaf's gradient, and per leaf its ``(k_i, *leaf)`` products."""

GradAndBlockHvps = Callable[
    [Callable[..., torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[object],
     int | None],
    Blocks,
]  # fmt: skip
"""The optional multi-leaf primitive ``grad_and_block_hvps(f, leaves, tangents, args, chunk_size)``."""

CollapsedJet = Callable[
    [Callable[..., torch.Tensor], torch.Tensor, torch.Tensor, Sequence[object], int | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""The optional primitive ``collapsed_jet(f, x, directions, args, chunk_size)``: value, first, second."""


class TaylorCoefficients(Protocol):
    """The optional primitive ``taylor_coefficients`` (see the module docstring)."""

    def __call__(
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
    ) -> tuple[torch.Tensor, ...]: ...


@overload
def require_primitive(
    backend: Backend, primitive: Literal["grad_and_block_hvps"], operator: str
) -> GradAndBlockHvps: ...


@overload
def require_primitive(
    backend: Backend, primitive: Literal["collapsed_jet"], operator: str
) -> CollapsedJet: ...


@overload
def require_primitive(
    backend: Backend, primitive: Literal["taylor_coefficients"], operator: str
) -> TaylorCoefficients: ...


def require_primitive(backend: Backend, primitive: str, operator: str) -> Callable[..., Any]:
    """``backend``'s method ``primitive``, or a ValueError naming a backend that has it."""
    method: Callable[..., Any] | None = getattr(backend, primitive, None)
    if method is None:
        raise ValueError(
            f"{operator} needs the {primitive} primitive, which backend={backend.name!r} does "
            f"not implement; use backend={OPTIONAL_PRIMITIVES[primitive]!r}"
        )
    return method


_MEMBERS = tuple(n for n in (*Backend.__annotations__, *vars(Backend)) if n[0] != "_")
""":class:`Backend`'s members, read off the protocol."""

_CONFORMING: set[type] = set()
"""Classes that have :data:`_MEMBERS` themselves: their instances are backends without the
protocol check, which on Python 3.11 costs as much as a small problem's whole kernel."""


def resolve_backend(backend: str | Backend) -> Backend:
    """The backend object for a name or a backend value; raises if it cannot start here."""
    if isinstance(backend, str):
        if backend == "torch":
            from pyhvp.backends.torch import TorchBackend

            return TorchBackend()
        if backend == "julia":
            from pyhvp.backends.julia import JuliaBackend

            return JuliaBackend()
        raise ValueError(
            f"backend must be one of {list(BACKEND_NAMES)} or a Backend, got {backend!r}"
        )
    if type(backend) in _CONFORMING:
        return backend
    if isinstance(backend, type):  # the class itself passes the protocol check (its methods)
        raise TypeError(
            f"backend must be a name {list(BACKEND_NAMES)} or a Backend object, got the class "
            f"{backend.__name__} itself: pass an instance, {backend.__name__}()"
        )
    if isinstance(backend, Backend):  # a protocol check: 15-45 us a call on Python 3.11
        if all(hasattr(type(backend), member) for member in _MEMBERS):
            _CONFORMING.add(type(backend))
        return backend
    raise TypeError(
        f"backend must be a name {list(BACKEND_NAMES)} or a Backend object, "
        f"got {type(backend).__name__}"
    )


def available_backends() -> list[str]:
    """Names of the backends that can run right now; never hangs, never downloads."""
    from pyhvp.backends.julia import julia_available

    return ["torch", *(["julia"] if julia_available() else [])]
