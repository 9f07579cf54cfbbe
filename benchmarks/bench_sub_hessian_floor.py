"""What a LeNet-5 sub-Hessian can cost: the floor of pyhvp's algorithm and a faster one by hand.

Issue 28 asks for LeNet-5's sub-Hessians (k components of each of its 8 tensors, 64 images,
cross-entropy) at 0.3x the seed's loop. Every route pyhvp has -- the sparse route, the reverse
route, the loop -- pushes one Hessian-vector product per selected component through the network
downstream of the op the component enters. This benchmark times, side by side with the seed's
loop and pyhvp's ``method="auto"``:

* **HVP floor**: for each tensor, its k HVPs of the loss with respect to the output of the op it
  enters (dense tangents of that activation's shape, by autograd's double backward, which is
  faster here than ``vmap(jvp(grad))``), summed over the tensors: the least any
  one-HVP-per-component method pays, with no injection, no setup and no weight gradients.
* **forward tangents by hand**: the same blocks by a different algorithm, derived by hand for
  this network: one forward and ONE reverse pass (the adjoint of every activation), then each
  component's tangent pushed forward only, and at every nonlinearity the pairwise term
  ``sum <adjoint * tanh'', t_a * t_b>`` (a weighted Gram matrix), plus the cross-entropy head's
  ``sum_b t_a^T (diag(s) - s s^T) t_b``. Exact (checked against the seed's loop first); no
  tangent travels backwards.

The second row was the baseline for pyhvp's forward-tangent route (``method="forward"``,
:mod:`pyhvp.restricted.forward`), the generic algorithm it became, timed beside it: it finds the
same terms for any loss, op by op. One thread, one pinned core. Usage: python
benchmarks/bench_sub_hessian_floor.py
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.nn.functional as F
from _timing import Report, allocator, announce, interleaved_ms, one_core
from bench_sub_hessian import EAGER, LeNet5, module_problem, seed_loop, with_backend

import pyhvp

SITES = (("conv1.weight", "conv1.bias"), ("conv2.weight", "conv2.bias"),
         ("fc1.weight", "fc1.bias"), ("fc2.weight", "fc2.bias"))  # fmt: skip
"""The tensors entering each op (its weight and bias), in the network's order."""


def activations(p, X):
    """One forward: every value the tangents and the adjoints need, by name."""
    v = {"y1": F.conv2d(X, p["conv1.weight"], p["conv1.bias"])}
    v["a1"] = torch.tanh(v["y1"])
    v["p1"], v["i1"] = F.max_pool2d(v["a1"], 2, return_indices=True)
    v["y2"] = F.conv2d(v["p1"], p["conv2.weight"], p["conv2.bias"])
    v["a2"] = torch.tanh(v["y2"])
    v["p2"], v["i2"] = F.max_pool2d(v["a2"], 2, return_indices=True)
    v["y3"] = F.linear(v["p2"].flatten(1), p["fc1.weight"], p["fc1.bias"])
    v["a3"] = torch.tanh(v["y3"])
    v["y4"] = F.linear(v["a3"], p["fc2.weight"], p["fc2.bias"])
    return v


def tail(p, site, y, labels):
    """The loss as a function of the output ``y`` of op ``site`` (0-3)."""
    if site == 0:
        y = F.conv2d(F.max_pool2d(torch.tanh(y), 2), p["conv2.weight"], p["conv2.bias"])
    if site <= 1:
        y = F.linear(F.max_pool2d(torch.tanh(y), 2).flatten(1), p["fc1.weight"], p["fc1.bias"])
    if site <= 2:
        y = F.linear(torch.tanh(y), p["fc2.weight"], p["fc2.bias"])
    return F.cross_entropy(y, labels)


def hvps_at(p, v, labels, site, tangents):
    """``len(tangents)`` HVPs of the loss w.r.t. op ``site``'s output, one double backward each."""
    y = v[f"y{site + 1}"].detach().requires_grad_()
    (g,) = torch.autograd.grad(tail(p, site, y, labels), y, create_graph=True)
    return [torch.autograd.grad(g, y, t, retain_graph=True)[0] for t in tangents]


def contributions(p, v, X, site, weight_entries, bias_entries):
    """Each selected entry's tangent of op ``site``'s output: a weight entry adds the input it
    multiplies (a shifted input channel, or an input column) to its output channel or column, a
    bias entry ones there."""
    inputs = (X, v["p1"], v["p2"].flatten(1), v["a3"])[site]
    shape = p[SITES[site][0]].shape
    out = v[f"y{site + 1}"]
    t = out.new_zeros(len(weight_entries) + len(bias_entries), *out.shape)
    for n, flat in enumerate(weight_entries):
        o, c, *offsets = torch.unravel_index(torch.tensor(flat), shape)
        if offsets:
            i, j = offsets
            t[n, :, o] = inputs[:, c, i : i + out.shape[2], j : j + out.shape[3]]
        else:
            t[n, :, o] = inputs[:, c]
    for n, o in enumerate(bias_entries, start=len(weight_entries)):
        t[n, :, o] = 1.0
    return t


