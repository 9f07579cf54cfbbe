"""Specification of check_instances: it passes independent instances and names coupled ones."""

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import pyhvp


def gaussian(x, mu):
    return torch.exp(-((x - mu) ** 2).sum(-1))


def batch_norm(train):
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(3).double().train(train)
    return lambda x: (norm(x) ** 2).sum(-1)


def one_pair(x):
    """Only instance 5 reads another instance's variables (instance 1)."""
    leak = torch.zeros(x.shape[0], dtype=x.dtype).index_add(0, torch.tensor([5]), x[1:2, 0])
    return (x**2).sum(-1) + leak


def no_grad_max(x):
    with torch.no_grad():
        return x.abs().max()


def item_pair(x):
    """Only instance 5 reads another instance's variables (instance 1), through a Python float."""
    shift = torch.zeros(x.shape[0], dtype=x.dtype)
    shift[5] = x[1, 0].item()
    return (x**2).sum(-1) + shift


X = torch.randn(8, 3, dtype=torch.float64)
MU = torch.randn(3, dtype=torch.float64)
STIFF_X = torch.cat([torch.full((1, 3), 0.02, dtype=torch.float64), X[1:]])
"""Instance 0 near the singular point of a stiff potential: r^-12 is 3e17 there, about 1
elsewhere (until 2026-12-05 its magnitude set one rounding threshold for every instance, which
hid the others' couplings)."""


def stiff_plus(coupling):
    """A stiff per-instance potential r^-12 plus ``coupling(x)``."""
    return lambda x: (x**2).sum(-1) ** -6 + coupling(x)


