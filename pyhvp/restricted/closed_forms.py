"""Ops whose tangents and second-order term the forward-tangent route writes in closed form:
a layer norm, a softmax, a product of two matrices that both carry tangents, attention
(``scaled_dot_product_attention``, ``nn.MultiheadAttention``'s) and the cross-entropy of class
indices.

For each, :func:`closed_form` gives a :class:`ClosedForm` where the arguments carrying a
bucket's tangents are the ones written here (else None: ``vmap(jvp)`` pushes them, autograd's
batched double backward gives the term). Its ``push`` takes those arguments' ``(K, *shape)``
tangents to the output's; its ``terms``, with the adjoint ``d = dL/d output``, the ``(K, K)``
sum ``d . f''[t_i, t_j]``. ``<u, v>`` below sums over the op's reduced dim, then over the rest.

* ``F.layer_norm``, its input alone: over a row of the normalised dims (``D`` entries),
  ``n = (x - mean x) / s``, ``s = sqrt(var x + eps)``, ``y = w n + b``, ``a = w d``,
  ``c = 1 / (D s^2)`` and ``a~ = a - mean a``::

      dy[t] = w (t - mean t - n <n, t> / D) / s
      term  = c (3 <a, n> <n, t> <n, u> / D - <a~, t> <n, u> - <a~, u> <n, t>
                 - <a, n> (<t, u> - D mean t mean u))

* ``softmax(x, dim)``: ``s = softmax(x)``, ``g = s (d - <d, s>)`` (the gradient of ``d . s``)::

      ds[t] = s (t - <s, t>)
      term  = <t, g u> - <s, t> <g, u> - <s, u> <g, t>

* ``A @ B``, both carrying tangents (attention's scores and its average of the values), with
  one batch shape: ``d(AB)[t] = t_A B + A t_B``, ``term = <d, t_A u_B> + <d, u_A t_B>``.

* ``scaled_dot_product_attention(q, k, v)``, no dropout: ``S = s q k^T + mask``,
  ``P = softmax(S)``, ``O = P v``, each of the three a closed form above; its term is theirs
  summed, against the adjoints ``dP = d v^T`` of ``P`` and ``s dS`` of ``q k^T`` (``dS`` the
  softmax's backward of ``dP``).

* ``F.cross_entropy(z, y)`` of ``(N, C)`` logits and class indices, its mean or sum over the
  ``M`` rows whose class is not ``ignore_index`` (``M = 1`` for the sum), no class weights or
  label smoothing: ``p = softmax(z)`` per row, ``dL[t] = <p - onehot(y), t> / M`` over those
  rows and ``term = d (<t, p u> - <p, t> <p, u>) / M``.

Autograd's batched double backward gave the same terms at 3-9x the cost, ``vmap(jvp)`` the
tangents at up to 2x: a one-block transformer encoder's two layer norms, softmax and two
attention products took half the route's time at k = 16 per tensor, the cross-entropy a third
of the seed's ``Linear(784, 10)`` at k = 2.

>>> x, e_2 = torch.tensor([[-1.0, 0.0, 1.0]]), torch.tensor([[[0.0, 1.0, 0.0]]])
>>> norm = LayerNorm(x, (3,), None, eps=1 / 3)  # s = 1, n = x, <n, e_2> = 0
>>> norm.push(e_2)  # e_2 - mean e_2
tensor([[[-0.3333,  0.6667, -0.3333]]])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from pyhvp.restricted import contributions as rules
from pyhvp.restricted.ops import bind

Tensor = torch.Tensor

LAYER_NORMS = frozenset({F.layer_norm})
"""``nn.LayerNorm``'s call: affine in its weight and bias together (no term between them)."""

_SOFTMAXES = frozenset({torch.softmax, F.softmax, Tensor.softmax})

_FLOATING = (torch.float32, torch.float64)


