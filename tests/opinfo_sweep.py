"""PyTorch's OpInfo database as the Taylor engine's coverage test, as functorch tests its
transforms: one case per op that supports double backward, each run in a forked child so that a
crash fails that case and not the run.

A case is the op's first float64 sample whose differentiated input ``x`` (``sample.input``, or
the first floating tensor among its inputs) has at most ``MAX_ELEMENTS`` elements. Its scalar
function is ``f(flat) = sum_k <w_k, out_k>`` over the op's floating outputs (complex ones as their
real and imaginary parts) with fixed random weights ``w_k``, ``x = flat.reshape(x.shape)`` and
every other argument fixed, called through the op's ``gradcheck_wrapper`` (so ``eigh`` sees
``A + A^H``, as autograd's tests have it). Checked against autograd's dense Hessian in float64:

* ``hessian_diagonal(f, flat)`` against its diagonal, ``laplacian(f, flat)`` against its trace;
* the third order, where torch has one: the gradient of ``<v, hessian_diagonal(f, flat)>`` in
  ``flat`` along a fixed random direction, against central differences of the dense diagonal
  (autograd's triple backward is not the judge: it is wrong for LayerNorm on torch 2.14);
* the fourth order, where torch has one: ``directional_derivatives(f, flat, v, order=4)`` (the
  engine's fourth-order jets) against ``d^k/dt^k f(flat + t v)``, ``k = 0..4``, by nested
  ``torch.autograd.grad`` in ``t``. Where they differ at orders 3 and 4 only, central differences
  of ``v^T H(flat + t v) v`` (the dense Hessian: autograd's double backward) judge: autograd's
  own higher derivatives are wrong for some ops (``native_layer_norm``'s third and fourth, on
  torch 2.13), and an op whose engine result agrees with the differences is exact.

Run as a script for the counts table and a markdown report of every op that is not exact::

    .venv/bin/python tests/opinfo_sweep.py [--report sweep-report.md] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import faulthandler
import linecache
import multiprocessing
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree

import pyhvp
from pyhvp.taylor import registry

MAX_ELEMENTS = 48
SAMPLES = 3  # the op's first samples of at most MAX_ELEMENTS: values on each, third order on one
TIMEOUT_S = 240.0  # the slowest ops (ormqr, pca_lowrank) take about 70 s on a busy 2-core machine
MEMORY_LIMIT = 3 << 30  # bytes a case may allocate (beyond the forked process's own)
RECORDED = pyhvp.TorchBackend(guards=False)
"""The sweep checks the engine's rules, which see the record of f either way: without dynamo's
guards, which would trace each sample's f anew (its shapes differ) and more than double the
sweep's time. The guards' program is the record's by construction (tests/test_guards.py)."""
VALUE_RTOL = 1e-6  # of the dense Hessian's largest entry (plus an absolute 1e-6)
FOURTH_RTOL = 1e-6  # of the largest of the reference's five derivatives (plus an absolute 1e-6)
FOURTH_DIFFERENCES_RTOL = 1e-5  # the same, against central differences of the dense Hessian
FOURTH_STEP = 1e-3
THIRD_RTOL = 1e-5  # of the larger of the derivative and <v, diagonal>, plus an absolute 1e-5
THIRD_STEP = 1e-4  # five-point central differences: error ~ step^4 f^(7), roundoff ~ 1e-16 / step

# The outcomes, worst last; a case is exact, refused (a pyhvp error that names the cause) or a
# defect. "skip" cases have no reference: autograd itself cannot give the dense Hessian.
EXACT, REFUSED, SKIP = "exact", "refused", "skip"
CRASH, WRONG, INTERNAL, TIMEOUT = "crash", "wrong", "internal error", "timeout"
CLASSES = (EXACT, REFUSED, CRASH, WRONG, INTERNAL, TIMEOUT, SKIP)


@dataclass(frozen=True)
class Refusal:
    """An op the engine refuses on purpose: why, and a piece of the error message it raises."""

    reason: str
    message: str


COMPLEX = Refusal(
    "computes complex intermediates from x: jets would need complex coefficients",
    "complex intermediates are not supported",
)

