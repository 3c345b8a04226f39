"""``kvboost-server`` with the soak test's instruments (testing only: never a way to run a real server).

    python -m experiments.bench.soak_server --fault-rate 0.001 [every kvboost-server flag and override]

The same command line as ``kvboost-server`` (``kvboost.serving.cli.main`` runs it) plus ``--fault-rate P`` and
``--fault-seed S``, taken off before the server sees its arguments. What it adds, all from outside the library:

- **Faults**: once the app is built (after warm-up and the step budget's calibration, so the server starts), each
  call of the engine's ``runner.run`` (every forward of a scheduled step) raises ``InjectedFault`` with probability
  ``P`` (a seeded generator), half of them before the forward, half after it (its K/V rows written, its logits
  dropped), so that the core's rollback meets both.
- **Waits**: every admission of a request by the scheduler is recorded: steps from its arrival, whether it was
  preempted, and whether a request that had aged past ``aging_steps`` (or was preempted) still waited behind it,
  i.e. was overtaken (``kvboost.engine.scheduler``: aged requests go first, oldest first).
- **Routes** (``/soak/...``, on the loop thread between steps): ``GET /soak/books`` (the KV pool's counts and its
  own consistency check, the pins, the queues; ``quiescent`` says no request is queued or running),
  ``POST /soak/unpin`` (``engine.unpin`` of a token-id list; kvboost-server has no unpin route), ``GET /soak/waits``
  and ``GET /soak/faults``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from typing import Any

#: what the instruments collected (one server process)
STATE: dict[str, Any] = {"faults": {"armed": False, "calls": 0, "raised_before": 0, "raised_after": 0},
                         "waits": [], "overtaken": [], "lost_preempted_flag": []}  # fmt: skip
_LOCK = threading.Lock()


class InjectedFault(RuntimeError):
    """The soak test's injected forward failure."""


