"""How pdserve installs and how its packages depend on each other.

- One import namespace: every module is `pdserve.*` (pyproject.toml maps the layout's folders into
  it), so nothing of ours can shadow another distribution's module. The generic top-level names
  of old did: transformers 5.25 began requiring HF's `kernels` distribution (module `kernels`),
  our `kernels` package shadowed it, and every transformers model failed to import.
- The package graph runs one way: app -> gateway and the two roles -> common -> kvtransfer ->
  engine -> kernels (the generated stubs, pdserve.v1, sit below all of them). Every import
  statement counts, lazy ones inside functions included.
"""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
LAYOUT_NAMES = ("engine", "gateway", "kvtransfer", "prefill_node", "decode_node", "kernels")

RANK = {
    "pdserve": 6,  # the app: cli, serve, bench, make_model
    "pdserve.gateway": 5,
    "pdserve.prefill_node": 5,
    "pdserve.decode_node": 5,
    "pdserve.common": 4,
    "pdserve.kvtransfer": 3,
    "pdserve.engine": 2,
    "pdserve.kernels": 1,
    "pdserve.v1": 0,
}
"""A package may import only packages of a lower rank (so the graph has no cycle)."""


def _subpackages(package: str, folder: Path) -> set[str]:
    found = set()
    for init in folder.rglob("__init__.py"):
        rel = init.parent.relative_to(folder).parts
        found.add(".".join((package, *rel)))
    return found


def test_the_package_list_is_every_folder_mapped() -> None:
    expected = set()
    for package, folder in PACKAGE_DIRS.items():
        subs = _subpackages(package, REPO_ROOT / folder)
        # a folder mapped on its own (pdserve.v1 in proto/) is not also a sub-package of its parent
        expected |= {s for s in subs if s == package or s not in PACKAGE_DIRS}
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == expected
    assert set(RANK) == set(PACKAGE_DIRS)


def test_one_top_level_name_owned_by_no_other_distribution() -> None:
    assert {p.split(".")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]} == {"pdserve"}
    owners = importlib.metadata.packages_distributions()
    assert [d for d in owners.get("pdserve", []) if d != "pdserve"] == []


def _modules() -> dict[str, Path]:
    """Every module of ours, by its import name (the longest package-dir mapping wins)."""
    modules: dict[str, Path] = {}
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: kv[0].count(".")):
        root = REPO_ROOT / folder
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *rel)).removesuffix(".__init__")
            modules[name] = path
    return modules


def _imports(path: Path, module: str) -> list[str]:
    """Absolute names of everything the module imports (relative imports resolved)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                is_package = path.name == "__init__.py"
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def _layer(name: str) -> str | None:
    """The ranked package a module belongs to, or None for a module not of ours."""
    best = None
    for package in RANK:
        if (name == package or name.startswith(package + ".")) and (
            best is None or len(package) > len(best)
        ):
            best = package
    return best


def test_no_module_imports_the_old_top_level_names() -> None:
    bare = set(LAYOUT_NAMES) | {"pdserve_kernels", "common"}
    offenders = [
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for module, path in _modules().items()
        for name in _imports(path, module)
        if name.split(".")[0] in bare
    ]
    assert offenders == []


def test_imports_run_one_way_down_the_layers() -> None:
    modules = _modules()
    assert len(modules) > 80  # every module was found
    upward = []
    for module, path in modules.items():
        source = _layer(module)
        for name in _imports(path, module):
            target = _layer(name)
            if target is None or target == source:
                continue
            if RANK[target] >= RANK[source]:
                upward.append(f"{module} ({source}) imports {name} ({target})")
    assert upward == []


def test_the_import_checker_sees_lazy_and_upward_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function is found, and its layer is named."""
    lazy = tmp_path / "m.py"
    lazy.write_text("def f():\n    from pdserve.gateway import main\n")
    assert "pdserve.gateway.main" in _imports(lazy, "pdserve.engine.m")
    assert _layer("pdserve.gateway.main") == "pdserve.gateway"
    assert _layer("pdserve.cli") == "pdserve"
    assert _layer("torch") is None


ENGINE_INTERNALS = {"runner", "scheduler", "kv"}
"""LLMEngine's parts. Outside pdserve.engine, code goes through the engine's facade (requests,
step(), kv_cache, load()); benchmarks that time the parts may reach in, tests may inspect."""


def test_nothing_outside_the_engine_reaches_into_its_parts() -> None:
    reaching = []
    for module, path in _modules().items():
        if _layer(module) == "pdserve.engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                reaching.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} .{node.attr}")
    assert reaching == []
