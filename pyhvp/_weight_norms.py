"""Weight normalisation, differentiated twice: :data:`weight_norms_written_out`.

Autograd's double backward of ``torch._weight_norm`` -- its fused ``_weight_norm_interface``, on
the first or last dim, which ``nn.utils.parametrizations.weight_norm`` and ``nn.utils.weight_norm``
call -- is wrong (torch 2.5.1 to 2.14.1): the Hessian of
``tanh(x @ torch._weight_norm(v, g, 0).T).square().sum()`` over ``(v, g)`` came out asymmetric,
0.83 off that of the same formula written out, and a ``sub_hessian`` of a weight-normalised
layer's ``original0`` / ``original1`` 0.9-1.7 off on every route. Inside the context it runs as
the formula torch's own unfused path computes, ``v * (g / norm_except_dim(v, 2, dim))`` (over
every entry, ``dim=-1``, ``v.norm()``): the same values, and second derivatives autograd gets right
(forward mode too, which the fused op lacks).

>>> v, g = torch.tensor([[3.0, 4.0]]), torch.tensor([[10.0]])
>>> with weight_norms_written_out:
...     torch._weight_norm(v, g, 0)  # v / |v| * g
tensor([[6., 8.]])
"""

from __future__ import annotations

import sys

import torch

from pyhvp._replacing import Replacement

_fused = torch._weight_norm


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``torch._weight_norm(v, g, dim)``: ``v`` scaled to the norm ``g`` over every dim but
    ``dim``, written out inside the context (in this thread), torch's op elsewhere."""
    if not _REPLACED.inside():  # (another thread's calls keep torch's behaviour)
        return _fused(v, g, dim)
    # over every entry (dim -1, weight_norm's dim=None) as v.norm(): torch's forward derivative
    # of norm_except_dim(v, 2, -1) has shape (1, 1) for its () value, and forward mode raised
    norm = v.norm() if dim == -1 else torch.norm_except_dim(v, 2, dim)
    if dim in (0, v.dim() - 1) and g.numel() == norm.numel():  # the fused op, which torch runs
        g = g.reshape(norm.shape)  # there, reads g flat: a g of shape (out,) scales each row
    return v * (g / norm)


_REPLACED = Replacement(
    [
        (torch, "_weight_norm", _weight_norm),
        # (nn.utils.weight_norm imports it: its module's own name for it)
        (sys.modules["torch.nn.utils.weight_norm"], "_weight_norm", _weight_norm),
    ]
)


weight_norms_written_out = _REPLACED
"""``with weight_norms_written_out:`` or ``@weight_norms_written_out``: inside, in this thread,
``torch._weight_norm`` runs as its formula (module docstring)."""
