"""Dynamo's guards in place of the per-call record (issue 17): a program is reused while the
guards on ``f`` hold, and never once anything ``f``'s result depends on has changed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from dense import instance_hessian_diagonal, instance_laplacian
from torch import nn

import pyhvp
from pyhvp.taylor import guards, program

GUARDED = pyhvp.TorchBackend(compile=False, guards=True)
RECORDED = pyhvp.TorchBackend(compile=False, guards=False)


@pytest.fixture
def records(monkeypatch):
    """How many times ``f`` (or the graph dynamo traced) has been recorded so far."""
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return record(*args, **kwargs)

    record = program.record
    monkeypatch.setattr(program, "record", counted)
    monkeypatch.setattr(guards, "record", counted)
    return count


class Branchy(nn.Module):
    """Takes another branch in evaluation mode."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 1)

    def forward(self, x):
        y = self.inner(torch.tanh(x)).squeeze(-1)
        return y**3 if self.training else torch.sin(y)


def _net(device):
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double().to(device)


def parameter_updated_in_place(device):
    net = _net(device)

    def change():
        with torch.no_grad():
            net[0].weight.mul_(2)

    return lambda x: net(x).squeeze(-1), change


def parameter_replaced(device):
    net = _net(device)

    def change():
        net[0].weight = nn.Parameter(torch.randn(8, 3, dtype=torch.float64, device=device))

    return lambda x: net(x).squeeze(-1), change


def module_switched_to_evaluation(device):
    net = Branchy().double().to(device)
    return net, lambda: net.train(False)


def python_state_changed(device):
    state = {"power": 3}

    def change():
        state["power"] = 4

    return lambda x: (torch.tanh(x) ** state["power"]).sum(-1), change


def float_in_a_closure_changed(device):
    width = [0.5]

    def change():
        width[0] = 1.5

    return lambda x: torch.exp(-width[0] * (x**2).sum(-1)), change


def closed_over_tensor_replaced(device):
    centre = {"mu": torch.zeros(3, dtype=torch.float64, device=device)}

    def change():
        centre["mu"] = torch.ones(3, dtype=torch.float64, device=device)

    return lambda x: torch.exp(-((x - centre["mu"]) ** 2)).sum(-1), change


def forward_hook_registered(device):
    net = _net(device)
    return lambda x: net(x).squeeze(-1), lambda: net[0].register_forward_hook(
        lambda module, inputs, out: 3 * out
    )


def forward_pre_hook_registered(device):
    net = _net(device)
    return lambda x: net(x).squeeze(-1), lambda: net[0].register_forward_pre_hook(
        lambda module, inputs: (2 * inputs[0],)
    )


def class_forward_patched(device):
    class Cubed(nn.Module):  # a class per call: the patch stays with it
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 1)

        def forward(self, x):
            return self.inner(torch.tanh(x)).squeeze(-1) ** 3

    def change():
        Cubed.forward = lambda self, x: torch.sin(self.inner(x).squeeze(-1))

    return Cubed().double().to(device), change


CHANGES = {  # f, and a change between calls that its result depends on
    "a parameter updated in place": parameter_updated_in_place,
    "a parameter replaced": parameter_replaced,
    "a module switched to evaluation (another branch)": module_switched_to_evaluation,
    "an int in Python state changed": python_state_changed,
    "a float in a closure changed": float_in_a_closure_changed,
    "a closed-over tensor replaced": closed_over_tensor_replaced,
    "a forward hook registered": forward_hook_registered,
    "a forward pre-hook registered": forward_pre_hook_registered,
    "a module's class given another forward": class_forward_patched,
}


