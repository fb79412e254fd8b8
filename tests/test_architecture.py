"""The layering rules of the library, checked on its source (no imports executed).

* dependencies point one way: ``models -> jax_prefix_attn -> pallas_kernels``;
* no import cycle among library modules;
* no module uses another module's private (``_``-prefixed) name;
* no module-level mutable containers that could act as switches (tables are tuples or
  read-only mappings);
* the product does not talk about its own development history.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "jax_prefix_attn", "models")
LAYER = {"pallas_kernels": 0, "jax_prefix_attn": 1, "models": 2}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """``[(imported module, [imported names], lineno)]`` of library modules imported by ``name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    out.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] not in PACKAGES:
                continue
            names = [a.name for a in node.names]
            # ``from pkg import module`` imports a module, not a name
            sub = [n for n in names if f"{mod}.{n}" in MODULES]
            for n in sub:
                out.append((f"{mod}.{n}", [], node.lineno))
            rest = [n for n in names if n not in sub]
            if rest:
                out.append((mod, rest, node.lineno))
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_dependencies_point_one_way():
    bad = []
    for name, deps in GRAPH.items():
        for mod, _, line in deps:
            if LAYER[mod.split(".")[0]] > LAYER[name.split(".")[0]]:
                bad.append(f"{name}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = {name: {m for m, _, _ in deps if m in MODULES and m != name}
             for name, deps in GRAPH.items()}
    # a package's __init__ re-exports its modules; an edge into the package itself is fine
    # as long as the modules it re-exports do not import the package back
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
    bad = []
    for name, path in MODULES.items():
        for mod, names, line in GRAPH[name]:
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{name}:{line} imports {n} from {mod}")
        src = path.read_text()
        aliases = {a.asname or a.name.rpartition(".")[2]
                   for node in ast.walk(ast.parse(src)) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for a in node.names if (getattr(node, "module", "") or a.name).split(".")[0] in PACKAGES}
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                bad.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_no_mutable_module_level_containers():
    """Module-level lists, dicts and sets would be switches anyone can flip at run time."""
    bad = []
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            targets = []
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["__all__"]:
                continue
            if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                                  ast.SetComp)) or (isinstance(value, ast.Call)
                                                    and getattr(value.func, "id", "") in
                                                    ("dict", "list", "set")):
                bad.append(f"{name}:{node.lineno} {names}")
    assert not bad, "\n".join(bad)


HISTORY = re.compile(r"\bsessions?[ -]?\d|\bsession\b|\bissue #?\d|bench/results/logs",
                     re.IGNORECASE)


def _tracked_files():
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out if f.endswith((".py", ".md", ".toml", ".txt", "Makefile"))]


def test_no_development_history_in_the_product():
    bad = []
    for path in _tracked_files():
        if not path.exists() or path.name == "test_architecture.py":
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not bad, f"{len(bad)} lines:\n" + "\n".join(bad[:60])
