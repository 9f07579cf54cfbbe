"""What a loss changes beyond its own values: a batch norm's running statistics in training, the
vectors ``spectral_norm``'s power iteration keeps, data written in place, a ``torch.Generator``
of its own. The seed's loop runs the loss once; pyhvp's routes run it more than once (the survey,
then each kernel), and every run would start from the last one's changes (``spectral_norm``: a
Hessian at another normalisation, 1e-2 off). :class:`Changes`, kept by the survey, finds such
state and puts it back after the survey; :class:`Held` (what later calls put back) makes a :class:`Snapshot` of it before a call's first run and puts it back before each further run, so
that each run computes what the seed's one run does and the call leaves one run's changes.

Only what the survey sees through torch functions is found: a write in a custom
``autograd.Function`` or TorchScript, or one that only later batches make, is not.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from pyhvp.restricted.ops import hidden_writes


class Changes:
    """Kept by a run of the loss under a mode: before each call, :meth:`before`; after it,
    :meth:`made` with its outputs."""

    def __init__(self) -> None:
        self._made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """By ``id``: a tensor the run did not make but writes to, and its value before."""
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        """By ``id``: a generator the run draws from, and its state before."""

    def before(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
               written: object) -> None:  # fmt: skip
        """Before ``func(*args, **kwargs)``, which writes ``written`` (a tensor, a tuple of them,
        or None): note the generators it is given and the tensors it writes that the run did not
        make (or the base of a view of one), with their state now."""
        for value in pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Generator) and id(value) not in self.generators:
                self.generators[id(value)] = (value, value.get_state())
        for value in [*pytree.tree_leaves(written), *hidden_writes(func, args, kwargs)]:
            if not isinstance(value, torch.Tensor):
                continue
            target = value if value._base is None else value._base
            if self._made.get(id(target)) is target or id(target) in self.tensors:
                continue
            with torch.no_grad():
                self.tensors[id(target)] = (target, target.detach().clone())

    def made(self, outputs: Sequence[torch.Tensor]) -> None:
        """The call's output tensors: made by the run (writing to them changes nothing else)."""
        for value in outputs:
            self._made[id(value)] = value

    def undo(self) -> None:
        """Put every noted tensor and generator back as it was before the run."""
        Snapshot(list(self.tensors.values()), list(self.generators.values())).restore()

    def held(self) -> Held:
        """What later calls put back before each run (the tensors by weak reference)."""
        return Held(tuple(weakref.ref(t) for t, _ in self.tensors.values()),
                    tuple(g for g, _ in self.generators.values()))  # fmt: skip


class Held(NamedTuple):
    """What one call's runs share and put back: :meth:`snapshot` before its first run."""

    tensors: tuple[weakref.ref[torch.Tensor], ...] = ()
    generators: tuple[torch.Generator, ...] = ()

    def snapshot(self) -> Snapshot:
        with torch.no_grad():
            alive = [t for t in (ref() for ref in self.tensors) if t is not None]
            saved = [(t, t.detach().clone()) for t in alive]
        return Snapshot(saved, [(g, g.get_state()) for g in self.generators])


class Snapshot(NamedTuple):
    """State as it was before a call's first run: :meth:`restore` before each further one."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    generators: list[tuple[torch.Generator, torch.Tensor]]

    def restore(self) -> None:
        for tensor, value in self.tensors:
            _put(tensor, value)
        for generator, state in self.generators:
            generator.set_state(state)


def _put(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor[...] = value``, where autograd does not see it (an inference tensor: inside
    inference mode, where alone it may be written)."""
    with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
        tensor.copy_(value)
