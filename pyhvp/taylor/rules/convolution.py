"""Convolutions: bilinear in input and weight, plus the bias -- each product batched over
directions with ``vmap`` (which folds them into the convolution's batch), so a convolution
costs K convolutions, not a dense Jacobian."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch.func import vmap

from pyhvp.taylor.jets import Context, Jet, coefficient_of, expanded, plus, value_of
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

    x, w = value_of(input), value_of(weight)

    def through(order: int) -> Tensor | None:
        cx, cw = coefficient(input, order), coefficient(weight, order)
        terms = [
            None if cx is None else vmap(conv, in_dims=(0, None))(cx, w),
            None if cw is None else vmap(conv, in_dims=(None, 0))(x, cw),
        ]
        cb = coefficient_of(bias, 1, order) if isinstance(bias, Jet) else None
        if cb is not None:  # (L, C_out) -> (L, 1, C_out, 1, ...)
            terms.append(cb.reshape(cb.shape[0], 1, -1, *(1,) * (out.ndim - 2)))
        return plus(*terms)

    first, second = through(1), through(2)
    fx, fw = coefficient(input, 1), coefficient(weight, 1)
    if fx is not None and fw is not None:
        lead = max(fx.shape[0], fw.shape[0])
        fx, fw = fx.expand(lead, *fx.shape[1:]), fw.expand(lead, *fw.shape[1:])
        second = plus(second, 2 * ctx.pair(vmap(conv), fx, fw))
    return Jet(out, cast(Tensor, first), second)  # an input is a jet: not None