SPARSE = Refusal("makes a sparse tensor: the engine carries dense ones", "dense (strided) tensors")
VALUE_BRANCHES = Refusal(
    "prod reductions whose backward branches on the values (zeros): a kernel cannot trace it",
    "branch on the values",
)
NO_FUNCTORCH = Refusal(
    "a torch-internal autograd.Function without functorch support (no setup_context)",
    "setup_context",
)
TOO_LARGE = Refusal(
    "the reverse fallback's dense derivatives of a (3, 50) pseudo-inverse need gigabytes",
    "need more memory than there is",
)
WRITES_X = Refusal("max_norm renormalises the embedding (x) in place", "f modifies x")
NO_THIRD_ORDER = Refusal(
    "values exact; autograd's derivatives of the fallback's coefficients (third order) are not "
    "reliable: its backward writes in place",
    "(a third derivative) is not available",
)

BEYOND_DENSE_FALLBACK = Refusal(
    "no fourth-order rule, and the dense reverse-mode fallback's work (autograd's fourth "
    "derivatives in all 25 inputs of a 5x5 matrix function) is over its limit",
    "over the limit of its work",
)

# Ops refused on purpose, by OpInfo name ("name" or "name.variant"), on each torch release the
# sweep runs on: each release has its own op database. Everything else must be exact.
REFUSED_ON_2_13: dict[str, Refusal] = {
    **dict.fromkeys(
        ["complex", "polar", "view_as_complex", "cfloat", "cdouble", "chalf", "stft",
         "linalg.eig", "linalg.eigvals",
         "fft.fft", "fft.fft2", "fft.fftn", "fft.ifft", "fft.ifft2", "fft.ifftn",
         "fft.rfft", "fft.rfft2", "fft.rfftn", "fft.irfft", "fft.irfft2", "fft.irfftn",
         "fft.hfft", "fft.hfft2", "fft.hfftn", "fft.ihfft", "fft.ihfft2", "fft.ihfftn"],
        COMPLEX,
    ),
    **dict.fromkeys(["to_sparse", "sparse.sampled_addmm"], SPARSE),
    **dict.fromkeys(["index_reduce.prod", "scatter_reduce.prod"], VALUE_BRANCHES),
    **dict.fromkeys(["nn.functional.linear_cross_entropy.chunked",
                     "nn.functional.linear_cross_entropy.chunked_none"], NO_FUNCTORCH),
    "linalg.pinv.singular": TOO_LARGE,
    "nn.functional.embedding": WRITES_X,
    **dict.fromkeys(["ormqr", "linalg.householder_product"], NO_THIRD_ORDER),
}  # fmt: skip
MATRIX_ABOVE_SECOND_ORDER = Refusal(
    "no fourth-order rule for a matrix decomposition, and nested reverse mode through its "
    "backward formulas outgrows memory beyond 2x2 matrices (a 3x3 svd at fourth order: over 3 GB)",
    "carries matrix decompositions above second order",
)
REFUSED_AT_FOURTH_ORDER_ON_2_13: dict[str, Refusal] = dict.fromkeys(
    ["cholesky", "cholesky_inverse", "lu", "qr", "svd", "svd_lowrank",
     "pca_lowrank", "pinverse", "norm.nuc", "linalg.cholesky", "linalg.cholesky_ex",
     "linalg.cond", "linalg.eigh", "linalg.eigvalsh", "linalg.lstsq",
     "linalg.lstsq.grad_oriented", "linalg.qr", "linalg.lu_factor", "linalg.lu_factor_ex",
     "linalg.lu", "linalg.lu_solve", "linalg.solve_triangular", "linalg.pinv",
     "linalg.pinv.singular", "linalg.pinv.hermitian", "linalg.svd", "linalg.svdvals"],
    MATRIX_ABOVE_SECOND_ORDER,
)  # fmt: skip
"""Ops refused at the fourth order only (their values and third order are exact): the 5x5 (and
3x3, 2x3) matrices of their samples, 2026-12-03."""
REFUSALS = {"2.13": REFUSED_ON_2_13, "2.14": REFUSED_ON_2_13}
FOURTH_ORDER_REFUSALS = {
    "2.13": REFUSED_AT_FOURTH_ORDER_ON_2_13,
    "2.14": {**{op: r for op, r in REFUSED_AT_FOURTH_ORDER_ON_2_13.items()
                if op not in ("cholesky", "qr")},
             **dict.fromkeys(["linalg.matrix_sqrth", "linalg.polar"], BEYOND_DENSE_FALLBACK)},
}  # fmt: skip
"""2.14.1's database has four ops 2.13's lacks (cdist, pdist, linalg.matrix_sqrth, linalg.polar:
all exact to third order; the two matrix functions refused at fourth order) and lacks two
(cholesky, qr); the engine refuses the same ops on both otherwise (2026-12-03)."""
RELEASE = ".".join(torch.__version__.split(".")[:2])
REFUSED_OPS: dict[str, Refusal] | None = REFUSALS.get(RELEASE)
REFUSED_AT_FOURTH_ORDER: dict[str, Refusal] | None = FOURTH_ORDER_REFUSALS.get(RELEASE)
"""The running release's table; None where the sweep has none (the tests then skip the sweep:
its refusals would name another database's ops)."""

