"""The only place mgserve reads the process environment.

Settings come from ``MGSERVE_<NAME>`` variables named in ``mgserve/config.py``; a few non-setting
variables (the user's cache directory) are read here too, so a grep finds every one.
"""

from __future__ import annotations

import os
from pathlib import Path


def get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def cache_dir(configured: str | None = None) -> Path:
    """Where mgserve keeps the assembled built-in model and compiled kernels."""
    if configured:
        return Path(configured)
    xdg = get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "mgserve"
