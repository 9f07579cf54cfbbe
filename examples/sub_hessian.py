"""
Sub-Hessians of a classifier's loss
===================================

Seed 003: the k x k Hessian of a loss over k selected components of each parameter tensor.

First the seed's own code (its model and its loop of k reverse passes per tensor), then pyhvp
(one batched pass per tensor; with joint=True one pass over all selected components), then the
two compared.
Run: ``python examples/sub_hessian.py``.
"""

import torch
from torch import nn

import pyhvp

# --- the seed's code ------------------------------------------------------------------------


def compute_sub_hessian(grad, weights, idxs):
    """The seed's function; only dtype/device were added to ``torch.zeros``."""
    n_elems = grad.numel()
    flat_grad = grad.reshape(-1)
    sub_hessian = torch.zeros(size=(len(idxs), n_elems), dtype=grad.dtype, device=grad.device)
    for i, idx in enumerate(idxs):
        row_hessian = torch.autograd.grad(flat_grad[idx], weights, retain_graph=True)[0]
        row_hessian = row_hessian.reshape(-1)
        sub_hessian[i] = row_hessian
    sub_hessian = sub_hessian[:, idxs]
    return sub_hessian


class MnistModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10, bias=True)

    def forward(self, x):
        x = x.reshape(-1, 28 * 28)
        x = self.fc(x)
        return x


def seed_sub_hessians(model, criterion, X, y, idxs):
    """The seed's driver: backward with create_graph, then its loop for every named parameter."""
    model.zero_grad(set_to_none=True)
    outputs = model(X)
    loss = criterion(outputs, y)
    loss.backward(create_graph=True)
    result = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            result[name] = compute_sub_hessian(param.grad, param, idxs[name]).detach()
    model.zero_grad(set_to_none=True)  # break the grad <-> graph cycle torch warns about
    return result


# --- pyhvp ----------------------------------------------------------------------------------


def pyhvp_sub_hessians(model, criterion, X, y, idxs, joint=False):
    loss, params = pyhvp.module_loss(model, criterion, X, y)
    index = {name: torch.tensor(i) for name, i in idxs.items()}
    return pyhvp.sub_hessian(loss, params, index, joint=joint)


def main():
    torch.manual_seed(0)
    model = MnistModel()
    criterion = nn.CrossEntropyLoss()
    X = torch.rand(100, 1, 28, 28)  # 100 images of size 28*28
    y = torch.randint(0, 10, size=(100,))
    idxs = {"fc.weight": [0, 4, 1000], "fc.bias": [0, 4]}

    seed = seed_sub_hessians(model, criterion, X, y, idxs)
    blocks = pyhvp_sub_hessians(model, criterion, X, y, idxs)
    for name, block in blocks.items():
        print(f"{name}: pyhvp\n{block}\nseed's loop\n{seed[name]}")
        torch.testing.assert_close(block, seed[name])

    joint = pyhvp_sub_hessians(model, criterion, X, y, idxs, joint=True)
    print(f"joint (5, 5), weight and bias components with their cross terms:\n{joint}")
    torch.testing.assert_close(joint[:3, :3], blocks["fc.weight"])
    print("pyhvp agrees with the seed's loop")


if __name__ == "__main__":
    main()
