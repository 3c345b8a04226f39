"""kvboost-server under chaos: 32 concurrent chat clients (the official ``openai`` client), exceptions injected into
a seeded fraction of the engine's forwards, and a SIGKILL + restart of the server on the same disk folder midway.

The server runs through ``tests/kvboost_testkit/chaos_server.py`` (``kvboost.serving.cli.main`` with the runners'
``run`` wrapped to raise ``RuntimeError`` in a seeded fraction of the forwards, before or after the forward, and a
``/chaos/state`` route that reads the KV pool's books on the loop thread). Each client holds a multi-turn conversation (groups of
clients share a system prompt, so the prefix cache serves across clients); a 500 ``engine_error`` (an injected fault
hit its request) and a connection error (the SIGKILL) are retried, bounded. After about half of the conversations'
first turns completed, the server is SIGKILLed with requests in flight and a new one starts on the same disk folder
and the same ``KVBOOST_CACHE_DIR`` (the stored salt secret): the clients go on against it.

Checked afterwards:

- every completed answer (token ids and text) equals what a fresh engine of the same config generates cold for the
  same messages, alone (fp32);
- ``usage.prompt_tokens`` is the prompt's token count, and ``0 <= cached_tokens < prompt_tokens`` (the last prompt
  token is always computed) and ``cached_tokens`` is at most the longest common token prefix of the prompt with any
  sequence the server (either process: the disk tier outlives the first) could have computed before the answer
  came: the prompt of any request sent before (failed or not), its prompt + answer (generated tokens are stored) and
  its answer re-tokenized as the next turn will see it (the canonical store);
- the restarted server served cached tokens that only the killed one computed (its disk records);
- at quiescence no KV block is referenced (``vllm:kv_cache_usage_perc`` 0, the pool's books consistent, no ref
  count left), and the engine loop still runs (``GET /health``);
- faults really fired (500 ``engine_error`` answers, each one an injected fault), and each process completed
  requests.

The model is the tiny random one with a larger init scale (``initializer_range=0.2``): at the default scale its
greedy answer is "\\n" x 8 whatever the prompt, which would make the output comparison blind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from kvboost_testkit.server_process import LaunchedServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MARKER = "chaos: injected fault"  # chaos_server.MARKER
KEY = "chaos-key"
OVERRIDES = [
    "model=tiny_random",
    "engine.decode=eager",
    "warmup=false",
    "chunker.chunk_size=16",
    "+model.random_init.initializer_range=0.2",
]
MAX_TOKENS = 8
CLIENTS = 32
FAULT_P = 0.08  # of the forwards
KILL_AFTER_FIRST_TURNS = CLIENTS // 2
MAX_ATTEMPTS = 25  # per turn: engine errors are retried (each attempt fails with a small probability)
START_STAGGER_S = 0.05  # client i starts its conversation i * this after the first (arrivals spread over steps)
KILL_WITH_IN_FLIGHT = 2  # the SIGKILL waits for at least this many requests in flight
# a small step: prompts are prefilled in chunks over several steps (a fault can hit a half-prefilled request) and
# requests queue behind the running ones; more forwards, so more of them fail
SERVER_FLAGS = ["--max-running", "8", "--max-batch-tokens", "128"]

SYSTEMS = [
    (
        "You are a terse assistant for a hardware store. Answer in a few words, never apologise, and always name the "
        "aisle where the customer can find the item they ask about."
    ),
    (
        "You are a travel guide who knows every small town in Portugal. Answer with one surprising fact about the "
        "place and one dish a visitor should try there."
    ),
    (
        "You are a patient math tutor for children. Explain each answer with a tiny example using apples or marbles, "
        "and end with an encouraging word."
    ),
    (
        "You are a ship's log keeper on a nineteenth century whaling vessel. Report everything as a dated log entry "
        "with the weather and the wind."
    ),
]
TOPICS = [
    "a hammer",
    "Obidos",
    "seven times eight",
    "the fog",
    "wood glue",
    "Tomar",
    "half of ninety",
    "a storm",
    "sandpaper",
    "Monsaraz",
    "prime numbers",
    "the harpoon",
    "a ladder",
    "Sintra",
    "fractions",
    "the crew",
    "paint rollers",
    "Evora",
    "long division",
    "the whale",
    "duct tape",
    "Braga",
    "triangles",
    "the cook",
    "a spirit level",
    "Lagos",
    "even numbers",
    "the captain",
    "hinges",
    "Viseu",
    "the number zero",
    "ice",
]
FOLLOW_UPS = ["Why is that?", "Say it again in other words, {name}.", "And one more detail about {topic}, please."]


def conversation_plan(i: int) -> tuple[list[dict[str, str]], list[str]]:
    """Client ``i``'s system prompt (shared with every fourth client) and its user messages (2 or 3 turns)."""
    name, topic = f"client {i}", TOPICS[i % len(TOPICS)]
    first = f"I am {name}. Tell me about {topic}."
    turns = [first] + [f.format(name=name, topic=topic) for f in FOLLOW_UPS[: 2 if i % 3 == 0 else 1]]
    return [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}], turns


