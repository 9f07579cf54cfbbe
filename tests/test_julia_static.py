"""Static checks of the bundled Julia package (no Julia needed): it parses, fatou finds no
undefined name, device code never nests Enzyme, never maps or splats a tuple whose length is a
type parameter, every package name device code uses is listed in julia/README.md with its
upstream GPU test, and its dependencies match pyhvp/juliapkg.json."""

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JULIA_FILES = sorted((ROOT / "julia").rglob("*.jl"))
JULIA_SRC = sorted((ROOT / "julia" / "src").glob("*.jl"))
FATOU = shutil.which("fatou") or str(Path(sys.executable).with_name("fatou"))


OPTIONS = ("--color", "never", "--output", "concise")


def fatou_lint(*paths):
    return subprocess.run(
        [FATOU, "lint", "--config", str(ROOT / "fatou.toml"), *OPTIONS, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def parser():
    tree_sitter = pytest.importorskip("tree_sitter")
    tsjulia = pytest.importorskip("tree_sitter_julia")
    return tree_sitter.Parser(tree_sitter.Language(tsjulia.language()))


def syntax_problems(tree):
    return [
        f"{node.type} at {node.start_point}"
        for node in walk(tree.root_node)
        if node.type == "ERROR" or node.is_missing
    ]


def test_the_julia_package_has_source_and_tests():
    names = {p.relative_to(ROOT / "julia").as_posix() for p in JULIA_FILES}
    assert {"src/PyHVP.jl", "test/runtests.jl"} <= names


@pytest.mark.parametrize("path", JULIA_FILES, ids=lambda p: p.name)
def test_tree_sitter_parses_without_error_nodes(parser, path):
    assert syntax_problems(parser.parse(path.read_bytes())) == []


def test_fatou_finds_nothing_in_the_julia_package():
    done = fatou_lint(ROOT / "julia")
    assert done.returncode == 0, done.stdout + done.stderr


def test_fatou_config_reports_a_misspelled_name(tmp_path):
    bad = tmp_path / "bad.jl"
    bad.write_text("function f(x)\n    return sum(abs2, x) + lenght(x)\nend\n")
    report = fatou_lint(bad)
    assert "undefined-name" in report.stdout + report.stderr and report.returncode == 1


# ------------------------------------------------------------------ a small Julia call graph


def walk(node) -> Iterator:
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def text(node) -> str:
    return node.text.decode()


def where(path, node) -> str:
    return f"{Path(path).name}:{node.start_point[0] + 1}"


def callee_name(call) -> str | None:
    """`f` for `f(...)` and for `M.f(...)`; None for anything else (`(s::T)(...)`)."""
    callee = call.children[0]
    if callee.type == "field_expression":
        callee = callee.children[-1]
    return text(callee) if callee.type == "identifier" else None


def defined_name(node) -> str | None:
    """The name a `function` or short-form definition defines (the type, for a functor)."""
    if node.type == "function_definition":
        head = next((c.children[0] for c in node.children if c.type == "signature"), None)
    elif node.type == "assignment":
        head = node.children[0]
    else:
        return None
    while head is not None and head.type in ("where_expression", "typed_expression"):
        head = head.children[0]
    if head is None or head.type != "call_expression":
        return None
    callee = head.children[0]
    if callee.type == "parenthesized_expression":  # functor: (s::SumOverInstances)(X)
        identifiers = [n for n in walk(callee) if n.type == "identifier"]
        return text(identifiers[-1]) if identifiers else None
    return callee_name(head)


def positional_arguments(call) -> list:
    arguments = next((c for c in call.children if c.type == "argument_list"), None)
    return list(arguments.named_children) if arguments is not None else []


class JuliaCode:
    """The function definitions and calls of some Julia files, found by tree-sitter-julia."""

    def __init__(self, parser, paths):
        self.trees = [(path, parser.parse(Path(path).read_bytes())) for path in paths]
        self.definitions = {}  # name -> [(path, node)]
        for path, node in self.nodes():
            name = defined_name(node)
            if name is not None:
                self.definitions.setdefault(name, []).append((path, node))

    def nodes(self):
        for path, tree in self.trees:
            for node in walk(tree.root_node):
                yield path, node

    def reachable(self, path, start) -> list:
        """`start` and every definition its identifiers lead to, transitively: `(path, node)`."""
        found, frontier, seen = [(path, start)], [start], set()
        while frontier:
            for node in walk(frontier.pop()):
                name = text(node) if node.type == "identifier" else None
                if name in self.definitions and name not in seen:
                    seen.add(name)
                    for found_path, definition in self.definitions[name]:
                        found.append((found_path, definition))
                        frontier.append(definition)
        return found

    def calls(self, names):
        for path, node in self.nodes():
            if node.type == "call_expression" and callee_name(node) in names:
                yield path, node


AUTODIFF = {"autodiff", "autodiff_deferred"}
ENZYME_ANNOTATIONS = {"Const", "Active", "Duplicated", "DuplicatedNoNeed", "BatchDuplicated"}


def nested_differentiation(code: JuliaCode) -> list[str]:
    """Where a function differentiated by `autodiff_deferred` (its second argument, Enzyme's
    function slot) calls `autodiff`/`autodiff_deferred` itself, directly or through other
    functions of the same files: the nesting GPUCompiler.jl#629 cannot compile on a GPU."""
    found = []
    for path, call in code.calls({"autodiff_deferred"}):
        arguments = positional_arguments(call)
        if len(arguments) < 2:
            continue
        target = arguments[1]
        while target.type == "call_expression" and callee_name(target) in ENZYME_ANNOTATIONS:
            target = positional_arguments(target)[0]
        for body_path, body in code.reachable(path, target):
            for node in walk(body):
                if node.type == "call_expression" and callee_name(node) in AUTODIFF:
                    found.append(
                        f"{text(target)} is differentiated by autodiff_deferred at "
                        f"{where(path, call)} and calls {callee_name(node)} at "
                        f"{where(body_path, node)}"
                    )
    return found


def kernels(code: JuliaCode) -> list:
    """The functions launched by `@cuda`: `(path, name node)`."""
    found = []
    for path, node in code.nodes():
        macro = node.children[0] if node.type == "macrocall_expression" else None
        if macro is not None and text(macro) == "@cuda":
            arguments = next(c for c in node.children if c.type == "macro_argument_list")
            launched = [c for c in arguments.named_children if c.type == "call_expression"]
            found.extend((path, call.children[0]) for call in launched)
    return found


def imported_names(code: JuliaCode) -> dict[str, str]:
    """`name -> package` for every `using Package: name, ...`."""
    found = {}
    for _, node in code.nodes():
        if node.type == "selected_import":
            package, *names = node.named_children
            found.update((text(name), text(package)) for name in names)
    return found


def device_package_names(code: JuliaCode) -> dict[str, str]:
    """The imported names that code reachable from a kernel uses: `name -> package`."""
    imported = imported_names(code)
    used = {
        text(node)
        for path, kernel in kernels(code)
        for _, body in code.reachable(path, kernel)
        for node in walk(body)
        if node.type == "identifier"
    }
    return {name: imported[name] for name in used & imported.keys()}


# ------------------------------------------------------------------ device code

OLD_GPU_JL = """
@inline function instance_gradient(x, f, args::Tuple)
    return autodiff_deferred(Reverse, Const(f), Active, Active(x), map(Const, args)...)[1][1]
end

function grad_and_hvp_kernel!(G, HV::NTuple{K}, f, X, V::NTuple{K}, args, xdims, argdims) where {K}
    b = (blockIdx().x - 1) * blockDim().x + threadIdx().x
    I = CartesianIndices(Base.tail(size(X)))[b]
    x = instance_load(X, I, xdims)
    v = map(t -> instance_load(t, I, xdims), V)
    dg, g = autodiff_deferred(
        ForwardWithPrimal, Const(instance_gradient), Duplicated, tangents(x, v), Const(f)
    )
    return nothing
end
"""

NESTING_CASES = [  # name: (Julia source, what the check must report)
    (
        "old-gpu-jl-forward-over-in-kernel-reverse",
        OLD_GPU_JL,
        [
            "instance_gradient is differentiated by autodiff_deferred at case.jl:10 and calls "
            "autodiff_deferred at case.jl:2"
        ],
    ),
    (
        "through-a-helper",
        "inner(x) = autodiff(Reverse, g, Active(x))\nouter(x) = 2 * inner(x)\n"
        "k(x, dx) = autodiff_deferred(Forward, Const(outer), Duplicated(x, dx))\n",
        [
            "outer is differentiated by autodiff_deferred at case.jl:3 and calls autodiff at "
            "case.jl:1"
        ],
    ),
    (
        "a-closure",
        "k(x, dx) = autodiff_deferred(Forward, Const(z -> autodiff(Reverse, g, Active(z))), "
        "Duplicated(x, dx))\n",
        [
            "z -> autodiff(Reverse, g, Active(z)) is differentiated by autodiff_deferred at "
            "case.jl:1 and calls autodiff at case.jl:1"
        ],
    ),
    (
        "one-level-as-upstream-gpu-tests-do",
        "square(x) = x * x\nk(x) = autodiff_deferred(Reverse, Const(square), Active, Active(x))\n",
        [],
    ),
]


@pytest.mark.parametrize(
    ("case", "source", "reports"), NESTING_CASES, ids=[c[0] for c in NESTING_CASES]
)
def test_nested_differentiation_check_finds_autodiff_inside_differentiated_code(
    parser, tmp_path, case, source, reports
):
    path = tmp_path / "case.jl"
    path.write_text(source.lstrip("\n"))
    assert nested_differentiation(JuliaCode(parser, [path])) == reports


def test_device_code_never_differentiates_a_function_that_differentiates(parser):
    assert nested_differentiation(JuliaCode(parser, JULIA_SRC)) == []


def test_device_names_are_those_reachable_from_a_cuda_kernel(parser, tmp_path):
    path = tmp_path / "case.jl"
    path.write_text(
        "using CUDA: @cuda, threadIdx, synchronize\nusing ForwardDiff: Dual, partials\n"
        "seed(x) = Dual(x, one(x))\n"
        "kernel(out, x) = (out[threadIdx().x] = seed(x[threadIdx().x]); nothing)\n"
        "launch(out, x) = (@cuda kernel(out, x); synchronize(); partials)\n"
    )
    assert device_package_names(JuliaCode(parser, [path])) == {
        "threadIdx": "CUDA",
        "Dual": "ForwardDiff",
    }


TUPLE_CONSUMERS = {"map", "foreach"}


def type_length_tuples(definition) -> set[str]:
    """The names in one function definition that hold a tuple whose length is a type parameter:
    arguments typed `NTuple{N, ...}` with `N` a name (not a literal), and locals assigned an
    `ntuple(...)`."""
    names = set()
    for node in walk(definition):
        if node.type == "typed_expression" and node.named_children[-1].type == (
            "parametrized_type_expression"
        ):
            kind, parameters = node.named_children[-1].named_children[:2]
            length = parameters.named_children[0] if parameters.named_children else None
            if text(kind) == "NTuple" and length is not None and length.type == "identifier":
                names.add(text(node.named_children[0]))
        elif node.type == "assignment" and node.children[0].type == "identifier":
            value = node.children[-1]
            if value.type == "call_expression" and callee_name(value) == "ntuple":
                names.add(text(node.children[0]))
    return names


def tuple_maps_and_splats(code: JuliaCode) -> list[str]:
    """Where device code (what a `@cuda` kernel reaches) `map`s/`foreach`es over or splats a
    tuple whose length is a type parameter. Base's `map(f, t::Any32)` (32 or more elements)
    collects into a `Vector{Any}` and splats it: a heap allocation and a dynamic call that
    device code cannot compile. `ntuple(i -> ..., Val(N))` unrolls at any length."""
    found = []
    reached = {
        (path, definition.start_point, definition.end_point): (path, definition)
        for path, kernel in kernels(code)
        for path, definition in code.reachable(path, kernel)
        if defined_name(definition) is not None
    }
    for path, definition in reached.values():
        tuples = type_length_tuples(definition)
        for node in walk(definition):
            if node.type == "call_expression" and callee_name(node) in TUPLE_CONSUMERS:
                mapped = [text(a) for a in positional_arguments(node)[1:] if text(a) in tuples]
                found.extend(f"{callee_name(node)} over {m} at {where(path, node)}" for m in mapped)
            elif node.type == "splat_expression" and text(node.named_children[0]) in tuples:
                found.append(f"splat of {text(node.named_children[0])} at {where(path, node)}")
    return sorted(found)


LAUNCH = "launch(h, x, v) = @cuda k(h, x, v)\n"

TUPLE_CASES = [  # name: (Julia source with a kernel `k`, what the check must report)
    (
        "old-duals-jl-map-over-ntuple-local",
        LAUNCH + "function k(h, x::NTuple{N,T}, v::NTuple{K,NTuple{N,T}}) where {N,K,T}\n"
        "    dy = ntuple(i -> h(x, i), Val(N))\n"
        "    return map(value, dy), ntuple(j -> map(d -> partials(d, j), dy), Val(K))\n"
        "end\n",
        ["map over dy at case.jl:4", "map over dy at case.jl:4"],
    ),
    (
        "old-gpu-jl-map-over-ntuple-argument",
        LAUNCH + "k(h, x, V::NTuple{K}) where {K} = h(map(t -> t[1], V))\n",
        ["map over V at case.jl:2"],
    ),
    (
        "splat-through-a-helper",
        LAUNCH + "k(h, x, v) = helper(h, x)\nhelper(h, x::NTuple{N,T}) where {N,T} = h(x...)\n",
        ["splat of x at case.jl:3"],
    ),
    (
        "ntuple-form-as-duals-jl-now",
        LAUNCH + "function k(h, x::NTuple{N,T}, v) where {N,T}\n"
        "    dy = ntuple(i -> h(x, i), Val(N))\n"
        "    return ntuple(i -> value(dy[i]), Val(N))\n"
        "end\n",
        [],
    ),
    ("literal-length-is-not-a-type-parameter", LAUNCH + "k(h, x::NTuple{3}, v) = map(h, x)\n", []),
    (
        "host-code-may-map",
        LAUNCH + "k(h, x, v) = nothing\nhost(x::NTuple{N}) where {N} = map(abs, x)\n",
        [],
    ),
]


@pytest.mark.parametrize(
    ("case", "source", "reports"), TUPLE_CASES, ids=[c[0] for c in TUPLE_CASES]
)
def test_tuple_check_finds_map_and_splat_of_type_length_tuples_in_device_code(
    parser, tmp_path, case, source, reports
):
    path = tmp_path / "case.jl"
    path.write_text(source)
    assert tuple_maps_and_splats(JuliaCode(parser, [path])) == reports


def test_device_code_never_maps_or_splats_a_type_length_tuple(parser):
    assert tuple_maps_and_splats(JuliaCode(parser, JULIA_SRC)) == []


def readme_table_names() -> set[str]:
    """The backticked names in the table rows of julia/README.md."""
    lines = (ROOT / "julia" / "README.md").read_text().splitlines()
    return {name for row in lines if row.startswith("|") for name in re.findall(r"`([^`]+)`", row)}


def test_every_package_name_device_code_uses_has_its_upstream_gpu_test_in_the_readme(parser):
    used = device_package_names(JuliaCode(parser, JULIA_SRC))
    assert used, "no device code found: the kernel detection is broken"
    listed = readme_table_names()
    unlisted = sorted(f"{package}.{name}" for name, package in used.items() if name not in listed)
    assert unlisted == [], "give each a row in julia/README.md's device table"


def definitions_inside_macro_calls(code: JuliaCode) -> list[str]:
    """fatou does not look inside a macro call: `@inline f(x) = lenght(x)` passes its
    undefined-name rule. Write `@inline` as the body's first statement, or leave it out."""
    return [
        where(path, node)
        for path, node in code.nodes()
        if node.type == "macro_argument_list"
        and any(defined_name(c) is not None for c in node.named_children)
    ]


def test_definitions_inside_macro_calls_are_found(parser, tmp_path):
    path = tmp_path / "case.jl"
    path.write_text("@inline f(x) = lenght(x)\n@inline function g(x)\n    x\nend\nh(x) = x\n")
    assert definitions_inside_macro_calls(JuliaCode(parser, [path])) == ["case.jl:1", "case.jl:2"]


def test_no_definition_hides_from_fatou_inside_a_macro_call(parser):
    assert definitions_inside_macro_calls(JuliaCode(parser, JULIA_SRC)) == []


# ------------------------------------------------------------------ dependencies


def test_juliapkg_json_declares_exactly_the_julia_packages_dependencies():
    """pyhvp installs julia/Project.toml's deps through juliapkg, then `include`s the package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "julia" / "Project.toml").read_text())
    spec = json.loads((ROOT / "pyhvp" / "juliapkg.json").read_text())
    declared = {name: (p["uuid"], p["version"]) for name, p in spec["packages"].items()}
    expected = {name: (uuid, project["compat"][name]) for name, uuid in project["deps"].items()}
    assert declared == expected


def test_juliapkg_json_has_no_path_entry():
    """A relative `path` names a different directory from the source checkout's copy and from
    the installed copy; juliapkg 0.1.23 finds both when Python starts from the repository root
    with a non-editable install, and refuses them ("'path' entries are not unique")."""
    spec = json.loads((ROOT / "pyhvp" / "juliapkg.json").read_text())
    assert [name for name, p in spec["packages"].items() if "path" in p] == []