class ClosedForm(Protocol):
    def push(self, *tangents: Tensor) -> Tensor:
        """The output's ``(K, *out.shape)`` tangents of the arguments' ``(K, *shape)`` ones."""

    def terms(self, adjoint: Tensor, *tangents: Tensor) -> Tensor:
        """The ``(K, K)`` second-order term between the rows of the arguments' tangents."""


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """``F.layer_norm(input, normalized_shape, weight, ..., eps)`` along its input's tangents."""

    input: Tensor
    normalized_shape: tuple[int, ...]
    weight: Tensor | None
    eps: float = 1e-5

    @functools.cached_property
    def _statistics(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """``n``, its normalised dims flattened into the last; ``1 / s`` per row; the weight,
        flattened."""
        rows = self.input.detach().flatten(self.input.ndim - len(self.normalized_shape))
        centred = rows - rows.mean(-1, keepdim=True)
        inverse = (centred.square().mean(-1, keepdim=True) + self.eps).rsqrt()
        weight = None if self.weight is None else self.weight.detach().reshape(-1)
        return centred * inverse, inverse, weight

    @functools.cached_property
    def _scale(self) -> Tensor:
        """``w / s``, the normalised dims flattened."""
        _, inverse, weight = self._statistics
        return inverse if weight is None else inverse * weight

    def push(self, *tangents: Tensor) -> Tensor:
        (given,) = tangents
        n = self._statistics[0]
        rows = given.reshape(len(given), *n.shape)
        along_n = (n * rows).mean(-1, keepdim=True)
        pushed = rows - rows.mean(-1, keepdim=True)  # in place from here: a third fewer passes
        return pushed.addcmul_(n, along_n, value=-1).mul_(self._scale).reshape(given.shape)

    def terms(self, adjoint: Tensor, *tangents: Tensor) -> Tensor:
        (given,) = tangents
        n, inverse, weight = self._statistics
        size = n.shape[-1]
        a = adjoint.reshape(n.shape) if weight is None else adjoint.reshape(n.shape) * weight
        c = inverse.square().reshape(-1) / size  # 1 / (D s^2), per row
        an = (a * n).sum(-1).reshape(-1)
        rows = given.reshape(len(given), -1, size)
        along_n = (rows * n.reshape(-1, size)).sum(-1)  # <n, t>, (K, rows)
        along_a = (rows * (a - a.mean(-1, keepdim=True)).reshape(-1, size)).sum(-1)
        means = rows.sum(-1) / size
        weight_tu = -an * c  # the weight of <t, u> - D mean t mean u
        mixed = (along_a * -c) @ along_n.mT
        terms = mixed + mixed.mT + (along_n * (3 * c * an / size)) @ along_n.mT
        terms += gram(rows * weight_tu[:, None], rows)
        return terms - (means * (weight_tu * size)) @ means.mT


@dataclasses.dataclass(frozen=True)
class Softmax:
    """``softmax(input, dim)`` along its input's tangents."""

    input: Tensor
    dim: int
    safe: bool = False
    """Rows all ``-inf`` give zeros, not NaN (attention's math kernel's ``_safe_softmax``: a
    query row whose every key is masked)."""

    @functools.cached_property
    def _output(self) -> Tensor:
        output = torch.softmax(self.input.detach(), self.dim)
        if self.safe:
            masked = torch.isneginf(self.input.detach()).all(self.dim, keepdim=True)
            output = output.masked_fill(masked, 0.0)
        return output

    def push(self, *tangents: Tensor) -> Tensor:
        (given,) = tangents
        s, dim = self._output, self.dim % self.input.ndim + 1  # the tangents' dim
        return s * (given - (given * s).sum(dim, keepdim=True))

    def gradient(self, adjoint: Tensor) -> Tensor:
        """The input's adjoint of the output's (softmax's backward)."""
        s = self._output
        return s * (adjoint - (adjoint * s).sum(self.dim, keepdim=True))

    def terms(self, adjoint: Tensor, *tangents: Tensor) -> Tensor:
        (given,) = tangents
        s, dim = self._output, self.dim % self.input.ndim
        weighted = given * self.gradient(adjoint)
        along_s = (given * s).sum(dim + 1).reshape(len(given), -1)
        along_g = weighted.sum(dim + 1).reshape(len(given), -1)
        mixed = along_s @ along_g.mT
        return gram(weighted, given) - mixed - mixed.mT


@dataclasses.dataclass(frozen=True)
class Product:
    """``A @ B`` along tangents of both (``A``'s first), of one batch shape."""

    a: Tensor
    b: Tensor

    def push(self, *tangents: Tensor) -> Tensor:
        of_a, of_b = tangents
        return _rows_times(of_a, self.b.detach()) + _times_rows(self.a.detach(), of_b)

    def terms(self, adjoint: Tensor, *tangents: Tensor) -> Tensor:
        of_a, of_b = tangents
        # <d, t_A u_B> = <t_A, d u_B^T>
        crossed = gram(of_a, _times_rows(adjoint, of_b.mT))
        return crossed + crossed.mT


def _rows_times(rows: Tensor, b: Tensor) -> Tensor:
    """``rows @ b``, ``(K, *batch, s, n) @ (*batch, n, m)``, with the K rows stacked along ``s``:
    one product per batch entry, no K copies of ``b`` (``matmul`` broadcasts by copying); other
    batch shapes by ``matmul``."""
    if rows.shape[1:-2] != b.shape[:-2]:
        return torch.matmul(rows, b)
    k, s = rows.shape[0], rows.shape[-2]
    stacked = rows.movedim(0, -3).reshape(*b.shape[:-2], k * s, rows.shape[-1])
    return (stacked @ b).reshape(*b.shape[:-2], k, s, b.shape[-1]).movedim(-3, 0)


def _times_rows(a: Tensor, rows: Tensor) -> Tensor:
    """``a @ rows``, ``(*batch, s, n) @ (K, *batch, n, m)``, with the K rows side by side along
    ``m``: no K copies of ``a``; other batch shapes by ``matmul``."""
    if rows.shape[1:-2] != a.shape[:-2]:
        return torch.matmul(a, rows)
    k, m = rows.shape[0], rows.shape[-1]
    side_by_side = rows.movedim(0, -2).reshape(*a.shape[:-2], rows.shape[-2], k * m)
    return (a @ side_by_side).reshape(*a.shape[:-1], k, m).movedim(-2, 0)


def gram(a: Tensor, b: Tensor) -> Tensor:
    """``a.reshape(K, -1) @ b.reshape(K, -1).mT`` of two ``(K, *shape)`` tensors: their
    elements taken in ``a``'s memory order, as ``(outer, K, inner)`` blocks of one product each
    where the ``K`` rows lie inside it (a product's tangents, an attention head's), which the
    reshape copies (a transformer's softmax and attention products at k = 16 per tensor: 0.7
    ms a product against 1.1-1.4).

    >>> a = torch.arange(6.0).reshape(2, 3)
    >>> gram(a, a)  # [[0 + 1 + 4, 0 + 4 + 10], [.., 9 + 16 + 25]]
    tensor([[ 5., 14.],
            [14., 50.]])
    """
    strides = a.stride()
    order = sorted(range(a.ndim), key=lambda d: (-strides[d], d))
    at = order.index(0)
    shape = [a.shape[d] for d in order]
    outer, inner = math.prod(shape[:at]), math.prod(shape[at + 1 :])
    if outer == 1 or inner < GRAM_INNER:  # one product (a row's blocks would be tiny)
        return a.reshape(len(a), -1) @ b.reshape(len(b), -1).mT
    blocks = a.permute(order).reshape(outer, len(a), inner)
    return (blocks @ b.permute(order).reshape(outer, len(b), inner).mT).sum(0)


GRAM_INNER = 64
"""Elements per row of a block below which :func:`gram` makes one product."""


@dataclasses.dataclass(frozen=True)
class Attention:
    """``scaled_dot_product_attention(query, key, value, mask, is_causal=causal, scale=scale)``
    (``mask`` boolean, of the query's dtype or None) along tangents of the ones ``carried`` (of
    query, key and value)."""

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    causal: bool
    scale: float
    carried: tuple[bool, bool, bool]

    @functools.cached_property
    def _additive(self) -> Tensor | None:
        """The mask as torch adds it to the scores (-inf where a boolean one is False)."""
        q, mask = self.query, self.mask
        if self.causal:
            mask = torch.ones(q.shape[-2], self.key.shape[-2], dtype=torch.bool, device=q.device)
            mask = mask.tril()
        if mask is None or mask.dtype != torch.bool:
            return None if mask is None else mask.detach()
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf"))  # fmt: skip

    @functools.cached_property
    def _scores(self) -> Softmax:
        scores = self.scale * (self.query.detach() @ self.key.detach().mT)
        return Softmax(scores if self._additive is None else scores + self._additive, -1, True)

    def _split(self, tangents: Sequence[Tensor]) -> list[Tensor | None]:
        given = iter(tangents)
        return [next(given) if carried else None for carried in self.carried]

    def _score_tangents(self, of_q: Tensor | None, of_k: Tensor | None) -> Tensor | None:
        parts = ([] if of_q is None else [of_q @ self.key.detach().mT]) + (
            [] if of_k is None else [self.query.detach() @ of_k.mT])  # fmt: skip
        return None if not parts else self.scale * sum(parts[1:], parts[0])

    def push(self, *tangents: Tensor) -> Tensor:
        of_q, of_k, of_v = self._split(tangents)
        scores, value = self._scores, self.value.detach()
        of_scores = self._score_tangents(of_q, of_k)
        parts = [] if of_scores is None else [scores.push(of_scores) @ value]
        if of_v is not None:
            parts.append(scores._output @ of_v)
        return sum(parts[1:], parts[0])

    def terms(self, adjoint: Tensor, *tangents: Tensor) -> Tensor:
        of_q, of_k, of_v = self._split(tangents)
        scores, value = self._scores, self.value.detach()
        p = scores._output
        of_scores = self._score_tangents(of_q, of_k)
        terms = adjoint.new_zeros(len(tangents[0]), len(tangents[0]))
        if of_scores is not None:
            adjoint_p = adjoint @ value.mT
            if of_q is not None and of_k is not None:
                product = Product(self.query, self.key.mT)
                terms += product.terms(self.scale * scores.gradient(adjoint_p), of_q, of_k.mT)
            terms += scores.terms(adjoint_p, of_scores)
            if of_v is not None:
                terms += Product(p, value).terms(adjoint, scores.push(of_scores), of_v)
        return terms


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """``F.cross_entropy(logits, target, ignore_index=ignore_index)`` along the logits'
    tangents, its ``mean`` or sum."""

    logits: Tensor
    target: Tensor
    ignore_index: int
    mean: bool

    @functools.cached_property
    def _rows(self) -> tuple[Tensor, Tensor]:
        """The target with 0 for an ignored class (a valid index), and each row's weight: 1
        where its class counts, 0 where not, over their number for a mean (with none, NaN, as
        autograd has it: no branch on the data, since the survey may run inside vmap)."""
        counts = self.target != self.ignore_index
        counted = counts.to(self.logits.dtype)
        return torch.where(
            counts, self.target, 0
        ), counted / counted.sum() if self.mean else counted

    @functools.cached_property
    def _probabilities(self) -> Tensor:
        return torch.softmax(self.logits.detach(), -1)

    def push(self, *tangents: Tensor) -> Tensor:
        (given,) = tangents
        p, (target, counted) = self._probabilities, self._rows
        gradient = p.scatter_add(1, target[:, None], -torch.ones_like(p[:, :1]))
        return (given * (gradient * counted[:, None])).sum((1, 2))

    def terms(self, adjoint: Tensor, *tangents: Tensor) -> Tensor:
        (given,) = tangents
        p, weight = self._probabilities, adjoint * self._rows[1]
        along_p = (given * p).sum(-1, keepdim=True)  # <p, t> per row, (K, N, 1)
        # <t, p (u - <p, u>)>: centred per row, not <t, p u> - <p, t> <p, u> over all rows,
        # whose two terms cancel at confident rows (float32: 5x the generic route's error)
        return gram(given * (p * weight[:, None]), given - along_p)


def closed_form(
    func: Callable[..., Any],
    op: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    carrying: Sequence[Any],
) -> ClosedForm | None:
    """The closed form of this call along tangents of the arguments ``carrying`` (in the call's
    order), or None where it is not written here."""
    if func in LAYER_NORMS:
        return _layer_norm(args, kwargs, carrying)
    if func in _SOFTMAXES:
        return _softmax(func, args, kwargs, carrying)
    if func is F.cross_entropy:
        return _cross_entropy(args, kwargs, carrying)
    if func is F.scaled_dot_product_attention:
        return _attention(args, kwargs, carrying)
    if op == "matmul":
        bound = bind(op, args, kwargs) or {}
        a, b = bound.get("input"), bound.get("other")
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and _floating(a)):
            return None
        if a.ndim < 2 or b.ndim < 2:
            return None
        if a.shape[:-2] != b.shape[:-2] or len(carrying) != 2 or a.dtype != b.dtype:
            return None
        if carrying[0] is a and carrying[1] is b:
            return Product(a, b)
    return None


