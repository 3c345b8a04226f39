"""kvboost-server survives SIGKILL with its disk tier: a server process (random tiny copy of the bundled model, a
memory tier over the write-through disk tier of ``--disk-cache-dir``) serves a turn, is killed while requests stream,
and a new process on the same folder and the same stored salt secret serves the next turn from the disk records
(cached_tokens > 0) with the greedy tokens a fresh engine gives cold. A record damaged on disk before the restart is
dropped and recomputed, never served (``kvboost:cache_corrupt_entries_dropped``)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from kvboost_testkit.server_process import LaunchedServer

from kvboost.cache import payload as fmt

pytestmark = pytest.mark.slow

KEY = "restart-key"
# --disk-cache-dir writes through by default: what a killed server computed is on disk
OVERRIDES = ["model=tiny_random", "engine.decode=eager", "warmup=false", "chunker.chunk_size=16"]
TURN_1 = [
    {"role": "system", "content": "You are a careful assistant that answers in one short sentence."},
    {"role": "user", "content": "Name one reason a disk cache helps an inference server after a restart."},
]
MAX_TOKENS = 16


class ServerProcess(LaunchedServer):
    """``python -m kvboost.serving`` in a subprocess; the base URL comes from its ready line."""

    def __init__(self, disk: Path, env: dict[str, str]) -> None:
        args = [sys.executable, "-m", "kvboost.serving", *OVERRIDES, "--port", "0", "--disk-cache-dir", str(disk),
                "--api-key", KEY, "--log-level", "warning"]  # fmt: skip
        super().__init__(args, env)

    def client(self, **options) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, **options)

    def chat(self, messages: list[dict[str, str]]) -> dict:
        with self.client() as c:
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "return_token_ids": True})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str) -> float:
        with self.client() as c:
            text = c.get("/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def records(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.kvr"))


def wait_for_records(folder: Path, at_least: int, timeout: float = 30.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(found := records(folder)) < at_least:
        assert time.monotonic() < deadline, f"only {len(found)} records written in {timeout} s"
        time.sleep(0.05)
    return found


def damage_record(folder: Path, token_ids: list[int], start: int) -> Path:
    """Flip a byte in the tensors of the exact record of ``token_ids`` at ``start``: its header still reads (the
    index keeps it), the whole-record checksum fails when a request reads it."""
    for path in records(folder):
        data = bytearray(path.read_bytes())
        header = fmt.decode_header(bytes(data))
        if header["exact"] and header["start"] == start and header["token_ids"] == token_ids:
            data[-fmt.CHECKSUM_SIZE - 5] ^= 0xFF
            path.write_bytes(bytes(data))
            return path
    raise AssertionError(f"no record of the chunk at {start}")


def assert_rewritten_intact(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fmt.verify(path.read_bytes())
            return
        except (OSError, fmt.RecordError):
            assert time.monotonic() < deadline, f"{path} was not rewritten intact"
            time.sleep(0.05)


def reference(messages: list[dict[str, str]]) -> list[int]:
    """The greedy tokens of a fresh engine (same config, nothing cached) for ``messages``."""
    from kvboost.build import build_engine
    from kvboost.serving.cli import build_parser, compose_config

    cfg = compose_config(build_parser().parse_args(OVERRIDES))
    with build_engine(cfg) as engine:
        return engine.generate(messages, max_new_tokens=MAX_TOKENS, mode="cold").output_ids


def test_sigkill_mid_stream_then_restart_reuses_disk_records(tmp_path):
    disk, home = tmp_path / "kv", tmp_path / "kvboost-cache"
    env = {**os.environ, "KVBOOST_CACHE_DIR": str(home)}
    env.pop("KVBOOST_SALT_SECRET", None)
    env.pop("KVBOOST_API_KEYS", None)

    first = ServerProcess(disk, env)
    try:
        turn1 = first.chat(TURN_1)
        with first.client() as c:
            prompt_ids = c.post("/tokenize", json={"messages": TURN_1}).json()["tokens"]
        assert len(prompt_ids) == turn1["usage"]["prompt_tokens"] >= 32
        assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        stored = wait_for_records(disk, turn1["usage"]["prompt_tokens"] // 16)
        secret = home / "server_secret"
        assert secret.exists() and secret.stat().st_mode & 0o777 == 0o600
        # load: streams of other conversations in flight (each stores its chunks when it ends) when the kill comes
        streams = []
        for i in range(3):
            c = first.client()
            body = {"messages": [{"role": "user", "content": f"Stream {i}: " + "tell me a long story " * 6}],
                    "max_tokens": 400, "stream": True}  # fmt: skip
            r = c.send(c.build_request("POST", "/v1/chat/completions", json=body), stream=True)
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            streams.append((c, lines))
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        for c, lines in streams:
            with pytest.raises(httpx.HTTPError):  # cut off mid-stream, not ended
                for _ in lines:
                    pass
            c.close()
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    assert first.proc.returncode == -signal.SIGKILL
    assert len(records(disk)) >= len(stored)
    # the second chunk of turn 1's prompt (inside the prefix the next turn shares, whatever the answer tokenizes to)
    damaged = damage_record(disk, prompt_ids[16:32], 16)

    answer1 = turn1["choices"][0]["message"]["content"]
    turn2 = TURN_1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "And a second one?"}]
    expected = reference(turn2)
    second = ServerProcess(disk, env)
    try:
        served = second.chat(turn2)
        assert served["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # from the first process's records
        assert served["choices"][0]["token_ids"] == expected
        assert second.metric("kvboost:cache_corrupt_entries_dropped_total") >= 1  # the damaged record, not served
        assert_rewritten_intact(damaged)  # deleted, recomputed, stored again (write-through)
        again = second.chat(TURN_1)  # turn 1 once more: the same answer, from the cache
        assert again["choices"][0]["message"]["content"] == answer1
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        second.proc.send_signal(signal.SIGTERM)  # graceful: loop stopped, engine closed (disk flushed)
        second.proc.wait(60)
    finally:
        if second.proc.poll() is None:
            second.proc.kill()
    assert second.proc.returncode in (0, -signal.SIGTERM), "".join(second.lines)
    assert "Traceback" not in "".join(second.lines), "".join(second.lines)
