"""Specification: compiled kernels are right where inductor would write into an expanded tensor.

Inductor (torch 2.5-2.13) reinplaces an indexed write into an intermediate with internal overlap
-- ``zeros(n).expand(k, n)``, which ``vmap`` makes of an unbatched destination -- so that every
row gets the sum of all rows' writes (pytorch#183986). Compiled Hessian-vector products of any
``f`` using ``index_select`` or ``index_add``, and compiled jet kernels of ``index_add``, gave
silently wrong values. pyhvp compiles with a pass that gives such writes a fresh destination
(:mod:`pyhvp.backends.inductor`), and checks each compiled kernel's first result against an
eager run: each case here is checked against dense float64, and that the compiled kernel itself
was right.
"""

import warnings

import pytest
import torch
from dense import instance_hvp, instance_laplacian
from torch.fx.experimental.proxy_tensor import make_fx

import pyhvp
from pyhvp.backends import inductor

COMPILED = pyhvp.TorchBackend(compile=True)
PICK = torch.tensor([3, 0, 5, 3])  # a repeat: two writes to one place
DISTINCT = torch.tensor([4, 0, 2])


def index_select(x):
    return (x.index_select(-1, PICK.to(x.device)) ** 3).sum(-1)


def index_add(x):
    added = torch.zeros_like(x).index_add(-1, PICK.to(x.device), torch.sin(x[..., :4]))
    return (added**2 * x).sum(-1)


def index_copy(x):
    copied = torch.zeros_like(x).index_copy(-1, DISTINCT.to(x.device), x[..., :3] ** 2)
    return (copied * torch.cos(x)).sum(-1)


def index_assignment(x):
    y = x.clone()
    y[..., DISTINCT.to(x.device)] = torch.tanh(x[..., 3:])
    return (y**3).sum(-1)


def slice_assignment(x):
    y = x.clone()
    y[..., 1:4] = torch.sin(x[..., :3])
    return (y**2 * x).sum(-1)


FUNCTIONS = [index_select, index_add, index_copy, index_assignment, slice_assignment]


def tiered(cases, fast):
    """Each case as a pytest param, the one named ``fast`` in ``make test`` and the others marked
    slow (compiling is this module's cost: 5-13 s a case; ``make test-all`` runs them all)."""
    return [
        pytest.param(case, id=name, marks=() if name == fast else pytest.mark.slow)
        for name, case in cases.items()
    ]


# Miscompiles the pass does not prevent, which the first-call check of compiled kernels catches
# (pyhvp.backends.compile_policy.disagreement): the call then returns the eager result.
CAUGHT_BY_THE_CHECK = {("hvp", "index_assignment")} if torch.__version__ < "2.13" else set()


def compiled(operator, f, run):
    """``run()``; asserts that the compiled kernel itself was right (the first-call check did not
    have to replace its result), except where :data:`CAUGHT_BY_THE_CHECK` says otherwise."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    replaced = any("disagrees with the eager one" in str(w.message) for w in caught)
    assert replaced == ((operator, f.__name__) in CAUGHT_BY_THE_CHECK)
    return out


@pytest.mark.parametrize("f", tiered({f.__name__: f for f in FUNCTIONS}, fast="index_select"))
def test_compiled_hvps_equal_the_dense_hessian_times_v(f, device):
    x = torch.randn(5, 6, dtype=torch.float64, device=device)
    v = torch.randn(3, 5, 6, dtype=torch.float64, device=device)
    _, hv = compiled("hvp", f, lambda: pyhvp.grad_and_hvp(f, x, v, backend=COMPILED))
    torch.testing.assert_close(hv, instance_hvp(f, x, v))


@pytest.mark.parametrize("f", tiered({f.__name__: f for f in FUNCTIONS}, fast="index_add"))
def test_compiled_laplacians_equal_the_dense_trace(f, device):
    x = torch.randn(5, 6, dtype=torch.float64, device=device)
    lap = compiled("laplacian", f, lambda: pyhvp.laplacian(f, x, backend=COMPILED))
    torch.testing.assert_close(lap, instance_laplacian(f, x))


def expanded_zeros(x):
    return torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device).expand_as(x)


WRITES = {
    "index_add": lambda x, i: expanded_zeros(x).index_add(-1, i, x[..., : len(i)]),
    "index_copy": lambda x, i: expanded_zeros(x).index_copy(-1, i.unique(), x[..., :3]),
    "index_put": lambda x, i: expanded_zeros(x).index_put(
        (torch.arange(len(x), device=x.device)[:, None], i), x[..., : len(i)], accumulate=True
    ),
    "slice_scatter": lambda x, i: expanded_zeros(x).slice_scatter(x[..., :2], -1, 0, 2),
    "select_scatter": lambda x, i: expanded_zeros(x).select_scatter(x[..., 0], -1, 1),
}


@pytest.mark.parametrize("write", tiered(WRITES, fast="index_add"))
def test_a_write_into_an_expanded_intermediate_compiles_to_eager_values(write, device):
    x = torch.randn(4, 6, device=device)
    i = PICK.to(device)
    compiled = torch.compile(write, dynamic=False, backend=inductor.backend())
    torch.testing.assert_close(compiled(x, i), write(x, i))


def clones(graph_module):
    return sum(node.target is torch.ops.aten.clone.default for node in graph_module.graph.nodes)


def test_the_pass_copies_only_destinations_that_overlap_themselves():
    x, i = torch.randn(4, 6), PICK
    overlapping = make_fx(WRITES["index_add"])(x, i)
    dense = make_fx(lambda x, i: torch.zeros_like(x).index_add(-1, i, x[..., :4]))(x, i)
    before = clones(overlapping), clones(dense)
    inductor.fresh_destinations(overlapping.graph)
    inductor.fresh_destinations(dense.graph)
    assert (clones(overlapping), clones(dense)) == (before[0] + 1, before[1])


@pytest.mark.slow  # a compiled kernel and its compiled backward
def test_compiled_laplacian_gradients_in_captured_weights_equal_the_dense_ones(device):
    """A PINN-style step: the compiled kernel's backward (AOTAutograd) carries the same writes."""
    w = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)

    def f(x):
        return torch.tanh(torch.zeros_like(x).index_add(-1, PICK.to(device), x[..., :4] * w)).sum(
            -1
        )

    x = torch.randn(5, 6, dtype=torch.float64, device=device)
    (got,) = torch.autograd.grad(pyhvp.laplacian(f, x, backend=COMPILED).square().sum(), w)
    (expected,) = torch.autograd.grad(instance_laplacian(f, x).square().sum(), w)
    torch.testing.assert_close(got, expected)
