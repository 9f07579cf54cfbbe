"""Ops linear in their floating inputs (scatters, pools, pads, triangles, rolls, ...): each
coefficient goes through the op itself (:func:`~pyhvp.taylor.fallbacks.linear_rule`), as
``register_jet_rule(op, linear=True)`` / ``indexing=True`` does for a user's op."""

import torch

from pyhvp.taylor.fallbacks import linear_rule
from pyhvp.taylor.registry import RULES

aten = torch.ops.aten

INDEXING = (
    aten.roll.default,
    aten.tril.default,
    aten.triu.default,
    aten.take.default,
    aten.unfold.default,
    aten.unfold_copy.default,
    aten.alias_copy.default,
    aten.lift_fresh_copy.default,
    aten.narrow_copy.default,
    aten.t_copy.default,
    aten.diag_embed.default,
    aten.diag.default,
)
"""Ops that only move, select or repeat (or zero) the elements of their one floating input."""

LINEAR = (
    aten.index_add.default,
    aten.index_put.default,
    aten._unsafe_index_put.default,
    aten.scatter.src,
    aten.scatter_add.default,
    aten.index_copy.default,
    aten.masked_scatter.default,
    aten.avg_pool1d.default,
    aten.avg_pool2d.default,
    aten.avg_pool3d.default,
    aten._adaptive_avg_pool2d.default,
    aten._adaptive_avg_pool3d.default,
    aten.reflection_pad1d.default,
    aten.reflection_pad2d.default,
    aten.reflection_pad3d.default,
    aten.replication_pad1d.default,
    aten.replication_pad2d.default,
    aten.replication_pad3d.default,
    aten.col2im.default,
    aten.im2col.default,
    aten.block_diag.default,
    aten.trace.default,
)
"""Ops linear in their floating tensor inputs taken together (no additive constant): a constant
input (the tensor scattered into) has zero coefficients."""

for _op in INDEXING:
    RULES[_op] = linear_rule(_op, indexing=True)
for _op in LINEAR:
    RULES[_op] = linear_rule(_op, jointly=True)
