"""Where kvboost keeps files on disk (a leaf module: no kvboost imports, so anything may use it)."""

from __future__ import annotations

import os
from pathlib import Path


def kvboost_cache_dir() -> Path:
    """Root of kvboost's on-disk caches (``$KVBOOST_CACHE_DIR`` or ``~/.cache/kvboost``): converted models
    (``models/``), weight digests (``digests/``), the disk KV tier's default folder (``kv/``), int4 sidecars."""
    root = os.environ.get("KVBOOST_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvboost")
    return Path(root)
