"""Convolutions: bilinear in input and weight (Leibniz), plus the bias -- each product batched
over directions with ``vmap`` (which folds them into the convolution's batch), so a convolution
costs K convolutions per order, not a dense Jacobian."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch.func import vmap

from pyhvp.taylor.jets import Context, Jet, coefficient_of, expanded, leibniz, plus, value_of
from pyhvp.taylor.registry import rule

aten = torch.ops.aten
Tensor = torch.Tensor


@rule(aten.convolution.default)
def _convolution(
    ctx: Context, out: Tensor, input: Jet | Tensor, weight: Jet | Tensor, bias: Jet | Tensor | None,
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
    output_padding: Sequence[int], groups: int,
) -> Jet:  # fmt: skip
    def conv(a: Tensor, b: Tensor) -> Tensor:
        return cast(Tensor, aten.convolution.default(a, b, None, stride, padding, dilation,
                                                     transposed, output_padding, groups))  # fmt: skip

    def coefficient(arg: Jet | Tensor, order: int) -> Tensor | None:
        """The coefficient with every dim full but the batch (dim 0 of an input; a shared
        direction stays shared through the convolution)."""
        value = value_of(arg)
        c = coefficient_of(arg, value.ndim, order)
        keep = [0] if arg is input else []
        return None if c is None else expanded(c, value.shape, [d for d in range(value.ndim)
                                                                if d not in keep])  # fmt: skip

    def paired(a: Tensor, b: Tensor) -> Tensor:  # two coefficients: one lead for both
        lead = max(a.shape[0], b.shape[0])
        return vmap(conv)(a.expand(lead, *a.shape[1:]), b.expand(lead, *b.shape[1:]))

    orders = range(1, ctx.order + 1)
    coefficients = leibniz(
        ctx, vmap(conv, in_dims=(0, None)), value_of(input), value_of(weight),
        [coefficient(input, k) for k in orders], [coefficient(weight, k) for k in orders],
        right=lambda cw, x: vmap(conv, in_dims=(None, 0))(x, cw), both=paired,
    )  # fmt: skip
    if isinstance(bias, Jet):  # (L, C_out) -> (L, 1, C_out, 1, ...)
        for k in orders:
            cb = coefficient_of(bias, 1, k)
            if cb is not None:
                column = cb.reshape(cb.shape[0], 1, -1, *(1,) * (out.ndim - 2))
                coefficients[k - 1] = plus(coefficients[k - 1], column)
    return Jet(out, tuple(coefficients))  # an input is a jet: the first is not None