def by_forward_tangents(p, X, labels, idxs):
    """Every tensor's block: one forward, one reverse pass for the adjoints, then each entry's
    tangent pushed forward from its op with the pairwise second-order terms on the way."""
    v = activations(p, X)
    s = torch.softmax(v["y4"], 1)
    batch = X.shape[0]
    # the reverse pass: the adjoint of every tanh's output
    adjoint = {"a3": ((s - F.one_hot(labels, 10)) / batch) @ p["fc2.weight"]}
    d3 = adjoint["a3"] * (1 - v["a3"] ** 2)
    dp2 = (d3 @ p["fc1.weight"]).view_as(v["p2"])
    adjoint["a2"] = F.max_unpool2d(dp2, v["i2"], 2, output_size=v["a2"].shape[-2:])
    d2 = adjoint["a2"] * (1 - v["a2"] ** 2)
    dp1 = torch.nn.grad.conv2d_input(v["p1"].shape, p["conv2.weight"], d2)
    adjoint["a1"] = F.max_unpool2d(dp1, v["i1"], 2, output_size=v["a1"].shape[-2:])

    def tanh_term(t, name):
        a = v[name]
        weight = (adjoint[name] * -2 * a * (1 - a**2)).reshape(-1)
        flat = t.reshape(t.shape[0], -1)
        return (flat * weight) @ flat.T

    def pooled(t, name):
        index = v[f"i{name[-1]}"].flatten(2).expand(t.shape[0], -1, -1, -1)
        return t.flatten(3).gather(3, index).view(t.shape[0], *v[f"p{name[-1]}"].shape)

    blocks = {}
    for site, (weight, bias) in enumerate(SITES):
        t = contributions(p, v, X, site, idxs[weight], idxs[bias])
        k = t.shape[0]
        block = t.new_zeros(k, k)
        if site == 0:
            block += tanh_term(t, "a1")
            t = pooled(t * (1 - v["a1"] ** 2), "a1")
            t = F.conv2d(t.flatten(0, 1), p["conv2.weight"]).view(k, *v["y2"].shape)
        if site <= 1:
            block += tanh_term(t, "a2")
            t = pooled(t * (1 - v["a2"] ** 2), "a2").flatten(2) @ p["fc1.weight"].T
        if site <= 2:
            block += tanh_term(t, "a3")
            t = (t * (1 - v["a3"] ** 2)) @ p["fc2.weight"].T
        weighted = (t * s).sum(2)
        block += (torch.einsum("kbc,lbc->kl", t * s, t) - weighted @ weighted.T) / batch
        n = len(idxs[weight])
        blocks[weight], blocks[bias] = block[:n, :n], block[n:, n:]
    return blocks


def main() -> None:
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
    one_core()
    torch.set_num_threads(1)
    report = Report("bench_sub_hessian_floor", "cpu")
    report.text(f"malloc: {allocator()}")
    torch.manual_seed(0)
    model = LeNet5()
    X, labels = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    make = module_problem(model)
    p = {name: t.detach() for name, t in model.named_parameters()}
    v = activations(p, X)
    for k in (16, 128):
        announce(f"LeNet-5, k = {k} per tensor")
        torch.manual_seed(k)
        idxs = {n: torch.randperm(t.numel())[: min(k, t.numel())].tolist() for n, t in p.items()}
        by_hand = by_forward_tangents(p, X, labels, idxs)
        torch.testing.assert_close(by_hand, seed_loop(*make(X, labels), idxs), rtol=1e-3,
                                   atol=1e-6)  # fmt: skip
        index = {name: torch.tensor(i) for name, i in idxs.items()}
        selection = (make, X, labels, idxs, index)
        calls = {
            "seed loop": lambda idxs=idxs: seed_loop(*make(X, labels), idxs),
            "pyhvp auto eager": partial(with_backend(EAGER, "auto"), *selection),
            "pyhvp auto compiled": partial(
                with_backend(pyhvp.TorchBackend(compile=True), "auto"), *selection
            ),
            "forward tangents by hand": partial(by_forward_tangents, p, X, labels, idxs),
            "pyhvp forward": partial(with_backend(EAGER, "forward"), *selection),
        }
        for site, names in enumerate(SITES):
            count = sum(len(idxs[name]) for name in names)
            tangents = torch.randn(count, *v[f"y{site + 1}"].shape)
            calls[f"HVPs at {names[0].split('.')[0]}"] = partial(
                hvps_at, p, v, labels, site, tangents
            )
        times = interleaved_ms(calls, "cpu", warmup=8, rounds=21, budget_s=60.0)
        floor = sum(ms for name, ms in times.items() if name.startswith("HVPs at"))
        rows = [(name, ms) for name, ms in times.items() if not name.startswith("HVPs at")]
        rows.insert(3, ("HVP floor (sum of the 4 below)", floor))
        rows += [(name, ms) for name, ms in times.items() if name.startswith("HVPs at")]
        report.table(f"LeNet-5, k={k} per tensor, cpu", rows, "seed loop")
    report.save()


if __name__ == "__main__":
    main()
