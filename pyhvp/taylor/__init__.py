"""Taylor mode (jets) of any order for PyTorch functions: forward Laplacians, second
directional derivatives, bi-Laplacians and directional derivatives of any order, from one
forward pass of a value and its Taylor coefficients (:mod:`.jets`: one algebra for every order).

The mechanism, and why:

* **What runs.** ``f`` is recorded as a straight-line program of aten ops at every call
  (:mod:`.program`); per-op rules (:mod:`.rules`) push a value and its coefficients of orders
  1..K along K directions (the top one per direction, or summed: collapsed Taylor mode) through
  it; the rules are run once under ``make_fx`` into a flat graph of plain aten ops, the
  kernel (:mod:`.kernel`), which the torch backend runs eagerly or ``torch.compile``-s under its
  compile policy. One set of rules; the interpreter executes them exactly once per program and
  directions layout, as a tracer.
* **Why an interpreter over recorded aten ops, not a ``__torch_dispatch__`` tensor subclass.**
  Dispatch-level rules run below autograd, so a Laplacian computed by them could not be
  differentiated with respect to parameters (PINN and VMC training need exactly that), and every
  call would pay Python dispatch per op per coefficient. Here the kernel is a graph of ordinary
  ops: autograd differentiates it (parameters are kernel inputs), inductor compiles it (no nested
  forward-mode AD, which crashes inductor on the CPU), and eagerly it runs with no rule logic.
* **Why record at every call instead of tracing once.** A trace cached by function identity goes
  stale silently when a captured tensor is replaced, Python state changes or control flow depends
  on data. The per-call record is the cache key, so a stale kernel is never used; data-dependent
  control flow works (each branch is its own program). It costs one eager forward of ``f``.
  Tensors the record did not make are *constants*, inputs of the program, and so are Python
  floats that ``f`` adds, subtracts, multiplies or divides by (a time step, an annealed
  coefficient): one program serves every value. Other scalars (exponents, clamp bounds, ints)
  are part of the key, since rules branch on their values.
* **Shared directions.** Directions may be broadcast over instances (``(K, 1, ..., 1, *event)``):
  coefficients keep size-1 dims wherever a rule can, so ops before the first instance-dependent
  nonlinearity (``W e_i`` of a first linear layer) run once for all instances, not once each.
* **Diagonal coefficients.** Along the basis of x's event (the exact Laplacian's directions,
  checked by value), x's coefficient is the identity and stays diagonal through elementwise ops
  (:class:`~.jets.DiagonalCoefficient`: only the diagonal is stored); a sum over the event turns
  it into the dense coefficient by a reshape, and any other rule multiplies it out. A function
  elementwise in x before it mixes (``sum_i g(x_i)``) then costs O(N) per instance, not O(N^2).
* **Every real op works; what does not is refused by name.** Ops without a dedicated rule get
  reduced by PyTorch's decompositions where it has one, else a rule built from ``torch.func``
  on that op alone (elementwise derivatives for pointwise ops; the op's Jacobian and Hessian by
  reverse mode otherwise -- per matrix for batched ``torch.linalg`` ops), as folx falls back to
  an op's Hessian. Derivatives follow autograd: ``detach``, ``torch.no_grad()`` and
  ``inference_mode()`` inside ``f`` stop them, an in-place write under ``no_grad`` keeps the
  written tensor's, ``x`` reaching ``f`` again through ``args`` or a closure is a constant
  (partial derivatives), ``torch.func.grad`` inside ``f`` is differentiated.
  Refused with an error naming the cause: complex intermediates (``TypeError``),
  sparse tensors, ``torch.autograd.grad`` / ``.backward()`` inside ``f`` (use
  ``torch.func.grad``), writes to ``x``, directly or through a view (:class:`InPlaceInputError`;
  a tensor ``f`` reads and writes is copied before the write, and written once per call),
  ``as_strided`` views (and writes through them) of tensors not dense in memory, and an op
  whose fallback fails or would need a dense Hessian over the size limit
  (:class:`UnsupportedOpError`).

Where things are:

* :mod:`.jets` -- :class:`Jet`, :class:`Context` and the algebra of coefficients;
* :mod:`.registry` -- which rule carries an op (:func:`apply`), and the rule table;
* :mod:`.rules` -- the dedicated rules, one module per op family;
* :mod:`.fallbacks` -- rules built from ``torch.func`` for ops without a dedicated one;
* :mod:`.custom_ops` -- the program's own ops (stop-gradient, singular det, ...);
* :mod:`.recorder` -- runs ``f`` once and notes its aten ops;
* :mod:`.program` -- the record as a functional aten graph, and the program cache;
* :mod:`.kernel` -- the rules traced over a program into a flat aten graph.
"""

from pyhvp.taylor.fallbacks import UnsupportedOpError
from pyhvp.taylor.jets import Context, Jet, NotAtThisOrder, chain
from pyhvp.taylor.kernel import JetKernel, JetMode
from pyhvp.taylor.program import Capture, capture
from pyhvp.taylor.recorder import InPlaceInputError, outside_recording, recording
from pyhvp.taylor.registry import register_jet_rule

__all__ = [
    "Capture",
    "Context",
    "InPlaceInputError",
    "Jet",
    "JetKernel",
    "JetMode",
    "NotAtThisOrder",
    "UnsupportedOpError",
    "capture",
    "chain",
    "outside_recording",
    "recording",
    "register_jet_rule",
]