SAMPLE_OPS = (
    # the quickest op of each cause of refusal but the third order's (see below)
    "fft.fft2", "sparse.sampled_addmm", "scatter_reduce.prod",
    "nn.functional.linear_cross_entropy.chunked_none", "linalg.pinv.singular",
    "nn.functional.embedding",
    # exact ops, each reaching rules no op before it reaches
    "vstack", "norm.inf", "linalg.tensorsolve", "cumulative_trapezoid", "_unsafe_masked_index",
    "masked.median", "index_put", "log_softmax", "nn.functional.multi_head_attention_forward",
    "lgamma", "t", "cross", "select_scatter", "logsumexp", "stack", "logdet",
    "nn.functional.pad.circular", "diagonal", "masked.softmin", "vdot", "nn.functional.conv3d",
    "bfloat16", "constant_pad_nd", "as_strided_scatter", "diagonal_scatter", "unbind", "var",
    "pow", "__rsub__", "__rmatmul__", "combinations", "torch.ops.aten._safe_softmax.default",
    "kthvalue", "prod", "nn.functional.cosine_similarity", "nanquantile", "linalg.eigvalsh",
)  # fmt: skip
"""The ops of the fast tier's sweep (``make test``; every op runs in ``make test-all``), chosen
on torch 2.13 by ``python tests/opinfo_sweep.py --choose-sample`` (:func:`choose_sample`): the
quickest op of each cause of refusal, then, greedily, the exact op that reaches the most of the
engine's rules not yet reached per second of its case, until every dedicated rule and fallback
the full sweep reaches is reached by an exact op of the sample (so every family of rules,
``pyhvp/taylor/rules/``, is in it): 43 ops reaching 62 rules, 2026-12-03. One cause of
refusal is left to ``make test-all``: its two ops (``ormqr``, ``linalg.householder_product``,
``NO_THIRD_ORDER``) take a minute or more each on 2 cores, most of it in the engine's reverse
fallback."""


JUDGED_OUTPUTS = {"native_group_norm": (0,)}
"""Ops whose other floating outputs autograd is not the judge of: ``native_group_norm``'s mean
and inverse deviation are differentiable in autograd, yet its double backward drops the inverse
deviation's gradient unless the mean's is there too (the engine gives their true derivatives)."""


def refusal_of(outcome) -> Refusal | None:
    """The refusal on purpose that covers this outcome's op at its stage, if any."""
    table = REFUSED_AT_FOURTH_ORDER if outcome.stage == "fourth order" else REFUSED_OPS
    return (table or {}).get(outcome.op)


def op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def swept_ops() -> list:
    """Every op of the database that supports double backward."""
    return [op for op in op_db if op.supports_autograd and op.supports_gradgrad]


# --- one case -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one op gave: its worst sample's outcome. ``stage``: "values" (hessian_diagonal and
    laplacian) or "third order"; ``sample``: that sample's arguments; ``detail``: the error
    message, traceback head or size of the disagreement; ``samples``: how many were checked;
    ``routes``: the engine's rules its cases reached, when asked (:func:`note_routes`)."""

    op: str
    status: str
    stage: str = ""
    sample: str = ""
    detail: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    samples: int = 0
    routes: list[str] = field(default_factory=list)


class NoSample(Exception):
    """The op has no float64 sample with a small enough floating input on this device."""


def _floating_index(leaves: list) -> int | None:
    for i, leaf in enumerate(leaves):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.layout == torch.strided
        ):
            return i
    return None


def scalar_function(op, sample):
    """``(f, x)``: the case's scalar function of the flat differentiated input, and that input."""
    args = (sample.input, *sample.args)
    leaves, spec = pytree.tree_flatten((args, sample.kwargs))
    # sample.input when it is a floating tensor, else the first floating tensor among the inputs
    first = _floating_index(pytree.tree_leaves(sample.input))
    index = first if first is not None else _floating_index(leaves)
    if index is None:
        raise NoSample("no floating tensor input")
    x = leaves[index]

    def outputs(flat):
        current = list(leaves)
        current[index] = flat.reshape(x.shape)
        a, k = pytree.tree_unflatten(current, spec)
        out = sample.output_process_fn_grad(op.gradcheck_wrapper(op.op, *a, **k))
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return [
            torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
            for t in (t if t.layout == torch.strided else t.to_dense() for t in tensors)
            if t.is_floating_point() or t.is_complex()
        ]

    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device)
        * (k in JUDGED_OUTPUTS.get(op_id(op), (k,)))
        for k, o in enumerate(outputs(x.detach().reshape(-1)))
    ]
    if not weights:
        raise NoSample("no floating output")

    def f(flat):
        return sum((w * o).sum() for w, o in zip(weights, outputs(flat), strict=True))

    return f, x


