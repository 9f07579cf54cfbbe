"""Views, copies, concatenation and indexing: ops that move, select or repeat elements (their
coefficients move the same way)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.func import vmap

from pyhvp.taylor.custom_ops import WITH_DERIVATIVES_OF
from pyhvp.taylor.fallbacks import UnsupportedOpError
from pyhvp.taylor.jets import (
    ENGINE,
    Context,
    Dims,
    Jet,
    axes,
    axis,
    broadcast_dims,
    coefficient_of,
    expanded,
    lifted,
    linear,
    rearrange,
    value_of,
)
from pyhvp.taylor.registry import apply, rule

aten = torch.ops.aten
Tensor = torch.Tensor


def _reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Consecutive dims of ``src`` and ``dst`` that a reshape maps onto each other."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gs, gd, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gs.append(i)
                ps *= src[i]
                i += 1
            else:
                gd.append(j)
                pd *= dst[j]
                j += 1
        groups.append((gs, gd))
    groups += [([k], []) for k in range(i, len(src))] + [([], [k]) for k in range(j, len(dst))]
    return groups


def reshaped(t: Tensor, src: Sequence[int], dst: Sequence[int]) -> Tensor:
    """A coefficient of a value reshaped ``src -> dst``; broadcast dims stay broadcast where
    every dim they merge with is broadcast too."""
    lead = t.shape[0]
    if tuple(t.shape[1:]) == tuple(src) or 0 in src:
        return expanded(t, src).reshape(lead, *dst)
    sizes, expand_dims = [], []
    for gs, gd in _reshape_groups(src, dst):
        wide = [d for d in gs if src[d] != 1]
        shared = [d for d in wide if t.shape[d + 1] == 1]
        if wide and len(shared) == len(wide):  # constant along the whole group
            sizes += [1] * len(gd)
        else:
            expand_dims += shared
            sizes += [dst[d] for d in gd]
    return expanded(t, src, expand_dims).reshape(lead, *sizes)


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def _view(ctx: Context, out: Tensor, u: Jet, size: object) -> Jet:
    return rearrange(out, u, lambda t: reshaped(t, u.value.shape, out.shape))


@rule(aten.permute.default, aten.permute_copy.default)
def _permute(ctx: Context, out: Tensor, u: Jet, dims: Sequence[int]) -> Jet:
    nd = u.value.ndim
    order = [0, *(axis(d, nd) + 1 for d in dims)]
    return rearrange(out, u, lambda t: t.permute(order))


@rule(aten.transpose.int, aten.transpose_copy.int)
def _transpose(ctx: Context, out: Tensor, u: Jet, d0: int, d1: int) -> Jet:
    nd = u.value.ndim
    return rearrange(out, u, lambda t: t.transpose(axis(d0, nd) + 1, axis(d1, nd) + 1))


@rule(aten.t.default)
def _t(ctx: Context, out: Tensor, u: Jet) -> Jet:
    return rearrange(out, u, lambda t: t.transpose(1, 2) if u.value.ndim == 2 else t)


@rule(aten.expand.default, aten.expand_copy.default)
def _expand(ctx: Context, out: Tensor, u: Jet, size: object, implicit: bool = False) -> Jet:
    return rearrange(out, u, lambda t: lifted(t, out.ndim))  # new and size-1 dims stay broadcast


@rule(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def _unsqueeze(ctx: Context, out: Tensor, u: Jet, dim: int) -> Jet:
    return rearrange(out, u, lambda t: t.unsqueeze(axis(dim, out.ndim) + 1))


@rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.dims)
def _squeeze(ctx: Context, out: Tensor, u: Jet, dims: Dims = None) -> Jet:
    nd = u.value.ndim
    unit = [d for d in axes(dims, nd) if u.value.shape[d] == 1]
    return rearrange(out, u, lambda t: t.squeeze(tuple(d + 1 for d in unit)) if unit else t)


@rule(aten.select.int, aten.select_copy.int)
def _select(ctx: Context, out: Tensor, u: Jet, dim: int, index: int) -> Jet:
    d = axis(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        return t.select(d + 1, 0 if d in broadcast_dims(t, u.value.shape) else index)

    return rearrange(out, u, fn)


@rule(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(
    ctx: Context, out: Tensor, u: Jet, dim: int = 0, start: object = None, end: object = None,
    step: int = 1,
) -> Jet:  # fmt: skip
    d = axis(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        if d in broadcast_dims(t, u.value.shape):
            return t
        return cast(Tensor, aten.slice.Tensor(t, d + 1, start, end, step))  # aten ops are untyped

    return rearrange(out, u, fn)


@rule(WITH_DERIVATIVES_OF)
def _with_derivatives_of(ctx: Context, out: Tensor, value: object, source: object) -> Any:
    if not isinstance(source, Jet):
        return out
    return Jet(out, source.coefficients)


@rule(aten.clone.default, aten.alias.default, aten.detach.default)  # detach: an alias here
def _identity(ctx: Context, out: Tensor, u: Jet, *args: object, **kwargs: object) -> Jet:
    return Jet(out, u.coefficients)


@rule(aten._to_copy.default)
def _to_copy(ctx: Context, out: Tensor, u: Jet, **kwargs: object) -> Jet:
    return linear(out, u, lambda t: t.to(dtype=out.dtype, device=out.device))


@rule(aten.copy.default, aten.copy_.default)  # copy_: a decomposition's write, out of place
def _copy(ctx: Context, out: Tensor, dst: object, src: object, non_blocking: bool = False) -> Any:
    if not isinstance(src, Jet):
        return out
    return linear(out, src, lambda t: lifted(t, out.ndim).to(out.dtype))


@rule(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(
    ctx: Context, out: Tensor, u: Jet, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> Jet:
    nd = u.value.ndim
    d1, d2 = axis(dim1, nd), axis(dim2, nd)

    def fn(t: Tensor) -> Tensor:
        return expanded(t, u.value.shape, [d1, d2]).diagonal(offset, d1 + 1, d2 + 1)

    return rearrange(out, u, fn)


def _strided_index(value: Tensor, size: Sequence[int], stride: Sequence[int],
                   storage_offset: int | None) -> tuple[list[int], Tensor] | None:  # fmt: skip
    """Where ``value.as_strided(size, stride, storage_offset)`` reads, as ``(order, index)``:
    the element ``index[i]`` of ``value.permute(order)`` flattened is the view's element ``i``.
    None unless ``value`` is dense in its storage (a permutation of a contiguous tensor) and the
    view reads only its elements."""
    strides = value.stride()
    order = sorted(range(value.ndim), key=lambda d: -strides[d])
    if not value.permute(order).is_contiguous():
        return None
    start = 0 if storage_offset is None else storage_offset - value.storage_offset()
    reach = [(n - 1) * s for n, s in zip(size, stride, strict=True)]
    low = start + sum(r for r in reach if r < 0)
    high = start + sum(r for r in reach if r > 0)
    if 0 not in size and (low < 0 or high >= value.numel()):
        return None
    flat = torch.arange(max(value.numel(), 1), device=value.device)
    return order, flat.as_strided(size, stride, 0 if 0 in size else start)


@rule(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(
    ctx: Context, out: Tensor, u: Jet, size: Sequence[int], stride: Sequence[int],
    storage_offset: int | None = None,
) -> Jet:  # fmt: skip
    """A strided view of a value dense in its storage (group norm's decomposition on CPU): each
    coefficient gathers the same elements, found by the view's strides on the value's flat
    storage order -- not by ``as_strided`` on the coefficient, whose leading axis and broadcast
    dims give it other strides. Views of other tensors, or past the value's elements, are
    refused: autograd's fallback would read other memory than ``f`` did."""
    value = u.value
    where = _strided_index(value, size, stride, storage_offset)
    if where is None:
        raise UnsupportedOpError(
            f"pyhvp: f takes an as_strided view (size {tuple(size)}, stride {tuple(stride)}, "
            f"storage offset {storage_offset}) of a tensor of shape {tuple(value.shape)}, strides "
            f"{value.stride()} and storage offset {value.storage_offset()}; {ENGINE} supports "
            f"such views only of a tensor dense in memory (.contiguous() makes one) that read its "
            f"elements alone. Take the view of a contiguous tensor, or use ordinary views "
            f"(slicing, view, unfold)"
        )
    order, index = where
    permuted = [0, *(d + 1 for d in order)]

    def fn(t: Tensor) -> Tensor:
        flat = expanded(t, value.shape).permute(permuted).reshape(t.shape[0], -1)
        return flat[:, index]

    return rearrange(out, u, fn)


@rule(aten.constant_pad_nd.default)
def _pad(ctx: Context, out: Tensor, u: Jet, pad: Sequence[int], value: float = 0) -> Jet:
    nd = u.value.ndim
    padded = [nd - 1 - i // 2 for i in range(len(pad))]

    def fn(t: Tensor) -> Tensor:
        return cast(
            Tensor, aten.constant_pad_nd.default(expanded(t, u.value.shape, padded), pad, 0.0)
        )

    return linear(out, u, fn)


def _scattered(ctx: Context, out: Tensor, base: Jet | Tensor, src: Jet | Tensor,
               write: Callable[[Tensor, Tensor], Tensor]) -> Jet:  # fmt: skip
    """A write of ``src`` into a view of ``base`` (functionalized): linear in ``(base, src)``, so
    each coefficient is the same write, one dim further right (``write`` shifts its dims)."""
    value, written = value_of(base), value_of(src)

    def through(order: int) -> Tensor | None:
        cb, cs = coefficient_of(base, value.ndim, order), coefficient_of(src, written.ndim, order)
        if cb is None and cs is None:
            return None
        lead = max(c.shape[0] for c in (cb, cs) if c is not None)
        zero = value.new_zeros(())
        cb = (zero if cb is None else cb).expand(lead, *value.shape)
        cs = (zero if cs is None else cs).expand(lead, *written.shape)
        return write(cb, cs)

    return Jet(out, tuple(through(k) for k in range(1, ctx.order + 1)))  # base or src: a jet


@rule(aten.slice_scatter.default)
def _slice_scatter(ctx: Context, out: Tensor, base: Jet | Tensor, src: Jet | Tensor, dim: int = 0,
                   start: int | None = None, end: int | None = None, step: int = 1) -> Jet:  # fmt: skip
    d = axis(dim, out.ndim)
    return _scattered(ctx, out, base, src, lambda b, s: aten.slice_scatter.default(b, s, d + 1, start,
                                                                              end, step))  # fmt: skip


@rule(aten.select_scatter.default)
def _select_scatter(ctx: Context, out: Tensor, base: Jet | Tensor, src: Jet | Tensor, dim: int,
                    index: int) -> Jet:  # fmt: skip
    d = axis(dim, out.ndim)
    return _scattered(
        ctx, out, base, src, lambda b, s: aten.select_scatter.default(b, s, d + 1, index)
    )


@rule(aten.diagonal_scatter.default)
def _diagonal_scatter(ctx: Context, out: Tensor, base: Jet | Tensor, src: Jet | Tensor, offset: int = 0,
                      dim1: int = 0, dim2: int = 1) -> Jet:  # fmt: skip
    d1, d2 = axis(dim1, out.ndim) + 1, axis(dim2, out.ndim) + 1
    return _scattered(ctx, out, base, src,
                      lambda b, s: aten.diagonal_scatter.default(b, s, offset, d1, d2))  # fmt: skip


@rule(aten.as_strided_scatter.default)
def _as_strided_scatter(
    ctx: Context, out: Tensor, base: Jet | Tensor, src: Jet | Tensor, size: Sequence[int],
    stride: Sequence[int], storage_offset: int | None = None,
) -> Jet:  # fmt: skip
    """A write through an ``as_strided`` view (functionalized): linear in ``(base, src)``. Each
    coefficient is made contiguous, ``(L, *base.shape)``, so the direction axis is one more
    stride (``base.numel()``) of the same strided write -- when ``base`` itself is contiguous
    from offset 0, as the strides then address the same elements (vmap has no batching rule)."""
    value = value_of(base)
    if not value.is_contiguous() or value.storage_offset() != 0:
        raise RuntimeError(
            f"pyhvp: f writes through an as_strided view of a tensor of shape "
            f"{tuple(value.shape)} and strides {value.stride()} (storage offset "
            f"{value.storage_offset()}); the Taylor engine supports such writes into contiguous "
            f"tensors only. Write through ordinary views (slicing, view, select) instead"
        )
    nd = value.ndim

    def scattered(order: int) -> Tensor | None:
        cb, cs = coefficient_of(base, nd, order), coefficient_of(src, len(size), order)
        if cb is None and cs is None:
            return None
        lead = max(c.shape[0] for c in (cb, cs) if c is not None)
        zero = value.new_zeros(())
        cb = (zero if cb is None else cb).expand(lead, *value.shape).contiguous()
        cs = (zero if cs is None else cs).expand(lead, *size)
        return cast(Tensor, aten.as_strided_scatter.default(  # aten ops are untyped
            cb, cs, (lead, *size), (value.numel(), *stride), storage_offset))  # fmt: skip

    return Jet(out, tuple(scattered(k) for k in range(1, ctx.order + 1)))  # base or src: a jet


@rule(aten.cat.default)
def _cat(ctx: Context, out: Tensor, tensors: Sequence[Jet | Tensor], dim: int = 0) -> Jet:
    nd = out.ndim
    d = axis(dim, nd)
    parts = [t for t in tensors if value_of(t).numel() > 0 or value_of(t).ndim == nd]

    def join(order: int) -> Tensor | None:
        coefficients = [coefficient_of(t, nd, order) for t in parts]
        present = [c for c in coefficients if c is not None]
        if not present:
            return None
        lead = max(c.shape[0] for c in present)
        # a dim other than ``d`` stays broadcast only if it is broadcast in every part
        sizes = [
            1 if all(c is None or c.shape[i + 1] == 1 for c in coefficients) else out.shape[i]
            for i in range(nd)
        ]
        pieces = []
        for part, c in zip(parts, coefficients, strict=True):
            shape = [lead, *sizes]
            shape[d + 1] = value_of(part).shape[d]
            pieces.append(present[0].new_zeros(()).expand(shape) if c is None else c.expand(shape))
        return torch.cat(pieces, d + 1)

    return Jet(out, tuple(join(k) for k in range(1, ctx.order + 1)))  # a part is a jet


@rule(aten.stack.default)
def _stack(ctx: Context, out: Tensor, tensors: Sequence[Jet | Tensor], dim: int = 0) -> Jet:
    d = axis(dim, out.ndim)
    columns = [apply(ctx, aten.unsqueeze.default, t, d) for t in tensors]
    return cast(Jet, apply(ctx, aten.cat.default, columns, d))


@rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(ctx: Context, out: Sequence[Tensor], u: Jet, sizes: object, dim: int = 0) -> list[Jet]:
    d = axis(dim, u.value.ndim)
    starts = [0]
    for piece in out:
        starts.append(starts[-1] + piece.shape[d])
    return [apply(ctx, aten.slice.Tensor, u, d, a, b) for a, b in itertools.pairwise(starts)]


@rule(aten.unbind.int)
def _unbind(ctx: Context, out: Sequence[Tensor], u: Jet, dim: int = 0) -> list[Jet]:
    d = axis(dim, u.value.ndim)
    return [apply(ctx, aten.select.int, u, d, i) for i in range(len(out))]


@rule(aten.flip.default)
def _flip(ctx: Context, out: Tensor, u: Jet, dims: Sequence[int]) -> Jet:
    nd = u.value.ndim

    def fn(t: Tensor) -> Tensor:  # flipping a broadcast (constant) dim changes nothing
        flipped = [
            axis(d, nd) + 1 for d in dims if axis(d, nd) not in broadcast_dims(t, u.value.shape)
        ]
        return t.flip(flipped) if flipped else t

    return rearrange(out, u, fn)


@rule(aten.index.Tensor)
def _index(ctx: Context, out: Tensor, u: Jet, indices: Sequence[Tensor | None]) -> Jet:
    indexed = [d for d, i in enumerate(indices) if i is not None]
    present = cast(Sequence[Tensor], indices)  # not None at the positions in indexed
    if any(present[d].dtype == torch.bool for d in indexed):  # masks: let vmap place the dims
        return linear(out, u, lambda t: vmap(lambda z: aten.index.Tensor(z, list(indices)))(
            expanded(t, u.value.shape)))  # fmt: skip
    # index tensors in non-adjacent dims put their broadcast dims first (numpy's rule), which
    # for the coefficient means before its leading axis: move that axis back to the front
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    index_ndim = len(torch.broadcast_shapes(*(present[d].shape for d in indexed)))  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def fn(t: Tensor) -> Tensor:
        result: Tensor = aten.index.Tensor(expanded(t, u.value.shape, indexed), [None, *indices])
        return result if adjacent else result.movedim(index_ndim, 0)

    return rearrange(out, u, fn)


@rule(aten.index_select.default)
def _index_select(ctx: Context, out: Tensor, u: Jet, dim: int, index: Tensor) -> Jet:
    d = axis(dim, u.value.ndim)
    return rearrange(out, u, lambda t: expanded(t, u.value.shape, [d]).index_select(d + 1, index))


@rule(aten.gather.default)
def _gather(
    ctx: Context, out: Tensor, u: Jet, dim: int, index: Tensor, sparse_grad: bool = False
) -> Jet:
    d = axis(dim, u.value.ndim)

    def fn(t: Tensor) -> Tensor:
        return torch.gather(
            expanded(t, u.value.shape), d + 1, index.expand(t.shape[0], *index.shape)
        )

    return rearrange(out, u, fn)


@rule(aten.masked_select.default)
def _masked_select(ctx: Context, out: Tensor, u: Jet, mask: Tensor) -> Jet:
    """The elements where ``mask`` (broadcast with ``u``) holds, per direction."""
    shape = torch.broadcast_shapes(u.value.shape, mask.shape)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    chosen = mask.expand(shape)

    def fn(t: Tensor) -> Tensor:
        full = lifted(t, len(shape)).expand(t.shape[0], *shape)
        return full[:, chosen]

    return rearrange(out, u, fn) if tuple(u.value.shape) == tuple(shape) else linear(out, u, fn)
