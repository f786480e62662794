"""pdserve's top-level packages must not share a name with another installed distribution's
modules: transformers 5.25 began requiring HF's `kernels` distribution (module `kernels`), our
old `kernels` package shadowed it, and every transformers model failed to import."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def our_packages() -> set[str]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return {p.removesuffix("*") for p in patterns}


def test_top_level_packages_shadow_no_installed_distribution() -> None:
    owners = importlib.metadata.packages_distributions()
    clashes = {
        name: [d for d in owners.get(name, []) if d != "pdserve"] for name in our_packages()
    }
    assert our_packages() >= {"engine", "pdserve", "gateway"}
    assert not {name: d for name, d in clashes.items() if d}, clashes