def describe(sample, x) -> str:
    """The sample, short: tensors by shape, x marked."""

    def short(value):
        if value is x:
            return f"x{list(x.shape)}"
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."

    inputs = pytree.tree_map(short, ((sample.input, *sample.args), sample.kwargs))
    args = ", ".join(map(str, inputs[0]))
    kwargs = "".join(f", {k}={v}" for k, v in inputs[1].items())
    return f"({args}{kwargs})"


def small_samples(op, device: str, count: int = SAMPLES) -> list:
    """``[(f, x, description)]`` for the op's first ``count`` float64 samples whose differentiated
    input has 1 to MAX_ELEMENTS elements (an empty x has no variables: pyhvp refuses it)."""
    if torch.float64 not in op.supported_dtypes(torch.device(device).type):
        raise NoSample("no float64 support")
    found = []
    for sample in op.sample_inputs(device, torch.float64, requires_grad=False):
        try:
            f, x = scalar_function(op, sample)
        except NoSample:
            continue
        if 0 < x.numel() <= MAX_ELEMENTS:
            found.append((f, x.detach(), describe(sample, x)))
            if len(found) == count:
                break
    if not found:
        raise NoSample(f"no float64 sample with 1 to {MAX_ELEMENTS} elements in x")
    return found


def is_pyhvp_error(error: BaseException) -> bool:
    """Raised by a ``raise`` statement in pyhvp's own code: a refusal that names its cause, not an
    error of torch (or of Python) that escaped the engine."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    package = os.path.dirname(pyhvp.__file__) + os.sep
    return filename.startswith(package) and linecache.getline(
        filename, tb.tb_lineno
    ).lstrip().startswith("raise ")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _traceback_head(error: BaseException, lines: int = 3) -> str:
    """The exception, then the innermost frames, pyhvp's first."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [fr for fr in frames if f"{os.sep}pyhvp{os.sep}" in fr.filename]
    shown = (ours or frames)[-lines:]
    where = [f"  {Path(fr.filename).name}:{fr.lineno} in {fr.name}: {fr.line}" for fr in shown]
    return "\n".join([_first_line(error), *where])


def _engine_failure(error: BaseException, stage: str) -> tuple[str, str, str]:
    if is_pyhvp_error(error):
        return REFUSED, stage, f"{type(error).__name__}: {error}"
    return INTERNAL, stage, _traceback_head(error)


def _dense_hessian(f, flat, create_graph=False):
    return torch.autograd.functional.hessian(f, flat, create_graph=create_graph)


def _third_order_reference(f, flat, v, u):
    """``d/dt <v, diag H(flat + t u)>`` at 0 by central differences of the dense Hessian (the
    five-point stencil: error ~ step^4)."""

    def along(t):
        return (v * _dense_hessian(f, flat + t * u).diagonal()).sum()

    h = THIRD_STEP
    return (8 * (along(h) - along(-h)) - (along(2 * h) - along(-2 * h))) / (12 * h)


def _torch_has_third_order(f, flat, v) -> str | None:
    """None when autograd can differentiate the dense Hessian's diagonal; else why not."""
    leaf = flat.detach().requires_grad_()
    try:
        hessian = _dense_hessian(f, leaf, create_graph=True)
        if hessian.requires_grad:
            torch.autograd.grad((v * hessian.diagonal()).sum(), leaf, allow_unused=True)
    except Exception as error:
        return _first_line(error)
    return None


