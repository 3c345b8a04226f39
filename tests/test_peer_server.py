"""experiments/bench/peer_server.py: llama-server's command line, the build cache, errors, start / stop.

No real build: a tiny Python HTTP server stands in for the ``llama-server`` binary.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from experiments.bench import peer_server as ps

FAKE_SERVER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    opt = lambda name: args[args.index(name) + 1]
    mode = os.environ.get("FAKE_MODE", "ok")
    if mode == "crash":
        print("fake: cannot load model", flush=True)
        sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.environ["FAKE_ARGV"], "w") as f:
        json.dump({"argv": args, "pid": os.getpid()}, f)
    started = time.monotonic()

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            loading = time.monotonic() - started < float(os.environ.get("FAKE_LOAD_S", "0"))
            code = 503 if loading or self.path != "/health" else 200
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *a):
            pass

    print("fake llama-server listening", flush=True)
    HTTPServer((opt("--host"), int(opt("--port"))), H).serve_forever()
    """
)


@pytest.fixture
def fake_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_ARGV", str(tmp_path / "argv.json"))
    return binary


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ================================================================================================ command line
def test_llama_server_command_flags() -> None:
    cmd = ps.llama_server_command("/bin/llama-server", "/m/model.gguf", parallel=8, ctx=16384, threads=2, port=8123,
                                  extra=["--metrics"])  # fmt: skip
    assert cmd[0] == "/bin/llama-server"
    assert cmd[cmd.index("-m") + 1] == "/m/model.gguf"
    assert cmd[cmd.index("-np") + 1] == "8"
    assert cmd[cmd.index("-c") + 1] == "16384"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-tb") + 1] == "2"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    assert "--cont-batching" in cmd and cmd[-1] == "--metrics"
    with pytest.raises(ValueError):
        ps.llama_server_command("b", "m", parallel=0, ctx=1, threads=1, port=1)


