"""The random state ``f`` draws from, saved and restored: how pyhvp runs ``f`` again with the
very draws of an earlier run (dropout in train mode, an augmentation by Python's ``random``), on
the CPU and on CUDA. NumPy's global generator is not among them: reading its state costs 80 us
(it made a 1 ms sub-Hessian call 1.5x slower with its several saves), Python's 14."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch


class RandomState(NamedTuple):
    """The CPU generator's state, ``device``'s on CUDA (None elsewhere), and Python's
    ``random``'s (``random.getstate()``)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device
    python: Any


def save(device: torch.device) -> RandomState:
    """The state the next random draws on the CPU and on ``device`` start from."""
    on_cuda = device.type == "cuda"
    return RandomState(torch.get_rng_state(),
                       torch.cuda.get_rng_state(device) if on_cuda else None, device,
                       random.getstate())  # fmt: skip


def restore(state: RandomState) -> None:
    """Draws start from ``state`` again."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, state.device)
    random.setstate(state.python)


def drew(before: RandomState, after: RandomState) -> bool:
    """Whether random draws were made between two saves of one device's state."""
    return not (torch.equal(before.cpu, after.cpu) and before.python == after.python
                and (before.cuda is None or after.cuda is None
                     or torch.equal(before.cuda, after.cuda)))  # fmt: skip


@contextmanager
def replaying(state: RandomState) -> Iterator[None]:
    """Draws inside start from ``state``; after, they go on from where they were before."""
    now = save(state.device)
    restore(state)
    try:
        yield
    finally:
        restore(now)


class Repeated:
    """Runs of ``f`` that each draw what the first drew (a dropout's mask), as one run of ``f``
    would: :meth:`begin` before each run; the generator then goes on from one run's draws."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state: RandomState | None = None  # the first run's, once saved
        self.begun = False
        self.held: Callable[[], None] | None = None

    def hold(self, put_back: Callable[[], None]) -> None:
        """Before each further run, also ``put_back()`` what else ``f`` changes (a generator of
        its own, a batch norm's running statistics) as it was before the first."""
        self.held = put_back

    def begin(self, last: bool = False) -> None:
        """Before a run: a further one draws from the first's state again; the first saves
        that state, unless it is also the ``last`` (a call that runs ``f`` once saves nothing:
        11 us, 1% of a small sub-Hessian)."""
        if self.begun:
            if self.state is None:
                raise RuntimeError("Repeated.begin: a run after the one begun as the last")
            restore(self.state)
            if self.held is not None:
                self.held()
        elif not last:
            self.state = save(self.device)
        self.begun = True
