"""Which plan a repeated ``method="auto"`` sub-Hessian runs: the cost model's routes or an
alternative -- the seed's loop, and eagerly the sparse or the reverse route alone --, measured on
the calls themselves.

The cost model (:mod:`pyhvp.restricted.routes`) predicts; its constants come from one machine
and its errors reach 20-30% (a VM's page faults, a core shared with another process, the
allocator), about the margin by which the model's routes beat the loop on dense networks. So an
equal call (same signature: see ``submatrix._ROUTES``) runs as a trial: the model's routes first
(a warm-up: compiled kernels compile there), then every plan in turn, :data:`TIMED_RUNS` timed
runs each, back to back -- after an untimed one where the plan never ran in this process
(:data:`RUN_IN_THIS_PROCESS`); a plan slower than :data:`DROP` times the fastest run so far is
not run again --, and from then on the one that took least (the smaller of its runs). Where
other plans stayed within :data:`DROP` of it, they and it get a second round of as many runs
:data:`CONFIRM_AFTER` calls later, and the least of both rounds decides for good: a first
round that another process disturbed kept the sparse route for the seed's model at k = 16 per
tensor, 1.6x the forward route's time. Compiled
(``compile=True``), the only alternative is the loop, which compiles nothing: the routes alone
would compile kernels of their own to be tried. A run in which a kernel compiled, was checked
against eager or ran eagerly for the compile policy's own trial is not timed, and the plan runs
again (:func:`~pyhvp.backends.torch.unsettled_calls`): timed while compiling, the routes lost
to the loop, which the transformer block at k = 128 per tensor kept at 1.5x the compiled
sparse route. The reverse route alone is tried only where its one-hot tangents fit a memory
bound (``submatrix.TRIAL_TANGENTS``). Every plan gives the same
matrix up to rounding.
A run is one call; a call with ``data=`` runs the model's routes on every batch (its batches may
differ in size, which a trial would compare). Under the default ``compile="auto"`` there is no
trial: the compile policy compiles a plan's kernels once their eager time pays for it, and a trial
settled on eager times would keep the loop where the compiled routes beat it later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pyhvp.restricted.routes import Routes
from pyhvp.restricted.state import Held

TIMED_RUNS = 2
"""Timed runs of each plan before the trial settles."""

DROP = 1.5
"""A plan whose timed run took this many times the fastest run so far leaves the trial: the
trial's cost stays near one slow run per plan (the transformer block's reverse route alone,
eagerly at k = 128 per tensor: 1.9x the seed's loop). The cost model's routes always get their
runs: their first after another plan's can be their slowest (the seed's model compiled at k = 2:
1.9 ms after the loop's runs, 0.9 after its own)."""

CONFIRM_AFTER = 16
"""Calls of the plan kept before the second round between it and the plans within
:data:`DROP` of it."""

MODEL = "the cost model's routes"

RUN_IN_THIS_PROCESS: set[str] = set()
"""The plans (by name) that have run in this process: a plan's first run anywhere is a warm-up,
untimed, as the model's routes' first run in every trial is. It pays what a process pays once:
the forward-tangent route's first ``jvp`` imports torch's decompositions for forward mode
(160 ms, against 27 ms for LeNet-5's whole route at k = 2 per tensor); timed, that run made the
route leave the trial."""

LOOP_FALLBACK = "the seed's loop, where the model's routes failed"


