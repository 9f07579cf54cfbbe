"""Torch's warnings about its own internals, which the user cannot act on.

Torch 2.13 deprecates ``torch.jit.script`` and still calls it itself: inductor at a compile, and
forward-mode autograd when it first loads its decompositions (at the first ``torch.func.jvp``
of a process). Under warnings as errors (``python -W error``, pytest's ``filterwarnings =
error``) every compile failed on them, pyhvp's warning that it ran eagerly then raised, and the
sub-Hessian's forward route was refused (until 2026-12-07).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def torchs_own_deprecations_ignored() -> Iterator[None]:
    """The deprecation and future warnings raised in torch's own modules are ignored inside."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module="torch")
        yield


@functools.cache
def forward_mode_decompositions_loaded() -> None:
    """Loads forward-mode autograd's decompositions, as its first use in a process does, with
    torch's own deprecations ignored (0.2 s, once)."""
    with torchs_own_deprecations_ignored():
        import torch._decomp.decompositions_for_jvp  # noqa: F401
