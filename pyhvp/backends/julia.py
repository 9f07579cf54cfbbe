"""The julia backend: Enzyme.jl + CUDA.jl through juliacall. The only module that talks to Julia.

* **Start-up.** Julia starts lazily, on the first julia-backend call, with the juliacall
  environment variables set first (``PYTHON_JULIACALL_HANDLE_SIGNALS=yes``, threads ``auto``,
  optlevel 3, unless already set). PythonCall's FAQ asks for ``juliacall`` to be imported before
  ``torch``; pyhvp imports torch, so put ``import juliacall`` first in your program -- pyhvp warns
  otherwise. Julia starts offline (``PYTHON_JULIAPKG_OFFLINE=yes``) unless
  ``PYHVP_JULIA_AUTOINSTALL=yes``, so a call never downloads by surprise.
* **Availability.** :func:`julia_available` runs one offline probe in a subprocess (with a
  timeout) that starts Julia and loads the bundled package; its answer is cached per process.
* **Tensors.** Inputs are detached and made C-contiguous as ``(*batch, n)`` (``n`` = one
  instance's variables, flattened); outputs are allocated here and written in place by Julia
  through DLPack views -- no copy either way for contiguous inputs. DLPack reverses dims: Julia sees ``(n, batch...)``
  and the user function sees one instance's ``x`` with the event shape *reversed* (a vector for
  ``event_dims=1``). :func:`julia_layout` and :func:`julia_event_shape` are the one place
  where that happens.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pyhvp._checks import pad_arg_to_batch, per_arg_event_dims
from pyhvp.backends import BackendUnavailableError

MAX_TANGENTS_PER_CALL = 8
"""Enzyme's batch width is a compile-time constant; wider batches are sent in chunks."""

PROBE_TIMEOUT_S = 180.0
"""The availability probe gives up (answers False) after this long: it never hangs."""

JULIACALL_DEFAULTS = {
    "PYTHON_JULIACALL_HANDLE_SIGNALS": "yes",
    "PYTHON_JULIACALL_THREADS": "auto",
    "PYTHON_JULIACALL_OPTLEVEL": "3",
}

INSTALL_HELP = (
    "The julia backend needs juliacall, a Julia (1.10.3 or newer) and the Julia packages in "
    "pyhvp/juliapkg.json (Enzyme, CUDA, DLPack, StaticArrays, the bundled PyHVP). Install with "
    "internet: `pip install 'pyhvp[julia]'`, then once `python -c \"import juliapkg; "
    'juliapkg.resolve()"` (downloads Julia and the packages, then precompiles), or set '
    "PYHVP_JULIA_AUTOINSTALL=yes to let juliacall install them on first use. To use a Julia "
    "you already have, set PYTHON_JULIAPKG_EXE=/path/to/julia before the install command."
)