@dataclasses.dataclass
class Trial:
    """The trial between named plans, the cost model's routes (:data:`MODEL`) first; with one
    plan there is nothing to try."""

    plans: tuple[tuple[str, Routes], ...]
    warmed: bool = False
    """Whether the untimed warm-up run (the model's routes) was handed out."""
    seconds: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Timed runs, by plan name."""
    dropped: set[str] = dataclasses.field(default_factory=set)
    """Plans out of the trial (:data:`DROP`)."""
    settled: str | None = None
    """The name of the plan kept once the trial settled."""
    runs: int = TIMED_RUNS
    """Timed runs each plan still in the trial gets, over the rounds so far."""
    kept_calls: int = 0
    """Calls of the plan kept since the first round settled."""
    run_before: set[str] = dataclasses.field(default_factory=lambda: RUN_IN_THIS_PROCESS)
    """Plans whose first run in this process is past (:data:`RUN_IN_THIS_PROCESS`)."""
    state: Held = dataclasses.field(default_factory=Held)
    """What the loss changes beyond its values, as the survey found it: put back before each
    run of a call but its first, while it :meth:`~pyhvp.restricted.state.Held.holds`."""

    @property
    def model(self) -> Routes:
        return self.plans[0][1]

    def next(self) -> tuple[str, Routes, bool]:
        """The next run's plan, by name, and whether to time it (and :meth:`record` it)."""
        if self.settled is not None and self.final:
            return self.settled, dict(self.plans)[self.settled], False
        if self.settled is not None:
            self.kept_calls += 1
            if self.kept_calls <= CONFIRM_AFTER:
                return self.settled, dict(self.plans)[self.settled], False
            self.settled, self.runs = None, 2 * TIMED_RUNS  # the second round
        if len(self.plans) == 1:
            return (*self.plans[0], False)
        if not self.warmed:
            self.warmed = True
            return (*self.plans[0], False)
        # each plan's runs back to back, the alternatives first (the model's routes are warm):
        # a call after another plan's pays for the state that one left (the allocator's
        # returned buffers, caches), which a plan called again and again, as the trial's winner
        # is, does not
        name, routes = self._pending([*self.plans[1:], self.plans[0]])[0]
        first = name != self.plans[0][0] and name not in self.run_before  # (warmed above)
        self.run_before.add(name)
        return name, routes, not first

    def record(self, name: str, seconds: float) -> bool:
        """Add a timed run of plan ``name``; whether the trial settled on this run."""
        assert self.settled is None
        self.seconds.setdefault(name, []).append(seconds)
        best = min(min(runs) for runs in self.seconds.values())
        self.dropped |= {
            plan
            for plan, runs in self.seconds.items()
            if min(runs) > DROP * best and (plan != self.plans[0][0] or len(runs) >= TIMED_RUNS)
        }
        if self._pending(self.plans):
            return False
        self.settled = min(self.seconds, key=self.fastest)
        return True

    @property
    def final(self) -> bool:
        """Whether the plan kept is kept for good: after the second round, or where no other
        plan stayed within :data:`DROP` of it."""
        return (len(self.plans) == 1 or self.runs > TIMED_RUNS
                or self.dropped >= set(self.seconds) - {self.settled})  # fmt: skip

    def drop(self, name: str, loop: Routes) -> None:
        """Plan ``name`` failed (a kernel that cannot run this loss): out of the trial. Where it
        was the model's forward route, the routes the model chose otherwise take its place;
        where it was the model's other routes, the trial is over and ``loop`` (the seed's loop,
        which runs what autograd runs) serves every equal call."""
        instead = self.model.instead
        if name == self.plans[0][0] and instead is not None:
            self.plans = ((name, instead), *self.plans[1:])
            self.seconds.pop(name, None)
            return
        if name == self.plans[0][0]:
            self.plans, self.settled = ((LOOP_FALLBACK, loop),), LOOP_FALLBACK
            return
        self.dropped.add(name)
        self.seconds.pop(name, None)
        if self.settled is None and not self._pending(self.plans):
            self.settled = min(self.seconds, key=self.fastest) if self.seconds else self.plans[0][0]

    def _runs(self, name: str) -> list[float]:
        return self.seconds.get(name, [])

    def _pending(self, plans: Sequence[tuple[str, Routes]]) -> list[tuple[str, Routes]]:
        """The ``plans`` still to be timed."""
        return [
            plan
            for plan in plans
            if plan[0] not in self.dropped and len(self._runs(plan[0])) < self.runs
        ]

    def fastest(self, name: str) -> float:
        """The smaller of plan ``name``'s timed runs."""
        return min(self.seconds[name])
