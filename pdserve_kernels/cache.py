"""Where pdserve keeps what it builds once and reuses: compiled CPU kernels, GGUF checkpoints
converted to HF directories. It sits in the lowest package so every layer can use it."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_PARENT = Path(__file__).resolve().parent.parent


def cache_dir(kind: str) -> Path:
    """The folder for `kind` ("cpu_kernels", "gguf"): under PDSERVE_CACHE_DIR if set; in a
    source checkout its gitignored build/ (so two checkouts never share or rebuild each
    other's); for an installed wheel the user's cache directory (site-packages may not be
    writable)."""
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(os.environ["PDSERVE_CACHE_DIR"]) / kind
    if (_PACKAGE_PARENT / "pyproject.toml").is_file():
        return _PACKAGE_PARENT / "build" / kind
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pdserve" / kind
