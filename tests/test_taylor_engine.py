"""Specification of the Taylor engine where autograd is not the judge or not the point: (nearly)
singular matrices against closed forms, gradients of Laplacians (third order) against central
differences, users' own jet rules, the errors of ops it cannot carry, and which Python floats
are program inputs (one program for every value) rather than part of the program's key."""

import re
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from dense import (
    instance_hessian_diagonal,
    instance_jacobian,
    instance_laplacian,
    message_passing,
    nested_directional_derivatives,
)

import pyhvp
from pyhvp import taylor
from pyhvp.taylor import Jet, chain, program

aten = torch.ops.aten

# --- (nearly) singular matrices: closed forms, whatever LAPACK returns for a zero pivot --------


def det3(x):
    return torch.linalg.det(x.reshape(*x.shape[:-1], 3, 3))


def cofactors3(x):
    """det's gradient for 3x3 matrices, from cross products of rows (no LAPACK)."""
    r = x.reshape(*x.shape[:-1], 3, 3)
    rows = [torch.linalg.cross(r[..., (i + 1) % 3, :], r[..., (i + 2) % 3, :]) for i in range(3)]
    return torch.stack(rows, -2).reshape(x.shape)


def nearly_singular(dtype, gap):
    """Four 3x3 matrices whose last two rows agree up to a relative ``gap`` (0: exactly)."""
    generator = torch.Generator().manual_seed(2)
    a = torch.randn(4, 3, 3, generator=generator, dtype=torch.float64)
    a[:, 2] = a[:, 1] + gap * torch.randn(4, 3, generator=generator, dtype=torch.float64)
    return a.reshape(4, 9).to(dtype)


NEAR_SINGULAR = {
    "float64, equal rows": (torch.float64, 0.0, 1e-12),
    "float64, rows 1e-12 apart": (torch.float64, 1e-12, 1e-12),
    "float32, rows 1e-4 apart (det ~ 1e-5)": (torch.float32, 1e-4, 1e-4),
}


@pytest.mark.parametrize(("dtype", "gap", "atol"), NEAR_SINGULAR.values(), ids=NEAR_SINGULAR.keys())
def test_det_of_a_nearly_singular_matrix_has_its_closed_form_derivatives(dtype, gap, atol, device):
    """det is linear in each entry: its Laplacian is 0 and det^2 has Hessian diagonal
    2 cofactor^2 -- issue 16 item 2 (NaN where MKL returns det = -1.9e-17) and item 6 (a
    float32 Laplacian of 1.97 where the exact value is 0)."""
    x = nearly_singular(dtype, gap).to(device)
    scale = cofactors3(x.double()).abs().max().item() ** 2
    lap = pyhvp.laplacian(det3, x)
    squared = pyhvp.hessian_diagonal(lambda y: det3(y) ** 2, x)
    torch.testing.assert_close(lap.double(), torch.zeros(4, dtype=torch.float64, device=device),
                               atol=atol * scale, rtol=0)  # fmt: skip
    torch.testing.assert_close(squared.double(), 2 * cofactors3(x.double()) ** 2,
                               atol=atol * scale, rtol=1e-3 if dtype == torch.float32 else 1e-7)  # fmt: skip


def test_near_singular_inverse_and_slogdet_match_autograd_where_it_is_finite(device):
    """inv and slogdet of an ill-conditioned (but invertible) matrix: finite, as autograd's."""
    x = nearly_singular(
        torch.float64,
        1e-6,
    ).to(device)

    def f(y):
        a = y.reshape(*y.shape[:-1], 3, 3)
        return torch.linalg.inv(a).sum((-2, -1)) * 1e-6 + torch.linalg.slogdet(a).logabsdet

    expected = instance_hessian_diagonal(f, x)
    assert expected.isfinite().all()
    torch.testing.assert_close(pyhvp.hessian_diagonal(f, x), expected, rtol=1e-5, atol=1e-6)


# --- derivatives that are not finite stay at their entries (issue 29) ------------------------

AT_ZERO = [[0.0, 1.0, 2.0, 0.5], [1.0, 0.5, 3.0, 0.0], [0.25, 1.5, 0.0, 2.0]]
LAYER = torch.arange(1.0, 13.0, dtype=torch.float64).reshape(4, 3) / 10
SINGULAR = {  # f, at exact zeros of x: one entry of each instance
    "sqrt": lambda x: x.sqrt().sum(-1),
    "log, through a linear layer": lambda x: (x.log() @ LAYER.to(x.device)).sum(-1),
    "x ** 1.5, vector-valued": lambda x: torch.stack([(x**1.5).sum(-1), (x**0.5).sum(-1)], -1),
    "x log x": lambda x: (x * x.log()).sum(-1),
    "xlogy(x, x)": lambda x: torch.xlogy(x, x).sum(-1),
}


@pytest.mark.parametrize("f", SINGULAR.values(), ids=SINGULAR.keys())
def test_a_derivative_that_is_not_finite_stays_at_its_entry(f, device):
    """Where x has a zero, autograd's diagonal is -inf, inf or NaN at that entry and finite at
    the others; pyhvp's too (the Taylor engine multiplied the infinite derivative by the zero
    coefficients of the other directions: NaN everywhere). Not finite: -inf, inf or NaN, which
    autograd gives in turn for the same derivative by different routes (stack, sum)."""
    x = torch.tensor(AT_ZERO, dtype=torch.float64, device=device)
    expected = instance_hessian_diagonal(f, x)
    assert expected.isfinite().flatten(0, -2).sum(-1).tolist() == [3] * expected[..., 0].numel()
    got = pyhvp.hessian_diagonal(f, x)
    assert torch.equal(got.isfinite(), expected.isfinite())
    torch.testing.assert_close(got[got.isfinite()], expected[expected.isfinite()])


WITH_NAN = [[float("nan"), 1.0, -2.0, 0.5], [1.0, -0.5, 3.0, float("nan")]]
THROUGH_ABS = {
    "|x| ** 1.5": lambda x: (x.abs() ** 1.5).sum(-1),
    "sin |x|": lambda x: torch.sin(x.abs()).sum(-1),
    "|x| x": lambda x: (x.abs() * x).sum(-1),
}


@pytest.mark.parametrize("f", THROUGH_ABS.values(), ids=THROUGH_ABS.keys())
def test_a_nan_in_x_through_abs_makes_that_entrys_derivatives_nan_as_autograds(f, device):
    """``abs``'s slope at a NaN was ``sign(nan) = 0``, an exact zero that dropped the NaN: the
    diagonal there was finite (0), and so was the Laplacian, where autograd's are NaN."""
    x = torch.tensor(WITH_NAN, dtype=torch.float64, device=device)
    expected = instance_hessian_diagonal(f, x)
    got = pyhvp.hessian_diagonal(f, x)
    assert torch.equal(got.isnan(), x.isnan()) and torch.equal(expected.isnan(), x.isnan())
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_entropy_of_a_masked_softmax_is_that_of_the_kept_entries(device):
    """Autograd's diagonal is NaN at every kept entry (its softmax backward sums 0 * -inf over
    the masked ones); pyhvp's is the derivative of the entropy over the kept entries alone (0 at
    the masked ones), as the strong zeros of the masked entries' coefficients give it."""
    kept = torch.tensor([True, False, True, True], device=device)

    def entropy(x):
        scores = x.masked_fill(~kept, -torch.inf)
        return -(torch.softmax(scores, -1) * torch.log_softmax(scores, -1)).sum(-1)

    def kept_only(y):
        p = torch.softmax(y, -1)
        return -(p * p.log()).sum(-1)

    x = torch.randn(3, 4, dtype=torch.float64, device=device)
    assert instance_hessian_diagonal(entropy, x)[:, kept].isnan().all()
    expected = torch.zeros_like(x)
    expected[:, kept] = instance_hessian_diagonal(kept_only, x[:, kept])
    torch.testing.assert_close(pyhvp.hessian_diagonal(entropy, x), expected)