def _bound(
    names: Sequence[str],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    keywords: Sequence[str] | None = None,
) -> dict[str, Any] | None:
    """A call's arguments by name (``names``, in order), or None for more positional arguments
    than names or a keyword not among ``keywords`` (default: ``names``)."""
    if len(args) > len(names) or not set(kwargs) <= set(names if keywords is None else keywords):
        return None
    return dict(zip(names, args, strict=False)) | kwargs


def _floating(value: object) -> bool:
    return isinstance(value, Tensor) and value.dtype in _FLOATING


_LAYER_NORM_PARAMETERS = ("input", "normalized_shape", "weight", "bias", "eps")


def _layer_norm(
    args: Sequence[Any], kwargs: dict[str, Any], carrying: Sequence[Any]
) -> LayerNorm | None:
    bound = _bound(_LAYER_NORM_PARAMETERS, args, kwargs)
    if bound is None:
        return None
    input, shape = bound.get("input"), bound.get("normalized_shape")
    if not _floating(input) or len(carrying) != 1 or carrying[0] is not input or shape is None:
        return None
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return LayerNorm(input, shape, bound.get("weight"), float(bound.get("eps", 1e-5)))


def layer_norm_affine(
    args: Sequence[Any], kwargs: dict[str, Any], tensor: Tensor, entries: Tensor
) -> rules.Contribution | None:
    """The tangents of ``F.layer_norm``'s output along the entries ``entries`` of ``tensor``,
    its weight or bias over one normalised dim: entry ``j``'s is ``n[..., j]`` (the normalised
    input; the bias's: 1) at feature ``j``, zero elsewhere. None for any other use."""
    bound = _bound(_LAYER_NORM_PARAMETERS, args, kwargs)
    if bound is None:
        return None
    input, shape = bound.get("input"), bound.get("normalized_shape")
    weight, bias = bound.get("weight"), bound.get("bias")
    if not (_floating(input) and shape is not None and tensor.ndim == 1 and weight is not bias):
        return None
    input = cast(Tensor, input)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) != 1 or input.ndim < 1:
        return None
    if tensor is weight:
        normalised = LayerNorm(input, shape, None, float(bound.get("eps", 1e-5)))._statistics[0]
        values = normalised.movedim(-1, 0)[entries]
    elif tensor is bias:
        values = input.new_ones(()).expand(len(entries), *input.shape[:-1])
    else:
        return None
    return rules.Contribution(input.ndim - 1, entries, values)


