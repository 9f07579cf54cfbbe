"""Higher-order operators (issue 26): pyhvp's Taylor mode against nested torch.autograd.grad (the
idiom of PINN libraries: DeepXDE's ``hessian`` of a ``hessian``) and torch-jet's
``bilaplacian`` (captured, CSE'd, vmapped; eager and compiled).

Problems, tanh MLPs (widths 64, float32, one thread, the process pinned to one core):

* a 2-D Kirchhoff plate PINN training step (2-64-64-64-1, B = 4096): the loss
  ``mean((Delta^2 u - q)^2)`` and its backward to the parameters, time and peak memory;
* ``bilaplacian`` alone (3 hidden layers of 64): D = 2 (B = 4096), D = 5 (B = 1024), D = 16
  (B = 256);
* ``u_xxxx`` (``directional_derivatives(order=4)`` along ``e_0``), D = 2, B = 4096;
* the sixth derivative along ``e_0``, D = 2, B = 4096.

pyhvp eager (``compile=False``) and compiled (``compile=True``, timed after its compile).
Every result is checked against the nested-autograd one before timing. torch-jet rows are
skipped, with the reason, where ``import jet`` fails (``../shared/tools/install-torch-jet``).
Usage: python benchmarks/bench_higher_order.py [--quick]
"""

from __future__ import annotations

import sys

import torch
from _timing import Report, announce, interleaved_ms, one_core, peak_bytes
from torch import nn

import pyhvp

one_core()
torch.set_num_threads(1)

EAGER, COMPILED = pyhvp.TorchBackend(compile=False), pyhvp.TorchBackend(compile=True)