def test_the_strong_zero_kernel_runs_only_for_results_that_are_not_finite(device):
    """The plain kernel's finite results are the strong-zero kernel's (pyhvp.taylor.jets): a
    call whose results are finite builds no strong-zero kernel, one whose are not builds it."""
    f = SINGULAR["sqrt"]
    program._PROGRAMS.clear()
    x = torch.tensor(AT_ZERO, dtype=torch.float64, device=device)
    pyhvp.hessian_diagonal(f, x + 1)
    (recorded,) = program._PROGRAMS.values()
    assert [kernel.mode.strong for kernel in recorded.kernels.values()] == [False]
    pyhvp.hessian_diagonal(f, x)
    assert [kernel.mode.strong for kernel in recorded.kernels.values()] == [False, True]


# --- third order: gradients of the Laplacian against central differences -----------------------


MASKS = (torch.tensor([True, False, True, False, True, True]),
         torch.tensor([True, True, False, False, False, True]),
         torch.tensor([[True, True, True], [False, True, False]]))  # fmt: skip


def _weight(device):
    generator = torch.Generator().manual_seed(4)
    return torch.randn(6, 6, generator=generator, dtype=torch.float64).to(device)


THIRD_ORDER = {
    "cosine_similarity (an in-place clamp)": lambda w: lambda x: F.cosine_similarity(x, x @ w, -1),
    "pairwise_distance": lambda w: lambda x: F.pairwise_distance(x[..., :3], x[..., 3:]),
    "eigvalsh of an SPD matrix": lambda w: lambda x: torch.linalg.eigvalsh(
        (x @ w).reshape(*x.shape[:-1], 2, 3) @ (x @ w).reshape(*x.shape[:-1], 2, 3).mT
        + torch.eye(2, dtype=x.dtype, device=x.device)).log().sum(-1),
    "LayerNorm (torch 2.14's triple backward is off by 50)": lambda w: lambda x: F.layer_norm(
        x @ w, (6,)).pow(3).sum(-1),
    "masked logaddexp, both masked in places": lambda w: lambda x: torch.masked.logaddexp(
        x @ w, x.sin(), input_mask=MASKS[0].to(x.device),
        other_mask=MASKS[1].to(x.device)).mul(x.new_tensor(
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])).sum(-1),
    "logsumexp with a row of -inf": lambda w: lambda x: torch.logsumexp(
        (x @ w).reshape(*x.shape[:-1], 2, 3).masked_fill(MASKS[2].to(x.device), -torch.inf), -1).exp().sum(-1),
}  # fmt: skip


def central_difference_gradient(g, x, step=1e-5):
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    return torch.stack([(g(x + step * e) - g(x - step * e)) / (2 * step) for e in eye], -1)


@pytest.mark.parametrize("make", THIRD_ORDER.values(), ids=THIRD_ORDER.keys())
def test_the_gradient_of_a_laplacian_matches_central_differences(make, device):
    """Issue 16 item 5: what a PINN or score model trains through."""
    f = make(_weight(device))
    x = torch.randn(3, 6, dtype=torch.float64, device=device, requires_grad=True)
    (gradient,) = torch.autograd.grad(pyhvp.laplacian(f, x).sum(), x)
    expected = central_difference_gradient(lambda y: instance_laplacian(f, y), x.detach())
    torch.testing.assert_close(gradient, expected, rtol=1e-6, atol=1e-6)


def test_the_gradient_of_a_diagonal_through_masked_powers_is_its_closed_form(device):
    """x ** p for tensor exponents p = 0..3 and 0 ** |x|, at exact zeros of x: their rules mask
    ``p x^(p-1)`` where p = 0 and ``0 ** x log 0`` where x >= 0 (autograd's pow_backward); the
    masked branches' 0 * inf made the gradient of the diagonal NaN at every entry (issue 29)."""
    x = torch.tensor(AT_ZERO, dtype=torch.float64, device=device, requires_grad=True)
    powers = torch.arange(4, dtype=x.dtype, device=device)

    def f(y):  # per entry: 1 + y + y^2 + y^3 + 0^|y| + 0^|y|, of second derivative 2 + 6 y
        zero = torch.zeros((), dtype=y.dtype, device=y.device)
        return (y[..., None] ** powers).sum((-2, -1)) + (0.0 ** y.abs() + zero ** y.abs()).sum(-1)

    (gradient,) = torch.autograd.grad(pyhvp.hessian_diagonal(f, x).sum(), x)
    torch.testing.assert_close(gradient, torch.full_like(x, 6.0))


def test_cdist_laplacian_has_finite_equal_gradients_in_a_weight(device):
    """Issue 16 item 6: with y = x @ W, cdist(y, y) has zero distances on its diagonal; its
    Laplacian's gradient in W was all NaN (a where after a pow at 0)."""
    w = _weight(device)[:, :4].requires_grad_()
    x = torch.randn(3, 6, dtype=torch.float64, device=device)

    def f(x, w):
        y = (x @ w).reshape(*x.shape[:-1], 2, 2)
        return torch.cdist(y, y).sum((-2, -1))

    def by_hand(x, w):  # the same distances, zero ones left out (their derivatives are 0)
        y = (x @ w).reshape(*x.shape[:-1], 2, 2)
        return 2 * (y[..., 0, :] - y[..., 1, :]).norm(dim=-1)

    (gradient,) = torch.autograd.grad(pyhvp.laplacian(f, x, w).sum(), w)
    flat = w.detach().reshape(-1)
    expected = central_difference_gradient(
        lambda v: instance_laplacian(by_hand, x, v.reshape(6, 4)).sum(), flat[None]
    ).reshape(6, 4)
    assert gradient.isfinite().all()
    torch.testing.assert_close(gradient, expected, rtol=1e-6, atol=1e-6)


# --- users' own rules ------------------------------------------------------------------------


@torch.library.custom_op("pyhvp_test::softsign", mutates_args=())
def softsign(t: torch.Tensor) -> torch.Tensor:
    return t / (1 + t.abs())


@softsign.register_fake
def _(t):
    return torch.empty_like(t)


@pyhvp.register_jet_rule(softsign)
def _(ctx, out, u):  # g = u / (1 + |u|): g' = 1 / (1 + |u|)^2, g'' = -2 sign(u) / (1 + |u|)^3
    denominator = 1 + u.value.abs()
    return chain(ctx, out, u, denominator**-2, -2 * torch.sign(u.value) * denominator**-3)