def _softmax(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], carrying: Sequence[Any]
) -> Softmax | None:
    names = ("input", "dim", "_stacklevel", "dtype") if func is F.softmax else (
        "input", "dim", "dtype")  # fmt: skip
    bound = _bound(names, args, kwargs, (*names, "self"))
    if bound is None:
        return None
    input, dim = bound.get("input", bound.get("self")), bound.get("dim")
    if not _floating(input) or not isinstance(dim, int) or bound.get("dtype") is not None:
        return None
    if len(carrying) != 1 or carrying[0] is not input or input.ndim == 0:
        return None
    return Softmax(input, dim)


_CROSS_ENTROPY_PARAMETERS = ("input", "target", "weight", "size_average", "ignore_index",
                             "reduce", "reduction", "label_smoothing")  # fmt: skip


def _cross_entropy(
    args: Sequence[Any], kwargs: dict[str, Any], carrying: Sequence[Any]
) -> CrossEntropy | None:
    bound = _bound(_CROSS_ENTROPY_PARAMETERS, args, kwargs)
    if bound is None:
        return None
    logits, target = bound.get("input"), bound.get("target")
    if not _floating(logits) or len(carrying) != 1 or carrying[0] is not logits:
        return None
    if not isinstance(target, Tensor) or target.dtype != torch.int64 or logits.ndim != 2:
        return None
    options = [bound.get(name) for name in ("weight", "size_average", "reduce")]
    reduction = bound.get("reduction", "mean")
    if any(o is not None for o in options) or bound.get("label_smoothing", 0.0) != 0.0:
        return None
    if reduction not in ("mean", "sum") or target.shape != logits.shape[:1]:
        return None
    return CrossEntropy(logits, target, bound.get("ignore_index", -100), reduction == "mean")


