"""A kvboost-server (or a script that wraps one) in a subprocess, ready once it printed its base URL."""

from __future__ import annotations

import re
import subprocess
import threading


class LaunchedServer:
    """``args`` run with ``env`` (and ``cwd``); ``self.base`` is the URL of its ready line (without ``/v1``) and
    ``self.lines`` everything it printed so far. AssertionError, with that output, when it is not ready in time."""

    def __init__(self, args: list[str], env: dict[str, str], *, cwd: str | None = None,
                 ready_timeout: float = 180) -> None:  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd)  # fmt: skip
        self.lines: list[str] = []
        self.base = ""
        ready = threading.Event()

        def read() -> None:  # keep draining the pipe, or the server blocks on a full one
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.lines.append(line)
                if match := re.search(r"ready: (http://\S+)/v1", line):
                    self.base = match.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(ready_timeout):
            self.proc.kill()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
