"""What a loss changes beyond its own values: a batch norm's running statistics in training, the
vectors ``spectral_norm``'s power iteration keeps, data written in place, a ``torch.Generator``
of its own. The seed's loop runs the loss once; pyhvp's routes run it more than once (the survey,
then each kernel), and every run would start from the last one's changes (``spectral_norm``: a
Hessian at another normalisation, 1e-2 off). :class:`Changes`, kept by the survey, finds such
state and puts it back after the survey; :class:`Held` (what later calls put back) makes a
:class:`Snapshot` of it before a call's first run, put back before each further run, so that each
run computes what the seed's one run does and the call leaves one run's changes.

Memory is told apart by storage, so a write through any alias (``buf.data``, ``buf.detach()``,
a view, ``buf.to(buf.device)``) is one to ``buf``; memory of the loss's own inputs (a batch
written in place) is held by the input's position, as each call and batch passes other tensors.
The torch backend's compiled kernels use :class:`Recording` too: a kernel's first call runs it
eagerly as well, to check the compiled result by. Only what the survey (or, where no survey
runs, :func:`recorded`) sees through torch functions is found: a write in a custom
``autograd.Function`` or TorchScript, or one that only later batches make, is not (where a
kernel fails after such a write, the seed's loop would run from it: that call is refused,
``pyhvp.submatrix._refuse_unheld_writes``).
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pyhvp.backends.compile_policy import global_module_hooks
from pyhvp.restricted.ops import call_kind, hidden_writes, writes_to


def _storage(value: torch.Tensor) -> int | None:
    """Where ``value``'s memory starts (its storage's), or None for a tensor without one of its
    own (a ``torch.func`` wrapper, a meta tensor)."""
    try:
        start = value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return start or None


def _copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    return cast(torch.UntypedStorage, storage.clone())  # type: ignore[no-untyped-call]


class Changes:
    """Kept by a run of ``loss(*inputs)`` under a mode: before each call, :meth:`before`; after
    it, :meth:`made` with its input and output tensors."""

    def __init__(self, inputs: Sequence[object]) -> None:
        self._inputs: dict[int | None, list[int]] = {}  # storage -> the inputs over it
        for i, value in enumerate(inputs):
            if isinstance(value, torch.Tensor):
                self._inputs.setdefault(_storage(value), []).append(i)
        self._made: set[int] = set()  # storages the run allocated
        self._owners: dict[int, torch.Tensor] = {}  # the first tensor seen over other storages
        self.storages: dict[int, tuple[torch.Tensor, torch.UntypedStorage]] = {}
        """By storage: a tensor over memory the run writes but did not make, and its bytes."""
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        """By ``id``: a generator the run draws from, and its state before."""
        self.modes: dict[int, CalledModule] = {}
        """By ``id``: a module the run called, or a submodule of one, its ``training`` flag, its
        children and its forward hooks then (:func:`putting_back` notes them)."""

    def before(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
               values: Sequence[object], written: object) -> None:  # fmt: skip
        """Before ``func(*args, **kwargs)`` (``values``: its arguments flattened), which writes
        ``written`` (a tensor, a tuple of them, or None): note the generators it is given and the
        memory it writes that the run did not make, with their state now."""
        for value in values:
            if isinstance(value, torch.Generator) and id(value) not in self.generators:
                self.generators[id(value)] = (value, value.get_state())
            elif isinstance(value, torch.Tensor):
                start = _storage(value)
                if start is not None and start not in self._made:
                    self._owners.setdefault(start, value)
        for value in [*pytree.tree_leaves(written), *hidden_writes(func, args, kwargs)]:
            start = _storage(value) if isinstance(value, torch.Tensor) else None
            if start is None or start in self._made or start in self.storages:
                continue
            owner = self._owners.get(start, value)
            self.storages[start] = (owner, _copy(owner.untyped_storage()))

    def made(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """The call's tensors: an output over memory none of its inputs has is the run's own
        (writing to it changes nothing else); one over an input's is that input's."""
        given = {_storage(v) for v in inputs}
        for value in outputs:
            start = _storage(value)
            if start is not None and start not in given:
                self._made.add(start)

    def undo(self) -> None:
        """Put every noted memory and generator back as it was before the run."""
        self.snapshot().restore()

    def snapshot(self) -> Snapshot:
        """The noted memory and generators as they were before the run (what :meth:`undo`
        restores, and may restore again)."""
        saved = [(owner.untyped_storage(), data) for owner, data in self.storages.values()]
        return Snapshot(saved, list(self.generators.values()))

    def held(self) -> Held:
        """What later calls put back before each run: memory of the loss's inputs by position,
        other memory by a weak reference to a tensor over it."""
        positions, owners = [], []
        for start, (owner, _) in self.storages.items():
            if start in self._inputs:  # each input over it: another call's may not share it
                positions.extend(self._inputs[start])
            else:
                owners.append(weakref.ref(owner))
        return Held(tuple(positions), tuple(owners), tuple(g for g, _ in self.generators.values()),
                    tuple(self.modes.values()), global_module_hooks())  # fmt: skip


class CalledModule(NamedTuple):
    """A module a run called (or a submodule of one) as the run found it."""

    module: weakref.ref[torch.nn.Module]
    training: bool
    callees: tuple[tuple[int, ...], tuple[int, ...]]
    """What else a call of the module runs: :func:`_callees`."""

    @staticmethod
    def of(module: torch.nn.Module) -> CalledModule:
        return CalledModule(weakref.ref(module), module.training, _callees(module))

    def holds(self) -> bool:
        """Whether the module lives, in the same mode, with the same children and hooks (one
        swapped in since, ``model[1] = other``, or a hook registered since, runs other code,
        which may change other state)."""
        module = self.module()
        return (module is not None and module.training == self.training
                and _callees(module) == self.callees)  # fmt: skip


def _callees(module: torch.nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``id`` of each child of ``module``, and the handle id of each of its forward (pre-)
    hooks: read from ``_modules`` and the hook dicts (``children()``, a generator that skips
    repeats, costs 4x: every cached call checks every module)."""
    hooks = (*module._forward_pre_hooks, *module._forward_hooks)
    return tuple(map(id, module._modules.values())), hooks


