"""The house's shape, read from the source (docs/usage.md, "The package's layout"): no import
cycle between the modules of `mecheval_kernels` (folder kernels/) and `mecheval`, no
function-local import of a module of the house that would close one, `mecheval_kernels` never
imports `mecheval`, no function outside the
Triton kernels longer than 80 lines, a README under 180 lines, and test folders that mirror the
package's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# import name -> folder
PACKAGES = {"mecheval_kernels": "kernels", "mecheval": "mecheval"}
LONGEST_FUNCTION = 80
LONGEST_README = 180


def _module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(REPO / PACKAGES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(package, path): path
    for package, folder in PACKAGES.items()
    for path in (REPO / folder).rglob("*.py")
}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The house's modules that `node`, in module `name`, imports, with the packages above them
    (importing a.b.c runs a and a.b first), leaving out the packages that hold `name`."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = (
                name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
            )
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for target in targets:
        parts = target.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in MODULES and prefix != name and not name.startswith(prefix + "."):
                found.add(prefix)
    return found


def _top_level_imports(body: list[ast.stmt]):
    """Imports run when the module is imported: at the top, and inside top-level if/try blocks
    (but not `if TYPE_CHECKING:`)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _top_level_imports(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [s for h in node.handlers for s in h.body]
            yield from _top_level_imports(node.body + handlers + node.orelse + node.finalbody)


GRAPH = {
    name: set().union(*(_imported(name, n) for n in _top_level_imports(tree.body)))
    for name, tree in TREES.items()
}


def _reaches(start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        here = stack.pop()
        if here == goal:
            return True
        if here not in seen:
            seen.add(here)
            stack.extend(GRAPH[here])
    return False


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def test_the_import_graph_is_read():
    assert len(MODULES) > 100 and "mecheval.interventions.grid" in GRAPH["mecheval.interventions"]


def test_no_import_cycle():
    cycles = [
        f"{name} -> {other} -> ... -> {name}"
        for name, imports in GRAPH.items()
        for other in sorted(imports)
        if _reaches(other, name)
    ]
    assert not cycles, cycles


def test_no_function_local_import_closes_a_cycle():
    hidden = []
    for name, tree in TREES.items():
        for function in _functions(tree):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    hidden += [
                        f"{name}.{function.name} imports {other}"
                        for other in sorted(_imported(name, node))
                        if _reaches(other, name)
                    ]
    assert not hidden, hidden


def test_kernels_stand_alone():
    assert not [
        name
        for name, imports in GRAPH.items()
        if name.startswith("mecheval_kernels")
        and any(m.split(".")[0] == "mecheval" for m in imports)
    ]


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_long_function_outside_the_triton_kernels(package):
    long = [
        f"{MODULES[name].relative_to(REPO)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1})"
        for name, tree in TREES.items()
        if name.split(".")[0] == package
        for f in _functions(tree)
        if f.end_lineno - f.lineno + 1 > LONGEST_FUNCTION
        and not any("jit" in ast.unparse(d) for d in f.decorator_list)
    ]
    assert not long, long


def test_the_readme_is_a_short_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) < LONGEST_README


def test_the_test_folders_mirror_the_package():
    """tests/x/ holds the tests of mecheval/x/ (tests/kernels/ those of kernels/, tests/configs/
    those of configs/); what cuts across folders is a pytest marker, not a folder."""
    tests = REPO / "tests"
    folders = {path.parent.relative_to(tests) for path in tests.rglob("test_*.py")}
    strays = [
        str(folder)
        for folder in folders - {Path(".")}
        if not (REPO / "mecheval" / folder).is_dir() and not (REPO / folder).is_dir()
    ]
    assert not strays, f"test folders without a package folder: {sorted(strays)}"
