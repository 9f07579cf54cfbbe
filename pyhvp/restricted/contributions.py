"""What a one-hot direction of a selected operand adds to the output of the op that consumes it,
for ops linear in that operand, computed from the other operands alone (never a product with a
dense one-hot tensor of the operand's shape).

A :class:`Contribution` holds, for k selected entries of the operand, each entry's tangent of the
op's output; :func:`inject` adds ``sum_p z_p * tangent_p`` to the output. The ops:

* the einsum family (:func:`einsum_contribution`): ``torch.einsum``, ``F.linear``, ``matmul`` /
  ``mm`` / ``bmm`` / ``@`` with either operand selected -- the other operands gathered at the
  entry's indices and contracted over the rest;
* convolutions (:func:`conv_contribution`): entry ``(o, c, i, j)`` of a kernel adds the input
  channel ``c`` (of its group), shifted by ``(i, j)`` times the dilation and strided, to output
  channel ``o`` -- a gather of the padded input;
* transposed convolutions (:func:`conv_transpose_contribution`): input channel ``c`` scattered
  through a one-hot kernel into output channel ``o``, one grouped transposed convolution for all
  k entries;
* embeddings (:func:`embedding_contribution`): entry ``(r, c)`` adds 1 at feature ``c`` of every
  token equal to ``r`` -- eagerly as the list of those (token, entry) pairs, so that a batched
  pass costs what the matches are, not ``k`` times every token.

Every function here is plain torch code, differentiable (a direction's tangent depends on the
other operands, which may carry directions of other selected tensors) and traceable by dynamo.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Contribution(NamedTuple):
    """Each of k entries' tangent of an op's output ``out``. With ``entries`` set, a list of
    nonzeros: entry ``entries[n]``'s tangent is ``values[n]`` at flat position ``positions[n]``
    of ``out`` (``dim`` unused). Else with ``dim`` None, ``values`` is ``(k, *out.shape)``; else
    entry p's tangent is ``values[p]`` (``out.shape`` without ``dim``) placed at index
    ``positions[p]`` of ``out``'s dim ``dim`` (zero elsewhere)."""

    dim: int | None
    positions: torch.Tensor | None
    values: torch.Tensor
    entries: torch.Tensor | None = None


DENSE_PLACED = 16
"""Most positions of a placed dim for which directions may enter as a dense ``(k, *out)``
matrix: its products cost that many times the elements ``index_add`` moves."""


def inject(out: torch.Tensor, part: torch.Tensor, c: Contribution, batch: int) -> torch.Tensor:
    """``out + sum_p part[p] * tangent_p``. ``batch``: how many directions the Hessian pass
    pushes at once. Placed tangents enter by ``index_add`` (its batched backward holds ``batch *
    k`` tangents of ``values``' size), unless ``batch`` exceeds the placed dim's size, that is
    at most :data:`DENSE_PLACED` (a convolution's few channels) and ``values`` is constant in
    the pass: then as a dense ``(k, *out.shape)`` matrix contracted with ``part``, a matrix
    product in every pass. Values that depend on ``part`` (an input carrying the directions of
    another tensor of the group) would make that matrix ``batch`` times over (LeNet-5's fc2
    after fc1 at k = 128 per tensor: 477 ms against 106 by ``index_add``)."""
    z = part.to(out.dtype)
    values = c.values.to(out.dtype)
    if c.entries is not None:
        assert c.positions is not None
        flat = out.reshape(-1).index_add(0, c.positions, z[c.entries] * values)
        return flat.view(out.shape)
    k = values.shape[0]
    if c.dim is None:
        return out + torch.tensordot(z, values, 1)  # type: ignore[no-any-return]
    assert c.positions is not None
    size = out.shape[c.dim]
    if batch <= size or size > DENSE_PLACED or values.requires_grad:
        scaled = values * z.view(k, *[1] * (values.ndim - 1))
        return out.index_add(c.dim, c.positions, scaled.movedim(0, c.dim))
    shape = [k] + [1] * out.ndim
    shape[1 + c.dim] = size
    one_hot = one_hot_rows(c.positions, size, out.dtype).view(shape)
    return out + torch.tensordot(z, values.unsqueeze(1 + c.dim) * one_hot, 1)  # type: ignore[no-any-return]


