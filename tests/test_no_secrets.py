"""No secret printed, logged or published (issue 62):

- ``python -m kvboost.serving.ray`` printed the replicas' command line whole: the ``--salt-secret`` it generated and
  every ``--api-key``. Run here with a stand-in for Ray (the deployment itself is not what is tested): stdout, stderr
  and the log records hold neither secret, and a later log line quoting one is redacted;
- KV events published a tenant's raw salt in ``extra_keys``: an engine's events, encoded as they go on the wire,
  must not contain the salt's bytes; the extra key is a keyed hash that is equal for one salt and key, and differs
  across salts and across keys;
- the events socket bound every interface by default: it binds loopback unless told otherwise, and warns when told.
"""

from __future__ import annotations

import logging
import socket

import pytest
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.cache.events import (
    SALT_TAG_PREFIX,
    BlockStored,
    KVEventsConfig,
    ZmqEventPublisher,
    bind_address,
    encode_batch,
    salt_tag,
)
from kvboost.serving import ray as kray
from kvboost.serving.redact import REDACTED, RedactingFilter, redact_argv, secret_values

API_KEY = "sk-live-4f1c2a9e7d"
GENERATED = "9c1e" * 16  # what secrets.token_hex(32) returns in the run below


class _FakeServe:
    def start(self, **_):
        pass

    def run(self, *_a, **_k):
        pass

    def delete(self, *_):
        pass

    def shutdown(self):
        pass


class _FakeRay:
    def init(self, **_):
        pass


def test_ray_entry_prints_and_logs_no_secret(monkeypatch, capsys, caplog):
    monkeypatch.setattr(kray, "ray", _FakeRay())
    monkeypatch.setattr(kray, "serve", _FakeServe())
    monkeypatch.setattr(kray, "build_app", lambda *a, **k: object())
    monkeypatch.setattr(kray.secrets, "token_hex", lambda n: GENERATED)
    monkeypatch.delenv("KVBOOST_SALT_SECRET", raising=False)
    monkeypatch.delenv("KVBOOST_API_KEYS", raising=False)

    def stop(_seconds):  # the entry's wait loop: log a line quoting the secrets, then stop as Ctrl-C would
        kray.log.warning("late line %s / %s", API_KEY, GENERATED)
        raise KeyboardInterrupt

    monkeypatch.setattr(kray.time, "sleep", stop)
    caplog.set_level(logging.INFO)
    root_handlers = list(logging.getLogger().handlers)
    try:
        assert kray.main(["--no-redis", "--api-key", API_KEY, "model=tiny_random"]) == 0
        out = capsys.readouterr()
        logged = "\n".join(h.format(r) for r in caplog.records for h in [logging.Formatter()])
        for text in (out.out, out.err, logged):
            assert API_KEY not in text and GENERATED not in text
        assert "replica command line:" in out.out and f"--api-key {REDACTED}" in out.out
        assert f"--salt-secret {REDACTED}" in out.out  # the generated secret was there, hidden
        assert "late line ***" in logged
    finally:
        for handler in logging.getLogger().handlers:  # the entry's filter: off again for the other tests
            handler.filters = [f for f in handler.filters if not isinstance(f, RedactingFilter)]
            if handler not in root_handlers:
                logging.getLogger().removeHandler(handler)


def test_redact_argv_and_secret_values_cover_flags_overrides_and_urls():
    argv = ["--api-key", "k1", "--api-key=k2", "--salt-secret", "s3", "engine.kv_events.salt_key=e4",
            "cache.1.url=redis://:pw5@10.0.0.2:6379/0", "--port", "8000", "recompute=none"]  # fmt: skip
    shown = " ".join(redact_argv(argv))
    for value in ("k1", "k2", "s3", "e4", "pw5"):
        assert value not in shown.split() and f":{value}@" not in shown
    assert "--port 8000" in shown and "recompute=none" in shown and "10.0.0.2:6379/0" in shown
    assert set(secret_values(argv, environ={"KVBOOST_API_KEYS": "k6,k7"})) == {"k1", "k2", "s3", "e4", "pw5", "k6",
                                                                                "k7"}  # fmt: skip


