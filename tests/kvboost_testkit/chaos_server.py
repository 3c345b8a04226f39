"""``kvboost-server`` with faults injected into the model runner's forwards, for ``tests/test_server_chaos.py``.

    PYTHONPATH=tests python -m kvboost_testkit.chaos_server model=tiny_random ... --port 0   # kvboost-server's arguments

(from the checkout's root, so that its ``kvboost`` is the one served)

Nothing of kvboost is edited: before ``kvboost.serving.cli.main()`` runs, the runners' ``run`` (the one forward of
an engine step, class level) is wrapped so that a seeded fraction of the forwards raise ``RuntimeError``: half of
them before the forward, half after it (the rows' K/V were written into the pool, the step's bookkeeping was not
finished), and the app gets one more route, ``GET /chaos/state`` (API key as any route), that reads the KV pool's
books on the engine loop's thread: ``KVPool.verify()`` (free / idle / cached counts against the per-block flags),
referenced blocks, the sum of the ref counts, pins, and the faults injected so far.

Environment: ``KVBOOST_CHAOS_P`` (probability that a forward raises, default 0.05), ``KVBOOST_CHAOS_SEED`` (default
0), ``KVBOOST_CHAOS_LOG`` (a file that gets one line per injected fault, appended and unbuffered, so that the count
survives a SIGKILL).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
from typing import Any

#: the message of every injected fault (the test tells injected faults from real engine errors by it)
MARKER = "chaos: injected fault"


class Faults:
    """The seeded fault schedule shared by every patched runner of the process."""

    def __init__(self, probability: float, seed: int, log_path: str | None) -> None:
        self.probability = probability
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.forwards = 0
        self.injected = 0
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log_path else None

    def draw(self) -> tuple[bool, bool]:
        """(raise this forward, raise after running it)."""
        with self.lock:
            self.forwards += 1
            fail, after = self.rng.random() < self.probability, self.rng.random() < 0.5
            if fail:
                self.injected += 1
                if self.log_fd is not None:
                    os.write(self.log_fd, f"{os.getpid()} {self.injected} {'after' if after else 'before'}\n".encode())
            return fail, after

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"forwards": self.forwards, "injected": self.injected}


def patch_runners(faults: Faults) -> list[str]:
    """Wrap ``run`` of every runner class that defines it (class level: every engine of the process)."""
    from kvboost.runtime.hf_generic import HFGenericRunner
    from kvboost.runtime.llama import LlamaRunner

    patched = []
    for cls in (LlamaRunner, HFGenericRunner):
        if "run" not in vars(cls):
            continue
        original = vars(cls)["run"]

        def run(self: Any, batch: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            fail, after = faults.draw()
            if not fail:
                return _original(self, batch, *args, **kwargs)
            if after:
                _original(self, batch, *args, **kwargs)
            raise RuntimeError(f"{MARKER} ({'after' if after else 'before'} a forward of {batch.num_seqs} rows)")

        run.__wrapped__ = original  # type: ignore[attr-defined]
        cls.run = run  # type: ignore[method-assign]
        patched.append(cls.__name__)
    return patched


def pool_state(engine: Any, faults: Faults) -> dict[str, Any]:
    """The KV pool's books (runs on the engine loop's thread, between steps)."""
    pool = engine.pool
    try:
        pool.verify()
        books = "ok"
    except AssertionError as exc:
        books = f"inconsistent: {exc}"
    refs = [pool.refcount(b) for b in range(pool.num_blocks)]
    return {
        "books": books,
        "num_blocks": pool.num_blocks,
        "free": pool.num_free,
        "idle": pool.num_idle,
        "cached": pool.num_cached,
        "referenced": pool.num_referenced,
        "refs_total": sum(refs),
        "blocks_with_refs": sum(r > 0 for r in refs),
        "pinned": len(engine.store.pinned_keys()),
        "failed_forwards": engine.core.counters.get("failed_forwards", 0),
        "running": len(engine.core.scheduler.running),
        "waiting": engine.core.num_waiting(),
        **faults.snapshot(),
    }


def patch_app(faults: Faults) -> None:
    """``create_app`` gets the ``/chaos/state`` route (the CLI imports ``create_app`` when it builds the app)."""
    from kvboost.serving import server

    original = server.create_app

    def create_app(loop: Any, **kwargs: Any) -> Any:
        app = original(loop, **kwargs)

        @app.get("/chaos/state")
        async def chaos_state() -> dict[str, Any]:
            return await asyncio.wrap_future(loop.call(lambda engine: pool_state(engine, faults)))

        return app

    server.create_app = create_app


def main() -> int:
    faults = Faults(
        float(os.environ.get("KVBOOST_CHAOS_P", "0.05")),
        int(os.environ.get("KVBOOST_CHAOS_SEED", "0")),
        os.environ.get("KVBOOST_CHAOS_LOG"),
    )
    patched = patch_runners(faults)
    patch_app(faults)
    print(
        f"chaos: faults in {faults.probability:.0%} of the forwards of {', '.join(patched)} "
        f"(seed {os.environ.get('KVBOOST_CHAOS_SEED', '0')})",
        flush=True,
    )
    from kvboost.serving.cli import main as serve

    return serve(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