def test_build_commands() -> None:
    conf = ps.configure_command(Path("/src"), Path("/build"), ["-DGGML_NATIVE=ON"])
    assert conf[:5] == ["cmake", "-S", "/src", "-B", "/build"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_NATIVE=ON"):
        assert flag in conf
    assert conf[-1] == "-DGGML_NATIVE=ON"  # CPU flags last: they override the base options
    assert ps.build_command(Path("/build"), 2) == ["cmake", "--build", "/build", "--config", "Release",
                                                   "--target", "llama-server", "-j", "2"]  # fmt: skip
    dl = ps.download_command("0.3.36", Path("/dl"))
    assert "llama-cpp-python==0.3.36" in dl and ":all:" not in dl and dl[-2:] == ["-d", "/dl"]


def test_default_cmake_flags() -> None:
    assert ps.default_cmake_flags({"avx2", "fma"}, env={}) == ["-DGGML_NATIVE=ON"]
    amx = ps.default_cmake_flags({"avx512f", "amx_tile", "amx_int8"}, env={})
    assert amx[0] == "-DGGML_NATIVE=ON" and any("-mno-amx-int8" in f for f in amx)
    env = {ps.CMAKE_ARGS_ENV: "-DGGML_NATIVE=OFF -DGGML_AVX512=ON"}
    assert ps.default_cmake_flags({"amx_tile"}, env=env) == ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON"]


def test_cpu_info_parsing() -> None:
    info = "processor : 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 avx512f amx_tile pku\n"
    assert ps.cpu_model(info) == "AMD EPYC 9R14"
    assert ps.cpu_flags(info) == {"fpu", "sse", "avx2", "avx512f", "amx_tile", "pku"}
    assert ps.isa_flags(ps.cpu_flags(info)) == ["amx_tile", "avx2", "avx512f", "sse"]


def test_build_progress() -> None:
    assert ps.build_progress("[ 42%] Building CXX object src/llama.cpp.o") == 42.0
    assert ps.build_progress("[100%] Built target llama-server") == 100.0
    assert ps.build_progress("[25/100] Building CXX object x.o") == 25.0
    assert ps.build_progress("-- Configuring done") is None


# =================================================================================================== the cache
def test_cache_key() -> None:
    base = ps.cache_key("0.3.36", ["-DGGML_NATIVE=ON"], "AMD EPYC", ["avx2"])
    assert base == ps.cache_key("0.3.36", ["-DGGML_NATIVE=ON"], "AMD EPYC", ["avx2"])
    assert len(base) == 16 and int(base, 16) >= 0
    others = {
        ps.cache_key("0.3.37", ["-DGGML_NATIVE=ON"], "AMD EPYC", ["avx2"]),
        ps.cache_key("0.3.36", ["-DGGML_NATIVE=OFF"], "AMD EPYC", ["avx2"]),
        ps.cache_key("0.3.36", ["-DGGML_NATIVE=ON"], "Intel Xeon", ["avx2"]),
        ps.cache_key("0.3.36", ["-DGGML_NATIVE=ON"], "AMD EPYC", ["avx2", "avx512f"]),
    }
    assert base not in others and len(others) == 4
    assert ps.binary_dir(Path("/c"), "0.3.36", base) == Path(f"/c/llama-server-0.3.36-{base}")


def test_cached_binary_is_returned_without_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ps, "cpu_model", lambda: "Test CPU")
    monkeypatch.setattr(ps, "cpu_flags", lambda: {"avx2"})
    flags = ["-DGGML_NATIVE=ON"]
    key = ps.cache_key(ps.LLAMA_CPP_PYTHON_VERSION, flags, "Test CPU", ["avx2"])
    out = ps.binary_dir(tmp_path, ps.LLAMA_CPP_PYTHON_VERSION, key)
    out.mkdir(parents=True)
    (out / "llama-server").write_text("#!/bin/sh\n")
    (out / "llama-server").chmod(0o755)
    (out / "build_info.json").write_text(json.dumps({"build_seconds": 900}))

    def no_build(*a, **k):
        raise AssertionError("must not build")

    monkeypatch.setattr(ps, "fetch_source", no_build)
    monkeypatch.setattr(ps, "_run_build", no_build)
    monkeypatch.setattr(ps, "missing_tools", no_build)
    t0 = time.monotonic()
    assert ps.ensure_llama_server(tmp_path, cmake_flags=flags) == out / "llama-server"
    assert time.monotonic() - t0 < 1.0
    assert ps.build_info(out / "llama-server") == {"build_seconds": 900}
    # another flag set is another build: here it stops at the (faked) missing tools
    monkeypatch.setattr(ps, "missing_tools", lambda: ["cmake"])
    with pytest.raises(ps.MissingToolError):
        ps.ensure_llama_server(tmp_path, cmake_flags=["-DGGML_NATIVE=OFF"])


# =============================================================================================== missing tools
def test_missing_tools_message() -> None:
    assert ps.missing_tools(which=lambda name: f"/usr/bin/{name}", env={}) == []
    missing = ps.missing_tools(which=lambda name: None, env={})
    assert missing[0] == "cmake" and any("C++ compiler" in m for m in missing)
    only_cmake = ps.missing_tools(which=lambda name: None if name == "cmake" else f"/usr/bin/{name}", env={})
    assert only_cmake == ["cmake"]
    msg = ps.missing_tools_message(only_cmake)
    assert "missing: cmake" in msg and "pip install cmake" in msg and "compiler:" not in msg
    msg = ps.missing_tools_message(missing)
    assert "pip install cmake" in msg and "build-essential" in msg
    # $CXX names the compiler looked for
    assert "a C++ compiler (my-cxx)" in ps.missing_tools(which=lambda n: None if n == "my-cxx" else n,
                                                          env={"CXX": "my-cxx"})  # fmt: skip


def test_ensure_raises_missing_tool_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ps, "missing_tools", lambda: ["cmake", "a C++ compiler (c++ / g++ / clang++)"])
    with pytest.raises(ps.MissingToolError, match="pip install cmake"):
        ps.ensure_llama_server(tmp_path / "cache", cmake_flags=["-DTEST_ONLY=1"])
    assert not (tmp_path / "cache" / "downloads").exists()  # nothing fetched before the check