class _Recorder:
    def __init__(self) -> None:
        self.batches: list = []

    def publish(self, batch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


def test_events_carry_a_keyed_hash_of_the_salt_never_the_salt():
    salt = "tenant-salt-7e3f0a"
    recorders = [_Recorder(), _Recorder(), _Recorder()]
    engines = [make_engine("llama", decode="eager", kv_events={"enabled": True, "publisher": rec, "salt_key": key})
               for rec, key in zip(recorders, ["deploy-key", "deploy-key", "other-key"])]  # fmt: skip
    try:
        ids = random_ids(40, seed=3)
        for engine in engines:
            engine.generate(ids, max_new_tokens=2, cache_salt=salt)
        engines[0].generate(random_ids(40, seed=4), max_new_tokens=2, cache_salt="another-tenant")
        tags = []
        for rec in recorders:
            wire = b"".join(encode_batch(b, enc) for b in rec.batches for enc in ("map", "array"))
            assert salt.encode() not in wire and b"another-tenant" not in wire
            firsts = [e for b in rec.batches for e in b.events if isinstance(e, BlockStored) and e.extra_keys
                      and e.extra_keys[0] and str(e.extra_keys[0][0]).startswith(SALT_TAG_PREFIX)]  # fmt: skip
            tags.append({e.extra_keys[0][0] for e in firsts})
        assert tags[0] >= {salt_tag(salt, "deploy-key"), salt_tag("another-tenant", "deploy-key")}
        assert tags[1] == {salt_tag(salt, "deploy-key")}  # same salt, same key: equal (a router matches them)
        assert tags[2] == {salt_tag(salt, "other-key")} != tags[1]  # another key: unrelated
    finally:
        for engine in engines:
            engine.close()


def _listening_interfaces(port: int) -> bool:
    """Whether ``port`` can be reached on a non-loopback address of this machine (False when it has none)."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        return False
    if addr.startswith("127."):
        return False
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((addr, port)) == 0


def test_events_socket_binds_loopback_by_default_and_warns_elsewhere(caplog):
    zmq = pytest.importorskip("zmq")
    assert zmq is not None
    config = KVEventsConfig.from_options({"enabled": True, "endpoint": "tcp://*:*", "replay_endpoint": "tcp://*:*"})
    publisher = config.build_publisher()
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        assert publisher.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert not _listening_interfaces(int(publisher.endpoint.rsplit(":", 1)[1]))
    finally:
        publisher.shutdown()
    assert not [r for r in caplog.records if "beyond loopback" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="kvboost.cache.events"):
        assert bind_address("tcp://*:5557", "*") == "tcp://*:5557"
    assert [r for r in caplog.records if "beyond loopback" in r.getMessage()]
    assert bind_address("tcp://0.0.0.0:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert bind_address("tcp://[::]:5557", "::1") == "tcp://[::1]:5557"
    assert isinstance(ZmqEventPublisher, type)


def test_a_served_request_with_secrets_leaves_none_in_logs_or_event_bytes(caplog):
    """A request through the server's app with an API key, the server's salt secret and a request cache_salt: the
    log records (every logger, DEBUG up) and the KV events' wire bytes hold none of the key, the secret, the
    tenant's derived salt or the request's cache_salt."""
    import asyncio
    import json

    from kvboost.engine.loop import EngineLoop
    from kvboost.serving.server import create_app
    from kvboost.serving.tenancy import Tenancy

    api_key, secret, request_salt = "sk-test-91e0c4d2", "salt-secret-5d77a1", "user-salt-3b9f"
    tenant_salt = Tenancy([api_key], secret).authenticate(f"Bearer {api_key}").salt
    recorder = _Recorder()
    engine = make_engine("llama", decode="eager", kv_events={"enabled": True, "publisher": recorder})
    loop = EngineLoop(engine).start()
    caplog.set_level(logging.DEBUG)
    try:
        app = create_app(loop, model_name="tiny", api_keys=[api_key], server_secret=secret)
        body = json.dumps({"model": "tiny", "prompt": "a prompt of a few words, long enough for chunks " * 3,
                           "max_tokens": 3, "cache_salt": request_salt}).encode()  # fmt: skip
        headers = [("content-type", "application/json"), ("authorization", f"Bearer {api_key}")]

        async def ask():
            return [p async for p in kray.call_asgi(app, "POST", "/v1/completions", headers=headers, body=body)]

        assert asyncio.run(ask())[0]["status"] == 200
        bad = [("content-type", "application/json"), ("authorization", "Bearer sk-wrong-key")]
        asyncio.run(_collect(kray.call_asgi(app, "POST", "/v1/completions", headers=bad, body=body)))
        assert loop.call(lambda e: e.kv_events.batches).result(timeout=10) > 0
    finally:
        loop.shutdown()
        engine.close()
    logged = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    wire = b"".join(encode_batch(b, enc) for b in recorder.batches for enc in ("map", "array"))
    salted = [e for b in recorder.batches for e in b.events if isinstance(e, BlockStored) and e.extra_keys[0]]
    assert salted, "the salted request published no first block"
    for value in (api_key, secret, tenant_salt, request_salt, f"{tenant_salt}|{request_salt}"):
        assert value not in logged and value.encode() not in wire, value


async def _collect(gen):
    return [p async for p in gen]
