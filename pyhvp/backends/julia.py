"""The julia backend: Enzyme.jl, ForwardDiff.jl and CUDA.jl through juliacall. The only module
that talks to Julia (julia/README.md has the design and what each Julia path relies on).

* **Start-up.** Julia starts lazily, on the first julia-backend call, with the juliacall
  environment variables set first (``PYTHON_JULIACALL_HANDLE_SIGNALS=yes``, threads ``auto``,
  unless already set), and ``include``s the bundled package ``pyhvp/julia/src/PyHVP.jl``.
  PythonCall's FAQ asks for ``juliacall`` to be imported before ``torch``, and juliacall warns
  when it is not; pyhvp imports torch, so put ``import juliacall`` first in your program.
  Julia starts offline (``PYTHON_JULIAPKG_OFFLINE=yes``) unless ``PYHVP_JULIA_AUTOINSTALL=yes``,
  so a call never downloads by surprise.
* **Availability.** :func:`julia_available` runs one offline probe in a subprocess (with a
  timeout) that starts Julia and loads the bundled package; its answer is cached per process.
* **Tensors.** Inputs are detached and made C-contiguous as ``(*batch, n)`` (``n`` = one
  instance's variables, flattened); outputs are allocated here and written in place by Julia.
  Each tensor is lent as a DLPack capsule together with the shape Julia must see, ``(n,
  batch...)`` (:func:`lend`), and Julia hands every one back before the call returns -- no
  copy either way for contiguous inputs, nothing held afterwards. The user function sees one
  instance's ``x`` with the event shape *reversed* (a vector for ``event_dims=1``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pyhvp._checks import checked_arg_event_dims, pad_arg_to_batch, per_arg_event_dims
from pyhvp.backends import BackendUnavailableError
from pyhvp.taylor.recorder import recording

MAX_TANGENTS_PER_CALL = 8
"""Tangents per Julia call: a compile-time width (Enzyme's ``BatchDuplicated`` on the CPU, the
tangent duals' partials on CUDA); more are sent in chunks."""

PROBE_TIMEOUT_S = 180.0
"""The availability probe gives up (answers False) after this long: it never hangs."""

JULIACALL_DEFAULTS = {
    "PYTHON_JULIACALL_HANDLE_SIGNALS": "yes",
    "PYTHON_JULIACALL_THREADS": "auto",
}

BUNDLED_PACKAGE = Path(__file__).resolve().parents[1] / "julia" / "src" / "PyHVP.jl"
"""The bundled Julia package, loaded with ``include`` (no juliapkg ``path`` entry to clash)."""

INSTALL_HELP = (
    "The julia backend needs juliacall, a Julia of 1.10.3 or newer in the range juliacall "
    "accepts, and the Julia packages in "
    "pyhvp/juliapkg.json (Enzyme, CUDA, DLPack, ForwardDiff, StaticArrays). Install with "
    'internet, in a checkout of pyhvp (it is not on PyPI): `pip install ".[julia]"`, then '
    'once `python -c "import juliapkg; '
    'juliapkg.resolve()"` (downloads Julia and the packages, then precompiles), or set '
    "PYHVP_JULIA_AUTOINSTALL=yes to let juliacall install them on first use. To use a Julia "
    "you already have, set PYTHON_JULIAPKG_EXE=/path/to/julia before the install command."
)

_PROBE = (
    "import sys, juliacall; juliacall.Main.include(sys.argv[1]); "
    "print(juliacall.Main.seval('string(VERSION)'))"
)


class JuliaBackendError(RuntimeError):
    """Julia raised an error inside a julia-backend call; the message carries Julia's own."""


class JuliaFunction:
    """A per-instance Julia function given as source, for ``backend="julia"``.

    ``source`` evaluates to a function ``f(x, args...)`` of one instance's variables ``x`` and
    one instance's args, returning a scalar. ``arg_event_dims`` gives each tensor arg's number
    of trailing per-instance dims (default: ``event_dims``), as in :func:`pyhvp.per_instance`.
    """

    def __init__(self, source: str, arg_event_dims: int | Sequence[int] | None = None) -> None:
        if not isinstance(source, str):
            raise TypeError(f"source must be a str of Julia code, got {type(source).__name__}")
        if not source.strip():
            raise ValueError("source must be Julia code for a function, got an empty string")
        self.source = source
        self.arg_event_dims = checked_arg_event_dims(arg_event_dims)

    def __repr__(self) -> str:
        return f"julia_function({self.source!r})"


def julia_function(source: str, arg_event_dims: int | Sequence[int] | None = None) -> JuliaFunction:
    """Wrap Julia source of a per-instance function for ``backend="julia"`` (compiled on first use).

    ``f(x, args...)`` gets one instance's ``x`` (a vector for ``event_dims=1``; for more event
    dims, an array with the event shape reversed) and one instance's args, and returns a scalar.
    Write it generically, for any ``AbstractArray`` of any ``Real``: on the CPU ``x`` is a view
    that Enzyme differentiates; on CUDA it is an ``SArray`` of ForwardDiff dual numbers.

    >>> jf = julia_function("(x, mu) -> exp(-sum(abs2, x .- mu))")
    >>> jf.source
    '(x, mu) -> exp(-sum(abs2, x .- mu))'
    """
    return JuliaFunction(source, arg_event_dims)


# ----------------------------------------------------------------------------- start-up

_STATE: dict[str, Any] = {"main": None, "probe": None, "functions": {}}


def _auto_install() -> bool:
    return os.environ.get("PYHVP_JULIA_AUTOINSTALL", "").lower() in ("yes", "1", "true")


def probe_julia(timeout_s: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Can Julia start offline with the bundled package? ``(ok, reason)``; never downloads.

    Runs in a subprocess with ``PYTHON_JULIAPKG_OFFLINE=yes`` and a timeout, so a missing Julia
    answers in about a second and nothing in this process is touched.
    """
    if importlib.util.find_spec("juliacall") is None:
        return False, "juliacall is not installed"
    env = {**os.environ, **JULIACALL_DEFAULTS, "PYTHON_JULIAPKG_OFFLINE": "yes"}
    # a session of its own: on a timeout the Julia it started goes too, not only the Python
    with subprocess.Popen(
        [sys.executable, "-c", _PROBE, str(BUNDLED_PACKAGE)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return False, f"starting Julia offline took longer than {timeout_s:.0f} s"
    if process.returncode != 0:
        lines = (stderr or stdout).strip().splitlines()
        return False, "offline start failed: " + (lines[-1] if lines else "no output")
    return True, "Julia " + stdout.strip()


def julia_available() -> bool:
    """True when the julia backend can really start here (offline probe, cached per process)."""
    if _STATE["main"] is not None:
        return True
    if _STATE["probe"] is None:
        _STATE["probe"] = probe_julia()
    return bool(_STATE["probe"][0])


def _start_julia() -> Any:
    """Import juliacall (environment first) and load the bundled package; once per process."""
    if _STATE["main"] is not None:
        return _STATE["main"]
    if "juliacall" not in sys.modules:
        for key, value in JULIACALL_DEFAULTS.items():
            os.environ.setdefault(key, value)
    offline_was = os.environ.get("PYTHON_JULIAPKG_OFFLINE")
    if offline_was is None and not _auto_install():
        os.environ["PYTHON_JULIAPKG_OFFLINE"] = "yes"
    try:
        try:
            import juliacall
        except Exception as error:  # juliapkg's bare Exception: no Julia it may use
            raise BackendUnavailableError(
                f"the julia backend cannot start ({type(error).__name__}: {error}). {INSTALL_HELP}"
            ) from error
        main = juliacall.Main
        call_julia("loading the bundled PyHVP package", main.include, str(BUNDLED_PACKAGE))
    finally:
        if offline_was is None:
            os.environ.pop("PYTHON_JULIAPKG_OFFLINE", None)
    _STATE["main"] = main
    return main


def call_julia(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call into Julia; any exception becomes a :class:`JuliaBackendError` that says what failed.

    Not only ``juliacall.JuliaError``: PythonCall re-raises a Python exception thrown inside a
    Julia call as its own type, and reports a ``MethodError`` of the called function itself as
    a ``TypeError``. An interrupt (not an ``Exception``) passes through unchanged.
    """
    try:
        return fn(*args)
    except Exception as error:
        raise JuliaBackendError(
            f"julia backend: {what} failed in Julia:\n{type(error).__name__}: {error}"
        ) from error


def _compiled(main: Any, jf: JuliaFunction) -> Any:
    functions = _STATE["functions"]
    if jf.source not in functions:
        functions[jf.source] = call_julia(
            f"evaluating the function source {jf.source!r}", main.seval, jf.source
        )
    return functions[jf.source]


# ----------------------------------------------------------------------------- DLPack glue


def julia_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape Julia gives a C-contiguous torch tensor of ``shape``: the dims reversed
    (column-major over the same memory)."""
    return tuple(int(d) for d in reversed(shape))


def julia_layout(tensor: torch.Tensor, lead: Sequence[int], own_dims: int) -> torch.Tensor:
    """``tensor`` (``*lead, *own``) detached, flattened to ``(*lead, prod(own))``, C-contiguous.

    The result is what DLPack lends to Julia without a copy (Julia sees it as
    ``(prod(own), reverse(lead)...)``); it is a copy only if ``tensor`` was not contiguous.
    """
    own = tensor.shape[tensor.ndim - own_dims :]
    return tensor.detach().reshape(*lead, math.prod(own)).contiguous()


def lend(tensor: torch.Tensor) -> tuple[Any, tuple[int, ...]]:
    """A C-contiguous ``tensor`` as Julia borrows it: ``(DLPack capsule, Julia shape)``.

    Julia is told the shape (:func:`julia_shape`) rather than left to DLPack.jl, which guesses
    the layout from the strides: torch 2.4-2.8 export every size-1 dim with stride 1, so a
    ``(1, 3)`` tensor reads as column-major and would arrive unreversed. The capsule is
    consumed by Julia, which hands the tensor back before the call returns.
    """
    return tensor.__dlpack__(), julia_shape(tensor.shape)


def check_julia_tensor(name: str, tensor: torch.Tensor) -> None:
    """The dtypes and devices the julia backend handles: float32/64 on the CPU or a CUDA GPU."""
    if tensor.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"{name} must be float32 or float64 for backend='julia', got {tensor.dtype}"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name} must be on cpu or cuda for backend='julia', got {name} on {tensor.device}"
        )


def check_no_autograd(named: Sequence[tuple[str, object]]) -> None:
    """Julia's results carry no autograd graph: refuse inputs that need one (grad mode on), and
    calls nested in ``f`` of a Taylor-engine operator, which would read the result as a
    constant (a silent zero derivative)."""
    if recording():
        raise ValueError(
            "backend='julia' is called inside f of a Taylor-engine operator (pyhvp.laplacian, "
            "hessian_diagonal, ...), which cannot differentiate Julia's result and would read "
            "it as a constant: use backend='torch' for the nested call"
        )
    for name, value in named:
        if torch.is_grad_enabled() and isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(
                f"{name} requires grad, but backend='julia' results are not differentiable: "
                f"pass {name}.detach(), call under torch.no_grad(), or use backend='torch'"
            )


def julia_args(
    args: Sequence[object],
    arg_event_dims: int | Sequence[int] | None,
    event_dims: int,
    batch: torch.Size,
) -> tuple[tuple[object, ...], tuple[tuple[int, ...], ...]]:
    """Args as Julia receives them -- tensors in :func:`julia_layout` (to be lent), numbers as
    floats -- and each arg's reversed per-instance shape (``()`` for numbers)."""
    values: list[object] = []
    shapes: list[tuple[int, ...]] = []
    for i, (arg, own) in enumerate(
        zip(args, per_arg_event_dims(arg_event_dims, event_dims, len(args)), strict=True)
    ):
        if isinstance(arg, torch.Tensor):
            padded = pad_arg_to_batch(f"args[{i}]", arg, own, batch)
            values.append(julia_layout(padded, padded.shape[: len(batch)], own))
            shapes.append(julia_shape(padded.shape[len(batch) :]))
        elif isinstance(arg, (int, float)):
            values.append(float(arg))
            shapes.append(())
        else:
            raise TypeError(
                f"args[{i}] must be a torch.Tensor or a Python number for backend='julia', "
                f"got {type(arg).__name__}"
            )
    return tuple(values), tuple(shapes)


# ----------------------------------------------------------------------------- the backend


class JuliaBackend:
    """Per-instance grad and HVPs in Julia: Enzyme on CPU; on GPU one CUDA thread per instance,
    on nested ForwardDiff duals.

    Construction raises :class:`~pyhvp.BackendUnavailableError` when Julia cannot start here.
    ``second_directional`` is not implemented (it raises): exact Hessian diagonals of scalar
    functions run on ``grad_and_hvp`` and work; vector-valued ones need the torch backend.
    """

    name = "julia"

    def __init__(self) -> None:
        if _STATE["main"] is None and not _auto_install() and not julia_available():
            reason = _STATE["probe"][1] if _STATE["probe"] else "unknown"
            raise BackendUnavailableError(
                f"the julia backend cannot start ({reason}). {INSTALL_HELP}"
            )

    def grad_and_hvp(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        tangents: torch.Tensor,
        args: Sequence[object],
        event_dims: int,
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(f, JuliaFunction):
            raise TypeError(
                f"f must be a pyhvp.julia_function(...) for backend='julia', got {type(f).__name__}"
            )
        check_julia_tensor("x", x)
        check_no_autograd(
            [("x", x), ("v", tangents), *((f"args[{i}]", a) for i, a in enumerate(args))]
        )
        batch = x.shape[: x.ndim - event_dims]
        xj = julia_layout(x, batch, event_dims)
        vj = julia_layout(tangents, tangents.shape[: 1 + len(batch)], event_dims)
        argv, arg_shapes = julia_args(args, f.arg_event_dims, event_dims, batch)
        g = torch.empty_like(xj)
        hv = torch.empty_like(vj)
        if xj.numel() == 0:  # no instance or no variable: nothing to compute, nothing to lend
            return g.reshape(x.shape), hv.reshape(tangents.shape)
        main = _start_julia()
        fn = _compiled(main, f)
        width = min(chunk_size or MAX_TANGENTS_PER_CALL, MAX_TANGENTS_PER_CALL)
        # torch exports a CUDA tensor only while its device is current; Julia is told the device.
        on_device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
        with on_device:
            if x.is_cuda:
                torch.cuda.current_stream(x.device).synchronize()
            for start in range(0, vj.shape[0], width):
                part = range(start, min(start + width, vj.shape[0]))
                call_julia(
                    "grad_and_hvp",
                    main.PyHVP.grad_and_hvp_dlpack_b,
                    lend(g),
                    tuple(lend(hv[j]) for j in part),
                    fn,
                    lend(xj),
                    tuple(lend(vj[j]) for j in part),
                    tuple(lend(a) if isinstance(a, torch.Tensor) else a for a in argv),
                    julia_shape(x.shape[x.ndim - event_dims :]),
                    arg_shapes,
                    x.device.index if x.is_cuda else None,
                )
        return g.reshape(x.shape), hv.reshape(tangents.shape)

    def second_directional(
        self,
        f: Callable[..., torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        args: Sequence[object],
        chunk_size: int | None,
    ) -> torch.Tensor:
        raise NotImplementedError(
            "backend='julia' implements grad_and_hvp only; second_directional "
            "(second directional derivatives: hessian_diagonal of a vector-valued f) needs "
            "backend='torch'"
        )