def one_hot_rows(positions: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """``(*positions.shape, size)``: 1 at each position, else 0. ``F.one_hot``, but for a
    ``size`` of 0 (an op's output with an empty dim), which it refuses."""
    if size == 0:
        return torch.zeros(*positions.shape, 0, dtype=dtype, device=positions.device)
    return F.one_hot(positions, size).to(dtype)


def tangents(c: Contribution, into: torch.Tensor) -> torch.Tensor:
    """Fills ``into``, zeros of shape ``(k, *out.shape)``, with each entry's tangent of ``out``
    (the dense form of ``c``), and returns it."""
    values = c.values.detach().to(into.dtype)
    if c.entries is not None:
        assert c.positions is not None
        into.view(len(into), -1).index_put_((c.entries, c.positions), values, accumulate=True)
    elif c.dim is None:
        into.copy_(values)
    else:
        assert c.positions is not None
        where = torch.arange(len(into), device=into.device)
        into.movedim(1 + c.dim, 1)[where, c.positions] = values
    return into


def reduced(c: Contribution, shape: Sequence[int], dims: Sequence[int], mean: bool) -> Contribution:
    """A list of nonzeros ``c`` (``c.entries`` set) of a value of ``shape``, moved to a sum
    (``mean``: a mean) of that value over ``dims``, keepdim or not: each to its position
    there, scaled by one over the reduced size for a mean (repeats add up in :func:`inject`)."""
    assert c.entries is not None and c.positions is not None
    coords = torch.unravel_index(c.positions, tuple(shape))
    positions = torch.zeros_like(c.positions)
    for d, size in enumerate(shape):
        if d not in dims:
            positions = positions * size + coords[d]
    values = c.values / math.prod(shape[d] for d in dims) if mean else c.values
    return Contribution(None, positions, values, c.entries)


# --- the einsum family ---------------------------------------------------------------------


def parse_einsum(equation: str, ndims: Sequence[int]) -> tuple[list[str], str]:
    """``equation``'s operand and output subscripts, ellipses spelt out as letters (broadcast
    right-aligned) and an implicit output made explicit (letters seen once, sorted, after the
    ellipsis dims), as ``torch.einsum`` reads it."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    inputs = lhs.split(",")
    free = iter(c for c in string.ascii_letters if c not in equation)
    widths = [n - (len(spec) - 3) for spec, n in zip(inputs, ndims, strict=True) if "..." in spec]
    ellipsis = "".join(next(free) for _ in range(max(widths, default=0)))

    def spell(spec: str, n: int) -> str:
        return spec.replace("...", ellipsis[len(ellipsis) - n :]) if "..." in spec else spec

    inputs = [
        spell(spec, n - (len(spec) - 3) if "..." in spec else 0)
        for spec, n in zip(inputs, ndims, strict=True)
    ]
    if arrow:
        return inputs, rhs.replace("...", ellipsis)
    letters = "".join(s.replace("...", "") for s in lhs.split(","))
    once = sorted(c for c in set(letters) if letters.count(c) == 1)
    return inputs, ellipsis + "".join(once)


def matmul_subscripts(a_ndim: int, b_ndim: int) -> tuple[list[str], str]:
    """``torch.matmul``'s contraction as einsum subscripts (1-D operands, broadcast batch dims)."""
    if a_ndim == 1 and b_ndim == 1:
        return ["k", "k"], ""
    batch = "abcdefgh"[: max(a_ndim, b_ndim) - 2]
    a = "k" if a_ndim == 1 else batch[len(batch) - (a_ndim - 2) :] + "nk"
    b = "k" if b_ndim == 1 else batch[len(batch) - (b_ndim - 2) :] + "km"
    return [a, b], batch + ("n" if a_ndim > 1 else "") + ("m" if b_ndim > 1 else "")


def linear_subscripts(x_ndim: int, w_ndim: int) -> tuple[list[str], str]:
    """``F.linear(x, w)`` (``x @ w.T``) as einsum subscripts."""
    batch = "abcdefgh"[: x_ndim - 1]
    return [batch + "i", "oi" if w_ndim == 2 else "i"], batch + ("o" if w_ndim == 2 else "")


def einsum_flops(inputs: Sequence[str], output: str, operands: Sequence[torch.Tensor]) -> int:
    """Multiply-adds of the contraction: the product of every index's size."""
    sizes: dict[str, int] = {}
    for spec, t in zip(inputs, operands, strict=True):
        for letter, n in zip(spec, t.shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), n)
    return math.prod(sizes.values())


