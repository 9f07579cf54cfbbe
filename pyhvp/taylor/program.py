"""What ``f`` computes, as a straight-line program of aten ops, and the guard that says when a
cached program (and its compiled jet kernels) applies to a new call.

Every call runs ``f`` once, eagerly, under a light ``TorchDispatchMode`` that records each aten
op, its non-tensor arguments, the shapes of its outputs, and where each tensor argument comes
from: ``x``, an earlier op, or a *constant* (any other tensor: args, captured parameters,
tensors made from Python data). That record is the cache key. Equal records mean the same
program: same ops in the same order with the same options, so data-dependent control flow,
replaced parameters, changed Python state or a different ``x`` layout can never reuse a stale
program -- they record differently and build a new one. Constants are inputs of the program,
passed anew at every call, so a program is reused across calls whatever tensor objects ``f``
captures (a lambda rebuilt per call, parameters updated in place or replaced), and gradients
flow to them when they require grad. The record costs one forward of ``f`` (about 5 us per op of
overhead), paid at every call.

On a miss the record becomes an fx graph, replayed once through ``make_fx(functionalize(...))``
with layer, group and (evaluation-mode) batch norm and CPU attention decomposed, into a functional aten program
-- the graph the jet rules (:mod:`.rules`) run on.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from pyhvp._keys import Identity, Value, value_key
from pyhvp.taylor.kernel import JetKernel, build_kernel, traceable
from pyhvp.taylor.rules import STOP_GRADIENT

aten = torch.ops.aten
Tensor = torch.Tensor

PROGRAMS_CACHED = 64
"""Programs remembered (least recently used dropped first)."""

DECOMPOSITIONS = get_decompositions(
    [
        aten.native_layer_norm,
        aten.native_group_norm,
        aten._native_batch_norm_legit_no_training,
        aten.native_batch_norm,
        aten._scaled_dot_product_flash_attention_for_cpu,
    ]
)
"""Composite ops rewritten into ops that have dedicated jet rules (var_mean, rsqrt, ...)."""


X = ("x",)


def _meta(t: Tensor) -> Hashable:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


class InPlaceInputError(ValueError):
    """f modified x or a tensor it reads in place."""


class _Recorder(TorchDispatchMode):
    """Records the aten ops ``f`` runs: the cache key and, on a miss, the program."""

    def __init__(self, x: Tensor) -> None:
        super().__init__()
        self.labels: dict[int, Hashable] = {id(x): X}
        self.alive: list[object] = [x]  # ids stay unique while recording
        self.constants: list[Tensor] = []
        self.events: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            self._refuse_input_writes(func, args, kwargs)
        described = (self._describe(args), self._describe(tuple(sorted(kwargs.items()))))
        out = func(*args, **kwargs)
        k = len(self.events)
        self.events.append((func, *described, self._outputs(out, ("op", k))))
        return out

    def _describe(self, value: object) -> Hashable:
        if isinstance(value, Tensor):
            label = self.labels.get(id(value))
            if label is None:
                label = ("constant", len(self.constants))
                self.labels[id(value)] = label
                self.constants.append(value)
                self.alive.append(value)
            return label
        if isinstance(value, (list, tuple)):
            return (type(value) is list, tuple(self._describe(v) for v in value))
        return value_key(value) or ("object", Identity(value))

    def _outputs(self, out: object, label: tuple) -> Hashable:
        """Labels output tensors (an in-place op's result replaces its input's label)."""
        if isinstance(out, Tensor):
            self.labels[id(out)] = label
            self.alive.append(out)
            return ("tensor", tuple(out.shape), out.dtype)
        if isinstance(out, (list, tuple)):
            return (
                type(out) is list,
                tuple(self._outputs(o, (*label, i)) for i, o in enumerate(out)),
            )
        return value_key(out) or ("object",)

    def _refuse_input_writes(self, func: object, args: tuple, kwargs: dict) -> None:
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            label = self.labels.get(id(value)) if isinstance(value, Tensor) else None
            if label is not None and label[0] in ("x", "constant"):
                what = "x" if label == X else f"a tensor of shape {tuple(value.shape)} that f reads"
                raise InPlaceInputError(
                    f"f modifies {what} in place ({func}); pyhvp evaluates f several times and "
                    f"needs it to leave its inputs unchanged (a module in training mode updating "
                    f"its statistics? call module.eval())"
                )


@dataclass(eq=False)
class Program:
    """``f`` as a functional aten graph ``(x, *constants) -> f(x, *args)`` with its jet kernels."""

    graph: fx.GraphModule
    kernels: dict[Hashable, JetKernel] = field(default_factory=dict)

    def kernel(
        self, collapsed: bool, x: Tensor, directions: Tensor, constants: Sequence[Tensor]
    ) -> JetKernel:
        """The jet kernel for this mode and directions layout (traced on first use)."""
        key = (collapsed, _meta(directions))
        if key not in self.kernels:
            self.kernels[key] = build_kernel(self.graph, collapsed, x, directions, constants)
        return self.kernels[key]


_PROGRAMS: OrderedDict[Hashable, Program] = OrderedDict()


@dataclass(frozen=True)
class Capture:
    """One call's program and the constants to pass it."""

    program: Program
    constants: tuple[Tensor, ...]

    def kernel(self, collapsed: bool, x: Tensor, directions: Tensor) -> JetKernel:
        return self.program.kernel(collapsed, x, directions, self.constants)


