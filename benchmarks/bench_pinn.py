"""PINN training steps (issue 17, item 1): pyhvp.laplacian against the PINN libraries' idiom.

A 2-D or 3-D Poisson residual on a tanh MLP (in -> width -> width -> width -> 1) at B collocation
points. The idiom (DeepXDE, PINA): ``torch.autograd.grad(u.sum(), x, create_graph=True)``, then
one more backward per input dim for the diagonal of the Hessian, summed. Two tables per problem:
the Laplacian alone, and a whole training step -- forward, Laplacian, the residual loss
``((lap - source) ** 2).mean()`` and its backward to the parameters. Both methods are checked
against each other (and their parameter gradients too) before anything is timed; then they are
timed interleaved, one thread, medians. Ratios divide by the idiom (below 1: pyhvp is faster).

Usage: python benchmarks/bench_pinn.py [cpu|cuda]
"""

from __future__ import annotations

import sys

import torch
from _timing import Report, announce, interleaved_ms

import pyhvp

SIZES = (1024, 4096, 16384)
PROBLEMS = [(dims, width) for dims in (2, 3) for width in (64, 128)]


def mlp(dims: int, width: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(dims, width), torch.nn.Tanh()]
    layers += [torch.nn.Linear(width, width), torch.nn.Tanh()] * 2
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)


def idiom_laplacian(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The PINN libraries' way: a gradient with its graph, then one backward per input dim."""
    x = x.requires_grad_() if not x.requires_grad else x
    u = net(x).squeeze(-1)
    (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    return sum(
        torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(x.shape[1])
    )


def pyhvp_laplacian(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return pyhvp.laplacian(lambda y: net(y).squeeze(-1), x)


def step(net: torch.nn.Module, laplacian: object, x: torch.Tensor, source: torch.Tensor) -> None:
    """One training step's derivative work: residual loss, backward to the parameters."""
    net.zero_grad(set_to_none=True)
    loss = ((laplacian(net, x.detach().clone()) - source) ** 2).mean()
    loss.backward()


def check(net: torch.nn.Module, x: torch.Tensor, source: torch.Tensor) -> None:
    ours, theirs = pyhvp_laplacian(net, x), idiom_laplacian(net, x.clone())
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-4, atol=1e-4)
    grads = []
    for laplacian in (pyhvp_laplacian, idiom_laplacian):
        step(net, laplacian, x, source)
        grads.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]
        )  # the last bias: no Laplacian
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def timed(
    net: torch.nn.Module, x: torch.Tensor, source: torch.Tensor, device: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms of the Laplacian alone and of a training step, each method interleaved."""
    alone = interleaved_ms(
        {
            "idiom": lambda: idiom_laplacian(net, x.clone()),
            "pyhvp": lambda: pyhvp_laplacian(net, x),
        },
        device,
    )
    steps = interleaved_ms(
        {
            "idiom": lambda: step(net, idiom_laplacian, x, source),
            "pyhvp": lambda: step(net, pyhvp_laplacian, x, source),
        },
        device,
    )
    return alone, steps


def main(device: str) -> None:
    if device == "cpu":
        torch.set_num_threads(1)
    report = Report("bench_pinn", device)
    for dims, width in PROBLEMS:
        net = mlp(dims, width, device)
        for batch in SIZES:
            name = f"{dims}-D Poisson, width {width}, B = {batch}"
            announce(name)
            generator = torch.Generator().manual_seed(1)
            x = torch.rand(batch, dims, generator=generator).to(device)
            source = torch.ones(batch, device=device)
            check(net, x, source)
            alone, steps = timed(net, x, source, device)
            report.table(f"{name}: Laplacian", list(alone.items()), "idiom")
            report.table(f"{name}: training step", list(steps.items()), "idiom")
            panel = f"{dims}-D, width {width}: training step"
            report.point(panel, "collocation points B", batch, list(steps.items()))
    report.save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
