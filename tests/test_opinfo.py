"""PyTorch's OpInfo database as the Taylor engine's coverage test (issue 16), as functorch tests
its transforms: every op that supports double backward is exact -- ``hessian_diagonal`` and
``laplacian`` equal autograd's dense Hessian, and their gradient in x equals central differences
of it -- or refused on purpose with a pyhvp error that names the cause (``REFUSED_OPS``, a table
per torch release: the sweep is skipped on a release without one). Each op runs in a child
process, so a crash fails that op and not the run. How a case is built and judged:
``opinfo_sweep.py``; ``python tests/opinfo_sweep.py`` prints the counts table.

The fast tier (``make test``) sweeps the ops of ``SAMPLE_OPS``; the others are marked ``slow``
(``make test-all``). Run alone: ``pytest tests/test_opinfo.py`` (or deselect with
``-m "not opinfo"``)."""

import os
import signal

import pytest
import torch
from opinfo_sweep import (
    CRASH,
    EXACT,
    INTERNAL,
    REFUSALS,
    REFUSED,
    REFUSED_AT_FOURTH_ORDER,
    REFUSED_OPS,
    RELEASE,
    SAMPLE_OPS,
    SKIP,
    TIMEOUT,
    TIMEOUT_S,
    WRONG,
    isolated_case,
    op_id,
    refusal_of,
    single_thread,
    swept_ops,
    warm_up,
)
from torch.testing._internal.opinfo.core import OpInfo, SampleInput
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

pytestmark = pytest.mark.opinfo

if REFUSED_OPS is None:
    pytest.skip(
        f"no table of refusals for torch {RELEASE}'s op database (the sweep runs on "
        f"{', '.join(REFUSALS)}: opinfo_sweep.REFUSALS)",
        allow_module_level=True,
    )

OPS = swept_ops()


def tiered(op):
    """The op's case: in the fast tier when the op is in the sample, else marked slow."""
    marks = () if op_id(op) in SAMPLE_OPS else pytest.mark.slow
    return pytest.param(op, marks=marks, id=op_id(op))


@pytest.fixture(scope="module", autouse=True)
def _forkable():
    """One intra-op thread while children are forked; torch's first-call work done once."""
    with single_thread():
        warm_up("cpu")
        yield


def explain(outcome) -> str:
    where = f" on {outcome.sample}" if outcome.sample else ""
    stage = f" ({outcome.stage})" if outcome.stage else ""
    return f"{outcome.op}: {outcome.status}{stage}{where}\n{outcome.detail}"


@pytest.mark.parametrize("op", [tiered(op) for op in OPS])
def test_op_is_exact_or_refused_on_purpose(op, device):
    outcome = isolated_case(op, str(device))
    if outcome.status == SKIP:
        pytest.skip(outcome.detail)
    refusal = refusal_of(outcome)
    if refusal is None:
        assert outcome.status == EXACT, explain(outcome)
    else:
        assert outcome.status == REFUSED and refusal.message in outcome.detail, explain(outcome)


def test_refused_tables_name_ops_of_the_database():
    assert set(REFUSED_OPS) | set(REFUSED_AT_FOURTH_ORDER) <= {op_id(op) for op in OPS}


def test_the_sample_names_ops_of_the_database():
    assert set(SAMPLE_OPS) <= {op_id(op) for op in OPS}


# --- the judge itself: each outcome is recognised (stub ops, run through the same harness) ---


def _sample_inputs(op, device, dtype, requires_grad, **kwargs):
    yield SampleInput(torch.linspace(0.5, 2.0, 6, dtype=dtype, device=device).reshape(2, 3))


class _WrongSecondDerivative(torch.autograd.Function):
    """x^3 whose backward is 3 x^2 + x^2: autograd's Hessian (of the backward) is 8x, not 6x."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 4 * x**2


def _segfault(x):
    os.kill(os.getpid(), signal.SIGSEGV)


def _hang(x):
    while True:
        pass


def _fails_while_recorded(x):
    """x^3, but an IndexError while a dispatch mode (pyhvp's recorder) is active: a defect of
    the engine, not a refusal."""
    if _get_current_dispatch_mode_stack():
        raise IndexError("an engine's bug")
    return x**3


def _stub(name, fn):
    return OpInfo(name, op=fn, dtypes=(torch.float64,), sample_inputs_func=_sample_inputs,
                  supports_autograd=True, supports_gradgrad=True)  # fmt: skip


JUDGED = [
    ("exact", lambda x: (x.exp() * x.sin()).sum(-1), EXACT),
    ("wrong", _WrongSecondDerivative.apply, WRONG),
    ("refused", lambda x: torch.polar(x, x), REFUSED),  # complex intermediates
    ("crash", _segfault, CRASH),
    ("hang", _hang, TIMEOUT),
    ("no reference", lambda x: (x - 0.5).sqrt(), SKIP),  # infinite at the sample's 0.5
    ("internal error", _fails_while_recorded, INTERNAL),
]


HANG_S = 5.0  # how long the hanging stub is given: any time limit judges it


@pytest.mark.parametrize(("name", "fn", "status"), JUDGED, ids=[j[0] for j in JUDGED])
def test_the_sweep_recognises_each_outcome(name, fn, status):
    timeout = HANG_S if status == TIMEOUT else TIMEOUT_S
    assert isolated_case(_stub(name, fn), "cpu", timeout=timeout).status == status


def test_a_crash_s_stack_goes_to_its_outcome_not_to_the_log(capfd):
    outcome = isolated_case(_stub("crash", _segfault), "cpu")
    assert "in _segfault" in outcome.detail and "Fatal Python" not in capfd.readouterr().err
