"""Torch's ops whose derivatives autograd gets wrong when it differentiates them twice, written
out for pyhvp's runs: :data:`differentiated_twice`, one context for the rewrites that each
module keeps -- the norms (:mod:`pyhvp._norms`), the fused weight normalisation
(:mod:`pyhvp._weight_norms`) and ``sinc`` (:mod:`pyhvp._sinc`). Every path that differentiates
a function twice by autograd enters it, so a rewrite added here reaches all of them.
"""

from __future__ import annotations

from pyhvp._norms import twice_differentiable_norms
from pyhvp._replacing import Together
from pyhvp._sinc import twice_differentiable_sinc
from pyhvp._weight_norms import weight_norms_written_out

differentiated_twice = Together(
    twice_differentiable_norms, weight_norms_written_out, twice_differentiable_sinc
)
"""``with differentiated_twice:`` or ``@differentiated_twice``: each module's context at once."""