def check_sample(f, x, third_order: bool = True) -> tuple:
    """``(status, stage, detail, notes)`` of one sample."""
    flat = x.reshape(-1).clone()
    n = flat.numel()
    try:
        hessian = _dense_hessian(f, flat)
    except Exception as error:
        return SKIP, "values", f"reference unavailable: {_first_line(error)}", []
    if not torch.isfinite(hessian).all():
        return SKIP, "values", "reference unavailable: autograd's Hessian is not finite", []
    reference = hessian.diagonal()
    scale = 1.0 + hessian.abs().max().item()

    try:
        diagonal = pyhvp.hessian_diagonal(f, flat, event_dims=1, backend=RECORDED)
        laplacian = pyhvp.laplacian(f, flat, event_dims=1, backend=RECORDED)
    except Exception as error:
        return (*_engine_failure(error, "values"), [])
    for what, got, want, tol in (
        ("hessian_diagonal", diagonal, reference, VALUE_RTOL * scale),
        ("laplacian", laplacian, reference.sum(), VALUE_RTOL * scale * n),
    ):
        if got.shape != want.shape:
            shapes = f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
            return WRONG, "values", f"{what}: {shapes}", []
        error = (got - want).abs().max().item()
        if not error <= tol:  # NaN included
            where = f"tolerance {tol:.3g}, reference scale {scale:.3g}"
            return WRONG, "values", f"{what}: max error {error:.3g} ({where})", []
    return check_third_order(f, flat, reference) if third_order else (EXACT, "", "", [])


def check_third_order(f, flat, reference) -> tuple:
    """The directional derivative of ``<v, hessian_diagonal(f, x)>`` along u, by autograd through
    pyhvp, against central differences of the dense diagonal."""
    generator = torch.Generator().manual_seed(1)
    v = torch.randn(flat.shape, generator=generator, dtype=flat.dtype).to(flat.device)
    u = torch.randn(flat.shape, generator=generator, dtype=flat.dtype).to(flat.device)
    missing = _torch_has_third_order(f, flat, v)
    if missing is not None:
        return EXACT, "", "", [f"no third order in torch: {missing}"]
    try:
        want = _third_order_reference(f, flat, v, u)
    except Exception as error:
        return EXACT, "", "", [f"no third-order reference: {_first_line(error)}"]
    if not torch.isfinite(want):
        return EXACT, "", "", ["no third-order reference: central differences not finite"]
    leaf = flat.clone().requires_grad_()
    try:
        diagonal = pyhvp.hessian_diagonal(f, leaf, event_dims=1, backend=RECORDED)
        gradient = None
        if diagonal.requires_grad:
            (gradient,) = torch.autograd.grad((v * diagonal).sum(), leaf, allow_unused=True)
    except Exception as error:
        return (*_engine_failure(error, "third order"), [])
    got = (gradient * u).sum().item() if gradient is not None else 0.0
    scale = 1.0 + max(abs(want.item()), (v * reference).sum().abs().item())
    error = abs(got - want.item())
    if not error <= THIRD_RTOL * scale:
        detail = (
            f"directional derivative {got:.10g}, central differences {want.item():.10g} "
            f"(error {error:.3g}, tolerance {THIRD_RTOL * scale:.3g})"
        )
        if gradient is None:
            detail += "; pyhvp's result does not depend on x"
        return WRONG, "third order", detail, []
    return EXACT, "", "", []


def _nested_directional_derivatives(f, flat, v, order):
    """``d^k/dt^k f(flat + t v)`` at 0, ``k = 0..order``, by nested ``torch.autograd.grad``."""
    t = torch.zeros((), dtype=flat.dtype, device=flat.device, requires_grad=True)
    h = f(flat + t * v)
    values = [h.detach()]
    for _ in range(order):
        (h,) = torch.autograd.grad(h, t, create_graph=True, allow_unused=True,
                                   materialize_grads=True)  # fmt: skip
        values.append(h.detach())
    return torch.stack(values)


def check_fourth_order(f, flat) -> tuple:
    """``directional_derivatives(f, flat, v, order=4)`` against nested autograd in ``t``."""
    generator = torch.Generator().manual_seed(2)
    v = torch.randn(flat.shape, generator=generator, dtype=flat.dtype).to(flat.device)
    try:
        want = _nested_directional_derivatives(f, flat, v, 4)
    except Exception as error:
        return EXACT, "", "", [f"no fourth order in torch: {_first_line(error)}"]
    if not torch.isfinite(want).all():
        return EXACT, "", "", ["no fourth-order reference: autograd's derivatives not finite"]
    try:
        got = pyhvp.directional_derivatives(f, flat, v, order=4, backend=RECORDED)
    except Exception as error:
        return (*_engine_failure(error, "fourth order"), [])
    scale = 1.0 + want.abs().max().item()
    error = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
    if error <= FOURTH_RTOL * scale:
        return EXACT, "", "", []
    detail = (f"derivatives of orders 0..4 {got.tolist()}, nested autograd {want.tolist()} "
              f"(max error {error:.3g}, tolerance {FOURTH_RTOL * scale:.3g})")  # fmt: skip
    if got.shape == want.shape and (got[:3] - want[:3]).abs().max() <= FOURTH_RTOL * scale:
        try:
            differences = _hessian_differences(f, flat, v)
        except Exception as failure:
            return WRONG, "fourth order", f"{detail}; no second judge: {_first_line(failure)}", []
        off = (got[3:] - differences).abs().max().item()
        if off <= FOURTH_DIFFERENCES_RTOL * scale:
            note = (f"nested autograd's orders 3 and 4 are wrong ({want[3:].tolist()}); central "
                    f"differences of the dense Hessian agree with pyhvp")  # fmt: skip
            return EXACT, "", "", [note]
        detail += f"; central differences of the dense Hessian give {differences.tolist()}"
    return WRONG, "fourth order", detail, []


