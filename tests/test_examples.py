"""Every example runs to the end: each one checks its own result (closed form, dense Hessian or
the seed's own code) and exits non-zero when pyhvp disagrees. Figures go to matplotlib's
non-interactive backend (the docs' gallery shows them)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ARGS = {"particles_hvp.py": ["2e4"]}  # a small problem: the example's default is sized for a GPU


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs_and_checks_itself(script):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *ARGS.get(script, [])],
        env={**os.environ, "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_getting_started_tour_runs():
    tour = Path(__file__).resolve().parents[1] / "docs" / "tour.py"
    done = subprocess.run([sys.executable, str(tour)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