def tanh_mlp(d: int, hidden: int = 3, width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for w_in in (d, *[width] * (hidden - 1)):
        layers += [nn.Linear(w_in, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def nested_partial(u: torch.Tensor, x: torch.Tensor, alpha: tuple[int, ...]) -> torch.Tensor:
    """``d^alpha u`` per instance by nested ``torch.autograd.grad`` (graphs kept)."""
    for i in alpha:
        (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        u = g[:, i]
    return u


def nested_laplacian(u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    return sum(torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i]
               for i in range(x.shape[1]))  # fmt: skip


def nested_bilaplacian(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    return nested_laplacian(nested_laplacian(net(x)[:, 0], x), x)


def pyhvp_bilaplacian(backend):
    return lambda net, x: pyhvp.bilaplacian(lambda y: net(y)[..., 0], x, backend=backend)


def torch_jet_bilaplacian(net: nn.Module, x: torch.Tensor) -> dict[str, object]:
    import jet

    x0 = x[0]
    module, _ = jet.capture_graph(jet.bilaplacian(net, (x0,), collapsed=True), (x0,))
    jet.common_subexpression_elimination(module.graph)
    module.recompile()
    batched = torch.func.vmap(module)
    compiled = torch.compile(batched)
    return {"torch-jet eager": lambda: batched(x)[:, 0],
            "torch-jet compiled": lambda: compiled(x)[:, 0]}  # fmt: skip


def checked(methods: dict[str, object], reference: torch.Tensor, what: str) -> dict[str, object]:
    scale = reference.abs().max().item() + 1.0
    for name, fn in methods.items():
        error = (fn().detach() - reference).abs().max().item()
        assert error <= 2e-3 * scale, f"{what}: {name} off by {error:.3g} (scale {scale:.3g})"
    return methods


def bilaplacian_alone(report: Report, d: int, b: int) -> None:
    announce(f"bilaplacian D={d} B={b}")
    net = tanh_mlp(d).requires_grad_(False)
    x = torch.randn(b, d)
    methods = {
        "nested autograd": lambda: nested_bilaplacian(net, x).detach(),
        "pyhvp eager": lambda: pyhvp_bilaplacian(EAGER)(net, x),
        "pyhvp compiled": lambda: pyhvp_bilaplacian(COMPILED)(net, x),
    }
    try:
        methods.update(torch_jet_bilaplacian(net, x))
    except ImportError as error:
        report.text(f"  torch-jet skipped: {error}")
    checked(methods, nested_bilaplacian(net, x).detach(), f"bilaplacian D={d}")
    rows = list(interleaved_ms(methods, rounds=10, budget_s=30.0).items())
    report.table(f"bilaplacian, tanh MLP 3x64, D={d}, B={b}, float32", rows, "nested autograd")
    report.point("bi-Laplacian", "D", d, rows)


def along_axis(report: Report, order: int, b: int = 4096) -> None:
    announce(f"order {order} along e_0")
    net = tanh_mlp(2).requires_grad_(False)
    x = torch.randn(b, 2)
    e0 = torch.tensor([1.0, 0.0])

    def nested():
        y = x.detach().requires_grad_()
        return nested_partial(net(y)[:, 0], y, (0,) * order).detach()

    def taylor(backend):
        return lambda: pyhvp.directional_derivatives(lambda y: net(y)[..., 0], x, e0,
                                                     order=order, backend=backend)[order]  # fmt: skip

    methods = {"nested autograd": nested, "pyhvp eager": taylor(EAGER),
               "pyhvp compiled": taylor(COMPILED)}  # fmt: skip
    checked(methods, nested(), f"order {order}")
    rows = list(interleaved_ms(methods, rounds=10, budget_s=30.0).items())
    report.table(f"d^{order}u/dx^{order}, tanh MLP 3x64, D=2, B={b}, float32", rows,
                 "nested autograd")  # fmt: skip


def plate_step(report: Report, b: int = 4096) -> None:
    """One Kirchhoff plate training step: Delta^2 u = q, loss and backward."""
    announce("plate PINN step")
    net = tanh_mlp(2)
    x = torch.rand(b, 2)
    q = torch.sin(torch.pi * x[:, 0]) * torch.sin(torch.pi * x[:, 1])

    def step(bilaplacian):
        net.zero_grad(set_to_none=True)
        loss = ((bilaplacian(net, x) - q) ** 2).mean()
        loss.backward()
        return loss.detach()

    methods = {
        "nested autograd": lambda: step(nested_bilaplacian),
        "pyhvp eager": lambda: step(pyhvp_bilaplacian(EAGER)),
        "pyhvp compiled": lambda: step(pyhvp_bilaplacian(COMPILED)),
    }
    gradients = {}
    for name, fn in methods.items():
        fn()
        gradients[name] = torch.cat([torch.zeros_like(p).reshape(-1) if p.grad is None
                                     else p.grad.reshape(-1) for p in net.parameters()])  # fmt: skip
    for name, g in gradients.items():
        torch.testing.assert_close(g, gradients["nested autograd"], rtol=1e-3, atol=1e-3,
                                   msg=f"plate step: {name}'s gradients")  # fmt: skip
    rows = list(interleaved_ms(methods, rounds=10, budget_s=30.0).items())
    report.table(f"plate PINN step (Delta^2 u = q), 2-64-64-64-1, B={b}, float32", rows,
                 "nested autograd")  # fmt: skip
    peaks = {name: peak_bytes(fn, "cpu") for name, fn in methods.items()}
    report.text("\n  peak memory of a step: " + ", ".join(
        f"{name} {b / 2**20:.0f} MiB ({b / peaks['nested autograd']:.2f})"
        for name, b in peaks.items()))  # fmt: skip


def main(quick: bool = False) -> None:
    report = Report("bench_higher_order", "cpu")
    shapes = [(2, 1024)] if quick else [(2, 4096), (5, 1024), (16, 256)]
    for d, b in shapes:
        bilaplacian_alone(report, d, b)
    along_axis(report, 4, 1024 if quick else 4096)
    along_axis(report, 6, 1024 if quick else 4096)
    plate_step(report, 1024 if quick else 4096)
    report.save()


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