def _hessian_differences(f, flat, v) -> torch.Tensor:
    """``d/dt`` and ``d^2/dt^2`` of ``v^T H(flat + t v) v`` at 0 (orders 3 and 4 of ``f`` along
    ``v``) by five-point central differences (error ~ step^4; roundoff ~ 1e-16 / step^2)."""
    h = FOURTH_STEP

    def quadratic(t):
        return v @ _dense_hessian(f, flat + t * v) @ v

    g = {k: quadratic(k * h) for k in (-2, -1, 0, 1, 2)}
    third = (8 * (g[1] - g[-1]) - (g[2] - g[-2])) / (12 * h)
    fourth = (-g[2] + 16 * g[1] - 30 * g[0] + 16 * g[-1] - g[-2]) / (12 * h * h)
    return torch.stack([third, fourth])


SEVERITY = (EXACT, SKIP, REFUSED, WRONG, INTERNAL, TIMEOUT, CRASH)


def run_case(op, device: str, progress=None) -> Outcome:
    """The op's outcome, its worst sample's (the third order on the first sample only), computed
    in this process; ``progress(description)`` is called before each sample (run it in a child:
    it may crash)."""
    name = op_id(op)
    start = time.perf_counter()
    try:
        samples = small_samples(op, device)
    except NoSample as why:
        return Outcome(name, SKIP, detail=f"no usable sample: {why}")
    worst = None
    for k, (f, x, description) in enumerate(samples):
        if progress is not None:
            progress(description)
        checks = [check_sample(f, x, third_order=k == 0)]
        if k == 0 and checks[0][0] == EXACT:
            checks.append(check_fourth_order(f, x.reshape(-1).clone()))
        for status, stage, detail, notes in checks:
            outcome = Outcome(name, status, stage, description, detail, notes=notes)
            if worst is None or SEVERITY.index(status) > SEVERITY.index(worst.status):
                worst = outcome
            elif notes:
                worst.notes += notes
    worst.seconds = time.perf_counter() - start
    worst.samples = len(samples)
    return worst


# --- isolation ----------------------------------------------------------------------------------