class Held(NamedTuple):
    """What one call's runs share and put back: :meth:`snapshot` before its first run."""

    positions: tuple[int, ...] = ()
    """Inputs of the loss (the selected tensors, the other params, the batch's tensors)."""
    owners: tuple[weakref.ref[torch.Tensor], ...] = ()
    generators: tuple[torch.Generator, ...] = ()
    modes: tuple[CalledModule, ...] = ()
    """The modules the run called and their submodules, as it found them."""
    global_hooks: tuple[int, ...] = ()
    """:func:`~pyhvp.backends.compile_policy.global_module_hooks` after the run."""

    def holds(self) -> bool:
        """Whether every tensor over the other memory still exists (where one is gone, the loss
        reads a rebuilt model or global: its state is another) and every module is as it was
        (one switched since, by ``model.train()`` however the loss reaches it, or given another
        child or hook, runs other code, which may change other state), and so are the global
        module hooks: else found anew."""
        return (
            all(ref() is not None for ref in self.owners)
            and all(mode.holds() for mode in self.modes)
            and global_module_hooks() == self.global_hooks
        )

    def snapshot(self, inputs: Sequence[object]) -> Snapshot:
        """The state now, of this call's ``inputs`` and of the other memory and generators."""
        storages = [t.untyped_storage() for t in self._memory(inputs).values()]
        saved = [(s, _copy(s)) for s in storages]
        return Snapshot(saved, [(g, g.get_state()) for g in self.generators])

    def unheld_by(self, other: Held | None, inputs: Sequence[object], first: int = 0) -> str:
        """What memory of this state ``other`` does not hold, in words (``""``: it holds all of
        it): of this call's ``inputs`` from position ``first`` on, or other memory, by where it
        starts. Not generators: one the loss makes on each run is another object each time
        (refused at every call, by identity, in a review of this check)."""
        inputs = (*[None] * first, *inputs[first:])
        memory, held = self._memory(inputs), {} if other is None else other._memory(inputs)
        tensors = [t for start, t in memory.items() if start not in held]
        return ", ".join(f"a tensor of shape {tuple(t.shape)} ({t.dtype})" for t in tensors)

    def _memory(self, inputs: Sequence[object]) -> dict[int | None, torch.Tensor]:
        """A tensor over each memory held, by where the memory starts."""
        tensors = [inputs[i] for i in self.positions]
        tensors += [t for t in (ref() for ref in self.owners) if t is not None]
        return {_storage(t): t for t in tensors if isinstance(t, torch.Tensor)}