# ---------------------------------------------------------------------- the server processes
class ChaosServer(LaunchedServer):
    """``tests/kvboost_testkit/chaos_server.py`` (kvboost-server with injected faults) in a subprocess."""

    def __init__(self, disk: Path, env: dict[str, str], seed: int) -> None:
        args = [sys.executable, "-m", "kvboost_testkit.chaos_server", *OVERRIDES, "--port", "0",
                "--disk-cache-dir", str(disk),
                "--api-key", KEY, "--log-level", "warning", *SERVER_FLAGS]  # fmt: skip
        env = {**env, "KVBOOST_CHAOS_P": str(FAULT_P), "KVBOOST_CHAOS_SEED": str(seed),
               "PYTHONPATH": str(ROOT / "tests")}  # the module runs from the checkout (cwd) and tests/
        super().__init__(args, env, cwd=ROOT, ready_timeout=240)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    def state(self) -> dict[str, Any]:
        with self.http() as c:
            r = c.get("/chaos/state")
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict[str, float]:
        with self.http() as c:
            text = c.get("/metrics").text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


class Fleet:
    """The server the clients talk to now: generation 1, then (after the SIGKILL) generation 2."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.generation = 0
        self.base = ""
        self.killed: set[int] = set()
        self.done = threading.Event()  # the test is over (or failed): waiting clients give up

    def publish(self, base: str) -> None:
        with self.cond:
            self.generation += 1
            self.base = base
            self.cond.notify_all()

    def mark_killed(self) -> None:
        with self.cond:
            self.killed.add(self.generation)

    def current(self) -> tuple[int, str]:
        with self.cond:
            return self.generation, self.base

    def after_connection_error(self, generation: int, timeout: float = 300.0) -> bool:
        """True once a newer server is up (the one that failed was killed); False: an unexpected connection error."""
        deadline = time.monotonic() + timeout
        with self.cond:
            if generation not in self.killed:
                return False
            while self.generation == generation and not self.done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 1.0))
            return self.generation > generation


# ---------------------------------------------------------------------- the clients
@dataclass
class Attempt:
    client: int
    turn: int
    attempt: int
    generation: int
    messages: list[dict[str, str]]
    sent: float
    received: float = 0.0
    outcome: str = "pending"  # ok | engine_error | connection_error | unexpected
    detail: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""


class Run:
    """Shared state of the clients and the killer."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.lock = threading.Lock()
        self.attempts: list[Attempt] = []
        self.first_turns_done = 0
        self.in_flight = 0
        self.progress = threading.Condition(self.lock)
        self.failures: list[str] = []
        self.model = ""

    def client(self, i: int) -> None:
        try:
            self._conversation(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            with self.lock:
                self.failures.append(f"client {i} crashed: {exc!r}")

    def _conversation(self, i: int) -> None:
        time.sleep(i * START_STAGGER_S)
        messages, turns = conversation_plan(i)
        clients: dict[int, openai.OpenAI] = {}
        for t, user in enumerate(turns):
            messages = messages + [{"role": "user", "content": user}]
            answer = self._turn(i, t, messages, clients)
            if answer is None:
                return
            messages = messages + [{"role": "assistant", "content": answer.text}]
        for c in clients.values():
            c.close()

    def _turn(
        self, i: int, t: int, messages: list[dict[str, str]], clients: dict[int, openai.OpenAI]
    ) -> Attempt | None:
        unexpected = 0
        for k in range(MAX_ATTEMPTS):
            generation, base = self.fleet.current()
            if generation not in clients:
                clients[generation] = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=180)
            attempt = Attempt(i, t, k, generation, [dict(m) for m in messages], time.monotonic())
            with self.lock:
                self.attempts.append(attempt)
                self.in_flight += 1
            try:
                response = clients[generation].chat.completions.create(
                    model=self.model,
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"return_token_ids": True},
                )
                body = response.model_dump()
                attempt.outcome = "ok"
                choice = body["choices"][0]
                attempt.token_ids = list(choice.get("token_ids") or [])
                attempt.text = choice["message"]["content"] or ""
                attempt.finish_reason = choice["finish_reason"]
                attempt.prompt_tokens = body["usage"]["prompt_tokens"]
                attempt.cached_tokens = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            except openai.APITimeoutError as exc:
                attempt.outcome, attempt.detail = "unexpected", f"timeout: {exc!r}"
            except openai.APIConnectionError as exc:
                attempt.outcome, attempt.detail = "connection_error", repr(exc)
            except openai.APIStatusError as exc:
                err = exc.body if isinstance(exc.body, dict) else {}
                err = err.get("error", err) if isinstance(err.get("error"), dict) else err
                injected = exc.status_code == 500 and err.get("code") == "engine_error" and MARKER in str(err)
                attempt.outcome = "engine_error" if injected else "unexpected"
                attempt.detail = f"{exc.status_code} {err}"
            finally:
                attempt.received = time.monotonic()
                with self.lock:
                    self.in_flight -= 1
                    if attempt.outcome == "ok" and t == 0:
                        self.first_turns_done += 1
                    self.progress.notify_all()
            if attempt.outcome == "ok":
                return attempt
            if attempt.outcome == "connection_error" and not self.fleet.after_connection_error(generation):
                attempt.outcome = "unexpected"
            if attempt.outcome == "unexpected":
                unexpected += 1
                if unexpected >= 3 or self.fleet.done.is_set():
                    with self.lock:
                        self.failures.append(f"client {i} turn {t}: {attempt.detail}")
                    return None
                time.sleep(1.0)
        with self.lock:
            self.failures.append(f"client {i} turn {t}: no answer in {MAX_ATTEMPTS} attempts")
        return None


