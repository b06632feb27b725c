"""The house stays readable: no import cycles, a torch-free command line, no private names across
modules, typed options that cannot drift from what is accepted, and ``mypy --strict`` clean."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import accelkit
from accelkit._options import CODE_LAUNCH_NAMES, InitOptions, LaunchOptions, LaunchSettings, Options, StateOptions

ROOT = Path(__file__).parent.parent
PACKAGE = Path(accelkit.__file__).parent


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: set[str] = field(default_factory=set)  # every import (module- and function-level)
    top_level: set[str] = field(default_factory=set)  # imports run when the module is imported
    typed: set[str] = field(default_factory=set)  # imports for type checkers only (under TYPE_CHECKING)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _parse(path: Path) -> Module:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    module = Module(".".join(parts), path, is_package)
    base = parts if is_package else parts[:-1]

    def target(node: ast.ImportFrom) -> list[str]:
        if node.level:
            prefix = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [prefix, *(f"{prefix}.{a.name}" for a in node.names)]

    def visit(nodes: list[ast.stmt], top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                module.typed.update(
                    name
                    for inner in node.body
                    for child in ast.walk(inner)
                    for name in (
                        [a.name for a in child.names]
                        if isinstance(child, ast.Import)
                        else target(child)
                        if isinstance(child, ast.ImportFrom)
                        else []
                    )
                )
                visit(node.orelse, top)
                continue
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = target(node)
            module.imports.update(found)
            if top:
                module.top_level.update(found)
            inner_top = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child_field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, child_field, None)
                if isinstance(children, list):
                    visit([c for c in children if isinstance(c, ast.stmt)], inner_top)
            for handler in getattr(node, "handlers", []):
                visit(handler.body, inner_top)

    visit(ast.parse(path.read_text()).body, True)
    return module


MODULES = {m.name: m for m in (_parse(p) for p in sorted(PACKAGE.rglob("*.py")))}


def _resolve(name: str) -> str | None:
    """The accelkit module an import names (``accelkit.x.y.func`` -> ``accelkit.x.y``), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: Module, imports: set[str]) -> set[str]:
    """Modules that importing ``imports`` executes: each target and the packages above it (their
    ``__init__``), except the importer's own packages, which are already running. A name taken from
    an own package's ``__init__`` (``from . import Protocol``) is an edge to it: the module needs
    what that ``__init__`` defines, so an ``__init__`` importing it back is a loop inside the package."""
    out: set[str] = set()
    own = {module.name.rsplit(".", k)[0] for k in range(1, module.name.count(".") + 1)}
    for name in imports:
        target = _resolve(name) if name.startswith("accelkit") else None
        if target in own and name != target:
            out.add(target)
        while target and target != module.name and target not in own:
            out.add(target)
            target = target.rpartition(".")[0] or None
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


# A loop being removed: the strategies' __init__ holds the protocol and imports the implementations.
CYCLE_WAIVERS: list[list[str]] = []


def test_no_import_cycles() -> None:
    graph = {name: _edges(m, m.imports) for name, m in MODULES.items()}
    found = _cycles(graph)
    assert [c for c in found if c not in CYCLE_WAIVERS] == []
    assert [c for c in CYCLE_WAIVERS if c not in found] == []  # a waiver goes with its loop


def test_the_cycle_finder_sees_a_loop_inside_a_package() -> None:
    # A package's __init__ imports its implementation, which takes a name from that __init__.
    init = Module("accelkit.pkg", PACKAGE, is_package=True, imports={"accelkit.pkg.impl"})
    impl = Module("accelkit.pkg.impl", PACKAGE, is_package=False, imports={"accelkit.pkg.Protocol"})
    saved = dict(MODULES)
    MODULES.update({init.name: init, impl.name: impl})
    try:
        graph = {m.name: _edges(m, m.imports) for m in (init, impl)}
    finally:
        MODULES.clear()
        MODULES.update(saved)
    assert _cycles(graph) == [["accelkit.pkg", "accelkit.pkg.impl"]]


# Imports of the launcher's private modules, being removed (the launcher's face is being built).
PRIVATE_MODULE_WAIVERS: set[str] = set()


