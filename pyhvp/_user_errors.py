"""How a failure of the user's function reaches the user: as the user's own error.

pyhvp runs ``f`` eagerly, under its recorder (a ``TorchDispatchMode``), under the sparse
sub-Hessian's ``TorchFunctionMode`` and through dynamo (guards, compiled kernels). An exception
raised inside ``f`` is re-raised as it is -- its type and message -- with:

* the user's frame on top: the frames pyhvp's modes add below it (the mode's handler and the
  torch plumbing that calls it) are cut from the traceback, which then ends where eager code's
  would (:func:`user_errors`);
* a hint for a well-known mistake (:data:`HINTS`: NumPy inside ``f``), added as a note;
* no log of torch's tracing: while pyhvp traces (dynamo, fake tensors, ``make_fx``, inductor),
  records of torch's tracing loggers emitted by that thread are dropped (:func:`quiet_tracing`),
  so a shape bug in ``f`` does not print fake-tensor tracebacks before the error. What a user
  asked for with ``TORCH_LOGS`` (a level set on a torch logger) still shows.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

PACKAGE = str(Path(__file__).resolve().parent) + os.sep
MODE_HANDLERS = frozenset({"__torch_dispatch__", "__torch_function__"})
"""pyhvp functions through which torch calls back into pyhvp while ``f`` runs."""
PLUMBING = tuple(
    os.sep.join(("torch", *parts)) for parts in (("_compile.py",), ("_dynamo", "eval_frame.py"))
)
"""torch's frames between a user's op and a mode's handler (``torch._disable_dynamo``'s wrapper)."""

NUMPY_HINT = (
    "pyhvp differentiates f through torch operations: write f with torch functions on x "
    "(torch.sin, not np.sin). NumPy cannot be differentiated, and .detach().numpy() would make "
    "f a constant with zero derivatives"
)
NO_SECOND_DERIVATIVE_HINT = (
    "torch has no derivative of this op's backward, which the HVPs (autograd's double backward) "
    "differentiate: write that step with ops that have one ((a[:, None] - b[None]).pow(2)"
    ".sum(-1).sqrt() for torch.cdist before torch 2.14), or, outside a torch.func transform, use "
    "the Taylor-engine operators (hessian_diagonal, laplacian), whose rules do not need it"
)
EMBEDDING_BAG_HINT = (
    "torch has no derivative of embedding_bag's backward. sub_hessian runs "
    "torch.nn.functional.embedding_bag (as nn.EmbeddingBag calls it) with ops that have one, but "
    "not a function bound before the call (from torch.nn.functional import embedding_bag): call "
    "it through the module. Elsewhere, write the pooling with F.embedding and a sum, or use the "
    "Taylor-engine operators (hessian_diagonal, laplacian), whose rules do not need it"
)
INFERENCE_TENSOR_HINT = (
    "the function differentiated uses a tensor made under torch.inference_mode() (weights "
    "built or loaded there), which autograd cannot save for the derivatives pyhvp takes: clone "
    "it outside inference mode (w = w.clone()), or pass it to the operator as an arg (pyhvp "
    "clones an inference arg)"
)
HINTS = {
    "Can't call numpy() on Tensor that requires grad": NUMPY_HINT,
    "Inference tensors cannot be saved for backward": INFERENCE_TENSOR_HINT,
    "the derivative for '_embedding_bag_backward'": EMBEDDING_BAG_HINT,
    "the derivative for '": NO_SECOND_DERIVATIVE_HINT,
}
"""The start of an error's message -> what to do instead (the first that applies), added to
errors raised in ``f``."""


def user_errors(operator: Callable[P, R]) -> Callable[P, R]:
    """``operator``, re-raising an exception of the user's function as described above."""

    @functools.wraps(operator)
    def reporting(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return operator(*args, **kwargs)
        except Exception as error:
            _cut_mode_frames(error)
            _add_hint(error)
            _add_extra_args_hint(operator, error, args)
            raise

    return reporting


KEYWORD_ONLY_STRINGS = frozenset({"exact", "hutchinson", "hutch++", "diag++", "torch", "julia"})
"""Values of pyhvp's keyword-only options (``method=``, ``backend=``) that a call may pass
positionally by mistake, where they join ``*args`` and reach ``f``."""


def _add_extra_args_hint(operator: Callable[..., object], error: BaseException,
                         call_args: tuple[object, ...]) -> None:  # fmt: skip
    """A note on ``f``'s ``TypeError`` about its positional arguments when the call's ``*args``
    hold a string that is the value of a keyword-only option (``hessian_diagonal(f, x,
    "hutchinson")``): the operator passed it on to ``f``."""
    if not isinstance(error, TypeError) or "positional argument" not in str(error):
        return
    extra = _var_positional(operator, call_args)
    suspects = [a for a in extra if isinstance(a, str) and a in KEYWORD_ONLY_STRINGS]
    if suspects:
        value = suspects[0]
        option = "backend" if value in ("torch", "julia") else "method"
        name = getattr(operator, "__name__", "the operator")
        note(error, f"{name} passed {value!r} on to f as an extra argument (f(x, *args)): its "
                    f"options are keyword-only, as in {option}={value!r}")  # fmt: skip


def _var_positional(operator: Callable[..., object], call_args: tuple[object, ...]
                    ) -> tuple[object, ...]:  # fmt: skip
    """The part of ``call_args`` that ``operator``'s ``*args`` takes (empty if it has none)."""
    try:
        parameters = list(inspect.signature(operator).parameters.values())
    except (TypeError, ValueError):
        return ()
    for i, parameter in enumerate(parameters):
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return call_args[i:]
    return ()


def _cut_mode_frames(error: BaseException) -> None:
    """End ``error``'s traceback at the frame that called an op pyhvp's mode intercepted, when
    the error came from the op (raised outside pyhvp, or by a handler's call of the op) rather
    than from pyhvp itself (whose handlers raise their own errors from helpers)."""
    entries = []
    tb = error.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if not entries or (_in_package(entries[-1].tb_frame) and not _handler(entries[-1])):
        return  # pyhvp's own error: its frames say where
    for i, entry in enumerate(entries):
        if _handler(entry):
            while i > 0 and entries[i - 1].tb_frame.f_code.co_filename.endswith(PLUMBING):
                i -= 1
            if i > 0:
                entries[i - 1].tb_next = None
            return


def _handler(entry: types.TracebackType) -> bool:
    """Whether the frame is one of pyhvp's mode handlers."""
    return entry.tb_frame.f_code.co_name in MODE_HANDLERS and _in_package(entry.tb_frame)


def _in_package(frame: types.FrameType) -> bool:
    return frame.f_code.co_filename.startswith(PACKAGE)


def stacklevel_outside_pyhvp(through_torch: bool = False) -> int:
    """The ``warnings.warn`` stacklevel, for the caller of this function, that names the first
    frame outside the pyhvp package, torch's :data:`PLUMBING` (the ``torch.compiler.disable``
    wrapper around every public operator) and ``contextlib``'s wrapper of the functions pyhvp
    decorates with a context (until 2026-12-07 a warning from under one named that wrapper):
    the user's call. ``through_torch``: outside torch too (a hook autograd's engine calls)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (
        _in_package(frame)
        or frame.f_code.co_filename.endswith(PLUMBING)
        or frame.f_code.co_filename == contextlib.__file__
        or (through_torch and frame.f_code.co_filename.startswith(_TORCH_PACKAGE))
    ):
        frame, level = frame.f_back, level + 1
    return level


_TORCH_PACKAGE = str(Path(torch.__file__).resolve().parent) + os.sep


def _add_hint(error: BaseException) -> None:
    message = str(error)
    for start, hint in HINTS.items():  # the first that applies
        if message.startswith(start):
            note(error, hint)
            return


def note(error: BaseException, text: str) -> None:
    """``error.add_note(text)`` (Python 3.11+; on 3.10 the text joins the message), once."""
    if text in str(error) or text in getattr(error, "__notes__", ()):
        return
    if sys.version_info >= (3, 11):
        error.add_note(text)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{text}", *error.args[1:])


TRACING_LOGGERS = (
    "torch._dynamo",
    "torch._inductor",
    "torch._functorch",
    "torch._subclasses",
    "torch.fx",
    "torch._guards",
)
"""torch's loggers of tracing and compiling, and their children."""


_QUIET: dict[int, int] = {}
"""Thread id -> how many :class:`quiet_tracing` blocks that thread is inside (none: absent)."""
_TORCH = logging.getLogger("torch")


class _DropTracingRecords(logging.Filter):
    """Drops the records of :data:`TRACING_LOGGERS` emitted by a thread inside
    :func:`quiet_tracing`, unless the user set a level on their logger (``TORCH_LOGS``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if threading.get_ident() not in _QUIET or not record.name.startswith(TRACING_LOGGERS):
            return True
        return _level_set_by_user(record.name)


def _level_set_by_user(name: str) -> bool:
    """Whether a logger from ``name`` up to (not including) ``torch`` has a level of its own:
    torch's logging leaves them unset unless ``TORCH_LOGS`` or ``set_logs`` asks."""
    while name.startswith("torch."):
        if logging.getLogger(name).level != logging.NOTSET:
            return True
        name = name.rpartition(".")[0]
    return False


_DROP = _DropTracingRecords()


def _filtered_handlers() -> None:
    """Put :data:`_DROP` on every handler of the ``torch`` loggers (torch gives many of them
    handlers of their own, which do not propagate), once, and again when torch's logging set
    new handlers (``torch._logging.set_logs`` replaces them all, the ``torch`` logger's too)."""
    torch_handlers = tuple(_TORCH.handlers)
    if torch_handlers == _scanned[0]:
        return
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "torch" or name.startswith("torch.")):
            for handler in logger.handlers:
                if _DROP not in handler.filters:
                    handler.addFilter(_DROP)
    _scanned[0] = torch_handlers


_scanned: list[tuple[logging.Handler, ...] | None] = [None]
"""The ``torch`` logger's handlers when the loggers were last scanned."""


class quiet_tracing:  # named as the function it replaces: with quiet_tracing(): ...
    """While pyhvp traces or compiles: torch's tracing logs from this thread are dropped."""

    def __enter__(self) -> None:
        _filtered_handlers()
        thread = threading.get_ident()
        _QUIET[thread] = _QUIET.get(thread, 0) + 1

    def __exit__(self, *exc: object) -> None:
        thread = threading.get_ident()
        depth = _QUIET.pop(thread) - 1
        if depth:
            _QUIET[thread] = depth
