"""The project's modules import each other without cycles, folders import only the folders
below them (``FOLDER_ORDER``, the order docs/architecture.md opens with), and no module
imports another module's private (underscore-prefixed) name.

Imports are read from source with ``ast``, function-level ones included: an import deferred into
a function is still a dependency, and deferring one only hides a cycle. Modules are found by
walking the package folders and named by their path from the repository root
(``stitch/hlo/parser.py`` is ``stitch.hlo.parser``); ``bench/`` counts too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("stitch", "bench")
TOP_LEVEL_MODULES = ("stitch_autoload",)
SKIPPED_FOLDERS = {"tests", "__pycache__", "build", "dist"}


def _module_files() -> dict[str, Path]:
    """Dotted module name → source file, for every module of the project's packages."""
    modules: dict[str, Path] = {}
    for name in TOP_LEVEL_MODULES:
        path = ROOT / f"{name}.py"
        if path.exists():
            modules[name] = path
    for package in PACKAGES:
        folder = ROOT / package
        if not folder.is_dir():
            continue
        for path in folder.rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if any(part in SKIPPED_FOLDERS or part.startswith((".", "venv")) for part in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _resolve(name: str) -> str | None:
    """The project module a dotted name refers to, or None (not the project's)."""
    return name if name in MODULES else None


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _absolute_base(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, with a relative import made absolute."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if _is_package(module) else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _longest_project_prefix(name: str) -> str | None:
    """``import a.b.c`` depends on the deepest of a.b.c, a.b, a that is a project module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        found = _resolve(".".join(parts[:end]))
        if found:
            return found
    return None


def _imports(module: str) -> tuple[set[str], list[str]]:
    """The project modules ``module`` imports, and its imports of other modules' private names
    (as ``"line N: from X import _name"``)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    depends: set[str] = set()
    private: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = _longest_project_prefix(alias.name)
                if found:
                    depends.add(found)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(module, node)
            base_module = _longest_project_prefix(base) if base else None
            if base_module is None:
                continue
            for alias in node.names:
                submodule = _resolve(f"{base}.{alias.name}")
                if submodule:
                    depends.add(submodule)
                else:
                    depends.add(base_module)
                is_dunder = alias.name.startswith("__") and alias.name.endswith("__")
                if alias.name.startswith("_") and not is_dunder:
                    private.append(f"line {node.lineno}: from {base} import {alias.name}")
    depends.discard(module)
    return depends, private


def _graph() -> dict[str, set[str]]:
    return {module: _imports(module)[0] for module in MODULES}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


# The pipeline's order, bottom first: a module may import its own folder and the folders
# listed before its own, never one after it. Top-level modules count as folders of their own.
FOLDER_ORDER = (
    "stitch.hlo",           # HLO: parse, print, evaluate, graphs, index and segment analyses
    "stitch.errors",        # the error hierarchy (re-exported from hlo)
    "stitch.version",
    "stitch.models",        # the zoo's HLO models
    "stitch.codegen",       # Kernel IR, lowering, LLVM/PTX, compile cache, host targets
    "stitch.analysis",      # what may share a kernel: codegen's build rules, feasibility
    "stitch.cost",          # device models: specs, occupancy, latency, HBM, GEMM rates
    "stitch.schedule",      # one kernel's schedule: tuner, layouts, GEMM-chain tilings
    "stitch.pricing",       # a planned kernel's price: delta-evaluator, chains, structure keys
    "stitch.explorer",      # patterns, beam search, BLP, the planner
    "stitch.compiler",      # stitch.compile: plan, lower, build a module
    "stitch.config",        # the settings read from the environment, one registry
    "stitch.xla_pass",      # stitch as an HLO pass inside XLA's compiler
    "stitch.frontends",     # what the front ends share: switching, verification
    "stitch.frontends.jax",  # stitch.jit
    "stitch.frontends.tf",  # tf.function and Keras' TF trainer
    "stitch.autoload",      # STITCH_ENABLE=1: the frameworks patched on import
    "stitch.cli",
    "stitch",               # the package's own namespace
    "stitch_autoload",
    "bench",
)


def _folder(module: str) -> str:
    """The FOLDER_ORDER entry ``module`` belongs to: the longest one that is a prefix of it
    (a subpackage of the list stands apart from its parent)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        # "stitch" is the package's own __init__ only: a new folder must be listed.
        if name in FOLDER_ORDER and (name != "stitch" or module == "stitch"):
            return name
    return module


def test_folders_import_only_downward():
    rank = {folder: i for i, folder in enumerate(FOLDER_ORDER)}
    unknown = sorted({_folder(m) for m in MODULES} - set(rank))
    assert not unknown, f"folders missing from FOLDER_ORDER: {unknown}"
    upward = [f"  {module} -> {target}" for module in sorted(MODULES)
              for target in sorted(_imports(module)[0])
              if rank[_folder(target)] > rank[_folder(module)]]
    assert not upward, "imports of a folder above the importer's:\n" + "\n".join(upward)


def _reached(start: str) -> set[str]:
    graph = _graph()
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("start,packages", [
    ("stitch.explorer.planner", "PLANNING_PACKAGES"),
    ("stitch.codegen.lower", "CODEGEN_PACKAGES"),
    ("stitch.codegen.gpu_cache", "CODEGEN_PACKAGES")])
def test_cached_results_are_keyed_by_all_the_code_that_makes_them(start, packages):
    """A cached plan or build is keyed by the source of the folders listed in
    ``stitch.codegen.cache``: every stitch folder the producer imports must be among them,
    or an edit there would leave stale entries in use."""
    from stitch.codegen import cache
    listed = set(getattr(cache, packages))
    folders = {m.split(".")[1] if m.count(".") >= 2 or _is_package(m) else ""
               for m in _reached(start) if m.startswith("stitch.")}
    assert folders - listed == set(), (start, sorted(folders - listed))


def test_modules_found():
    assert len(MODULES) > 50
    assert _resolve("stitch.hlo.ir") and _resolve("stitch.codegen.lower")


def test_no_import_cycles():
    graph = _graph()
    cycles = _strongly_connected(graph)
    report = []
    for component in cycles:
        members = set(component)
        edges = [f"  {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        report.append(" <-> ".join(component) + "\n" + "\n".join(edges))
    assert not cycles, "import cycles among the project's modules:\n" + "\n".join(report)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_imports(module):
    private = _imports(module)[1]
    assert not private, f"{module} imports private names:\n" + "\n".join(private)