def einsum_contribution(
    inputs: Sequence[str],
    output: str,
    operands: Sequence[torch.Tensor],
    selected: int,
    coords: torch.Tensor,
) -> Contribution | str:
    """The tangents of ``einsum(inputs -> output, *operands)`` along k one-hot directions of
    operand ``selected`` (its entries' coordinates ``coords``, ``(ndim, k)``): each other operand
    gathered at the entry's indices, then contracted. A reason (str) where this does not apply."""
    spec = inputs[selected]
    weight = operands[selected]
    if len(set(spec)) != len(spec):
        return "an index repeated within the selected operand (a diagonal)"
    k = coords.shape[1]
    sizes: dict[str, int] = {}
    for s, t in zip(inputs, operands, strict=True):
        for letter, n in zip(s, t.shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), n)
    # the selected operand's indices; a size-1 dim broadcasts it and selects nothing
    own = {letter: coords[i] for i, letter in enumerate(spec) if weight.shape[i] != 1}
    batch_letter = next(c for c in string.ascii_letters if c not in sizes)
    specs, tensors = [], []
    for s, t in (
        pair for i, pair in enumerate(zip(inputs, operands, strict=True)) if i != selected
    ):
        hit = [i for i, letter in enumerate(s) if letter in own]
        if hit:
            t = t.expand([sizes[letter] if letter in own else -1 for letter in s])
            t = t.movedim(hit, list(range(len(hit))))[tuple(own[s[i]] for i in hit)]
            s = batch_letter + "".join(letter for letter in s if letter not in own)
        specs.append(s)
        tensors.append(t)
    rest = "".join(letter for letter in output if letter not in own)
    present = set("".join(specs))
    computed = "".join(letter for letter in rest if letter in present)
    if tensors:
        lead = batch_letter if batch_letter in present else ""
        equation = f"{','.join(specs)}->{lead}{computed}"
        # one gathered operand already in the output's order (x @ W.T): it is the tangents
        same = len(tensors) == 1 and specs[0] == lead + computed
        values = tensors[0] if same else torch.einsum(equation, *tensors)
        if not lead:  # no other operand shares an index with the selection
            values = values.expand(k, *values.shape)
    else:
        values = weight.new_ones(k)
    # indices only the selected operand has, at size 1, kept as size-1 dims of the output
    for i, letter in enumerate(rest):
        if letter not in present:
            values = values.unsqueeze(1 + i)
    placed = [dim for dim, letter in enumerate(output) if letter in own]
    if not placed:
        return Contribution(None, None, values)
    if len(placed) == 1:
        return Contribution(placed[0], own[output[placed[0]]], values)
    for dim in placed:  # several dims placed (a batched selected operand): a dense tangent
        values = values.unsqueeze(1 + dim)
    for dim in placed:
        letter = output[dim]
        shape = [k] + [1] * len(output)
        shape[1 + dim] = sizes[letter]
        values = values * one_hot_rows(own[letter], sizes[letter], values.dtype).view(shape)
    return Contribution(None, None, values)


# --- convolutions --------------------------------------------------------------------------