_PROBE = (
    "import juliacall; juliacall.Main.seval('import PyHVP'); "
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
        self.arg_event_dims = arg_event_dims

    def __repr__(self) -> str:
        return f"julia_function({self.source!r})"


def julia_function(source: str, arg_event_dims: int | Sequence[int] | None = None) -> JuliaFunction:
    """Wrap Julia source of a per-instance function for ``backend="julia"`` (compiled on first use).

    ``f(x, args...)`` gets one instance's ``x`` (a vector for ``event_dims=1``; for more event
    dims, an array with the event shape reversed) and one instance's args, and returns a scalar.
    Write it for any ``AbstractArray``: it runs on views (CPU) and on ``SArray``s (CUDA).

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
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"starting Julia offline took longer than {timeout_s:.0f} s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return False, "offline start failed: " + (lines[-1] if lines else "no output")
    return True, "Julia " + done.stdout.strip()


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
        if "torch" in sys.modules:
            warnings.warn(
                "pyhvp: torch was imported before juliacall; PythonCall's FAQ reports heap "
                "corruption in that order on some systems. Remedy: put `import juliacall` "
                "before `import torch` / `import pyhvp` in your program.",
                RuntimeWarning,
                stacklevel=4,
            )
        for key, value in JULIACALL_DEFAULTS.items():
            os.environ.setdefault(key, value)
    offline_was = os.environ.get("PYTHON_JULIAPKG_OFFLINE")
    if offline_was is None and not _auto_install():
        os.environ["PYTHON_JULIAPKG_OFFLINE"] = "yes"
    try:
        import juliacall

        main = juliacall.Main
        _call_julia("loading the bundled PyHVP package", main.seval, "import PyHVP")
    finally:
        if offline_was is None:
            os.environ.pop("PYTHON_JULIAPKG_OFFLINE", None)
    _STATE["main"] = main
    return main


def _call_julia(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call into Julia; a ``juliacall.JuliaError`` becomes a :class:`JuliaBackendError`."""
    import juliacall

    try:
        return fn(*args)
    except juliacall.JuliaError as error:
        raise JuliaBackendError(f"julia backend: {what} failed in Julia:\n{error}") from error


def _compiled(main: Any, jf: JuliaFunction) -> Any:
    functions = _STATE["functions"]
    if jf.source not in functions:
        functions[jf.source] = _call_julia(
            f"evaluating the function source {jf.source!r}", main.seval, jf.source
        )
    return functions[jf.source]


# ----------------------------------------------------------------------------- DLPack glue


def julia_event_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape Julia sees for a C-contiguous torch shape: DLPack reverses the dims."""
    return tuple(int(d) for d in reversed(shape))


def julia_layout(tensor: torch.Tensor, lead: Sequence[int], own_dims: int) -> torch.Tensor:
    """``tensor`` (``*lead, *own``) detached, flattened to ``(*lead, prod(own))``, C-contiguous.

    The result is what DLPack hands to Julia without a copy (Julia sees it as
    ``(prod(own), reverse(lead)...)``); it is a copy only if ``tensor`` was not contiguous.
    """
    own = tensor.shape[tensor.ndim - own_dims :]
    flat = tensor.detach().reshape(*lead, math.prod(own)).contiguous()
    # DLPack.jl reverses the dims only when the strides are not column-major too; a size-1 dim
    # of a contiguous tensor may carry any stride (a (3, 1) transpose has strides (1, 3), which
    # reads as column-major), so restride to the row-major strides: same memory, no copy.
    strides = tuple(math.prod(flat.shape[i + 1 :]) for i in range(flat.ndim))
    return flat if flat.stride() == strides else flat.as_strided(flat.shape, strides)


def check_julia_tensor(name: str, tensor: torch.Tensor) -> None:
    """The dtypes and devices the julia backend handles: float32/64 on cpu or cuda:0."""
    if tensor.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"{name} must be float32 or float64 for backend='julia', got {tensor.dtype}"
        )
    if tensor.device.type not in ("cpu", "cuda") or tensor.device.index not in (None, 0):
        raise ValueError(
            f"{name} must be on cpu or cuda:0 for backend='julia' (CUDA.jl's default device), "
            f"got {name} on {tensor.device}"
        )


def check_no_autograd(named: Sequence[tuple[str, object]]) -> None:
    """Julia's results carry no autograd graph: refuse inputs that need one (grad mode on)."""
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
    """Args as Julia receives them -- tensors in :func:`julia_layout`, numbers as floats --
    and each arg's reversed per-instance shape (``()`` for numbers)."""
    values, shapes = [], []
    for i, (arg, own) in enumerate(
        zip(args, per_arg_event_dims(arg_event_dims, event_dims, len(args)), strict=True)
    ):
        if isinstance(arg, torch.Tensor):
            padded = pad_arg_to_batch(f"args[{i}]", arg, own, batch)
            values.append(julia_layout(padded, padded.shape[: len(batch)], own))
            shapes.append(julia_event_shape(padded.shape[len(batch) :]))
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
    """Per-instance grad and HVPs in Julia: Enzyme on CPU, one CUDA thread per instance on GPU.

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
        main = _start_julia()
        fn = _compiled(main, f)
        width = min(chunk_size or MAX_TANGENTS_PER_CALL, MAX_TANGENTS_PER_CALL)
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()
        for start in range(0, vj.shape[0], width):
            part = range(start, min(start + width, vj.shape[0]))
            _call_julia(
                "grad_and_hvp",
                main.PyHVP.grad_and_hvp_dlpack_b,
                g,
                tuple(hv[j] for j in part),
                fn,
                xj,
                tuple(vj[j] for j in part),
                argv,
                julia_event_shape(x.shape[x.ndim - event_dims :]),
                arg_shapes,
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
            "(forward-over-forward: hessian_diagonal of a vector-valued f) needs backend='torch'"
        )
