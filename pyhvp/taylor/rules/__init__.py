"""The dedicated jet rules, one module per op family; importing this package registers them
(:func:`pyhvp.taylor.registry.rule`).

* :mod:`.elementwise` -- ``y = g(u)`` by ``g'`` and ``g''``; ``where``, ``masked_fill``, dropout
* :mod:`.arithmetic` -- sums, products, quotients, powers
* :mod:`.matmul` -- matrix products
* :mod:`.linalg` -- det, slogdet, inverse, solve
* :mod:`.views` -- views, copies, concatenation, indexing
* :mod:`.linear` -- other ops linear in their inputs (scatters, pools, pads, ...)
* :mod:`.convolution` -- convolutions
* :mod:`.reductions` -- sums, means, extrema, variances, softmax, norms, distances
"""

from pyhvp.taylor.rules import (
    arithmetic,
    convolution,
    elementwise,
    linalg,
    linear,
    matmul,
    reductions,
    views,
)

__all__ = [
    "arithmetic",
    "convolution",
    "elementwise",
    "linalg",
    "linear",
    "matmul",
    "reductions",
    "views",
]