def capture(f: Callable[..., Tensor], x: Tensor, args: Sequence[object]) -> Capture:
    """Run ``f(x, *args)`` once under the recorder; return its (cached or new) program."""
    recorder = _Recorder(x)
    with torch.no_grad(), recorder:
        out = f(x, *args)
    if not isinstance(out, Tensor):
        raise TypeError(f"f must return a torch.Tensor, got {type(out).__name__}")
    if not out.is_floating_point():  # integers do not vary smoothly; complex is not supported
        raise TypeError(f"f must return a real floating tensor, got {out.dtype}")
    output = recorder._describe(out)
    key = (
        _meta(x),
        tuple(recorder.events),
        tuple(_meta(c) for c in recorder.constants),
        output,
    )
    program = _PROGRAMS.pop(key, None)
    if program is None:
        program = Program(_functional_graph(recorder, output, x))
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > PROGRAMS_CACHED:
        _PROGRAMS.popitem(last=False)
    return Capture(program, tuple(recorder.constants))


def _functional_graph(recorder: _Recorder, output: Hashable, x: Tensor) -> fx.GraphModule:
    """The record as an fx graph, replayed through functionalization and decompositions."""
    graph = fx.Graph()
    nodes: dict[Hashable, object] = {X: graph.placeholder("x")}
    for i in range(len(recorder.constants)):
        nodes[("constant", i)] = graph.placeholder(f"constant_{i}")
    for k, (func, args, kwargs, outputs) in enumerate(recorder.events):
        # f's own detach (nothing else emits one while recording without grad) stops gradients;
        # functionalization below emits detach as a mere alias, so f's is renamed first
        target = STOP_GRADIENT if func is aten.detach.default else func
        node = graph.call_function(target, _rebuild(args, nodes), dict(_rebuild(kwargs, nodes)))
        _name_outputs(graph, node, outputs, ("op", k), nodes)
    graph.output(nodes[output])
    graph.eliminate_dead_code()
    raw = fx.GraphModule(torch.nn.Module(), graph)
    with torch.no_grad():
        functional = make_fx(torch.func.functionalize(raw), decomposition_table=DECOMPOSITIONS)(
            *map(traceable, (x, *recorder.constants))
        )
    functional.graph.eliminate_dead_code()
    functional.recompile()
    return functional


def _rebuild(described: Hashable, nodes: dict) -> object:
    if isinstance(described, Value):
        return described.value
    if described in nodes:
        return nodes[described]
    kind = described[0]
    if kind == "object":
        return described[1].obj
    items = [_rebuild(item, nodes) for item in described[1]]
    return items if kind is True else tuple(items)


def _name_outputs(graph: fx.Graph, node: object, outputs: Hashable, label: tuple,
                  nodes: dict) -> None:  # fmt: skip
    if isinstance(outputs, Value):  # a non-tensor result: nothing to name
        return
    if outputs[0] == "tensor":
        nodes[label] = node
    elif outputs[0] in (True, False):
        for i, item in enumerate(outputs[1]):
            _name_outputs(graph, graph.call_function(operator.getitem, (node, i)), item,
                          (*label, i), nodes)  # fmt: skip