def _limit_memory(extra: int) -> None:
    """Address space capped at what the process has plus ``extra`` bytes: an op whose Hessian
    blows up fails with an allocation error (an internal error) instead of swapping the machine
    or drawing the OOM killer (a 48-element sample once took 23 GB). Linux only."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return
    size = next(
        int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:")
    )
    resource.setrlimit(
        resource.RLIMIT_AS, (size + extra, resource.getrlimit(resource.RLIMIT_AS)[1])
    )


def note_routes() -> list[str]:
    """Wraps each of the engine's dedicated rules and its two fallbacks (in this process) so that
    every call appends its name, ``module.function``, to the list returned."""
    reached: list[str] = []

    def noting(fn, name=None):
        name = name or f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}"

        def noted(*args, **kwargs):
            reached.append(name)
            return fn(*args, **kwargs)

        return noted

    for op, fn in list(registry.RULES.items()):
        registry.RULES[op] = noting(fn)
    for name in ("pointwise_fallback", "general_fallback"):
        setattr(registry, name, noting(getattr(registry, name)))
    return reached


def _child(connection, op, device, dump_path, routes):
    _limit_memory(MEMORY_LIMIT)
    # the Python stack at a fatal signal goes to the parent (its outcome's detail), not to the
    # log this process shares with the parent's (pytest's faulthandler writes to stderr)
    faulthandler.enable(file=open(dump_path, "w"))  # noqa: SIM115 -- open until the child ends
    if isinstance(op, str):  # from a fork server: the op by name
        op = next(o for o in swept_ops() if op_id(o) == op)
    reached = note_routes() if routes else []
    try:
        outcome = run_case(op, device, progress=lambda sample: connection.send(sample))
    except BaseException as error:
        outcome = Outcome(op_id(op), INTERNAL, "harness", detail=_traceback_head(error))
    outcome.routes = sorted(set(reached))
    connection.send(outcome)
    connection.close()


def isolated_case(op, device: str, timeout: float = TIMEOUT_S, routes: bool = False) -> Outcome:
    """``run_case`` in a child process: a crash (a signal) or a hang is that case's outcome, at
    the sample it had reached; a crash's detail holds the child's Python stack at the signal;
    ``routes=True`` notes the rules the case reached (:func:`note_routes`).

    On the CPU the child is forked from this process (set ``torch.set_num_threads(1)`` before:
    OpenMP thread pools do not survive a fork); CUDA does not survive a fork once initialised, so
    on a GPU the child is forked from a fork server that has imported torch but not touched CUDA,
    and is handed the op by name."""
    on_cpu = torch.device(device).type == "cpu"
    if not on_cpu:
        multiprocessing.set_forkserver_preload(["torch", __name__])
    context = multiprocessing.get_context("fork" if on_cpu else "forkserver")
    receive, send = context.Pipe(duplex=False)
    start = time.perf_counter()
    target = op if on_cpu else op_id(op)
    with tempfile.NamedTemporaryFile("r", prefix="pyhvp-sweep-", suffix=".dump") as dump:
        child = context.Process(
            target=_child, args=(send, target, device, dump.name, routes), daemon=True
        )
        child.start()
        send.close()
        sample = ""
        try:
            while receive.poll(max(0.0, start + timeout - time.perf_counter())):
                try:
                    message = receive.recv()
                except EOFError:  # the child died before it could answer
                    break
                if isinstance(message, Outcome):
                    return message
                sample = message
            else:
                child.kill()
                detail = f"no answer within {timeout:.0f} s"
                return Outcome(op_id(op), TIMEOUT, sample=sample, detail=detail, seconds=timeout)
        finally:
            child.join()
            receive.close()
        stack = _python_stack(dump.read())
    code = child.exitcode
    cause = signal.Signals(-code).name if code is not None and code < 0 else f"exit code {code}"
    seconds = time.perf_counter() - start
    detail = f"{cause}\n{stack}" if stack else cause
    return Outcome(op_id(op), CRASH, sample=sample, detail=detail, seconds=seconds)


def _python_stack(dump: str) -> str:
    """A faulthandler dump without its list of the process's extension modules (one long line
    of every compiled kernel's name, which says nothing about the crash)."""
    return "\n".join(
        line for line in dump.strip().splitlines() if not line.startswith("Extension modules:")
    )


WARM_UP = ("nn.functional.conv1d", "linalg.det", "cumsum", "nn.functional.cross_entropy")


def warm_up(device: str) -> None:
    """Runs a few cases in this process, each first in a child (so a crash here cannot end the
    run): torch's lazy imports and first-call initialisation then happen once, not in every
    forked child (about half a second each)."""
    for op in swept_ops():
        if op_id(op) in WARM_UP and isolated_case(op, device).status not in (CRASH, TIMEOUT):
            run_case(op, device)


