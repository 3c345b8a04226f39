"""A private ``redis-server`` on a free loopback port, for the tests and the experiment checks.

One place starts, waits for and stops such a server (``tests/kvboost_testkit/redis_server.py``,
``experiments/checks/plugin_matrix.py`` and ``experiments/checks/redis_tier_check.py`` use it)::

    reason = redis_unavailable_reason()  # None when the binary and the redis package are both here
    with RedisProcess("--maxmemory", "1gb") as server:
        use(server.url)

The server keeps nothing on disk (``--save "" --appendonly no``), listens on 127.0.0.1 only and logs to
``<folder>/redis.log``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from experiments.common import stop_process

if TYPE_CHECKING:  # typing.Self is 3.11+; only the type checker needs it (annotations are not evaluated)
    from typing_extensions import Self

FALLBACK_BINARY = "/usr/bin/redis-server"


def redis_server_binary() -> str | None:
    """The ``redis-server`` to run: ``$KVBOOST_REDIS_SERVER``, else the one on PATH, else
    ``/usr/bin/redis-server`` when it exists (a PATH without ``/usr/bin``); None when there is none."""
    return (
        os.environ.get("KVBOOST_REDIS_SERVER")
        or shutil.which("redis-server")
        or (FALLBACK_BINARY if os.path.exists(FALLBACK_BINARY) else None)
    )


def redis_unavailable_reason() -> str | None:
    """Why a private server cannot run here, as a sentence with the install command; None when it can."""
    if redis_server_binary() is None:
        return "redis-server binary not found (apt-get install redis-server, or set KVBOOST_REDIS_SERVER)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis package is not installed (pip install 'redis>=5')"
    return None


def _free_port() -> int:
    # The OS picks a free port; it is released before redis-server binds it, so another process can take it in
    # between: RedisProcess.start retries on another port when the server does not come up.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """One ``redis-server`` process on 127.0.0.1, started by :meth:`start`.

    ``extra_args`` go after the defaults on the command line (``"--maxmemory", "3gb"``, ...), so they can also
    override them. ``folder`` is the server's ``--dir`` and holds ``redis.log``; without one a temporary folder
    is made, and :meth:`close` removes it. As a context manager: started on entry, closed on exit.
    """

    def __init__(self, *extra_args: str, folder: str | Path | None = None, timeout: float = 10.0,
                 attempts: int = 5) -> None:  # fmt: skip
        self.extra_args = tuple(extra_args)
        self._own_folder = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="kvboost-redis-")) if folder is None else Path(folder)
        self.timeout = timeout
        self.attempts = attempts
        self.port = 0
        self.argv: list[str] = []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log (appended to by every start)."""
        return self.folder / "redis.log"

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Self:
        """Start the server and wait until it answers PING; returns ``self``.

        After :meth:`stop` the same port is tried first, so a restart comes back at the same address. A server
        that does not come up (most often: its port was taken meanwhile) is retried on another free port;
        RuntimeError, with the end of the log, after ``attempts`` tries. A running server is left as it is.
        """
        if self.running:
            return self
        reason = redis_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        binary = redis_server_binary()
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(self.attempts):
            self.port = self.port or _free_port()
            # --logfile "": log to stdout, which goes to redis.log (one file for every start, in order).
            self.argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                         "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                         "--logfile", "", *self.extra_args]  # fmt: skip
            with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return self
            self.stop()
            self.port = 0
        raise RuntimeError(f"redis-server did not start ({self.log_path}):\n{self._log_tail()}")

    def _wait_ready(self) -> bool:
        import redis

        deadline = time.monotonic() + self.timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if not self.running:  # exited (e.g. the port was taken): no point waiting
                    return False
                try:
                    if client.ping():
                        return True
                except redis.exceptions.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s). The port and the folder are kept for :meth:`start`."""
        proc, self.proc = self.proc, None
        stop_process(proc, grace_s=10.0)

    def close(self) -> None:
        """Stop the server and remove its folder when this object made it."""
        self.stop()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()  # the temporary folder would otherwise outlive a failed start
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()
