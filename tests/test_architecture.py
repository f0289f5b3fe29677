"""The package's shape: small modules, functions and classes, and imports that only point down the layers
apps → engine → decoding → runtime → kernels → hub → base (README: Architecture)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "swiftdecode"
MAX_MODULE, MAX_FUNCTION, MAX_CLASS = 400, 60, 150  # lines
# The layers, lowest first: a module's layer is the folder it lives in (the package's own __init__, its public API,
# sits with the apps); a module may import from its own layer and those below.
LAYERS = ("base", "hub", "kernels", "runtime", "decoding", "drafters", "engine", "apps")
RANK = {name: rank for rank, name in enumerate(LAYERS)}
APP_ONLY = ("argparse", "fastapi", "starlette", "uvicorn", "matplotlib", "ray")


def modules() -> dict[str, ast.Module]:
    """Dotted name (below `swiftdecode`, "" for the package itself) -> parsed source."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _source(name: str) -> str:
    path = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def layer(name: str) -> int:
    """The rank of the layer module `name` lives in."""
    folder = name.split(".")[0] if name else "apps"
    if "." not in name and name and not (PACKAGE / name).is_dir():
        folder = None  # a module beside the layer folders
    assert folder in RANK, f"module swiftdecode.{name} lies outside the layer folders {LAYERS}: move it into one"
    return RANK[folder]


def imports(name: str, tree: ast.Module, names: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module below `swiftdecode` or an outside top-level package, line, at module level)."""
    top_level = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = name.split(".")[: -node.level + (1 if (PACKAGE / name.replace(".", "/")).is_dir() else 0)]
                base = ".".join(["swiftdecode", *pkg, *([base] if base else [])])
            subs = [f"{base}.{a.name}" for a in node.names]
            found = [s for s in subs if s.removeprefix("swiftdecode.") in names and s.startswith("swiftdecode.")]
            out += [(m, node.lineno, id(node) in top_level) for m in (found or [base])]
    return [(m.removeprefix("swiftdecode.") if m.startswith("swiftdecode.") else m, line, top) for m, line, top in out]


def inside(module: str, names: set[str]) -> str | None:
    """The package module `module` refers to ("" for the package), or None if it is outside the package."""
    if module == "swiftdecode":
        return ""
    return module if module in names else None


def test_modules_functions_and_classes_are_small():
    too_big = []
    for name, tree in modules().items():
        lines = len(_source(name).splitlines())
        if lines > MAX_MODULE:
            too_big.append(f"module {name}: {lines} lines")
        for node in ast.walk(tree):
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                size = node.end_lineno - node.lineno + 1
                if size > limit:
                    too_big.append(f"{name}.{node.name}: {size} lines (limit {limit})")
    assert not too_big, too_big


def test_imports_point_down_the_layers():
    mods = modules()
    names = set(mods)
    upward = []
    for name, tree in mods.items():
        for module, line, _ in imports(name, tree, names):
            target = inside(module, names)
            if target is not None and target != name and layer(target) > layer(name):
                upward.append(f"swiftdecode.{name}:{line} imports swiftdecode.{target}")
    assert not upward, upward


def test_no_import_cycles_at_module_level():
    mods = modules()
    names = set(mods)
    graph = {
        name: {t for m, _, top in imports(name, tree, names) if top and (t := inside(m, names)) not in (None, name)}
        for name, tree in mods.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                pytest.fail(f"import cycle: {' -> '.join(path[path.index(nxt) :] + [nxt])}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_only_apps_import_cli_web_and_plotting_libraries():
    mods = modules()
    names = set(mods)
    misplaced = [
        f"swiftdecode.{name}:{line} imports {module}"
        for name, tree in mods.items()
        if layer(name) != RANK["apps"]
        for module, line, _ in imports(name, tree, names)
        if module.split(".")[0] in APP_ONLY
    ]
    assert not misplaced, misplaced


def test_no_formatter_escapes():
    """The formatter's layout holds everywhere: no comment that switches it off for a line or a block (say, to
    squeeze code under a size limit)."""
    escapes = [
        f"{path.relative_to(PACKAGE.parent)}:{i}"
        for path in [*PACKAGE.rglob("*.py"), *PACKAGE.parent.joinpath("tests").rglob("*.py")]
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)", line)
    ]
    assert not escapes, escapes


# Writes that change another library's objects in place: a class swap, a bound forward, a registry entry.
PATCHES = "runtime.patches"


def test_patching_lives_in_one_module():
    """Only `runtime.patches` swaps an object's class, assigns a `forward` or registers with transformers."""
    found = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            swaps = [t for t in targets if isinstance(t, ast.Attribute) and t.attr in ("__class__", "forward")]
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            registers = call and node.func.attr == "register" and "Interface" in ast.unparse(node.func.value)
            if (swaps or registers) and name != PATCHES:
                found.append(f"swiftdecode.{name}:{node.lineno}")
    assert not found, found


# The speculative round, for one request and for a batch: (module, function or Class.method) it reads through.
ROUND = [
    ("engine.round", "round_alone"),
    ("engine.round", "Proposer.propose"),
    ("engine.round", "Proposer.copy"),
    ("engine.round", "Proposer.observe"),
    ("engine.round", "forward_trees"),
    ("engine.round", "settle"),
    ("decoding.verification", "verify"),
]
ROUND_LINES, ROUND_FILES = 80, 3


def test_one_round_reads_in_80_lines_across_3_files():
    mods, lines = modules(), 0
    for module, dotted in ROUND:
        scope = mods[module]
        for part in dotted.split("."):
            scope = next(n for n in scope.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == part)
        lines += scope.end_lineno - scope.lineno + 1
    assert lines <= ROUND_LINES and len({m for m, _ in ROUND}) <= ROUND_FILES, lines
    batch = _source("engine.batch")  # the batch's round goes through the same verification
    assert all(f"{name}(" in batch for name in ("forward_trees", "settle", "proposer.copy"))
