"""Which plan a repeated ``method="auto"`` sub-Hessian runs: the cost model's routes or the
seed's loop, measured on the calls themselves.

The cost model (:mod:`pyhvp.restricted.routes`) predicts; its constants come from one machine
and its errors reach 20-30% (a VM's page faults, a core shared with another process, the
allocator), about the margin by which the model's routes beat the loop on dense networks. So
when the model's routes are not the loop itself, an equal call (same signature: see
``submatrix._ROUTES``) runs as a trial: the model's routes first (a warm-up: compiled kernels
compile there), then the loop and the model's routes alternately, :data:`TIMED_RUNS` timed runs
each, and from then on whichever took less (the smaller of its runs). Both give the same matrix
up to rounding. A run is one call; a call with ``data=`` runs the model's routes on every batch
(its batches may differ in size, which a trial would compare).
"""

from __future__ import annotations

import dataclasses

from pyhvp.restricted.routes import Routes

TIMED_RUNS = 2
"""Timed runs of each plan before the trial settles."""


@dataclasses.dataclass
class Trial:
    """The trial between the cost model's ``model`` routes and the seed's ``loop`` (None: the
    model's routes are the loop: nothing to try)."""

    model: Routes
    loop: Routes | None = None
    runs: int = 0
    """Runs handed out so far (the first is the untimed warm-up)."""
    seconds: dict[bool, list[float]] = dataclasses.field(
        default_factory=lambda: {False: [], True: []}
    )
    """Timed runs, by whether they ran the loop."""
    settled: Routes | None = None

    def next(self) -> tuple[Routes, bool]:
        """The plan of the next run, and whether to time it (and :meth:`record` it)."""
        if self.loop is None:
            return self.model, False
        if self.settled is not None:
            return self.settled, False
        runs, self.runs = self.runs, self.runs + 1
        if runs == 0:
            return self.model, False
        return (self.loop if runs % 2 else self.model), True

    def record(self, plan: Routes, seconds: float) -> Routes | None:
        """Add a timed run of ``plan``; the plan kept from now on once the trial settles (on this
        run), else None."""
        assert self.loop is not None and self.settled is None
        self.seconds[plan is self.loop].append(seconds)
        if min(len(times) for times in self.seconds.values()) < TIMED_RUNS:
            return None
        self.settled = self.loop if self.fastest(True) < self.fastest(False) else self.model
        return self.settled

    def fastest(self, loop: bool) -> float:
        """The smaller of the timed runs of the loop (``loop``) or of the model's routes."""
        return min(self.seconds[loop])
