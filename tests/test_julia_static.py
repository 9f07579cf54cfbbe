"""Static checks of the bundled Julia package: it parses, and fatou finds no undefined name."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JULIA_FILES = sorted((ROOT / "julia").rglob("*.jl"))
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


def syntax_problems(tree):
    stack, found = [tree.root_node], []
    while stack:
        node = stack.pop()
        if node.type == "ERROR" or node.is_missing:
            found.append(f"{node.type} at {node.start_point}")
        stack.extend(node.children)
    return found


def test_the_julia_package_has_source_and_tests():
    names = {p.relative_to(ROOT / "julia").as_posix() for p in JULIA_FILES}
    assert {"src/PyHVP.jl", "test/runtests.jl"} <= names


@pytest.mark.parametrize("path", JULIA_FILES, ids=lambda p: p.name)
def test_tree_sitter_parses_without_error_nodes(path):
    tree_sitter = pytest.importorskip("tree_sitter")
    tsjulia = pytest.importorskip("tree_sitter_julia")
    parser = tree_sitter.Parser(tree_sitter.Language(tsjulia.language()))
    assert syntax_problems(parser.parse(path.read_bytes())) == []


def test_fatou_finds_nothing_in_the_julia_package():
    done = fatou_lint(ROOT / "julia")
    assert done.returncode == 0, done.stdout + done.stderr


def test_fatou_config_reports_a_misspelled_name(tmp_path):
    bad = tmp_path / "bad.jl"
    bad.write_text("function f(x)\n    return sum(abs2, x) + lenght(x)\nend\n")
    report = fatou_lint(bad)
    assert "undefined-name" in report.stdout + report.stderr and report.returncode == 1