class single_thread:
    """``with single_thread():`` torch on one intra-op thread, restored after."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


# --- the counts table and report ----------------------------------------------------------------


def counts_table(outcomes: list[Outcome]) -> str:
    counts = Counter(o.status for o in outcomes)
    usable = sum(counts[c] for c in CLASSES if c != SKIP)
    skips = Counter(o.detail.split(":")[0] for o in outcomes if o.status == SKIP)
    rows = [f"| {c} | {counts[c]} |" for c in CLASSES if c != SKIP]
    lines = [
        f"{counts[EXACT]} of {usable} ops exact ({len(outcomes)} swept; skipped: "
        + ", ".join(f"{n} {why}" for why, n in sorted(skips.items()))
        + ")",
        "",
        "| class | ops |",
        "|---|---|",
        *rows,
    ]
    return "\n".join(lines)


def markdown_report(outcomes: list[Outcome], device: str, seconds: float) -> str:
    head = [
        "# OpInfo sweep of the Taylor engine",
        "",
        f"torch {torch.__version__}, device {device}, {len(outcomes)} ops with double backward, "
        f"first float64 sample with at most {MAX_ELEMENTS} elements in x; {seconds:.0f} s.",
        "",
        counts_table(outcomes),
    ]
    body = []
    for status in (CRASH, WRONG, INTERNAL, TIMEOUT, REFUSED, SKIP):
        cases = [o for o in outcomes if o.status == status]
        if not cases:
            continue
        body += ["", f"## {status} ({len(cases)})", ""]
        for o in sorted(cases, key=lambda o: o.op):
            shape = f" {o.sample}" if o.sample else ""
            stage = f" [{o.stage}]" if o.stage else ""
            known = refusal_of(o)
            if known is not None:
                table = f" (refused on purpose: {known.reason})"
            elif status == REFUSED:
                table = " (**not** in the table of refusals on purpose: the test fails)"
            else:
                table = ""
            detail = o.detail.strip().replace("\n", "\n    ")
            body.append(f"- `{o.op}`{shape}{stage}{table}:\n    {detail}")
    slowest = sorted(outcomes, key=lambda o: -o.seconds)[:10]
    body += ["", "## slowest cases", ""]
    body += [f"- `{o.op}`: {o.seconds:.1f} s ({o.status})" for o in slowest]
    notes = [o for o in outcomes if o.notes]
    if notes:
        body += ["", f"## exact, third order not checked ({len(notes)})", ""]
        body += [f"- `{o.op}`: {'; '.join(o.notes)}" for o in sorted(notes, key=lambda o: o.op)]
    return "\n".join(head + body) + "\n"


def choose_sample(outcomes: list[Outcome]) -> list[str]:
    """The fast tier's ops (``SAMPLE_OPS``), from a sweep that noted each case's routes: for each
    cause of refusal in the table, its quickest op; then, one at a time, the exact op that reaches
    the most rules no chosen exact op reaches per second of its case (ties by name), until every
    rule that some exact op reaches is reached."""
    table = REFUSED_OPS or {}
    chosen = []
    for refusal in dict.fromkeys(table.values()):
        refused = [o for o in outcomes if o.status == REFUSED and table.get(o.op) == refusal]
        if refused:
            chosen.append(min(refused, key=lambda o: (o.seconds, o.op)).op)
    exact = [o for o in outcomes if o.status == EXACT]
    missing = set().union(*(o.routes for o in exact))
    while missing:
        best = min(exact, key=lambda o: (-len(missing & set(o.routes)) / max(o.seconds, 0.1), o.op))
        chosen.append(best.op)
        missing -= set(best.routes)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="write the markdown report here")
    parser.add_argument("--only", nargs="*", help="op ids to run (default: all)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true",
                        help="run the jet kernels compiled (compile=True): inductor, pyhvp's "
                             "pass and the first-call checks; about 7x the time")  # fmt: skip
    parser.add_argument("--choose-sample", action="store_true",
                        help="note the rules each case reaches and print the fast tier's sample "
                             "(choose_sample)")  # fmt: skip
    options = parser.parse_args(argv)
    if options.compile:
        global RECORDED
        RECORDED = pyhvp.TorchBackend(compile=True, guards=False)
    ops = [op for op in swept_ops() if not options.only or op_id(op) in options.only]
    start = time.perf_counter()
    outcomes = []
    with single_thread():
        warm_up(options.device)
        for op in ops:
            outcome = isolated_case(op, options.device, routes=options.choose_sample)
            outcomes.append(outcome)
            if outcome.status not in (EXACT, SKIP):
                print(f"{outcome.op}: {outcome.status} {outcome.detail.splitlines()[0][:150]}",
                      file=sys.stderr, flush=True)  # fmt: skip
    seconds = time.perf_counter() - start
    print(counts_table(outcomes))
    slowest = sorted(outcomes, key=lambda o: -o.seconds)[:5]
    print(f"\n{seconds:.0f} s; slowest: " + ", ".join(f"{o.op} {o.seconds:.1f} s" for o in slowest))
    if options.report is not None:
        options.report.write_text(markdown_report(outcomes, options.device, seconds))
    if options.choose_sample:
        print_sample(choose_sample(outcomes), outcomes)
    return 0


def print_sample(chosen: list[str], outcomes: list[Outcome]) -> None:
    """The sample as the literal of ``SAMPLE_OPS``, each op with its outcome, time and the
    rules it was the first chosen op to reach."""
    by_name = {o.op: o for o in outcomes}
    reached: set[str] = set()
    print("\nSAMPLE_OPS = (")
    for name in chosen:
        o = by_name[name]
        new = sorted(set(o.routes) - reached) if o.status == EXACT else []
        reached |= set(new)
        print(f"    {name!r},  # {o.status}, {o.seconds:.1f} s: {', '.join(new)}")
    seconds = sum(by_name[name].seconds for name in chosen)
    print(f")  # {len(chosen)} ops, {seconds:.0f} s of cases; {len(reached)} rules reached")


if __name__ == "__main__":
    sys.exit(main())