INDEPENDENT = {
    "seed-000 layout, shared mu": (gaussian, torch.randn(2, 3, 4, 3), (torch.randn(2, 1, 1, 3),)),
    "per_instance function": (pyhvp.per_instance(lambda x: x.sum() ** 2), X, ()),
    "vector-valued": (lambda x: torch.sigmoid(x @ torch.ones(3, 5, dtype=x.dtype)), X, ()),
    "no value per instance (until 2026-12-06 an IndexError from a max over none)": (
        lambda x: x[..., :0] ** 2,
        X,
        (),
    ),
    "batch norm in eval mode": (batch_norm(train=False), X, ()),
    "event_dims=2": (lambda x: (x @ x.mT).sum((-2, -1)), torch.randn(4, 2, 3), ()),
    "constant": (lambda x: torch.ones(x.shape[:-1]), X, ()),
    "one instance": (lambda x: x.sum(-1) * x.sum(), X[:1], ()),
    "one instance at sqrt's infinite derivative (0 * inf is no leak)": (
        lambda x: torch.sqrt(x.abs()).sum(-1),
        torch.cat([torch.zeros(1, 3, dtype=torch.float64), X[1:]]),
        (),
    ),
    "one instance at log's infinite value": (
        lambda x: -torch.log(x.norm(dim=-1)),
        torch.cat([torch.zeros(1, 3, dtype=torch.float64), X[1:]]),
        (),
    ),
    "a stiff instance among others": (stiff_plus(lambda x: 0.1 * (x * x).sum(-1)), STIFF_X, ()),
    "one instance with a NaN in x (it scaled every shift: NaN everywhere)": (
        lambda x: (x**2).sum(-1),
        torch.cat([X[:2], X[2:3].clone().fill_diagonal_(torch.nan), X[3:]]),
        (),
    ),
    "one instance with an infinite x": (
        lambda x: (x**2).sum(-1),
        torch.cat([X[:2], X[2:3].clone().fill_diagonal_(torch.inf), X[3:]]),
        (),
    ),
    "dropout in training mode (each run draws from one state)": (
        lambda x: nn.functional.dropout(x, 0.5).sum(-1),
        X,
        (),
    ),
    # until 2026-12-07 (this stop's per-output scales): a weight of 1 / 1e-5 overflowed float16
    # to inf, and the identity's exact zeros made 0 * inf = NaN at other instances
    "outputs 1e5 apart through a batch identity matmul (float16)": (
        lambda x: torch.eye(8, dtype=x.dtype) @ torch.stack([100 * x[:, 0], 1e-3 * x[:, 0]], -1),
        X.half(),
        (),
    ),
    # a sparse output, which the HVPs take: the check crashed reshaping it
    "a sparse output": (lambda x: (x**2).sum(-1).to_sparse(), X, ()),
}
COUPLED = {
    "mean-centring": (lambda x: ((x - x.mean(0)) ** 2).sum(-1), X, None),
    "mean-centring, returned sparse": (
        lambda x: ((x - x.mean(0)) ** 2).sum(-1).to_sparse(),
        X,
        None,
    ),
    "mean-centring by a detached mean, returned sparse": (
        lambda x: ((x - x.mean(0).detach()) ** 2).sum(-1).to_sparse(),
        X,
        None,
    ),
    "batch norm in training mode": (batch_norm(train=True), X, None),
    "sum over instances, expanded": (lambda x: (x**3).sum().expand(x.shape[0]), X, None),
    "cumulative sum along a middle batch dim": (
        lambda x: x.cumsum(1).sum(-1),
        torch.randn(2, 3, 4, 3),
        None,
    ),
    "one pair: 1 -> 5": (one_pair, X, ((5,), (1,))),
    "mean-centring by a detached mean": (
        lambda x: ((x - x.mean(0).detach()) ** 2).sum(-1),
        X,
        None,
    ),
    "scaled by a maximum taken under no_grad": (lambda x: x.sum(-1) / no_grad_max(x), X, None),
    "one pair through .item(): 1 -> 5": (item_pair, X, ((5,), (1,))),
    "mean-centring, next to an infinite own gradient": (
        lambda x: torch.sqrt(x.abs()).sum(-1) + (x - x.mean(0)).sum(-1) ** 2,
        torch.cat([torch.zeros(1, 3, dtype=torch.float64), X[1:]]),
        None,
    ),
    "mean-field coupling next to a stiff instance": (
        stiff_plus(lambda x: 0.1 * (x * x.mean(0)).sum(-1)),
        STIFF_X,
        None,
    ),
    "detached mean-field coupling next to a stiff instance": (
        stiff_plus(lambda x: 0.1 * (x * x.mean(0).detach()).sum(-1)),
        STIFF_X,
        None,
    ),
    "mean-centring by a detached mean, next to a NaN in x": (
        lambda x: ((x - x[:, 1:].mean(0).detach().sum()) ** 2).sum(-1),
        torch.cat([X[:2], X[2:3].clone().fill_diagonal_(torch.nan), X[3:]]),
        None,
    ),
    "mean-centring, next to a NaN in x (it reaches every value: no derivative can be read)": (
        lambda x: ((x - x.mean(0)) ** 2).sum(-1),
        torch.cat([X[:2], X[2:3].clone().fill_diagonal_(torch.nan), X[3:]]),
        ((1,), (2,)),
    ),
    # until 2026-12-07 rounding was judged per instance: a stiff output or entry of x hid a
    # coupling in another (its per-instance Hessian diagonal then read 0 for 1.39)
    "mean-centring in one output, beside a stiff one (float32)": (
        lambda x: torch.stack([1e6 * (x**2).sum(-1), (x[:, 0] - x[:, 0].mean()) ** 2], -1),
        X.float(),
        None,
    ),
    "mean-centring by a detached mean in one output, beside a stiff one (float32)": (
        lambda x: torch.stack([1e6 * (x**2).sum(-1), (x[:, 0] - x[:, 0].mean().detach()) ** 2], -1),
        X.float(),
        None,
    ),
    "mean-centring through x0, beside a stiff x1 (float32)": (
        lambda x: 1e8 * x[:, 1] ** 2 + (x[:, 0] - x[:, 0].mean()) ** 2,
        X.float(),
        None,
    ),
    "mean-centring by a detached mean, next to an infinite own value": (
        lambda x: ((x - x.mean(0).detach()) ** 2).sum(-1) - torch.log(x.norm(dim=-1)),
        torch.cat([torch.zeros(1, 3, dtype=torch.float64), X[1:]]),
        None,
    ),
}


@pytest.mark.parametrize(("f", "x", "args"), INDEPENDENT.values(), ids=INDEPENDENT.keys())
def test_independent_instances_pass(f, x, args):
    event_dims = 2 if x.ndim == 3 and x.shape[-2:] == (2, 3) else 1
    assert pyhvp.check_instances(f, x, *args, event_dims=event_dims) is None


@pytest.mark.parametrize(("f", "x", "pair"), COUPLED.values(), ids=COUPLED.keys())
def test_coupled_instances_are_named(f, x, pair):
    with pytest.raises(pyhvp.InstanceCouplingError, match="f couples instances") as info:
        pyhvp.check_instances(f, x)
    if pair is not None:
        receiver, source = pair
        assert f"instance {receiver} depends on x at instance {source}" in str(info.value)


def test_a_coupling_without_derivatives_is_named_as_such():
    with pytest.raises(pyhvp.InstanceCouplingError, match="carries no derivative"):
        pyhvp.check_instances(COUPLED["mean-centring by a detached mean"][0], X)


