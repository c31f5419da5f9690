"""The package's layers import one way (DESIGN.md, "Target layout").

Every import statement in simkv/ counts: at module level, inside a function, under
TYPE_CHECKING (a module's `if __name__ == "__main__":` block, which runs it as a command, is
not a dependency of the layer). A module may import only the packages its own package is allowed below; no cycle
between packages; torch and triton only in simkv/gpu; nothing inside simkv imports names from
the top-level `simkv` package (only simkv/__init__.py's own lazy wrappers)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "simkv"

BASE = {"errors", "_version", "semantics", "kv_geometry", "limits"}
# package (first component under simkv) -> the packages it may import besides itself
ALLOWED = {
    "errors": set(),
    "limits": {"errors"},         # the numeric rules every input is checked against
    "_version": set(),
    "semantics": set(),
    "kv_geometry": set(),         # how layers share the KV pool (vLLM's groups), from a spec
    "launch_policy": set(),
    "weights": set(),             # the tensors a checkpoint holds (simkv.specs builds on it)
    "specs": BASE | {"weights"},
    "parallel": {"weights"},      # a tensor-parallel rank's share of them (beside specs)
    "sizing": BASE | {"specs", "launch_policy"},
    "config": BASE | {"specs", "sizing"},
    "engine": BASE | {"specs", "sizing", "config", "launch_policy"},
    "workload": BASE | {"specs", "config", "engine"},
    "profile": BASE | {"specs", "sizing", "config", "engine", "launch_policy"},
    "costmodel": BASE | {"specs", "sizing", "config", "engine", "launch_policy", "profile"},
    "sim": BASE | {"specs", "sizing", "config", "engine", "launch_policy", "workload",
                   "costmodel"},
    "gpu": BASE | {"specs", "sizing", "config", "engine", "launch_policy", "workload",
                   "profile"},
    "fitting": BASE | {"specs", "sizing", "config", "engine", "launch_policy", "workload",
                       "profile", "costmodel"},
    "whatif": BASE | {"specs", "sizing", "config", "engine", "launch_policy", "workload",
                      "costmodel", "sim"},
    "validation": BASE | {"specs", "sizing", "config", "engine", "launch_policy", "workload",
                          "profile", "costmodel", "sim", "gpu", "fitting"},
}
for _uses in ALLOWED.values():
    if "specs" in _uses:
        _uses.add("parallel")
ALLOWED["cli"] = set(ALLOWED) | {"whatif", "validation"}
ALLOWED["validate"] = ALLOWED["validation"] | {"validation"}
ALLOWED["__init__"] = BASE | {"config", "sim"}
TORCH = ("torch", "triton")


def package_of(module: str) -> str:
    """'simkv.engine.kv.paged' -> 'engine'; 'simkv' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path):
    """(line, imported module) for every import statement in the file, any depth."""
    module = module_name(path, root)
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    script = set()      # a module's `if __name__ == "__main__":` block runs it as a command
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            script |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in script:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            yield node.lineno, target, names


def violations(root: Path = PACKAGE) -> list[str]:
    """Every import that breaks the contract, as 'file:line: what'."""
    out = []
    edges: dict[str, set] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name == "__main__.py":      # `python -m simkv.X`: a command, not a layer
            continue
        module = module_name(path, root)
        pkg = package_of(module)
        where = f"{path.relative_to(root.parent)}"
        for line, target, names in imports_of(path, root):
            top = target.split(".")[0]
            if top in TORCH and pkg != "gpu":
                out.append(f"{where}:{line}: imports {target} outside simkv/gpu")
            if top != root.name:
                continue
            if target == root.name and pkg != "__init__":
                subs = [n for n in names or [] if (root / n).with_suffix(".py").is_file()
                        or (root / n).is_dir()]
                if names is None or len(subs) != len(names):
                    out.append(f"{where}:{line}: imports the top-level simkv package")
                    continue
                targets = [f"{root.name}.{n}" for n in subs]
            else:
                targets = [target]
            for t in targets:
                other = package_of(t)
                if other == pkg:
                    continue
                edges.setdefault(pkg, set()).add(other)
                if other not in ALLOWED.get(pkg, set()):
                    out.append(f"{where}:{line}: {pkg} imports {t} (a layer above it, or "
                               f"one it must not see)")
    return out


def test_every_import_points_down_the_layers():
    assert violations() == []


def test_every_package_has_a_place_in_the_layers():
    packages = {package_of(module_name(p, PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert packages <= set(ALLOWED), sorted(packages - set(ALLOWED))


def test_the_allowed_layers_have_no_cycle():
    seen, done = set(), set()

    def visit(pkg, path):
        assert pkg not in seen - done, f"cycle: {' -> '.join(path)}"
        if pkg in done:
            return
        seen.add(pkg)
        for other in ALLOWED.get(pkg, ()):
            if other != pkg:
                visit(other, path + [other])
        done.add(pkg)

    for pkg in ALLOWED:
        visit(pkg, [pkg])


@pytest.mark.parametrize("source, expected", [
    ("import simkv.sim.engine\n", "engine imports simkv.sim.engine"),
    ("def f():\n    from simkv.gpu import executor\n", "engine imports simkv.gpu"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from simkv.whatif import sweep\n",
     "engine imports simkv.whatif"),
    ("from ..costmodel import profiled\n", "engine imports simkv.costmodel"),
    ("import torch\n", "imports torch outside simkv/gpu"),
    ("from simkv import simulate\n", "imports the top-level simkv package"),
])
def test_the_check_fails_on_an_upward_import(tmp_path, source, expected):
    root = tmp_path / "simkv"
    (root / "engine").mkdir(parents=True)
    for pkg in ("sim", "gpu", "whatif", "costmodel"):
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "loop.py").write_text(source)
    found = violations(root)
    assert len(found) == 1 and expected in found[0], found


def test_a_downward_import_passes(tmp_path):
    root = tmp_path / "simkv"
    (root / "sim").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sim" / "__init__.py").write_text("")
    (root / "sim" / "engine.py").write_text("from simkv.engine import loop\nimport simkv.specs\n")
    assert violations(root) == []
