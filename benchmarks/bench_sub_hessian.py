"""Sub-Hessians over k selected components of every parameter tensor (seed 003), side by side.

Models: the seed's Linear(784, 10) and a 2-layer tanh MLP (784 -> 128 -> 10), CrossEntropy over
100 random images, float32; k = 2, 16, 128 random components per tensor (all of a tensor that has
fewer). Rows: pyhvp (``sub_hessian(*module_loss(...), index)`` per call: eager), pyhvp with the
loss built once (compiled from the third call), the seed's loop (one reverse pass
per component) and the answer the seed received (``torch.autograd.grad(..., is_grads_batched=True)``,
one batched pass per tensor). Every row computes all blocks from the model and data; results are
checked against each other first. Ratios are against the seed's loop.
On a shared CPU, OMP_NUM_THREADS=1 gives steadier figures (idle-waiting OpenMP threads stall
when other processes hold the cores). Usage: python benchmarks/bench_sub_hessian.py [cuda]
"""

from __future__ import annotations

import sys
import warnings
from functools import partial
from pathlib import Path

import torch
from _timing import median_ms, print_table
from torch import nn

import pyhvp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from sub_hessian import MnistModel, pyhvp_sub_hessians, seed_sub_hessians


def is_grads_batched(model, criterion, X, y, idxs):
    """The seed's answer: one-hot cotangents through a batched second backward, per tensor."""
    named = dict(model.named_parameters())
    loss = criterion(model(X), y)
    grads = torch.autograd.grad(loss, list(named.values()), create_graph=True)
    result = {}
    for (name, param), grad in zip(named.items(), grads, strict=True):
        onehot = nn.functional.one_hot(torch.tensor(idxs[name], device=X.device), param.numel())
        rows = torch.autograd.grad(
            grad.reshape(-1),
            param,
            grad_outputs=onehot.to(grad.dtype),
            is_grads_batched=True,
            retain_graph=True,
        )[0]
        result[name] = rows.reshape(len(idxs[name]), -1)[:, idxs[name]].detach()
    return result


def two_layer_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.Tanh(), nn.Linear(128, 10))


def one_loss(model, criterion, X, y):
    """pyhvp with the loss built once, as a loop over steps on the same data would: from the third
    call on, the torch backend runs its compiled kernel for it."""
    loss, params = pyhvp.module_loss(model, criterion, X, y)

    def sub_hessians(model, criterion, X, y, idxs):
        index = {name: torch.tensor(i, device=X.device) for name, i in idxs.items()}
        return pyhvp.sub_hessian(loss, params, index)

    return sub_hessians


METHODS = {
    "pyhvp": pyhvp_sub_hessians,
    "seed loop": seed_sub_hessians,
    "is_grads_batched": is_grads_batched,
}


def main(device: str) -> None:
    # the seed's loss.backward(create_graph=True) warns about a grad <-> graph cycle; it is broken
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    torch.manual_seed(0)
    X = torch.rand(100, 1, 28, 28, device=device)
    y = torch.randint(0, 10, size=(100,), device=device)
    criterion = nn.CrossEntropyLoss()
    summary = []
    for model_name, make in {
        "seed Linear(784, 10)": MnistModel,
        "MLP 784-128-10": two_layer_mlp,
    }.items():
        model = make().to(device)
        for k in (2, 16, 128):
            idxs = {
                name: torch.randperm(p.numel())[: min(k, p.numel())].tolist()
                for name, p in model.named_parameters()
            }
            methods = {**METHODS, "pyhvp, one loss": one_loss(model, criterion, X, y)}
            results = {name: fn(model, criterion, X, y, idxs) for name, fn in methods.items()}
            for name, blocks in results.items():
                torch.testing.assert_close(blocks, results["seed loop"], msg=name)
            rows = [
                (
                    name,
                    median_ms(
                        partial(fn, model, criterion, X, y, idxs),
                        device,
                        warmup=3,  # the third call of "pyhvp, one loss" compiles
                        budget_s=2.0,
                    ),
                )
                for name, fn in methods.items()
            ]
            print_table(f"{model_name}, k={k} per tensor, {device}", rows, "seed loop")
            times = dict(rows)
            summary.append(
                (
                    model_name,
                    k,
                    times["seed loop"] / times["pyhvp, one loss"],
                    times["is_grads_batched"] / times["pyhvp, one loss"],
                )
            )
    print("\npyhvp speed-up, loss built once (time of the other method / time of pyhvp)")
    print(f"  {'model':22} | {'k':>4} | {'vs seed loop':>12} | {'vs is_grads_batched':>19}")
    for model_name, k, vs_loop, vs_batched in summary:
        print(f"  {model_name:22} | {k:4d} | {vs_loop:12.1f} | {vs_batched:19.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