@pytest.mark.parametrize("make", CHANGES.values(), ids=CHANGES.keys())
def test_a_change_f_depends_on_is_seen_at_the_next_call(make, device):
    f, change = make(device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    for _ in range(2):  # traced, then reused
        pyhvp.laplacian(f, x, backend=GUARDED)
    change()
    torch.testing.assert_close(pyhvp.laplacian(f, x, backend=GUARDED), instance_laplacian(f, x))


@pytest.mark.parametrize("make", CHANGES.values(), ids=CHANGES.keys())
def test_a_call_whose_guards_hold_is_not_recorded(make, records, device):
    """What the route is for: after the call dynamo traced (which records f and dynamo's graph,
    and checks that both give one program), f is neither run nor recorded."""
    f, _ = make(device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    pyhvp.laplacian(f, x, backend=GUARDED)
    traced = records[0]
    for _ in range(3):
        pyhvp.hessian_diagonal(f, x, backend=GUARDED)
    assert (traced, records[0]) == (2, 2)


def test_a_class_swapped_in_after_a_first_call_then_patched_is_seen(device):
    """The classes whose forward is part of the route's key are read again once a submodule is
    swapped (the stale list kept serving tanh's program after a patch, also when dynamo's cached
    graph for the swapped-in module served without a new trace)."""

    class Activation(nn.Module):  # a class per call: the patch stays with it
        def forward(self, h):
            return torch.tanh(h)

    net = _net(device)
    f = lambda x: net(x).squeeze(-1)  # noqa: E731
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    tanh, activation = net[1], Activation()
    for module in (tanh, activation, tanh, activation):
        net[1] = module
        pyhvp.laplacian(f, x, backend=GUARDED)
    Activation.forward = lambda self, h: torch.sin(h)
    torch.testing.assert_close(pyhvp.laplacian(f, x, backend=GUARDED), instance_laplacian(f, x))


class GlobalActivation(nn.Module):
    def forward(self, h):
        return torch.tanh(h)


GLOBAL_NETWORK = nn.Sequential(nn.Linear(3, 8), GlobalActivation(), nn.Linear(8, 1)).double()


def through_the_global_network(x):
    return GLOBAL_NETWORK(x).squeeze(-1)


def test_a_class_patched_in_a_network_read_from_a_global_is_seen(device):
    """A network f reads from a global variable (not a closure) has its classes' forwards in the
    route's key too (a patched class kept serving the earlier program)."""
    GLOBAL_NETWORK.to(device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    for _ in range(2):
        pyhvp.laplacian(through_the_global_network, x, backend=GUARDED)
    original = GlobalActivation.forward
    GlobalActivation.forward = lambda self, h: torch.sin(h)
    try:
        got = pyhvp.laplacian(through_the_global_network, x, backend=GUARDED)
        expected = instance_laplacian(through_the_global_network, x)
    finally:
        GlobalActivation.forward = original
    torch.testing.assert_close(got, expected)


@dataclass
class Tripled:
    """A hook that is not hashable (a dataclass with ``eq``): nothing may key on it."""

    factor: float = 3.0

    def __call__(self, module, inputs, out):
        return self.factor * out


def test_a_global_module_hook_is_part_of_f(device):
    """A hook registered for every module applies to f's modules (from the next call on), never
    to pyhvp's own graphs (it tripled the jet kernel's outputs)."""
    net = _net(device)
    f = lambda x: net(x).squeeze(-1)  # noqa: E731
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    pyhvp.laplacian(f, x, backend=GUARDED)
    handle = torch.nn.modules.module.register_module_forward_hook(Tripled())
    try:
        expected = instance_laplacian(f, x)
        got = pyhvp.laplacian(f, x, backend=GUARDED)
    finally:
        handle.remove()
    torch.testing.assert_close(got, expected)


def _item_branch(x):
    return x.pow(3).sum(-1) if x.sum().item() > 0 else x.pow(2).sum(-1)


def _dropout(x):
    return torch.nn.functional.dropout(torch.tanh(x), 0.5).pow(2).sum(-1)


def _write(x):
    y = x * 1.0
    y[..., 0] = 2 * y[..., 0]
    return y.pow(3).sum(-1)


def _item_scale(x):
    return x.pow(3).sum(-1) / x.abs().max().item()


def _determinant(x):
    return torch.linalg.det(x.reshape(*x.shape[:-1], 2, 2) + 1)


DECLINED = {  # f the route must leave to the record at every call, and why
    "a branch on a value (.item(), a graph break)": _item_branch,
    "a random draw (dropout)": _dropout,
    "a write to a tensor": _write,
    "a determinant (its rule depends on the values)": _determinant,
    "a value read into Python (.item(), which no guard checks)": _item_scale,
}


def test_a_tensor_read_into_python_is_read_anew_at_every_call(device):
    """An annealed temperature read by ``.item()``: dynamo (torch 2.13) traces that whole and no
    guard checks the value; the graph's program kept the first call's number (the Laplacian of
    the first temperature at every later one) until such an ``f`` was declined."""
    temperature = torch.tensor(1.0, dtype=torch.float64, device=device)

    def f(x):
        return temperature.item() * torch.tanh(x).pow(2).sum(-1)

    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    for _ in range(2):
        pyhvp.laplacian(f, x, backend=GUARDED)
    temperature.fill_(4.0)
    torch.testing.assert_close(pyhvp.laplacian(f, x, backend=GUARDED), instance_laplacian(f, x))


def test_running_statistics_f_updates_are_updated_once_per_call_as_f_updates_them(device):
    """``F.batch_norm`` in training mode writes its running statistics by an op whose schema does
    not say so (``native_batch_norm``): the route ran ``f`` twice on its first call (two momentum
    steps) and never after (none)."""
    mean = torch.zeros(4, dtype=torch.float64, device=device)
    variance = torch.ones(4, dtype=torch.float64, device=device)

    def f(x):
        return torch.tanh(F.batch_norm(x, mean, variance, training=True)).pow(2).sum(-1)

    x = torch.randn(5, 4, dtype=torch.float64, device=device)
    for _ in range(3):
        mean.zero_()
        pyhvp.laplacian(f, x, backend=GUARDED)
        torch.testing.assert_close(mean, 0.1 * x.mean(0))  # one step of momentum 0.1 from 0


@pytest.mark.parametrize("f", DECLINED.values(), ids=DECLINED.keys())
def test_what_must_be_done_or_judged_anew_is_recorded_at_every_call(f, records, device):
    x = torch.randn(5, 4, dtype=torch.float64, device=device)
    for _ in range(3):
        torch.manual_seed(0)
        expected = pyhvp.laplacian(f, x, backend=RECORDED)
        torch.manual_seed(0)
        before = records[0]
        torch.testing.assert_close(pyhvp.laplacian(f, x, backend=GUARDED), expected)
        assert records[0] > before


def test_gradients_through_a_guarded_laplacian_reach_the_parameters(device):
    """A PINN step: the residual's gradient in the parameters, the same on both routes (the
    last bias has none: a Laplacian does not depend on it)."""
    net = _net(device)
    x = torch.randn(6, 3, dtype=torch.float64, device=device)

    def step(backend):
        net.zero_grad()
        pyhvp.laplacian(lambda y: net(y).squeeze(-1), x, backend=backend).square().mean().backward()
        return [p.grad for p in net.parameters()]

    for _ in range(2):
        torch.testing.assert_close(step(GUARDED), step(RECORDED))


def test_a_float_that_changes_every_call_leaves_the_route_after_a_few_graphs(records, device):
    """Dynamo specialises floats: each value is a graph, until the route gives way to the
    record, which serves every value with one program."""
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    for step in range(guards.GRAPHS_PER_ROUTE + 3):
        t = 0.5 + step / 10

        def f(y, t=t):
            return torch.exp(-t * (y**2).sum(-1))

        torch.testing.assert_close(pyhvp.hessian_diagonal(f, x, backend=GUARDED),
                                   instance_hessian_diagonal(f, x))  # fmt: skip
    route = guards._ROUTES[guards._route_key(f)]
    assert route.graphs == guards.GRAPHS_PER_ROUTE and route.declined is not None


def _through_one_lambda(net):
    """``net``'s output per instance, by one lambda code whatever the network."""
    return lambda y: net(y).squeeze(-1)


def test_one_lambda_over_many_networks_keeps_a_route_per_network(records, device):
    """A sweep over more networks than a route takes graphs, through one lambda: each network
    has its own route, so its later calls are served by its graph, unrecorded."""
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    nets = [_net(device) for _ in range(guards.GRAPHS_PER_ROUTE + 2)]
    for net in nets:
        for call in range(2):
            f = _through_one_lambda(net)
            before = records[0]
            torch.testing.assert_close(pyhvp.laplacian(f, x, backend=GUARDED),
                                       instance_laplacian(f, x))  # fmt: skip
            assert records[0] == before if call else records[0] > before
    assert all(route.declined is None for route in guards._ROUTES.values())


def test_networks_past_the_routes_of_a_code_share_one_route(monkeypatch, device):
    """A network made anew at every call would cost a route, and a dynamo trace, per call: past
    ROUTES_PER_CODE, callables of that code share one route (which declines as any route)."""
    monkeypatch.setattr(guards, "ROUTES_PER_CODE", 2)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    for _ in range(4):
        net = _net(device)
        f = _through_one_lambda(net)
        torch.testing.assert_close(pyhvp.laplacian(f, x, backend=GUARDED), instance_laplacian(f, x))
    assert guards._route_key(f) is f.__code__
    assert sum(isinstance(key, tuple) for key in guards._ROUTES) == 2


def test_guards_must_be_a_bool():
    with pytest.raises(ValueError, match="guards must be True or False, got 'yes'"):
        pyhvp.TorchBackend(guards="yes")