def _private_home(target: str) -> str | None:
    """The package whose private module ``target`` is (``accelkit.pkg._mod`` -> ``accelkit.pkg``), else None."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].startswith("_") and not parts[i].startswith("__"):
            return ".".join(parts[:i])
    return None


def test_no_private_module_is_imported_from_another_package() -> None:
    # A sibling package uses what a package's __init__ exports, not its private modules.
    crossings = set()
    for name, module in MODULES.items():
        for imported in module.imports | module.typed:
            target = _resolve(imported) if imported.startswith("accelkit") else None
            home = _private_home(target) if target else None
            if home and name != home and not name.startswith(home + "."):
                crossings.add(f"{name} -> {target}")
    assert sorted(crossings - PRIVATE_MODULE_WAIVERS) == []
    assert sorted(PRIVATE_MODULE_WAIVERS - crossings) == []  # a waiver goes with its import


def test_the_command_line_imports_no_torch_at_module_level() -> None:
    # `accelkit --help` and `accelkit config` stay fast: what the command line and each subcommand's
    # module pull in when imported (and the runner that starts a launched script), at module level.
    from accelkit._cli import COMMANDS

    graph = {name: _edges(m, m.top_level) for name, m in MODULES.items()}
    starts = ["accelkit._cli", "accelkit._cli._worker", *(f"accelkit._cli.{module}" for module, _ in COMMANDS.values())]
    for start in starts:
        parents = {start.rsplit(".", k)[0] for k in range(1, start.count(".") + 1)}  # run first, on any import
        seen = {start, *parents}
        todo = list(seen)
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        heavy = sorted(
            f"{name} imports {imp}"
            for name in seen
            for imp in MODULES[name].top_level
            if imp.split(".")[0] in ("torch", "yaml", "wrapt", "numpy")
        )
        assert heavy == [], f"importing {start} loads: {heavy}"


def test_no_private_name_crosses_a_module_boundary() -> None:
    crossings = []
    for name, module in MODULES.items():
        tree = ast.parse(module.path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = name.split(".") if module.is_package else name.split(".")[:-1]
                source = (
                    ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module or ""
                )
                if not source.startswith("accelkit"):
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in MODULES:
                        aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif alias.name.startswith("_") and not alias.name.startswith("__") and source != name:
                        crossings.append(f"{name}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                home = aliases[node.value.id]
                private = node.attr.startswith("_") and not node.attr.startswith("__")
                if private and f"{home}.{node.attr}" not in MODULES:
                    crossings.append(f"{name}: {home}.{node.attr}")
    assert crossings == []


# Hand-written checks in modules being reworked elsewhere: being removed.
INT_CHECK_WAIVERS: dict[str, int] = {}


def test_the_bool_or_int_check_is_written_once() -> None:
    # ``_options.is_int``: True is an int to isinstance, and no process count, rank or step.
    pattern = re.compile(
        r"isinstance\((?P<a>[\w.]+), bool\) or not isinstance\((?P=a), int\)"
        r"|isinstance\((?P<b>[\w.]+), int\) and not isinstance\((?P=b), bool\)"
    )
    found = {name: len(pattern.findall(m.path.read_text())) for name, m in MODULES.items()}
    found = {name: n for name, n in found.items() if n and name != "accelkit._options"}
    assert found == INT_CHECK_WAIVERS


def test_the_collectives_ask_their_wire_not_the_hardware() -> None:
    # How a checked collective travels is decided once, from the Backend (its Wire): no code under _collectives
    # tests the kind of device or of torch.distributed backend itself.
    pattern = re.compile(r"device[.]type|[.]is_cuda|torch[.]cuda|backend [!=]=|dist_backend")
    found = [
        f"{name}:{number}: {line.strip()}"
        for name, module in MODULES.items()
        if name.startswith("accelkit._collectives")
        for number, line in enumerate(module.path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert found == []


def test_the_root_stays_short_and_modules_small() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(root) <= 16, root
    big = []
    for module in MODULES.values():
        lines = module.path.read_text().splitlines()
        if len(lines) > 400 and not any("longer than 400 lines because" in line for line in lines[:20]):
            big.append(f"{module.name}: {len(lines)} lines")
    assert big == []


def test_no_package_or_module_is_named_like_a_public_function() -> None:
    # Importing accelkit.X sets the attribute X of accelkit: a module named like ak.X would shadow it.
    names = {n for n in accelkit.__all__ if not isinstance(getattr(accelkit, n), type)}
    clashes = sorted(name for name in MODULES if name.count(".") == 1 and name.split(".")[1] in names)
    assert clashes == []


def test_the_typed_options_are_exactly_the_accepted_ones() -> None:
    assert set(StateOptions.__annotations__) == set(Options.names())
    launch_keys = set(LaunchOptions.__annotations__) - set(Options.names())
    assert launch_keys == set(CODE_LAUNCH_NAMES) and launch_keys <= set(LaunchSettings.names())
    assert set(InitOptions.__annotations__) - set(Options.names()) <= launch_keys
    with pytest.raises(TypeError, match="did you mean 'precision'"):
        accelkit.distributed(precison="bf16")  # type: ignore[call-overload]


@pytest.mark.skipif(shutil.which("mypy") is None and not os.environ.get("CI"), reason="mypy is not installed")
def test_mypy_strict_accepts_the_package_and_a_user_script() -> None:
    # The README's calls, every documented option, decorator and context manager, typed strictly.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "accelkit", "tests/typing/user_script.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