def wrap_runner(engine: Any, rate: float, seed: int) -> None:
    """Make ``engine.runner.run`` raise with probability ``rate`` once :data:`STATE` says armed."""
    runner = engine.runner
    run = runner.run
    rng = random.Random(seed)
    faults = STATE["faults"]

    def run_with_faults(batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not faults["armed"]:
            return run(batch, *args, **kwargs)
        faults["calls"] += 1
        draw = rng.random()
        if draw < rate / 2:
            faults["raised_before"] += 1
            raise InjectedFault(f"soak: injected fault before forward {faults['calls']}")
        out = run(batch, *args, **kwargs)
        if draw < rate:
            faults["raised_after"] += 1
            raise InjectedFault(f"soak: injected fault after forward {faults['calls']}")
        return out

    runner.run = run_with_faults


def record_waits() -> None:
    """Record every admission (see the module docstring) by wrapping two of the scheduler's methods.

    Each request's place by the aging rule is read when the queue is ordered (``order_waiting``), since admission
    clears ``preempted`` before it calls ``admitted``: (0, arrival) preempted, (1, arrival) aged, 2 neither. A
    request queued again with ``started`` set but ``preempted`` clear (its resumption gave up its place) is
    counted in ``lost_preempted_flag``."""
    from kvboost.engine.scheduler import Scheduler

    order_waiting, admitted = Scheduler.order_waiting, Scheduler.admitted

    def place(self: Any, r: Any, step: int) -> tuple[int, int]:
        aged = step - r.arrival_step >= self.aging_steps
        return (0 if r.preempted else 1 if aged else 2, r.arrival_step)

    def order_waiting_noting_places(self: Any, step: int) -> None:
        order_waiting(self, step)
        self._soak_step = step
        self._soak_places = {id(r): (place(self, r, step), bool(r.started)) for r in self.waiting}
        lost = [r for r in self.waiting if r.started and not r.preempted and r.phase == "waiting"]
        if lost:
            with _LOCK:
                STATE["lost_preempted_flag"].append({"step": step, "requests": len(lost)})

    def admitted_recorded(self: Any, request: Any) -> None:
        places = getattr(self, "_soak_places", {})
        mine, resumed = places.get(id(request), ((2, request.arrival_step), False))
        ahead = [places[id(r)][0] for r in self.waiting if r is not request and id(r) in places]
        passed = [p for p in ahead if p[0] < 2 and p < mine]  # an aged or preempted request that should go first
        step = getattr(self, "_soak_step", request.arrival_step)
        with _LOCK:
            STATE["waits"].append({"kind": request.kind, "steps": step - request.arrival_step, "resumed": resumed,
                                   "place": mine[0], "preemptions": request.preemptions, "time": time.time()})
            for p in passed:
                STATE["overtaken"].append({"admitted_place": list(mine), "waiting_place": list(p)})
        admitted(self, request)

    Scheduler.order_waiting, Scheduler.admitted = order_waiting_noting_places, admitted_recorded


def books(engine: Any) -> dict[str, Any]:
    """The pool's counts, its consistency check and the pins (run on the loop thread, between steps)."""
    pool, core = engine.pool, engine.core
    try:
        pool.verify()
        verify = "ok"
    except AssertionError as exc:
        verify = f"failed: {exc}"
    pinned = engine.store.pinned_keys()
    return {"quiescent": not core.has_work(), "waiting": len(core.scheduler.waiting),
            "running": len(core.scheduler.running), "num_blocks": pool.num_blocks, "free": pool.num_free,
            "idle_cached": pool.num_idle, "referenced": pool.num_referenced, "cached": pool.num_cached,
            "pinned_keys": len(pinned), "verify": verify, "counters": dict(core.counters)}  # fmt: skip


def add_routes(app: Any, loop: Any) -> None:
    """The ``/soak`` routes (see the module docstring)."""
    from fastapi import Body

    async def on_loop(fn: Any) -> Any:
        return await asyncio.wrap_future(loop.call(fn))

    @app.get("/soak/books")
    async def get_books() -> dict[str, Any]:
        return await on_loop(books)

    @app.post("/soak/unpin")
    async def unpin(ids: list[int] = Body(..., embed=True)) -> dict[str, Any]:  # noqa: B008 - FastAPI's idiom
        return {"unpinned": await asyncio.to_thread(loop.engine.unpin, ids, chat=False)}

    @app.get("/soak/waits")
    async def waits() -> dict[str, Any]:
        with _LOCK:
            return {"waits": list(STATE["waits"]), "overtaken": list(STATE["overtaken"]),
                    "lost_preempted_flag": list(STATE["lost_preempted_flag"]),
                    "aging_steps": loop.core.scheduler.aging_steps, "step": loop.core.steps}  # fmt: skip

    @app.get("/soak/faults")
    async def faults() -> dict[str, Any]:
        return dict(STATE["faults"])


def main(argv: list[str] | None = None) -> int:
    import kvboost.build
    import kvboost.serving.server
    from kvboost.serving import cli

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--fault-rate", type=float, default=0.0)
    p.add_argument("--fault-seed", type=int, default=0)
    ours, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not 0.0 <= ours.fault_rate < 1.0:
        raise SystemExit(f"--fault-rate must be in [0, 1), got {ours.fault_rate}")
    build_engine, create_app = kvboost.build.build_engine, kvboost.serving.server.create_app

    def build_engine_with_faults(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        engine = build_engine(cfg, *args, **kwargs)
        if ours.fault_rate > 0:
            wrap_runner(engine, ours.fault_rate, ours.fault_seed)
        return engine

    def create_app_instrumented(loop: Any, *args: Any, **kwargs: Any) -> Any:
        app = create_app(loop, *args, **kwargs)
        add_routes(app, loop)
        STATE["faults"]["armed"] = ours.fault_rate > 0  # warm-up and calibration are over: the server starts
        return app

    kvboost.build.build_engine = build_engine_with_faults
    kvboost.serving.server.create_app = create_app_instrumented
    record_waits()
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