class Snapshot(NamedTuple):
    """State as it was before a call's first run: :meth:`restore` before each further one."""

    storages: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]
    generators: list[tuple[torch.Generator, torch.Tensor]]

    def restore(self) -> None:
        for storage, data in self.storages:
            storage.copy_(data)
        for generator, state in self.generators:
            generator.set_state(state)


class Recording(TorchFunctionMode):
    """Runs a loss once, noting in :attr:`changes` what it changes beyond its values (as the
    survey does while it surveys)."""

    def __init__(self, inputs: Sequence[object]) -> None:
        super().__init__()
        self.changes = Changes(inputs)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        values = pytree.tree_leaves((args, kwargs))
        written = writes_to(call_kind(func, args, kwargs), func, args, kwargs)
        self.changes.before(func, args, kwargs, values, written)
        out = func(*args, **kwargs)
        self.changes.made([v for v in values if isinstance(v, torch.Tensor)],
                          [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)])  # fmt: skip
        return out


@contextmanager
def without_dynamo() -> Iterator[None]:
    """A run of a function under a mode of pyhvp's (:class:`Recording`) with every
    ``torch.compile``'d function in it eager: dynamo traced the mode into such a function, with
    a warning (``Dynamo does not know how to trace the builtin ...``), and a graph it had cached
    would run without it. torch 2.5 has no stance: compiled functions compile there."""
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None:  # pragma: no cover - torch 2.5
        yield
        return
    with stance("force_eager"):
        yield


@contextmanager
def putting_back(changes: Changes, inputs: Sequence[object]) -> Iterator[None]:
    """A run of a loss of ``inputs`` that leaves the state as it found it: on a forked random
    state (the CPU's and the CUDA devices' of ``inputs``), its noted ``changes`` put back after
    it, whether it returns or raises. The modules it calls are noted in ``changes.modes``."""
    devices = sorted({t.device for t in inputs
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"}, key=str)  # fmt: skip

    def note(module: torch.nn.Module, given: object) -> None:
        # with its submodules: one it runs by ``.forward()`` calls no hook
        if id(module) not in changes.modes:
            for each in module.modules():
                changes.modes.setdefault(id(each), CalledModule.of(each))

    python = random.getstate()  # (fork_rng forks torch's generators alone)
    with torch.random.fork_rng(devices=devices):
        hook = torch.nn.modules.module.register_module_forward_pre_hook(note)
        try:
            yield
        finally:
            hook.remove()
            changes.undo()
            random.setstate(python)


def recorded(loss: Callable[..., object], inputs: Sequence[object]) -> Held:
    """What ``loss(*inputs)`` changes beyond its values, found by one run (with grad on) and put
    back: for routes that may run the loss more than once where no survey ran (the reverse
    route pass after pass, or again by the seed's loop where its kernel fails)."""
    mode = Recording(inputs)
    with putting_back(mode.changes, inputs), torch.enable_grad(), mode:
        loss(*inputs)
    return mode.changes.held()