# ---------------------------------------------------------------------- references
class Reference:
    """A fresh engine of the server's config: cold generation alone, tokenization, the canonical next-turn ids."""

    def __init__(self) -> None:
        from kvboost.build import build_engine
        from kvboost.serving.cli import build_parser, compose_config

        cfg = compose_config(build_parser().parse_args(OVERRIDES))
        self.engine = build_engine(cfg)
        self.memo: dict[str, tuple[list[int], str, list[int], list[list[int]]]] = {}

    def close(self) -> None:
        self.engine.close()

    def of(self, messages: list[dict[str, str]]) -> tuple[list[int], str, list[int], list[list[int]]]:
        """(greedy output ids, their text, prompt ids, sequences the server computes for these messages)."""
        from kvboost.reuse.canonical import canonical_turn

        key = json.dumps(messages)
        if key not in self.memo:
            engine = self.engine
            result = engine.generate(messages, max_new_tokens=MAX_TOKENS, mode="cold")
            prompt = list(engine.tokenize_with_spans(messages, chat=True)[0])
            assert list(result.prompt_ids) == prompt
            out = list(result.output_ids)
            computed = [prompt, prompt + out]
            turn = canonical_turn(engine, messages, prompt, out)
            if turn is not None:
                computed.append(list(turn.ids))
            self.memo[key] = (out, result.output_text, prompt, computed)
        return self.memo[key]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def share_converted_model(home: Path) -> None:
    """The servers' cache folder gets a link to the bundled model this process converted (once, in its own cache
    folder): the servers skip the GGUF conversion (tens of seconds); everything else in ``home`` is theirs."""
    from kvboost.models.loading import bundled_model_dir

    converted = bundled_model_dir()
    (home / "models").mkdir(parents=True)
    (home / "models" / converted.name).symlink_to(converted, target_is_directory=True)