_ATTENTION_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                         "enable_gqa")  # fmt: skip


def _attention(
    args: Sequence[Any], kwargs: dict[str, Any], carrying: Sequence[Any]
) -> Attention | None:
    """Query, key and value given by position (as ``nn.MultiheadAttention`` gives them: the
    tangents come in their order), of one batch shape and dtype, no dropout."""
    bound = _bound(_ATTENTION_PARAMETERS, args, kwargs, _ATTENTION_PARAMETERS[3:])
    if bound is None or len(args) < 3:
        return None
    q, k, v, mask = args[0], args[1], args[2], bound.get("attn_mask")
    if not all(isinstance(t, Tensor) and _floating(t) and t.ndim >= 2 for t in (q, k, v)):
        return None
    if not (q.dtype == k.dtype == v.dtype and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        return None
    if bound.get("dropout_p", 0.0) != 0.0 or bound.get("enable_gqa", False):
        return None
    carried = tuple(any(c is t for c in carrying) for t in (q, k, v))
    if sum(carried) != len(carrying) or not any(carried):  # (the mask carrying tangents too)
        return None
    if mask is not None and not (isinstance(mask, Tensor) and mask.dtype in (torch.bool, q.dtype)):
        return None
    causal = bool(bound.get("is_causal", False))
    if causal and mask is not None:
        return None  # torch refuses both
    scale = bound.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return Attention(q, k, v, mask, causal, scale, cast(tuple[bool, bool, bool], carried))