@torch.library.custom_op("pyhvp_test::smooth", mutates_args=())
def smooth(t: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """A custom linear op: a moving average along the last dim (kernel constant)."""
    return F.conv1d(t.reshape(-1, 1, t.shape[-1]), kernel.reshape(1, 1, -1)).reshape(
        *t.shape[:-1], -1
    )


@smooth.register_fake
def _(t, kernel):
    return t.new_empty((*t.shape[:-1], t.shape[-1] - kernel.shape[-1] + 1))


pyhvp.register_jet_rule(smooth, linear=True)


@torch.library.custom_op("pyhvp_test::reverse", mutates_args=())
def reverse(t: torch.Tensor) -> torch.Tensor:
    return t.flip(-1)


@reverse.register_fake
def _(t):
    return torch.empty_like(t)


pyhvp.register_jet_rule(reverse, indexing=True)


@torch.library.custom_op("pyhvp_test::log_cosh", mutates_args=())
def log_cosh(t: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.cosh(t))


@log_cosh.register_fake
def _(t):
    return torch.empty_like(t)


def test_a_custom_op_without_a_rule_or_a_derivative_formula_is_told_so():
    """torch's reason quoted was "an autograd.Function ... must override the setup_context
    staticmethod", about a class the user never wrote (a first-day review)."""
    with pytest.raises(
        pyhvp.UnsupportedOpError, match=r"no derivative formula .*register_autograd"
    ):
        pyhvp.laplacian(lambda y: log_cosh(y).sum(-1), torch.randn(5, 3, dtype=torch.float64))


KERNEL = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
USER_RULES = {
    "a rule (softsign)": (
        lambda x: softsign(x.sin() * 2).pow(2).sum(-1),
        lambda x: (x.sin() * 2 / (1 + (x.sin() * 2).abs())).pow(2).sum(-1),
    ),
    "linear=True (a moving average)": (
        lambda x: smooth(x.exp(), KERNEL.to(x.device)).pow(2).sum(-1),
        lambda x: F.conv1d(x.exp()[:, None], KERNEL.to(x.device)[None, None])[:, 0]
        .pow(2).sum(-1),
    ),
    "indexing=True (a reversal), shared directions": (
        lambda x: (reverse(x) * x.pow(2)).sum(-1),
        lambda x: (x.flip(-1) * x.pow(2)).sum(-1),
    ),
}  # fmt: skip


@pytest.mark.parametrize(("f", "reference"), USER_RULES.values(), ids=USER_RULES.keys())
def test_a_registered_rule_gives_the_dense_derivatives(f, reference, device):
    x = torch.randn(5, 6, dtype=torch.float64, device=device)
    torch.testing.assert_close(pyhvp.hessian_diagonal(f, x),
                               instance_hessian_diagonal(reference, x))  # fmt: skip
    torch.testing.assert_close(pyhvp.laplacian(f, x), instance_laplacian(reference, x))


@torch.library.custom_op("pyhvp_test::times", mutates_args=())
def times(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return t * s


@torch.library.custom_op("pyhvp_test::shifted", mutates_args=())
def shifted(t: torch.Tensor) -> torch.Tensor:
    return t + 1


for _op in (times, shifted):
    _op.register_fake(lambda t, *rest: torch.empty_like(t))
pyhvp.register_jet_rule(times, linear=True)
pyhvp.register_jet_rule(shifted, indexing=True)
NOT_LINEAR = {
    "linear=True on a product of two inputs that depend on x": lambda x: times(x, x.sin()).sum(-1),
    "indexing=True on an added constant": lambda x: shifted(x).pow(2).sum(-1),
}


@pytest.mark.parametrize("f", NOT_LINEAR.values(), ids=NOT_LINEAR.keys())
def test_a_flag_on_an_op_that_is_not_linear_is_refused(f):
    """Each flag's rule sends coefficients through the op itself: on a product it gave the
    Laplacian of ``x sin x`` as 0 (``2 cos x - x sin x``); with a constant added, a wrong one."""
    with pytest.raises(pyhvp.UnsupportedOpError, match="not linear in its inputs that depend on x"):
        pyhvp.laplacian(f, torch.randn(3, 4, dtype=torch.float64))


def test_register_jet_rule_refuses_what_is_not_an_op_and_a_rule_with_a_flag():
    with pytest.raises(TypeError, match=r"wrap one with torch\.library\.custom_op"):
        pyhvp.register_jet_rule(torch.sin, linear=True)
    with pytest.raises(ValueError, match="one of rule=, linear=True and indexing=True"):
        pyhvp.register_jet_rule(softsign, lambda *a: None, linear=True)


def test_register_jet_rule_refuses_a_rule_that_is_not_callable():
    with pytest.raises(TypeError, match="rule must be a function"):
        pyhvp.register_jet_rule(softsign, 3)


SQUARE = torch.library.custom_op(
    "pyhvp_test::square", lambda t: t * t, mutates_args=(), schema="(Tensor t) -> Tensor"
)
SQUARE.register_fake(lambda t: torch.empty_like(t))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_rule_registered_again_replaces_the_one_traced_before(compiled):
    """Kernels traced with the first rule were used again (a diagonal of 3 where the corrected
    rule says 2, while the Laplacian, traced afresh, had 2)."""
    backend = pyhvp.TorchBackend(compile=compiled)
    x = torch.randn(5, 4, dtype=torch.float64)

    def f(y):
        return SQUARE(y).sum(-1)

    for second in (3.0, 2.0):  # a wrong second derivative first, then the right one
        pyhvp.register_jet_rule(SQUARE, lambda ctx, out, u, c=second: chain(
            ctx, out, u, 2 * u.value, torch.full_like(u.value, c)))  # fmt: skip
        for _ in range(2):
            diagonal = pyhvp.hessian_diagonal(f, x, backend=backend)
            torch.testing.assert_close(diagonal, torch.full_like(x, second))


def _cube_rule(ctx, out, u):
    return chain(ctx, out, u, 3 * u.value**2, 6 * u.value, torch.full_like(u.value, 6.0))


def _without_directions(ctx, out, u):
    jet = _cube_rule(ctx, out, u)
    return Jet(
        out, tuple(None if c is None else c.sum(0) for c in (jet.first, *jet.coefficients[1:]))
    )


def _directions_summed(ctx, out, u):
    jet = _cube_rule(ctx, out, u)
    return Jet(out, (jet.first.sum(0, keepdim=True), *jet.coefficients[1:]))


MALFORMED_RULES = {
    "a jet of another value": (
        lambda ctx, out, u: Jet(2 * out, _cube_rule(ctx, out, u).coefficients),
        "whose value is not the op's output"),
    "coefficients without the directions' axis": (
        _without_directions, r"order-1 coefficient of shape \(4, 3\) for a value of shape \(4, 3\)"
    ),
    "first-order coefficients summed over the directions, an axis of 1 left": (
        _directions_summed,
        r"order-1 coefficient of shape \(1, 4, 3\) for a value of shape \(4, 3\): it must be "
        r"\(K = 3, the directions"),
    "no first-order coefficient": (
        lambda ctx, out, u: Jet(out, (None, *_cube_rule(ctx, out, u).coefficients[1:])),
        "without a first-order coefficient"),
    "a jet inside a tuple": (lambda ctx, out, u: (_cube_rule(ctx, out, u), out),
                             "returned 2 jets or tensors where the op has 1 outputs"),
    "a number": (lambda ctx, out, u: 3.0, "returned a float for an output tensor"),
    "no parameter for the input's jet": (lambda ctx, out: out,
                                         r"cannot take this call of the op.*signature: \(ctx, out\)"),
    "a derivative of another shape given to chain": (
        lambda ctx, out, u: chain(ctx, out, u, 3 * u.value[:, 0] ** 2, 6 * u.value),
        r"of .*cube.* raised RuntimeError: chain: derivative 1 has shape \(4,\), which does not "
        r"broadcast to the output's \(4, 3\)"),
}  # fmt: skip
"""A user's rule, and what the refusal says: these were used silently (another value; an axis
of 1 for the K directions, broadcast: every direction given one sum's coefficient) or
crashed inside the rules downstream (a rule without the input's parameter, in a bare TypeError
naming neither the op nor the rule; a derivative of another shape, in torch's broadcasting
error, naming neither)."""


def _malformed_cube(name, rule):
    op = torch.library.custom_op(
        f"pyhvp_test::cube_{len(name)}_{abs(hash(name)) % 10**6}",
        lambda t: t**3,
        mutates_args=(),
        schema="(Tensor t) -> Tensor",
    )
    op.register_fake(lambda t: torch.empty_like(t))
    pyhvp.register_jet_rule(op, rule)
    return op


MALFORMED_OPS = {name: _malformed_cube(name, rule) for name, (rule, _) in MALFORMED_RULES.items()}


@pytest.mark.parametrize("operator", [pyhvp.laplacian, pyhvp.hessian_diagonal],
                         ids=["laplacian", "hessian_diagonal"])  # fmt: skip
@pytest.mark.parametrize("name", MALFORMED_RULES)
def test_a_malformed_user_rule_is_refused_naming_the_op_and_the_fault(name, operator):
    op, (_, message) = MALFORMED_OPS[name], MALFORMED_RULES[name]
    with pytest.raises(pyhvp.UnsupportedOpError, match=message):
        operator(lambda y: op(y).sin().sum(-1), torch.rand(4, 3, dtype=torch.float64))


def test_index_add_runs_as_one_batched_index_add_in_the_kernel():
    """Not as the decomposition's accumulating ``index_put``: batched over directions, that is
    2-4x slower on the CPU (a graph network's Laplacian 1.5 vs 1.1 ms, its diagonal 3.1 vs 1.5)."""
    x = torch.randn(3, 4, dtype=torch.float64)
    captured = program.capture(message_passing, x, ())
    for collapsed in (True, False):
        mode = taylor.JetMode(order=2, collapsed=collapsed, outputs=(2,))
        kernel = captured.kernel(mode, x, torch.eye(4, dtype=x.dtype)[:, None])
        ops = {node.target for node in kernel.graph.graph.nodes}
        assert aten.index_add.default in ops and aten.index_put.default not in ops


# --- state f writes: running statistics, a captured tensor ------------------------------------


@pytest.mark.parametrize("through_a_view", [False, True], ids=["directly", "through a view"])
def test_a_captured_tensor_f_writes_acts_as_in_one_call_of_f(through_a_view, device):
    """Issue 16 item 3: batch norm in training mode updates running statistics. A tensor f
    reads and writes is written once per pyhvp call, as one call of f writes it, and the
    derivatives are those of f at the state before the call."""
    state = torch.ones(3, dtype=torch.float64, device=device)
    before = state.clone()

    def f(x):
        target = state[:2] if through_a_view else state
        target.mul_(2.0)  # a write, then a read of the written value
        return (x.pow(3) * state).sum(-1)

    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    lap = pyhvp.laplacian(f, x)
    once = before.clone()
    (once[:2] if through_a_view else once).mul_(2.0)
    torch.testing.assert_close(state, once)
    expected = instance_laplacian(lambda y: (y.pow(3) * once).sum(-1), x)
    torch.testing.assert_close(lap, expected)


def test_batch_norm_in_training_mode_matches_autograd_and_updates_its_statistics_once():
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(3).double().train()
    x = torch.randn(6, 3, dtype=torch.float64)

    def f(y):  # one instance: the whole batch, as a flat vector (training mode couples rows)
        return norm(y.reshape(6, 3)).pow(3).sum()[None]

    diagonal = pyhvp.hessian_diagonal(f, x.reshape(1, 18))
    statistics = norm.running_mean.clone()
    norm.reset_running_stats()
    f(x.reshape(1, 18))  # one call's update
    torch.testing.assert_close(statistics, norm.running_mean)
    # autograd's dense Hessian (torch.func refuses the in-place update)
    dense = torch.autograd.functional.hessian(lambda y: f(y[None])[0], x.reshape(18))
    torch.testing.assert_close(diagonal, dense.diagonal()[None])


@pytest.fixture
def real_replay(monkeypatch):
    """The program's replay on fake tensors fails, as for an op whose output shape depends on
    values (torch 2.5: ``repeat_interleave`` by a tensor of repeats): it runs on real values."""
    make_fx = program.make_fx

    def fake_fails(fn, *args, tracing_mode="real", **kwargs):
        if tracing_mode == "fake":
            raise RuntimeError("data-dependent output shape")
        return make_fx(fn, *args, tracing_mode=tracing_mode, **kwargs)

    monkeypatch.setattr(program, "make_fx", fake_fails)


def test_a_replay_on_real_values_makes_none_of_f_s_writes_again(real_replay):
    """Functionalization ends the replay with copy_ of the new values into the tensors f wrote:
    on real values those were f's own, written a second time (running statistics updated
    twice, dropout's scaled mask scaled again: twice f's value)."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(3).double().train()
    x = torch.randn(6, 3, dtype=torch.float64)
    pyhvp.hessian_diagonal(lambda y: norm(y.reshape(6, 3)).pow(3).sum()[None], x.reshape(1, 18))
    statistics = norm.running_mean.clone()
    norm.reset_running_stats()
    norm(x)
    torch.testing.assert_close(statistics, norm.running_mean)

    def f(y):
        return F.dropout(torch.sin(y), 0.5, training=True).sum(-1)

    torch.manual_seed(1)
    value, _, _ = pyhvp.grad_and_laplacian(f, x)
    torch.manual_seed(1)
    torch.testing.assert_close(value, f(x))


def test_f_runs_once_when_dynamo_runs_frames_eagerly():
    """Dynamo disabled (or left so: torch 2.5.1 after first calls from several threads) ran the
    guards' trampoline, and so f, eagerly; f was then recorded too: its write made twice.
    (Dynamo is reset after: what it cached while disabled stays eager in this process.)"""
    state, calls = torch.ones(3, dtype=torch.float64), []

    def f(y):
        calls.append(1)
        state.mul_(2.0)
        return (y.pow(3) * state).sum(-1)

    try:
        with torch._dynamo.config.patch(disable=True):
            pyhvp.laplacian(f, torch.randn(4, 3, dtype=torch.float64))
    finally:
        torch._dynamo.reset()
    assert len(calls) == 1
    torch.testing.assert_close(state, torch.full((3,), 2.0, dtype=torch.float64))


HELD = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
WITHOUT_TENSOR_OPS = {  # f, and its gradient per instance
    "x itself": (lambda y: y, torch.eye(3, dtype=torch.float64).expand(4, 3, 3)),
    "a tensor it holds": (lambda y: HELD, torch.zeros(4, 3, 3, dtype=torch.float64)),
}


@pytest.mark.parametrize(("g", "gradient"), WITHOUT_TENSOR_OPS.values(),
                         ids=WITHOUT_TENSOR_OPS.keys())  # fmt: skip
def test_f_without_tensor_ops_runs_once_a_call_and_has_its_derivatives(g, gradient):
    """Dynamo's frame of such an f has no graph: it made f's Python side effects, and f was
    then recorded, run a second time (the first call of each f)."""
    calls = []

    def f(y):
        calls.append(1)
        return g(y)

    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(2):
        calls.clear()
        value, got, laplacian = pyhvp.grad_and_laplacian(f, x)
        assert len(calls) == 1
        torch.testing.assert_close((value, got, laplacian),
                                   (g(x), gradient, torch.zeros_like(x)))  # fmt: skip


# --- mixed dtypes ---------------------------------------------------------------------------------


def test_a_float32_x_promoted_by_a_float64_constant_has_x_s_dtype_derivatives(device):
    """A sum of a float64 factor times float32 directions (kept factored) multiplied float64 by
    float32 matrices: 'expected m1 and m2 to have the same dtype'. The Laplacian, computed in
    float64, has x's dtype, as autograd's derivatives (issue 29)."""
    x = torch.randn(4, 3, device=device)
    c = torch.arange(1.0, 4.0, dtype=torch.float64, device=device)

    def f(y):
        return (c * y**2).sum(-1)

    lap = pyhvp.laplacian(f, x)
    assert lap.dtype == x.dtype == torch.float32
    torch.testing.assert_close(lap.double(), instance_laplacian(f, x), rtol=1e-6, atol=1e-6)


LOW_PRECISION_FACTORS = {  # f(y, G): G, a captured constant, promotes y * G to y's float64
    "sin(y * G)": lambda y, g: torch.sin(y * g).prod(-1),
    "sin(0.3 y * G)": lambda y, g: torch.sin(0.3 * y * g).pow(2).sum(-1),
    "exp(y / G)": lambda y, g: torch.exp(y / g).sum(-1),
}
FACTOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", FACTOR_DTYPES.values(), ids=FACTOR_DTYPES.keys())
@pytest.mark.parametrize("f", LOW_PRECISION_FACTORS.values(), ids=LOW_PRECISION_FACTORS.keys())
def test_a_lower_precision_captured_factor_gives_float64_derivatives(f, dtype, device):
    """x's diagonal coefficient times G was ``G`` itself, in G's dtype: its square was rounded
    there (2e-5 relative off with a bfloat16 G, 1e-8 with a float32 one)."""
    x = torch.randn(3, 4, dtype=torch.float64, device=device)
    g = (torch.rand(4, dtype=torch.float64, device=device) + 0.5).to(dtype)
    lap = pyhvp.laplacian(lambda y: f(y, g), x)
    reference = instance_laplacian(lambda y: f(y, g.double()), x)
    torch.testing.assert_close(lap, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", FACTOR_DTYPES.values(), ids=FACTOR_DTYPES.keys())
def test_grad_and_laplacian_with_a_lower_precision_captured_factor_is_float64(dtype, device):
    x = torch.randn(3, 4, dtype=torch.float64, device=device)
    g = (torch.rand(4, dtype=torch.float64, device=device) + 0.5).to(dtype)
    f = LOW_PRECISION_FACTORS["sin(y * G)"]
    value, gradient, lap = pyhvp.grad_and_laplacian(lambda y: f(y, g), x)
    reference = [f(x, g.double()), instance_jacobian(lambda y: f(y, g.double()), x),
                 instance_laplacian(lambda y: f(y, g.double()), x)]  # fmt: skip
    torch.testing.assert_close([value, gradient, lap], reference, rtol=1e-12, atol=1e-12)


SLOPED = {
    "leaky_relu(u, 0.2)": (lambda u: F.leaky_relu(u, 0.2), 0.2),
    "leaky_relu(u)": (F.leaky_relu, 0.01),
    "rrelu(u, 0.1, 0.3) in evaluation": (lambda u: F.rrelu(u, 0.1, 0.3, training=False), 0.2),
}


@pytest.mark.parametrize(("activation", "slope"), SLOPED.values(), ids=SLOPED.keys())
def test_a_float64_leaky_slope_is_not_rounded_to_float32(activation, slope, device):
    """``leaky_relu(u, s) ** 2 = s^2 u^2`` for u < 0: its Hessian diagonal is ``2 s^2`` to float64
    rounding (the slope was made a float32 tensor first: 1e-8 relative off)."""
    x = -torch.tensor([[1.0, 2.0]], dtype=torch.float64, device=device)
    got = pyhvp.hessian_diagonal(lambda y: activation(y).pow(2).sum(-1), x)
    torch.testing.assert_close(got, torch.full_like(x, 2 * slope**2), rtol=1e-15, atol=0)


def test_a_float64_hardswish_curvature_is_not_rounded_to_float32(device):
    """Inside (-3, 3) hardswish is ``u (u + 3) / 6``: curvature exactly 1/3 (a float32 1/3
    was 1e-8 relative off, a hundred times the float64 contract)."""
    x = torch.linspace(-2.5, 2.5, 5, dtype=torch.float64, device=device)[:, None]
    got = pyhvp.hessian_diagonal(lambda y: F.hardswish(y).sum(-1), x)
    torch.testing.assert_close(got, torch.full_like(x, 1 / 3), rtol=1e-15, atol=0)


KINKED_AT_0 = {
    "elu": F.elu,
    "selu": F.selu,
    "celu(u, 2)": lambda u: F.celu(u, 2.0),
    "elu, in place": lambda u: F.elu(u.clone(), inplace=True),
    "relu ** 2": lambda u: F.relu(u) ** 2,
    "hardtanh ** 2": lambda u: F.hardtanh(u) ** 2,
}
"""Activations with a kink at 0, where autograd's derivatives follow a convention: ``elu``'s
second derivative there is 0 (``elu_double_backward`` masks ``u < 0``), not its exponential
side's ``alpha * scale * input_scale ** 2`` (which the engine gave: 1 for elu, 1.76 for selu)."""


@pytest.mark.parametrize("activation", KINKED_AT_0.values(), ids=KINKED_AT_0.keys())
@pytest.mark.parametrize("order", [2, 3, 4])
def test_an_activation_at_its_kink_has_autograds_derivatives_there(activation, order, device):
    x = torch.tensor([[0.0, 0.0, 1.5, -0.5]], dtype=torch.float64, device=device)
    v = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64, device=device)

    def f(u):
        return activation(u).sum(-1)

    got = pyhvp.directional_derivatives(f, x, v, order=order)
    torch.testing.assert_close(
        got.cpu(), nested_directional_derivatives(f, x.cpu(), v.cpu(), order)
    )


KINKED_ELSEWHERE = {
    "hardswish at -3 and 3": (F.hardswish, [-3.0, 3.0, 1.0, -4.0]),
    "softplus(u, threshold=1) at 1": (lambda u: F.softplus(u, threshold=1.0), [1.0, 0.5, 2.0]),
}
"""Kinks away from 0: torch's derivatives there (torch 2.13-2.14, autograd's and torch.func's
alike) are the outer side's -- hardswish's slope 0 at -3 and 1 at 3, curvature 0 at both, where
its decomposition gave -1/2, 3/2 and 1/3 -- and softplus's curvature 0 at its threshold (s')."""


@pytest.mark.parametrize(("activation", "at"), KINKED_ELSEWHERE.values(), ids=KINKED_ELSEWHERE)
@pytest.mark.parametrize("order", [1, 2])  # (autograd's third derivative of hardswish: none)
def test_an_activation_at_a_kink_away_from_0_has_torchs_derivatives_there(activation, at, order):
    if order == 1 and torch.__version__ < "2.6":
        pytest.skip("torch 2.5's hardswish slope at -3 and 3 is the inner side's")
    x = torch.tensor([at], dtype=torch.float64)
    v = torch.ones_like(x[0])

    def f(u):
        return activation(u).sum(-1)

    got = pyhvp.directional_derivatives(f, x, v, order=order)
    torch.testing.assert_close(got, nested_directional_derivatives(f, x, v, order))


# --- what the engine cannot carry is refused, naming the op ------------------------------------


SMOOTH_WITH_KINKED_DECOMPOSITIONS = {
    "logsigmoid": lambda u: F.logsigmoid(u),
    "multilabel_soft_margin_loss": lambda u: F.multilabel_soft_margin_loss(
        u, torch.ones_like(u), reduction="none")[..., None],
    "huber_loss": lambda u: F.huber_loss(u, torch.zeros_like(u), reduction="none", delta=0.5),
    "huber_loss, mean": lambda u: torch.stack(
        [F.huber_loss(row, torch.zeros_like(row), delta=0.5) for row in u])[..., None],
    "smooth_l1_loss": lambda u: F.smooth_l1_loss(
        u, torch.zeros_like(u), reduction="none", beta=0.5),
}  # fmt: skip
"""Functions smooth at 0 that torch decomposes with kinks there (``min(0, x) - log1p(exp(-|x|))``,
``|d| ** 2``): each kink's zero convention made their second derivative at 0 zero (-1/4, 1)."""


@pytest.mark.parametrize("g", SMOOTH_WITH_KINKED_DECOMPOSITIONS.values(),
                         ids=SMOOTH_WITH_KINKED_DECOMPOSITIONS.keys())  # fmt: skip
def test_a_function_smooth_at_0_has_autograds_derivatives_there(g, device):
    """Entries at 0, at the quadratic zone's edges (+-0.5) and beyond: autograd's derivatives,
    a kink's convention included."""
    x = torch.tensor([[0.0, 0.5, -0.5], [0.0, 2.0, -0.25]], dtype=torch.float64, device=device)

    def f(u):
        return g(u).sum(-1)

    got = (pyhvp.hessian_diagonal(f, x), pyhvp.laplacian(f, x))
    diagonal = instance_hessian_diagonal(f, x)
    torch.testing.assert_close(got, (diagonal, diagonal.sum(-1)))


def test_an_op_autograd_cannot_differentiate_is_refused_naming_it():
    """Issue 16 item 6: heaviside raised autograd's RuntimeError from deep inside the engine."""
    x = torch.randn(3, 4)
    step = torch.tensor(0.5)
    with pytest.raises(pyhvp.UnsupportedOpError, match=r"aten\.heaviside.*register_jet_rule"):
        pyhvp.laplacian(lambda y: (torch.heaviside(y, step) * y**2).sum(-1), x)


def _pooled(x):
    """``adaptive_max_pool1d`` has no rule: the dense fallback over the whole batch (one
    instance) of 8 inputs and 3 outputs per row."""
    return F.adaptive_max_pool1d(torch.sin(x)[:, None], 3).pow(3).sum((-2, -1))


def test_a_fallback_whose_hessian_computation_outgrows_the_limit_is_refused_before_it_runs():
    """20 rows: the Hessian holds 160^2 * 60 = 1.5 M numbers, which the check counted, but
    autograd's double backward under jacrev of jacrev holds (60 * 160)^2 = 92 M at once, over the
    limit of 2^26 (it took 0.9 GB at 16 rows, 9.8 GB at 32, and asked for 34 GB at 64)."""
    x = torch.randn(20, 8, dtype=torch.float64)
    with pytest.raises(pyhvp.UnsupportedOpError, match=r"adaptive_max_pool2d.*over the limit"):
        pyhvp.laplacian(_pooled, x)


def test_a_fallback_within_the_limit_gives_autograd_s_derivatives(device):
    x = torch.randn(4, 8, dtype=torch.float64, device=device)
    torch.testing.assert_close(pyhvp.laplacian(_pooled, x), instance_laplacian(_pooled, x))


# --- Python floats: lifted into program inputs, not keyed by value -----------------------------

LIFTED_FLOATS = {  # f(x, t) with a float t that may change at every call (a time step)
    "exp(-t |x|^2)": lambda x, t: torch.exp(-t * (x**2).sum(-1)),
    "sin(t x) / t": lambda x, t: (torch.sin(t * x) / t).sum(-1),
    "tanh(x - t) + t": lambda x, t: (torch.tanh(x - t) + t).sum(-1),
    "(t - x)^3": lambda x, t: (torch.rsub(x, t) ** 3).sum(-1),
    "where(x > 0, x^3, t)": lambda x, t: torch.where(x > 0, x**3, t).sum(-1),
    "aten mul.Scalar, add.Scalar": lambda x, t: (
        aten.add.Scalar(aten.mul.Scalar(x, t), t).pow(2).sum(-1)
    ),
}
TIME_STEPS = (0.3, 1.7, -0.4, 0.3)


@pytest.fixture
def builds(monkeypatch):
    """``{"programs": n, "kernels": n}`` built during the test, from an empty program cache."""
    counts = {"programs": 0, "kernels": 0}

    def counting(name, build):
        def counted(*args, **kwargs):
            counts[name] += 1
            return build(*args, **kwargs)

        return counted

    monkeypatch.setattr(program, "_PROGRAMS", OrderedDict())
    monkeypatch.setattr(program, "_functional_graph",
                        counting("programs", program._functional_graph))  # fmt: skip
    monkeypatch.setattr(program, "build_kernel", counting("kernels", program.build_kernel))
    return counts


@pytest.mark.parametrize("f", LIFTED_FLOATS.values(), ids=LIFTED_FLOATS.keys())
def test_a_float_that_changes_every_call_reuses_one_program_with_each_calls_value(
    f, builds, device
):
    """Issue 17: a time step or annealed coefficient rebuilt the program and its kernel at every
    call (67 ms instead of 2). The float operand of + - * / and where is an input of the program:
    one program and one kernel serve every value, and each call gets its own value's result."""
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    for t in TIME_STEPS:
        value, _, lap = pyhvp.grad_and_laplacian(lambda y, t=t: f(y, t), x)
        torch.testing.assert_close(value, f(x, t))
        torch.testing.assert_close(lap, instance_laplacian(lambda y, t=t: f(y, t), x))
        torch.testing.assert_close(pyhvp.hessian_diagonal(lambda y, t=t: f(y, t), x),
                                   instance_hessian_diagonal(lambda y, t=t: f(y, t), x))  # fmt: skip
    assert builds == {"programs": 1, "kernels": 2}  # collapsed and per-direction


def _int_times_float(x, t):
    return (torch.arange(1, 4, device=x.device) * t * x**2).sum(-1)


def _zero_dim_times_float(x, t):  # the 0-d product's dtype shows once it is broadcast
    return (x**2 * (torch.tensor(2.0, device=x.device) * t).expand(3)).sum(-1)


def _zero_dim_int_times_float(x, t):
    return (x**2 * (torch.tensor(2, device=x.device) * t).expand(3)).sum(-1)


PROMOTIONS = {  # (f, x's dtype, default dtype): a lifted float promotes as the float itself
    "float32 x": (lambda x, t: (t * x**2).sum(-1), torch.float32, torch.float32),
    "float64 x": (lambda x, t: (t * x**2).sum(-1), torch.float64, torch.float32),
    "int tensor * float": (_int_times_float, torch.float32, torch.float32),
    "int tensor * float, default float64": (_int_times_float, torch.float32, torch.float64),
    "0-d float32 * float": (_zero_dim_times_float, torch.float32, torch.float32),
    "0-d int * float": (_zero_dim_int_times_float, torch.float32, torch.float32),
    "0-d int * float, default float64": (_zero_dim_int_times_float, torch.float32, torch.float64),
}


@pytest.mark.parametrize(("f", "dtype", "default"), PROMOTIONS.values(), ids=PROMOTIONS.keys())
def test_a_lifted_float_promotes_as_the_python_float_does(f, dtype, default, device):
    x = torch.randn(4, 3, dtype=dtype, device=device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        expected = f(x, 0.7)
        value, _, lap = pyhvp.grad_and_laplacian(lambda y: f(y, 0.7), x)
    finally:
        torch.set_default_dtype(previous)
    assert (value.dtype, lap.dtype) == (expected.dtype, x.dtype)  # the Laplacian: x's (issue 29)
    torch.testing.assert_close(value, expected, rtol=0, atol=0)
    exact = {"rtol": 1e-5, "atol": 1e-5} if torch.float32 in (expected.dtype, lap.dtype) else {}
    torch.testing.assert_close(lap.double(), instance_laplacian(lambda y: f(y, 0.7), x), **exact)


def test_a_value_dependent_scalar_keeps_a_program_per_value(builds):
    """A power's exponent stays in the key: its rule branches on the value (u^2, u^1, u^0)."""
    x = torch.randn(5, 3, dtype=torch.float64)
    for p in (2.0, 1.0, 0.0, 3.5, 2.0):
        lap = pyhvp.laplacian(lambda y, p=p: (y.abs() + 1).pow(p).sum(-1), x)
        torch.testing.assert_close(
            lap, instance_laplacian(lambda y, p=p: (y.abs() + 1).pow(p).sum(-1), x)
        )
    assert builds["programs"] == 4


def test_gradients_through_a_laplacian_with_a_lifted_float_match_autograd(builds, device):
    w = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)

    def f(y, w, t):
        return torch.exp(-t * torch.tanh(y @ w).pow(2).sum(-1))

    for t in (0.5, 1.5):
        lap = pyhvp.laplacian(lambda y, w, t=t: f(y, w, t), x, w)
        (grad,) = torch.autograd.grad(lap.sum(), w)
        dense = instance_laplacian(lambda y, w, t=t: f(y, w, t), x, w)
        (expected,) = torch.autograd.grad(dense.sum(), w)
        torch.testing.assert_close(lap, dense.detach())
        torch.testing.assert_close(grad, expected)
    assert builds["programs"] == 1


@pytest.mark.slow
def test_a_float_that_changes_every_call_compiles_once(builds, compiled):
    """Under compile=True a new value recompiled (a new program, a new kernel); the compile key
    is the kernel and the inputs' shapes and dtypes, never the lifted value."""
    x = torch.randn(5, 3, dtype=torch.float64)
    backend = pyhvp.TorchBackend(compile=True)
    f = LIFTED_FLOATS["exp(-t |x|^2)"]
    for t in TIME_STEPS:
        lap = pyhvp.laplacian(lambda y, t=t: f(y, t), x, backend=backend)
        torch.testing.assert_close(lap, instance_laplacian(lambda y, t=t: f(y, t), x))
    assert len(compiled) == 1
    assert builds == {"programs": 1, "kernels": 1}


# --- random ops: the kernel uses the draw f made, never a draw of its own ----------------------


def _seeded_weights(x):
    """A weight drawn from a generator seeded inside f: the same draw at every call of f."""
    g = torch.Generator(device=x.device).manual_seed(3)
    return torch.randn(x.shape[-1], generator=g, dtype=x.dtype, device=x.device)


def _in_place_draw(x):
    return torch.empty(x.shape[-1], dtype=x.dtype, device=x.device).uniform_(-1, 1)


RANDOM_DRAWS = {  # f(x) = sum((w x)^2) with a random w, or dropout(sin x)
    "randn with a generator seeded in f": _seeded_weights,
    "randn from the global generator": lambda x: torch.randn_like(x[0]),
    "uniform_ into a fresh tensor": _in_place_draw,
    "rand_like of x": lambda x: torch.rand_like(x),
    "dropout": None,
}


@pytest.mark.parametrize("draw", RANDOM_DRAWS.values(), ids=RANDOM_DRAWS.keys())
def test_a_random_draw_in_f_is_the_one_f_made(draw, builds, device):
    """A random op in f is drawn once, by f: the value, gradient and Laplacian are those of f with
    that draw (the kernel used to draw again: another sample, or a seeded generator advanced
    twice -- 5.30 instead of 2.12), and the global generator advances as in one call of f. A new
    draw at every call reuses one program."""
    x = torch.randn(4, 5, dtype=torch.float64, device=device)
    for seed in (0, 1):
        torch.manual_seed(seed)
        if draw is None:
            value, grad, lap = pyhvp.grad_and_laplacian(
                lambda y: F.dropout(torch.sin(y), 0.5, training=True).sum(-1), x
            )
            torch.manual_seed(seed)
            kept = F.dropout(torch.ones_like(x), 0.5, training=True)
            expected = (torch.sin(x) * kept).sum(-1), torch.cos(x) * kept, -value
        else:
            value, grad, lap = pyhvp.grad_and_laplacian(lambda y: ((draw(y) * y) ** 2).sum(-1), x)
            torch.manual_seed(seed)
            w = draw(x)
            expected = ((w * x) ** 2).sum(-1), 2 * w**2 * x, 2 * (w**2).sum(-1).expand(4)
        after = torch.randn(())  # the global generator moved on as in one call of f
        torch.manual_seed(seed)
        draw(x) if draw is not None else F.dropout(x, 0.5, training=True)
        torch.testing.assert_close((value, grad, lap, after), (*expected, torch.randn(())))
    assert builds["programs"] == 1


RANDOM_OPS_OF_X = {  # random ops of x: f's draw, autograd's derivatives
    "normal(mean=sin x, std=0.5)": lambda y: torch.normal(torch.sin(y), 0.5).sum(-1),
    "normal(mean=0.3, std=exp x)": lambda y: torch.normal(0.3, torch.exp(y)).sum(-1),
    "normal(mean=x^2, std=exp x/2)": lambda y: torch.normal(y**2, torch.exp(y / 2)).sum(-1),
    "rrelu, training": lambda y: F.rrelu(2 * torch.sin(y), training=True).pow(2).sum(-1),
    "rrelu, evaluation": lambda y: F.rrelu(2 * torch.sin(y), training=False).pow(2).sum(-1),
}


@pytest.mark.parametrize("f", RANDOM_OPS_OF_X.values(), ids=RANDOM_OPS_OF_X.keys())
def test_a_random_op_of_x_has_autograd_s_derivatives_at_f_s_draw(f, device):
    """As autograd has them: normal's draw is constant in its mean and std (zero derivatives, not
    a reparametrisation), RReLU is x * (f's slopes) in training: value, gradient and Laplacian
    equal autograd's on one call of f with the same seed."""
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    for seed in (0, 1):
        torch.manual_seed(seed)
        got = pyhvp.grad_and_laplacian(f, x)
        torch.manual_seed(seed)
        leaf = x.clone().requires_grad_()
        value = f(leaf)
        (grad,) = torch.autograd.grad(value.sum(), leaf, create_graph=True)
        lap = sum(torch.autograd.grad(grad[:, i].sum(), leaf, retain_graph=True)[0][:, i]
                  for i in range(3))  # fmt: skip
        torch.testing.assert_close(got, (value, grad, lap))


def test_a_random_op_that_varies_with_f_s_tensors_is_refused_naming_it(device):
    x = torch.randn(3, 2, dtype=torch.float64, device=device)
    gamma = torch.distributions.Gamma
    with pytest.raises(pyhvp.UnsupportedOpError, match=r"aten._standard_gamma.*randn_like"):
        pyhvp.laplacian(lambda y: gamma(torch.exp(y), 1.0).rsample().sum(-1), x)


NOT_DIFFERENTIATED_BY_TORCH = {
    "special.bessel_j0": lambda x: torch.special.bessel_j0(x).sum(-1),
    "special.airy_ai": lambda x: torch.special.airy_ai(x).sum(-1),
    "special.modified_bessel_k1, with a differentiable term": lambda x: (
        torch.special.modified_bessel_k1(x + 2) + x**2
    ).sum(-1),
    "special.legendre_polynomial_p(x, 3)": lambda x: torch.special.legendre_polynomial_p(x, 3).sum(
        -1
    ),
}


@pytest.mark.parametrize("operator", [pyhvp.laplacian, pyhvp.hessian_diagonal, pyhvp.bilaplacian])
@pytest.mark.parametrize(
    "f", NOT_DIFFERENTIATED_BY_TORCH.values(), ids=NOT_DIFFERENTIATED_BY_TORCH.keys()
)
def test_an_op_torch_does_not_differentiate_is_refused_by_name(f, operator):
    """torch marks these non-differentiable: their outputs carry no gradient and torch.func
    takes their derivatives as zeros, which the engine returned (the Laplacian of
    legendre_polynomial_p(x, 3): 0 for 15 x)."""
    x = torch.tensor([[0.3, 0.7]], dtype=torch.float64)
    with pytest.raises(
        pyhvp.UnsupportedOpError, match=r"torch does not differentiate aten\.special_"
    ):
        operator(f, x)


def test_forward_mode_inside_f_along_an_expanded_direction_is_exact():
    """torch.func.jvp inside f along a direction laid out unlike its primal (an expanded basis
    vector) records make_dual's aten._new_zeros_with_same_feature_meta, which was refused as an
    op torch does not differentiate (its output is zeros: a constant, like new_zeros)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    w = torch.randn(4, 3, generator=g, dtype=torch.float64)
    u = lambda y: torch.tanh(y @ w.T).pow(3).sum(-1) + y.prod(-1)  # noqa: E731

    def f(y):  # |grad u|^2 by forward mode, one expanded basis direction at a time
        return sum(torch.func.jvp(u, (y,), (torch.eye(3, dtype=y.dtype)[i].expand_as(y),))[1] ** 2
                   for i in range(3))  # fmt: skip

    dense = torch.func.vmap(torch.func.hessian(lambda z: f(z[None])[0]))(x)
    diagonal = torch.diagonal(dense, dim1=-2, dim2=-1)
    torch.testing.assert_close(pyhvp.laplacian(f, x), diagonal.sum(-1))
    torch.testing.assert_close(pyhvp.hessian_diagonal(f, x), diagonal)


def test_the_refusal_of_autograd_inside_f_recommends_only_what_the_engine_takes():
    """The refusal said "use torch.func.grad (or torch.func.vjp, jacrev)": torch.func.vjp's
    pullback runs autograd's backward pass, and was refused with the same message."""
    x = torch.randn(4, 3, dtype=torch.float64)
    u = lambda y: (y**3).sum(-1)  # noqa: E731

    def with_vjp(y):
        return torch.func.vjp(u, y)[1](torch.ones(y.shape[:-1], dtype=y.dtype))[0].pow(2).sum(-1)

    with pytest.raises(RuntimeError, match="autograd inside f") as refused:
        pyhvp.laplacian(with_vjp, x)
    assert "torch.func.vjp's pullback runs it too" in str(refused.value)
    advice = str(refused.value).split("Use ")[-1]
    assert "vjp" not in advice
    for transform in ("grad", "jacrev", "jacfwd"):  # what the advice names works
        gradient = getattr(torch.func, transform)

        def f(y, gradient=gradient):  # |3 y^2|^2: Laplacian 108 |y|^2
            return gradient(lambda z: u(z).sum())(y).pow(2).sum(-1)

        torch.testing.assert_close(pyhvp.laplacian(f, x), 108 * x.pow(2).sum(-1))


FOURTH_ORDER_HEAVY = {
    "svdvals": lambda y: torch.linalg.svdvals(y).sum(-1),
    "qr": lambda y: torch.linalg.qr(y).R.sum((-1, -2)),
    "lu": lambda y: torch.linalg.lu(y).U.sum((-1, -2)),
}


@pytest.mark.parametrize("f", FOURTH_ORDER_HEAVY.values(), ids=FOURTH_ORDER_HEAVY.keys())
def test_a_fourth_order_matrix_decomposition_is_refused_before_its_dense_fallback(f, monkeypatch):
    """A bi-Laplacian of two 2x2 matrices through svd, qr or lu passed 3.5 GB before an
    allocation failed (matrix_exp, which has a rule now, 12.7 GB: killed where memory is
    overcommitted). They are refused by name, before the fallback runs (which would fail this
    spec fast)."""

    def dense_fallback(*args, **kwargs):
        raise AssertionError("the dense fourth-order fallback ran")

    monkeypatch.setattr(taylor.fallbacks, "_dense_taylor", dense_fallback)
    x = torch.randn(2, 2, 2, dtype=torch.float64) + 3 * torch.eye(2, dtype=torch.float64)
    with pytest.raises(pyhvp.UnsupportedOpError, match="does not carry this one above third order"):
        pyhvp.bilaplacian(f, x, event_dims=2)
    with pytest.raises(pyhvp.UnsupportedOpError, match="does not carry this one above third order"):
        pyhvp.directional_derivatives(f, x, x, event_dims=2, order=4)


class Tagged(torch.Tensor):
    """A subclass that only tags its tensors: its ops are torch's, their results re-wrapped."""


class Overriding(torch.Tensor):
    """A subclass with a ``__torch_function__`` of its own (here torch's, but unseen as such)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


TAGGED_OPERATORS = {
    "hessian_diagonal": lambda f, x, *args: pyhvp.hessian_diagonal(f, x, *args),
    "laplacian": lambda f, x, *args: pyhvp.laplacian(f, x, *args),
    "bilaplacian": lambda f, x, *args: pyhvp.bilaplacian(f, x, *args),
    "directional_derivatives": lambda f, x, *args: pyhvp.directional_derivatives(
        f, x, torch.ones_like(x), *args, order=3
    ),
}
TAGGED_WHERE = {  # operator -> its result with a Tagged tensor there; plain tensors otherwise
    "x": lambda op, x, w: op(lambda z: (w * torch.sin(z) ** 3).sum(-1), x.as_subclass(Tagged)),
    "args": lambda op, x, w: op(
        lambda z, a: (a * torch.sin(z) ** 3).sum(-1), x, w.as_subclass(Tagged)
    ),
    "captured": lambda op, x, w: (
        lambda tagged: op(lambda z: (tagged * torch.sin(z) ** 3).sum(-1), x)
    )(w.as_subclass(Tagged)),
}


@pytest.mark.parametrize("where", TAGGED_WHERE.values(), ids=TAGGED_WHERE.keys())
@pytest.mark.parametrize("operator", TAGGED_OPERATORS.values(), ids=TAGGED_OPERATORS.keys())
def test_a_tagging_tensor_subclass_gives_the_plain_tensors_results(operator, where, device):
    """Until 2026-12-07 its re-wrapped results were new objects to the recorder: a Hessian
    diagonal of zeros, a Laplacian raising "Multiple dispatch failed"."""
    x = torch.tensor([[0.5, -1.0], [0.2, 0.7]], dtype=torch.float64, device=device)
    w = torch.tensor([1.5, -2.0], dtype=torch.float64, device=device)
    expected = operator(lambda z: (w * torch.sin(z) ** 3).sum(-1), x)
    torch.testing.assert_close(where(operator, x, w), expected, rtol=1e-12, atol=1e-12)


OPAQUE_TENSORS = {  # f's call -> the refusal (a subclass of its own ops; a sparse tensor)
    "overriding x": (
        lambda f, x, c: pyhvp.laplacian(f, x.as_subclass(Overriding)),
        TypeError,
        "x is a Overriding, a tensor subclass with its own __torch_function__",
    ),
    "overriding, captured": (
        lambda f, x, c: (lambda o: pyhvp.laplacian(lambda z: f(z) * o, x))(
            c.as_subclass(Overriding)
        ),
        pyhvp.UnsupportedOpError,
        "a tensor f captures is a Overriding",
    ),
    "sparse, captured (until 2026-12-07: 'unsupported operand type(s) for *')": (
        lambda f, x, c: (lambda s: pyhvp.laplacian(lambda z: s * f(z), x))(c.to_sparse()),
        pyhvp.UnsupportedOpError,
        "f uses a torch.sparse_coo tensor",
    ),
}


@pytest.mark.parametrize(("call", "error", "message"), OPAQUE_TENSORS.values(),
                         ids=OPAQUE_TENSORS.keys())  # fmt: skip
def test_a_tensor_whose_ops_the_engine_cannot_follow_is_refused_naming_it(call, error, message):
    x = torch.tensor([[0.5, -1.0], [0.2, 0.7]], dtype=torch.float64)
    with pytest.raises(error, match=re.escape(message)):
        call(lambda z: (z**3).sum(-1), x, torch.ones(2, dtype=torch.float64))