def _pads(
    padding: str | int | Sequence[int],
    kernel: Sequence[int],
    dilation: Sequence[int],
) -> list[tuple[int, int]]:
    """(left, right) zero padding per spatial dim, as the convolution applies it ("same": the
    odd one on the right)."""
    if padding == "valid":
        return [(0, 0)] * len(kernel)
    if padding == "same":
        totals = [d * (n - 1) for n, d in zip(kernel, dilation, strict=True)]
        return [(t // 2, t - t // 2) for t in totals]
    assert not isinstance(padding, str)
    return [(p, p) for p in _per_dim(padding, len(kernel))]


def _per_dim(value: int | Sequence[int], n: int) -> list[int]:
    return [int(value)] * n if isinstance(value, int) else [int(v) for v in value]


def conv_contribution(
    x: torch.Tensor,
    weight: torch.Tensor,
    coords: torch.Tensor,
    stride: int | Sequence[int] = 1,
    padding: str | int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Contribution:
    """Tangents of ``conv{n}d(x, weight, ...)`` along k one-hot kernel entries ``coords``
    (``(2 + n, k)``: output channel, input channel within the group, kernel offsets): the padded
    input's channel, shifted and strided, placed in the output channel."""
    spatial = weight.ndim - 2
    batched = x.ndim == spatial + 2
    if not batched:
        x = x.unsqueeze(0)
    kernel = list(weight.shape[2:])
    strides = _per_dim(stride, spatial)
    dilations = _per_dim(dilation, spatial)
    pads = _pads(padding, kernel, dilations)
    flat_pads = [p for pair in reversed(pads) for p in pair]
    padded = F.pad(x, flat_pads) if any(flat_pads) else x
    sizes = padded.shape[2:]
    outs = [(n - dilations[d] * (kernel[d] - 1) - 1) // strides[d] + 1 for d, n in enumerate(sizes)]
    out_channel, in_channel, offsets = coords[0], coords[1], coords[2:]
    channel = out_channel // (weight.shape[0] // groups) * weight.shape[1] + in_channel
    k = coords.shape[1]
    # flat index into one image of the padded input, per entry and output position
    index = (channel * math.prod(sizes)).view(k, *[1] * spatial)
    for d in range(spatial):
        step = math.prod(sizes[d + 1 :])
        start = offsets[d] * dilations[d]
        along = torch.arange(outs[d], device=x.device) * strides[d]
        shape = [k] + [1] * spatial
        shape[1 + d] = outs[d]
        index = index + ((start.view(k, 1) + along) * step).view(shape)
    gathered = padded.flatten(1).index_select(1, index.flatten())
    values = gathered.view(padded.shape[0], k, *outs).movedim(1, 0)
    if not batched:
        values = values.squeeze(1)
    return Contribution(1 if batched else 0, out_channel, values)


def conv_transpose_contribution(
    x: torch.Tensor,
    weight: torch.Tensor,
    coords: torch.Tensor,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    output_padding: int | Sequence[int] = 0,
    groups: int = 1,
    dilation: int | Sequence[int] = 1,
) -> Contribution:
    """Tangents of ``conv_transpose{n}d(x, weight, ...)`` along k one-hot kernel entries
    ``coords`` (``(2 + n, k)``: input channel, output channel within the group, kernel offsets):
    each entry's input channel through a one-hot kernel, all k in one grouped transposed
    convolution, placed in the output channel."""
    spatial = weight.ndim - 2
    batched = x.ndim == spatial + 2
    if not batched:
        x = x.unsqueeze(0)
    in_channel, out_local, offsets = coords[0], coords[1], coords[2:]
    k = coords.shape[1]
    out_channel = in_channel // (weight.shape[0] // groups) * weight.shape[1] + out_local
    kernel = weight.shape[2:]
    position = torch.zeros_like(in_channel)
    for d in range(spatial):
        position = position * kernel[d] + offsets[d]
    one_hot = one_hot_rows(position, math.prod(kernel), x.dtype).view(k, 1, *kernel)
    transpose = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
    values = transpose(
        x.index_select(1, in_channel),
        one_hot,
        None,
        stride,
        padding,
        output_padding,
        k,
        dilation,
    ).movedim(1, 0)
    if not batched:
        values = values.squeeze(1)
    return Contribution(1 if batched else 0, out_channel, values)


def embedding_contribution(
    indices: torch.Tensor, weight: torch.Tensor, coords: torch.Tensor
) -> Contribution:
    """Tangents of ``F.embedding(indices, weight)`` along k one-hot entries ``coords`` (row,
    column) of the table: 1 at the column of every token equal to the row (the true derivative,
    also in a ``padding_idx`` row, where autograd's is zero: the caller routes such entries to
    the reverse route). Eagerly the (token, entry) pairs that match; traced, where dynamo needs
    static shapes, each entry's ``(k, *indices.shape)`` indicator placed at its column (a batched
    pass then moves ``k`` times every token's feature)."""
    rows, columns = coords[0], coords[1]
    k = rows.shape[0]
    matches = indices.unsqueeze(0) == rows.view(k, *[1] * indices.ndim)
    if torch.compiler.is_compiling():
        return Contribution(indices.ndim, columns, matches.to(weight.dtype))
    entries, tokens = matches.view(k, -1).nonzero(as_tuple=True)
    positions = tokens * weight.shape[-1] + columns[entries]
    return Contribution(None, positions, torch.ones_like(positions, dtype=weight.dtype), entries)