def test_a_coupling_whose_derivatives_vanish_at_x_is_not_called_a_detach():
    """Mean-centring with every instance at one point: no first derivative couples there, the
    values (and the Hessian) do; until 2026-12-05 the message blamed a detach f does not have."""
    with pytest.raises(pyhvp.InstanceCouplingError, match="first derivatives that vanish"):
        pyhvp.check_instances(COUPLED["mean-centring"][0], torch.zeros(6, 3, dtype=torch.float64))


def spectral_norm_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(3, 6)), nn.Tanh(), nn.Linear(6, 1)
    ).double()


def test_a_detached_coupling_is_seen_where_every_run_updates_a_buffer():
    """``spectral_norm`` in training updates its power iteration's vectors at every run: until
    2026-12-06 each run of the check was another function, the values part judged f random and
    skipped, and this coupling through a detached mean passed."""
    net = spectral_norm_net()
    with pytest.raises(pyhvp.InstanceCouplingError, match="carries no derivative"):
        pyhvp.check_instances(lambda x: net(x - x.mean(0).detach())[..., 0], X)


def test_the_check_leaves_the_buffers_f_updates_as_it_found_them():
    """Until 2026-12-06 the check left them as its ninth run did, at shifted x's."""
    net, untouched = spectral_norm_net(), spectral_norm_net()
    pyhvp.check_instances(lambda x: net(x)[..., 0], X)
    assert torch.equal(net.state_dict()["0.parametrizations.weight.0._u"],
                       untouched.state_dict()["0.parametrizations.weight.0._u"])  # fmt: skip


