"""Which plan a repeated ``method="auto"`` sub-Hessian runs: the cost model's routes or an
alternative -- the seed's loop, and eagerly the sparse or the reverse route alone --, measured on
the calls themselves.

The cost model (:mod:`pyhvp.restricted.routes`) predicts; its constants come from one machine
and its errors reach 20-30% (a VM's page faults, a core shared with another process, the
allocator), about the margin by which the model's routes beat the loop on dense networks. So an
equal call (same signature: see ``submatrix._ROUTES``) runs as a trial: the model's routes first
(a warm-up: compiled kernels compile there), then every plan in turn, :data:`TIMED_RUNS` timed
runs each, and from then on the one that took least (the smaller of its runs). Compiled
(``compile=True``), the only alternative is the loop, which compiles nothing: the routes alone
would compile kernels of their own to be tried. Every plan gives the same matrix up to rounding.
A run is one call; a call with ``data=`` runs the model's routes on every batch (its batches may
differ in size, which a trial would compare).
"""

from __future__ import annotations

import dataclasses

from pyhvp.restricted.routes import Routes

TIMED_RUNS = 2
"""Timed runs of each plan before the trial settles."""

MODEL = "the cost model's routes"


@dataclasses.dataclass
class Trial:
    """The trial between named plans, the cost model's routes (:data:`MODEL`) first; with one
    plan there is nothing to try."""

    plans: tuple[tuple[str, Routes], ...]
    runs: int = 0
    """Runs handed out so far (the first is the untimed warm-up)."""
    seconds: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Timed runs, by plan name."""
    settled: str | None = None
    """The name of the plan kept once the trial settled."""

    @property
    def model(self) -> Routes:
        return self.plans[0][1]

    def next(self) -> tuple[str, Routes, bool]:
        """The next run's plan, by name, and whether to time it (and :meth:`record` it)."""
        if self.settled is not None:
            return self.settled, dict(self.plans)[self.settled], False
        if len(self.plans) == 1:
            return (*self.plans[0], False)
        runs, self.runs = self.runs, self.runs + 1
        if runs == 0:
            return (*self.plans[0], False)
        order = (*self.plans[1:], self.plans[0])  # the alternatives first: the model is warm
        return (*order[(runs - 1) % len(order)], True)

    def record(self, name: str, seconds: float) -> bool:
        """Add a timed run of plan ``name``; whether the trial settled on this run."""
        assert self.settled is None
        self.seconds.setdefault(name, []).append(seconds)
        if any(len(self.seconds.get(plan, ())) < TIMED_RUNS for plan, _ in self.plans):
            return False
        self.settled = min((plan for plan, _ in self.plans), key=self.fastest)
        return True

    def fastest(self, name: str) -> float:
        """The smaller of plan ``name``'s timed runs."""
        return min(self.seconds[name])