def wait_quiescent(server: ChaosServer, timeout: float = 120.0) -> tuple[dict[str, Any], dict[str, float]]:
    """Poll until nothing runs or waits (canonical stores included) and no block is referenced; the last readings."""
    deadline = time.monotonic() + timeout
    while True:
        state = server.state()  # also wakes the loop, which refreshes the snapshot /metrics reads
        metrics = server.metrics()
        quiet = state["running"] == 0 and state["waiting"] == 0
        if quiet and state["referenced"] == 0 and metrics.get("vllm:kv_cache_usage_perc", -1) == 0:
            return state, metrics
        if time.monotonic() > deadline:
            return state, metrics
        time.sleep(0.25)


# ---------------------------------------------------------------------- the test
def test_chaos_clients_faults_sigkill_restart(tmp_path):
    disk, home, fault_log = tmp_path / "kv", tmp_path / "kvboost-cache", tmp_path / "faults.log"
    env = {**os.environ, "KVBOOST_CACHE_DIR": str(home), "KVBOOST_CHAOS_LOG": str(fault_log)}
    env.pop("KVBOOST_SALT_SECRET", None)
    env.pop("KVBOOST_API_KEYS", None)
    t0 = time.monotonic()
    share_converted_model(home)

    fleet = Fleet()
    run = Run(fleet)
    servers: list[ChaosServer] = [ChaosServer(disk, env, seed=1)]
    threads: list[threading.Thread] = []
    killed_in_flight = 0
    try:
        fleet.publish(servers[0].base)
        with servers[0].http() as c:
            run.model = c.get("/v1/models").json()["data"][0]["id"]
        started = time.monotonic()
        threads = [threading.Thread(target=run.client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        # midway: about half of the first turns answered, requests in flight -> SIGKILL, restart on the same folder
        with run.lock:
            ok = run.progress.wait_for(
                lambda: (
                    run.failures
                    or (run.first_turns_done >= KILL_AFTER_FIRST_TURNS and run.in_flight >= KILL_WITH_IN_FLIGHT)
                ),
                180,
            )
            assert ok and not run.failures, (
                f"no kill point: {run.first_turns_done} first turns answered, "
                f"{run.in_flight} requests in flight; {run.failures}"
            )
            fleet.mark_killed()
            killed_in_flight = run.in_flight
            servers[0].proc.send_signal(signal.SIGKILL)
        servers[0].proc.wait(30)
        kill_at = time.monotonic()
        servers.append(ChaosServer(disk, env, seed=2))
        fleet.publish(servers[1].base)
        restarted = time.monotonic()
        for thread in threads:
            thread.join(600)
        assert not any(t.is_alive() for t in threads), "clients still running after 600 s"
        served = time.monotonic()
        assert not run.failures, "\n".join(run.failures)

        # quiescence on the restarted server: no block referenced, the books consistent, the loop running
        state, metrics = wait_quiescent(servers[1])
        with servers[1].http() as c:
            health = c.get("/health")
    finally:
        fleet.done.set()
        for server in servers:
            if server.proc.poll() is None:
                server.stop()
    assert servers[0].proc.returncode == -signal.SIGKILL
    assert servers[1].proc.returncode in (0, -signal.SIGTERM), "".join(servers[1].lines)
    for server in servers:  # the injected faults are logged as warnings; nothing else went wrong
        assert not [line for line in server.lines if "Traceback" in line or line.startswith(("ERROR", "CRITICAL"))], (
            "".join(server.lines)
        )

    assert health.status_code == 200, health.text
    assert state["books"] == "ok", state
    assert state["referenced"] == 0 and state["refs_total"] == 0 and state["pinned"] == 0, state
    assert metrics["vllm:kv_cache_usage_perc"] == 0, metrics["vllm:kv_cache_usage_perc"]
    assert metrics.get("kvboost:content_hit_tokens_total", 0) == 0  # exact reuse only: outputs must match cold

    # references: a fresh engine, cold, one request at a time (memoized per message list)
    attempts = run.attempts
    completed = [a for a in attempts if a.outcome == "ok"]
    reference = Reference()
    try:
        mismatches, bad_cached = [], []
        for a in completed:
            out, text, prompt, _ = reference.of(a.messages)
            if a.token_ids != out or a.text != text:
                mismatches.append(
                    f"client {a.client} turn {a.turn} (server {a.generation}, cached "
                    f"{a.cached_tokens}): served {a.token_ids} {a.text!r}, alone {out} {text!r}"
                )
            assert a.prompt_tokens == len(prompt), (a.client, a.turn, a.prompt_tokens, len(prompt))
            assert a.finish_reason in ("stop", "length") and len(a.token_ids) <= MAX_TOKENS
        # cached_tokens: within what the server (either process, disk tier) could have computed before the answer
        disk_hits = []
        for a in completed:
            _, _, prompt, _ = reference.of(a.messages)
            bound = bound_here = 0
            for b in attempts:
                if b is a or b.sent >= a.received:
                    continue
                for seq in reference.of(b.messages)[3]:
                    lcp = common_prefix(prompt, seq)
                    bound = max(bound, lcp)
                    if b.generation == a.generation:
                        bound_here = max(bound_here, lcp)
            if not (0 <= a.cached_tokens < a.prompt_tokens and a.cached_tokens <= bound):
                bad_cached.append(
                    f"client {a.client} turn {a.turn} (server {a.generation}): cached "
                    f"{a.cached_tokens} of {a.prompt_tokens}, at most {bound} could be cached"
                )
            if a.generation == 2 and a.cached_tokens > bound_here:
                disk_hits.append(a)
    finally:
        reference.close()
    end = time.monotonic()

    engine_errors = [a for a in attempts if a.outcome == "engine_error"]
    cut = [a for a in attempts if a.outcome == "connection_error"]
    injected = [line.split() for line in fault_log.read_text().splitlines()]
    injected_per_process = {g: sum(f[0] == str(servers[g - 1].proc.pid) for f in injected) for g in (1, 2)}
    per_process = {g: sum(a.generation == g for a in completed) for g in (1, 2)}
    summary = {
        "attempts": len(attempts),
        "completed": len(completed),
        "completed_per_process": per_process,
        "engine_errors_500": len(engine_errors),
        "connection_errors": len(cut),
        "in_flight_at_kill": killed_in_flight,
        "retried_turns": len({(a.client, a.turn) for a in attempts if a.attempt > 0}),
        "faults_injected": injected_per_process,
        "faults_injected_after_forward": sum(f[2] == "after" for f in injected),
        "forwards_server2": state["forwards"],
        "faults_server2": state["injected"],
        "failed_forwards_server2": state["failed_forwards"],
        "cached_tokens": sum(a.cached_tokens for a in completed),
        "prompt_tokens": sum(a.prompt_tokens for a in completed),
        "answers_with_cached_tokens": sum(a.cached_tokens > 0 for a in completed),
        "disk_hits_after_restart": len(disk_hits),
        "pool_after": {k: state[k] for k in ("free", "idle", "cached", "referenced", "num_blocks")},
        "seconds": {
            "server1_start": round(started - t0, 1),
            "to_kill": round(kill_at - started, 1),
            "restart": round(restarted - kill_at, 1),
            "serve_rest": round(served - restarted, 1),
            "references": round(end - served, 1),
            "total": round(end - t0, 1),
        },
    }
    print("chaos summary:", json.dumps(summary))

    assert not mismatches, (
        f"{len(mismatches)} of {len(completed)} answers differ from the same request alone:\n"
        + "\n".join(mismatches[:20])
    )
    assert not bad_cached, "\n".join(bad_cached[:20])
    expected_turns = sum(len(conversation_plan(i)[1]) for i in range(CLIENTS))
    assert len({(a.client, a.turn) for a in completed}) == len(completed) == expected_turns
    assert engine_errors, "no injected fault reached a client"
    assert len(injected) >= len(engine_errors), f"{len(engine_errors)} failed requests, {len(injected)} faults"
    # containment: a request failed only through a fault in a forward of its own rows alone (a batch that raised was
    # rolled back and its requests retried one at a time), never because another request's forward raised
    assert all("a forward of 1 rows" in a.detail for a in engine_errors), [a.detail for a in engine_errors]
    assert injected_per_process[1] >= 1 and injected_per_process[2] >= 1, injected_per_process
    assert state["failed_forwards"] >= state["injected"] >= 1, state
    assert per_process[1] >= 1 and per_process[2] >= 1, per_process
    assert cut, "the SIGKILL cut no request"
    assert summary["answers_with_cached_tokens"] > 0
    assert disk_hits, "the restarted server reused nothing the killed one computed"