# ========================================================================================== start and stop
def test_start_waits_for_health_and_stops(fake_binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LOAD_S", "0.6")  # /health answers 503 first, as while llama-server loads
    log_path = tmp_path / "logs" / "server.log"
    with ps.start_llama_server(fake_binary, "/m/model.gguf", parallel=4, ctx=8192, threads=2, log_path=log_path,
                               ready_timeout_s=30) as server:  # fmt: skip
        assert ps._health(f"{server.base_url}/health") == 200
        assert server.url.endswith("/v1") and server.url.startswith("http://127.0.0.1:")
        seen = json.loads((tmp_path / "argv.json").read_text())
        assert seen["argv"] == server.command[1:]
        assert "--cont-batching" in seen["argv"] and seen["argv"][seen["argv"].index("-np") + 1] == "4"
        proc = server.proc
        assert proc is not None and proc.poll() is None
    assert proc.poll() is not None and not _alive(seen["pid"])
    assert "fake llama-server listening" in log_path.read_text()


def test_stop_kills_a_server_that_ignores_sigterm(
    fake_binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "stubborn")
    t0 = time.monotonic()
    with ps.start_llama_server(fake_binary, "m.gguf", parallel=1, ctx=2048, threads=1, ready_timeout_s=30,
                               stop_grace_s=0.5, log_path=tmp_path / "s.log") as server:  # fmt: skip
        proc = server.proc
    assert proc is not None and proc.returncode == -9
    assert time.monotonic() - t0 < 20


def test_stopped_when_the_body_raises(fake_binary: Path, tmp_path: Path) -> None:
    with pytest.raises(KeyError), ps.start_llama_server(fake_binary, "m.gguf", parallel=1, ctx=2048, threads=1,
                                                        ready_timeout_s=30, log_path=tmp_path / "s.log") as s:  # fmt: skip
        proc = s.proc
        raise KeyError("boom")
    assert proc is not None and proc.poll() is not None


def test_server_that_exits_early_is_reported(fake_binary: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_MODE", "crash")
    with (
        pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*cannot load model"),
        ps.start_llama_server(
            fake_binary, "m.gguf", parallel=1, ctx=2048, threads=1, log_path=tmp_path / "crash.log", ready_timeout_s=30
        ),
    ):
        pass


# ================================================================================================ load_test.py
def test_load_test_peer_arguments() -> None:
    from experiments.bench.load_test import parse_args

    args = parse_args(["--peer", "llama-server", "--concurrency", "8", "--users", "8", "--turns", "2"])
    assert args.peer == "llama-server"
    s = ps.peer_settings(args)
    assert s["parallel"] == 8 and s["ctx"] == 8 * 2048 and s["threads"] >= 1
    args = parse_args(["--peer", "llama-server", "--concurrency", "32", "--peer-parallel", "8", "--peer-ctx", "4096"])
    assert ps.peer_settings(args) | {"threads": 0} == {"parallel": 8, "ctx": 4096, "threads": 0}
    args = parse_args(["--peer", "llama-server", "--sweep-concurrency", "1", "8", "32"])
    assert ps.peer_settings(args)["parallel"] == 32
    with pytest.raises(SystemExit):
        parse_args(["--peer", "llama-server", "--server", "kvboost"])


def test_load_test_peer_starts_on_the_given_gguf(fake_binary: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from experiments.bench.load_test import parse_args

    monkeypatch.setattr(ps, "ensure_llama_server", lambda: fake_binary)
    args = parse_args(["--peer", "llama-server", "--concurrency", "2", "--server-model", "/m/x.gguf",
                       "--server-args=--metrics", "--server-timeout", "30"])  # fmt: skip
    with ps.load_test_peer(args, tmp_path / "peer.log") as server:
        argv = json.loads((tmp_path / "argv.json").read_text())["argv"]
    assert argv[argv.index("-m") + 1] == "/m/x.gguf" and argv[argv.index("-np") + 1] == "2"
    assert argv[argv.index("-c") + 1] == "4096" and argv[-1] == "--metrics"
    assert server.proc is not None and server.proc.poll() is not None
