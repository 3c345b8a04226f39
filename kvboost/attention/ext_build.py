"""Building a C++ / CUDA extension with ``torch.utils.cpp_extension.load`` without hanging on a dead build.

torch serialises builds of one extension with a *file baton*: the builder creates ``<build dir>/lock`` and
deletes it when done; any other process waits until the file disappears, polling forever. A builder that is
killed (Ctrl-C, SIGKILL, an OOM kill, a benchmark stopped by hand) leaves the file behind, and every later
process that loads the extension hangs silently in ``FileBaton.wait``. Seen here: a leaderboard run waited six
minutes on a baton left by a killed run.

:func:`load_extension` holds an ``fcntl`` lock (``kvboost.models.loading.file_lock``) on a file beside the build
folder around torch's build. The kernel drops that lock with its process, so inside it no live kvboost builder
can hold torch's baton: a ``lock`` file found there is stale, and is removed (logged) before torch looks at it.
Builders outside kvboost that use the same folder are not covered (none do: the folder is named after kvboost's
extension).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def build_directory(name: str) -> Path:
    """The folder torch builds extension ``name`` in (``$TORCH_EXTENSIONS_DIR`` or its default root)."""
    from torch.utils import cpp_extension

    try:  # private, but the one place that knows the folder's naming (python version, CUDA/CPU) for this torch
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, TypeError):
        return Path(cpp_extension.get_default_build_root()) / name


def load_extension(name: str, **kwargs: Any) -> Any:
    """``torch.utils.cpp_extension.load(name=name, **kwargs)``, one kvboost builder at a time, a stale baton
    removed first."""
    from torch.utils.cpp_extension import load

    from kvboost.models.loading import file_lock

    folder = build_directory(name)
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.parent / f".{name}.kvboost-build.lock"):
        baton = folder / "lock"
        if baton.exists():
            log.warning("removing a stale build lock %s (left by a build that was killed)", baton)
            try:
                os.remove(baton)
            except FileNotFoundError:
                pass
        return load(name=name, **kwargs)