def test_a_function_compiled_by_torch_compile_is_checked_without_a_warning():
    """The first run notes what f writes under a mode of pyhvp's, which dynamo would trace
    into a compiled f (``Dynamo does not know how to trace the builtin ...``)."""
    compiled = torch.compile(lambda x: (x.sin() ** 2).sum(-1), backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pyhvp.check_instances(compiled, X) is None


def test_a_function_drawing_from_a_generator_of_its_own_is_judged_by_derivatives_alone():
    """Two runs from one random state differ: values cannot tell a coupling from a new draw."""
    own = torch.Generator().manual_seed(0)

    def noisy_and_detached(x):
        noise = torch.rand(x.shape, generator=own, dtype=x.dtype)
        return (x + noise - x.mean(0).detach()).sum(-1)

    assert pyhvp.check_instances(noisy_and_detached, X) is None


@pytest.mark.parametrize("made_inside", [True, False], ids=["inference tensor", "normal tensor"])
def test_inference_mode_changes_nothing(made_inside):
    f = COUPLED["mean-centring"][0]
    with torch.inference_mode():
        x = X.clone() if made_inside else X
        with pytest.raises(pyhvp.InstanceCouplingError):
            pyhvp.check_instances(f, x)
        assert pyhvp.check_instances(INDEPENDENT["vector-valued"][0], x) is None


def test_an_arg_made_in_inference_mode_is_taken_as_the_operators_take_it():
    """The operators clone inference tensors in ``args``; the check did not, and raised
    autograd's "Inference tensors cannot be saved for backward" on a function they accept."""
    with torch.inference_mode():
        w = torch.randn(X.shape[-1], dtype=X.dtype)
    assert pyhvp.check_instances(lambda x, w: ((x * w) ** 3).sum(-1), X, w) is None
    with pytest.raises(pyhvp.InstanceCouplingError):
        pyhvp.check_instances(lambda x, w: (((x - x.mean(0)) * w) ** 2).sum(-1), X, w)


def test_a_coupling_is_caught_in_float32_at_a_large_batch():
    """The mean's share of one instance is 1/B, but the probe moves half the batch at once."""
    x = torch.randn(100_000, 2)
    with pytest.raises(pyhvp.InstanceCouplingError):
        pyhvp.check_instances(lambda x: ((x - x.mean(0)) ** 2).sum(-1), x)


BAD = {
    "f drops the batch": (lambda: pyhvp.check_instances(lambda x: x.sum(), X), ValueError,
                          "batch_shape = (8,)"),
    "f not callable": (lambda: pyhvp.check_instances(3, X), TypeError, "f must be a Python function"),
    "generator not a Generator": (lambda: pyhvp.check_instances(torch.sin, X, generator=3),
                                  TypeError, "generator must be a torch.Generator"),
    "x not floating": (lambda: pyhvp.check_instances(torch.sin, X.long()), TypeError, "x"),
    "a NumPy arg": (lambda: pyhvp.check_instances(lambda x, m: (x - m).sum(-1), X,
                                                  np.zeros(X.shape[-1])),
                    TypeError, "args[0] must be a torch.Tensor, got a numpy"),
    "an arg of another dtype": (lambda: pyhvp.check_instances(lambda x, m: (x - m).sum(-1), X,
                                                              torch.zeros(X.shape[-1]).float()),
                                ValueError, "args[0] must have x's dtype"),
    # a check on values with autograd's passes: torch's requires_grad_() error before
    "inside vmap": (lambda: torch.func.vmap(lambda x: pyhvp.check_instances(torch.sin, x))(
        X[None]), ValueError, "check_instances cannot run inside a torch.func transform"),
    "inside grad": (lambda: torch.func.grad(lambda x: (pyhvp.check_instances(torch.sin, x),
                                                       x.sum())[1])(X),
                    ValueError, "check_instances cannot run inside a torch.func transform"),
}  # fmt: skip


@pytest.mark.parametrize(("call", "error", "text"), BAD.values(), ids=BAD.keys())
def test_bad_input_is_refused_naming_it(call, error, text):
    with pytest.raises(error, match=re.escape(text)):
        call()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_a_coupling_as_strong_as_the_own_dependence_is_caught_in_half_precision(dtype, seed):
    """Until 2026-12-06 a leak was rounding below 64 ulps of the largest derivative: 50% of it in
    bfloat16 (6% in float16), so instance 5 reading x[1] as strongly as its own x passed."""
    with pytest.raises(
        pyhvp.InstanceCouplingError, match=re.escape("(5,) depends on x at instance (1,)")
    ):
        pyhvp.check_instances(one_pair, X.to(dtype), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(4))
def test_an_instance_with_a_tiny_gradient_is_no_leak_in_float16(seed):
    """The README's Gaussian with one particle far from its centre: its own gradient (about 1e-5)
    is below float16's 2^-16, its weight 1 / gradient overflowed, and inf * 0 = NaN in the
    cotangent of an instance outside the receivers read as a leak (until 2026-12-06)."""
    x = X.to(torch.float16).clone()
    x[0] = torch.tensor([2.2, 2.2, 2.2])  # |x - mu|^2 about 15 from mu = 0: f about 3e-7
    assert pyhvp.check_instances(gaussian, x, torch.zeros(3, dtype=torch.float16),
                                 generator=torch.Generator().manual_seed(seed)) is None  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "name", ["one pair through .item(): 1 -> 5", "scaled by a maximum taken under no_grad"]
)
def test_a_coupling_through_values_is_caught_in_bfloat16(name, seed):
    """Values changed within 64 ulps were rounding: 50% of (1 + |f|) in bfloat16 (until
    2026-12-06), so instance 5 reading x[1] through .item() passed. Now a change beyond 2^-4 of
    (1 + |f|) is a coupling: one below it still passes (in 2-3% of random batches of these two
    functions), so the batch is drawn from a generator of its own, not from the global one,
    whose state at import depends on which test modules were imported first."""
    f, _, _ = COUPLED[name]
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with pytest.raises(pyhvp.InstanceCouplingError, match="carries no derivative"):
        pyhvp.check_instances(
            f, x.to(torch.bfloat16), generator=torch.Generator().manual_seed(seed)
        )


def test_a_statistic_added_and_taken_away_is_no_coupling_in_half_precision():
    """Rounding of a batch mean that cancels changes the values by a few ulps: no coupling."""
    for dtype in (torch.bfloat16, torch.float16):
        for seed in range(4):
            x = torch.randn(16, 3, generator=torch.Generator().manual_seed(seed)).to(dtype)
            f = lambda x: ((x - x.mean(0) + x.mean(0)) ** 2).sum(-1)  # noqa: E731
            assert (
                pyhvp.check_instances(f, x, generator=torch.Generator().manual_seed(seed)) is None
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e-6, 1e-10, 1e-16])
def test_a_coupling_through_values_of_a_small_f_is_caught(scale, dtype):
    """The values pass judged a change against 1 + |f|: a detached batch mean in an f whose
    values are 1e-6 (float32) or 1e-16 (float64) passed as rounding (until 2026-12-06)."""
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    f = lambda x: scale * ((x - x.mean(0).detach()) ** 2).sum(-1)  # noqa: E731
    with pytest.raises(pyhvp.InstanceCouplingError, match="carries no derivative"):
        pyhvp.check_instances(f, x, generator=torch.Generator().manual_seed(0))
