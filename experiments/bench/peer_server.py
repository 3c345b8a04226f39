"""llama.cpp's own ``llama-server`` as a serving peer: built once from source (cached), started, stopped.

``ensure_llama_server()`` builds the ``llama-server`` binary from the llama.cpp tree vendored in
llama-cpp-python's sdist (pinned: ``LLAMA_CPP_PYTHON_VERSION``, the version the ``peers`` extra and
``bench_peers.py`` use), so the HTTP peer runs the same llama.cpp as the in-process peer:

1. ``pip download llama-cpp-python==VERSION --no-binary llama-cpp-python --no-deps`` (the sdist, ~77 MB; only the
   package index is needed), extracted under ``<cache>/src``;
2. ``cmake`` (Release, static libraries, ``-DLLAMA_CURL=OFF``, no tests / examples / web UI download, no OpenSSL)
   with the CPU flags of ``default_cmake_flags()``: ``-DGGML_NATIVE=ON`` (every ISA extension this CPU has:
   AVX-512 where present, as in ``bench_peers.py``'s peer build) with AMX compiled out where the CPU reports it
   (``-mno-amx-*``: the peer build keeps AMX off, its AMX build died with SIGILL on some machines). Override them
   with ``KVBOOST_LLAMA_SERVER_CMAKE_ARGS="-D..."`` (shell-quoted) or ``cmake_flags=[...]``;
3. ``cmake --build --target llama-server -j <cores>`` (10-20 min on 2 cores), progress from cmake's ``[ NN%]``
   lines (tqdm), the full log in ``<build>/build.log``;
4. the binary is copied to ``<cache>/llama-server-<version>-<key>/llama-server`` with ``build_info.json``; ``key``
   hashes the version, the cmake flags and the CPU (model name and ISA flags), so a second call returns at once
   and a different CPU or flag set builds its own binary.

``start_llama_server(binary, gguf, parallel=N, ctx=C, threads=T, port=P)`` is a context manager: it runs
``llama-server -m GGUF -np N -c C --cont-batching -t T -tb T --host 127.0.0.1 --port P`` (output to a log file),
waits until ``GET /health`` answers 200 and stops the process on exit (SIGTERM, then SIGKILL after a grace period).
llama-server speaks the OpenAI chat API at ``<url>/v1``, which ``load_test.py --peer llama-server`` drives.

``-c`` is the context of all slots together: each of the ``-np`` slots gets ``C / N`` tokens
(``load_test.py``'s default ``--peer-ctx`` is ``N x 2048``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvboost.models.loading import file_lock

log = logging.getLogger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# sha256 of llama_cpp_python-0.3.36.tar.gz on PyPI (checked after the download; None skips the check)
LLAMA_CPP_PYTHON_SHA256: str | None = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
DEFAULT_CACHE_DIR = Path("~/.cache/kvboost/peers")
TARGET = "llama-server"
CMAKE_ARGS_ENV = "KVBOOST_LLAMA_SERVER_CMAKE_ARGS"
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# configure options that do not depend on the CPU: what gets built and what it may fetch (nothing)
BASE_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary to cache
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the web UI would be downloaded from a Hugging Face bucket at build time
)
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "vnni", "asimd", "sve", "neon")


class MissingToolError(RuntimeError):
    """A tool the build needs (cmake, a C or C++ compiler) is not on PATH."""


class BuildError(RuntimeError):
    """Downloading, configuring or compiling llama-server failed."""


# ================================================================================================ the machine
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    m = re.search(r"^(?:model name|Model)\s*:\s*(.+)$", _cpuinfo() if cpuinfo is None else cpuinfo, re.MULTILINE)
    return m.group(1).strip() if m else (platform.processor() or platform.machine() or "unknown")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on ARM); empty where unknown."""
    m = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", _cpuinfo() if cpuinfo is None else cpuinfo, re.MULTILINE)
    return set(m.group(1).split()) if m else set()


def isa_flags(flags: set[str]) -> list[str]:
    """The flags a native build depends on (SIMD / matrix extensions), sorted."""
    return sorted(f for f in flags if f.startswith(ISA_PREFIXES))


def default_cmake_flags(flags: set[str] | None = None, env: dict[str, str] | None = None) -> list[str]:
    """CPU flags for the build: ``$KVBOOST_LLAMA_SERVER_CMAKE_ARGS`` if set, else native with AMX compiled out."""
    env = os.environ if env is None else env
    if env.get(CMAKE_ARGS_ENV, "").strip():
        return shlex.split(env[CMAKE_ARGS_ENV])
    flags = cpu_flags() if flags is None else flags
    out = ["-DGGML_NATIVE=ON"]
    if any(f.startswith("amx") for f in flags):  # -march=native would turn AMX on; GCC/Clang honour -mno-* after it
        out += [f"-DCMAKE_C_FLAGS={AMX_OFF}", f"-DCMAKE_CXX_FLAGS={AMX_OFF}"]
    return out


def build_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# ============================================================================================ pure functions
def cache_key(version: str, cmake_flags: Sequence[str], cpu: str, isa: Sequence[str] = ()) -> str:
    """16 hex digits naming one build: the version, the cmake flags (order kept) and the CPU (model, ISA flags)."""
    blob = json.dumps({"version": version, "flags": list(cmake_flags), "cpu": cpu, "isa": sorted(isa)},
                      sort_keys=True)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def binary_dir(cache_dir: Path, version: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / f"{TARGET}-{version}-{key}"


def configure_command(source: Path, build: Path, cmake_flags: Sequence[str], cmake: str = "cmake") -> list[str]:
    return [cmake, "-S", str(source), "-B", str(build), *BASE_CMAKE_ARGS, *cmake_flags]


def build_command(build: Path, jobs: int, cmake: str = "cmake") -> list[str]:
    return [cmake, "--build", str(build), "--config", "Release", "--target", TARGET, "-j", str(jobs)]


def download_command(version: str, dest: Path) -> list[str]:
    # --no-binary for this package only: ":all:" would also build the sdist's build dependencies from source
    return [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary",
            "llama-cpp-python", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]  # fmt: skip


_PCT = re.compile(r"^\[\s*(\d+)%\]")  # Unix Makefiles: "[ 42%] Building CXX object ..."
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")  # Ninja: "[12/345] Building CXX object ..."


def build_progress(line: str) -> float | None:
    """Percent done from one line of ``cmake --build`` output, or None."""
    if m := _PCT.match(line):
        return float(m.group(1))
    if m := _NINJA.match(line):
        return 100.0 * int(m.group(1)) / max(1, int(m.group(2)))
    return None


def missing_tools(which: Callable[[str], str | None] = shutil.which, env: dict[str, str] | None = None) -> list[str]:
    """What the build needs and cannot find: ``cmake``, a C compiler, a C++ compiler (``$CC``/``$CXX`` honoured)."""
    env = os.environ if env is None else env
    missing = []
    if not which("cmake"):
        missing.append("cmake")
    cc = [env["CC"]] if env.get("CC") else ["cc", "gcc", "clang"]
    cxx = [env["CXX"]] if env.get("CXX") else ["c++", "g++", "clang++"]
    if not any(which(c) for c in cc):
        missing.append(f"a C compiler ({' / '.join(cc)})")
    if not any(which(c) for c in cxx):
        missing.append(f"a C++ compiler ({' / '.join(cxx)})")
    return missing


def missing_tools_message(missing: Sequence[str]) -> str:
    hints = []
    if "cmake" in missing:
        hints.append("cmake: `pip install cmake` (into this environment) or `apt-get install cmake`")
    if any("compiler" in m for m in missing):
        hints.append("C/C++ compiler: `apt-get install build-essential` (or g++ / clang), or set CC / CXX")
    return (f"building llama-server from source needs cmake and a C/C++ compiler; missing: {', '.join(missing)}. "
            f"Install: {'; '.join(hints)}.")  # fmt: skip


def llama_server_command(binary: str | Path, gguf: str | Path, *, parallel: int, ctx: int, threads: int, port: int,
                         host: str = "127.0.0.1", extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """``llama-server`` with ``parallel`` slots sharing ``ctx`` tokens of context, continuous batching."""
    if parallel < 1 or ctx < 1 or threads < 1:
        raise ValueError(f"parallel, ctx and threads must be >= 1 (got {parallel}, {ctx}, {threads})")
    return [str(binary), "-m", str(gguf), "-np", str(parallel), "-c", str(ctx), "--cont-batching",
            "-t", str(threads), "-tb", str(threads), "--host", host, "--port", str(port), *extra]  # fmt: skip


# ===================================================================================================== build
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_source(cache_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION, sdist: Path | None = None) -> Path:
    """The vendored llama.cpp tree of llama-cpp-python ``version``'s sdist (downloaded and extracted once)."""
    src_root = cache_dir / "src"
    source = src_root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    if sdist is None and os.environ.get("KVBOOST_LLAMA_CPP_SDIST"):
        sdist = Path(os.environ["KVBOOST_LLAMA_CPP_SDIST"])
    if sdist is None:
        dl = cache_dir / "downloads"
        sdist = dl / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            dl.mkdir(parents=True, exist_ok=True)
            cmd = download_command(version, dl)
            log.info("downloading the llama-cpp-python %s sdist: %s", version, shlex.join(cmd))
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not sdist.is_file():
                raise BuildError(f"`{shlex.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                                 f"{proc.stderr[-2000:]}")  # fmt: skip
    if version == LLAMA_CPP_PYTHON_VERSION and LLAMA_CPP_PYTHON_SHA256 and _sha256(sdist) != LLAMA_CPP_PYTHON_SHA256:
        raise BuildError(f"{sdist} does not have the sha256 of llama-cpp-python {version}'s sdist; delete it and retry")
    log.info("extracting %s", sdist)
    tmp = Path(tempfile.mkdtemp(prefix="extract-", dir=cache_dir))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name or m.name.endswith("PKG-INFO")]
            kwargs: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **kwargs)
        src_root.mkdir(parents=True, exist_ok=True)
        top = tmp / f"llama_cpp_python-{version}"
        if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise BuildError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
        shutil.rmtree(src_root / top.name, ignore_errors=True)
        os.replace(top, src_root / top.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return source


def _run_build(cmd: list[str], log_file: Path, *, progress: bool, desc: str) -> None:
    """Run ``cmd`` appending its output to ``log_file``; a tqdm bar fed by cmake's percentages."""
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=100, desc=desc, unit="%", bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
        except ImportError:
            bar = None
    last_logged = -10.0
    with log_file.open("a") as logf:
        logf.write(f"$ {shlex.join(cmd)}\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                logf.write(line)
                pct = build_progress(line)
                if pct is None:
                    continue
                if bar is not None:
                    bar.update(max(0.0, pct - bar.n))
                elif pct - last_logged >= 10:
                    log.info("%s: %.0f%%", desc, pct)
                    last_logged = pct
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            if bar is not None:
                bar.close()
    if rc != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
        raise BuildError(f"`{shlex.join(cmd)}` failed (exit {rc}); {log_file} ends with:\n{tail}")


def ensure_llama_server(cache_dir: str | Path = DEFAULT_CACHE_DIR, *, version: str = LLAMA_CPP_PYTHON_VERSION,
                        cmake_flags: Sequence[str] | None = None, jobs: int | None = None, progress: bool = True,
                        sdist: Path | None = None) -> Path:  # fmt: skip
    """Path of a ``llama-server`` built for this CPU; builds it (once, cached under ``cache_dir``) when missing."""
    cache_dir = Path(cache_dir).expanduser()
    flags = default_cmake_flags() if cmake_flags is None else list(cmake_flags)
    cpu = cpu_model()
    key = cache_key(version, flags, cpu, isa_flags(cpu_flags()))
    out_dir = binary_dir(cache_dir, version, key)
    binary = out_dir / TARGET
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    missing = missing_tools()
    if missing:
        raise MissingToolError(missing_tools_message(missing))
    with file_lock(cache_dir / f".{TARGET}-{key}.lock"):
        if binary.is_file():  # built by another process while this one waited
            return binary
        t0 = time.monotonic()
        source = fetch_source(cache_dir, version, sdist)
        build = cache_dir / f"build-{version}-{key}"
        build.mkdir(parents=True, exist_ok=True)
        log_file = build / "build.log"
        jobs = jobs or build_jobs()
        log.info("building %s (llama-cpp-python %s, flags %s, %d jobs); log: %s", TARGET, version, flags, jobs,
                 log_file)  # fmt: skip
        _run_build(configure_command(source, build, flags), log_file, progress=False, desc="cmake configure")
        _run_build(build_command(build, jobs), log_file, progress=progress, desc=f"building {TARGET}")
        built = build / "bin" / TARGET
        if not built.is_file():
            raise BuildError(f"the build finished but {built} is missing; see {log_file}")
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=cache_dir))
        shutil.copy2(built, tmp_dir / TARGET)
        info = {"llama_cpp_python": version, "cmake_flags": flags, "base_cmake_args": list(BASE_CMAKE_ARGS),
                "cpu": cpu, "isa": isa_flags(cpu_flags()), "jobs": jobs, "key": key,
                "build_seconds": round(time.monotonic() - t0, 1), "source": str(source),
                "compiler": _compiler_version(), "version_output": _version_output(tmp_dir / TARGET)}  # fmt: skip
        (tmp_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp_dir, out_dir)
        log.info("built %s in %.0f s: %s", TARGET, info["build_seconds"], out_dir / TARGET)
    return binary


def _compiler_version() -> str | None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        return None
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def _version_output(binary: Path) -> str | None:
    try:
        p = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (p.stdout + p.stderr).strip()[-1000:] or None


def build_info(binary: Path) -> dict[str, Any]:
    """What ``ensure_llama_server`` recorded beside ``binary`` (empty when it was not built here)."""
    try:
        return json.loads((Path(binary).parent / "build_info.json").read_text())
    except (OSError, ValueError):
        return {}


# ===================================================================================================== serve
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """A running ``llama-server``: its command, base URL (``url`` ends in ``/v1``) and log file."""

    command: list[str]
    host: str
    port: int
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _health(url: str, timeout: float = 2.0) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:  # 503 while the model loads
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def stop_process(proc: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    """SIGTERM ``proc`` (the process this module started), SIGKILL it if it is still there after ``grace_s``."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


@contextlib.contextmanager
def start_llama_server(binary: str | Path, gguf: str | Path, *, parallel: int, ctx: int, threads: int,
                       port: int | None = None, host: str = "127.0.0.1", extra: Sequence[str] = (),
                       log_path: Path | None = None, ready_timeout_s: float = 600.0,
                       stop_grace_s: float = 15.0) -> Iterator[LlamaServer]:  # fmt: skip
    """Start ``llama-server``, wait for ``GET /health`` = 200, yield it, stop it (terminate, then kill) on exit."""
    port = port or free_port()
    cmd = llama_server_command(binary, gguf, parallel=parallel, ctx=ctx, threads=threads, port=port, host=host,
                               extra=extra)  # fmt: skip
    log_path = log_path or Path(tempfile.mkdtemp(prefix="kvboost-llama-server-")) / "llama-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = LlamaServer(command=cmd, host=host, port=port, log_path=log_path)
    with log_path.open("wb") as logf:
        server.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {server.proc.returncode} before it was ready; "
                                   f"its log ({log_path}) ends with:\n{server.log_tail()}")  # fmt: skip
            if _health(f"{server.base_url}/health") == 200:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server did not answer {server.base_url}/health within "
                                   f"{ready_timeout_s:.0f} s; its log ({log_path}) ends with:\n{server.log_tail()}")  # fmt: skip
            time.sleep(0.25)
        yield server
    finally:
        stop_process(server.proc, grace_s=stop_grace_s)


# ====================================================================================== load_test.py's peer
def peer_settings(args: Any) -> dict[str, int]:
    """``-np``, ``-c`` and threads for ``load_test.py --peer llama-server`` from its arguments."""
    conc = args.concurrency or (max(args.sweep_concurrency) if args.sweep_concurrency else None) or args.users or 8
    parallel = args.peer_parallel or conc
    ctx = args.peer_ctx or parallel * 2048
    return {"parallel": parallel, "ctx": ctx, "threads": build_jobs()}


@contextlib.contextmanager
def load_test_peer(args: Any, log_path: Path) -> Iterator[LlamaServer]:
    """The llama-server ``load_test.py --peer llama-server`` measures: built if needed, on the bundled GGUF."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    binary = ensure_llama_server()
    gguf = args.server_model
    if gguf is None:
        from kvboost.models.loading import bundled_gguf_path  # the GGUF the bundled model is dequantized from

        gguf = str(bundled_gguf_path())
    s = peer_settings(args)
    with start_llama_server(binary, gguf, parallel=s["parallel"], ctx=s["ctx"], threads=s["threads"],
                            extra=shlex.split(args.server_args), log_path=log_path,
                            ready_timeout_s=args.server_timeout) as server:  # fmt: skip
        yield server


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.bench.peer_server``: build (or find) the binary and print its path."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--cmake-args", default=None, help="CPU flags instead of the default (shell-quoted)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    flags = shlex.split(args.cmake_args) if args.cmake_args is not None else None
    binary = ensure_llama_server(args.cache_dir, cmake_flags=flags, jobs=args.jobs)
    print(binary)
    print(json.dumps(build_info(binary), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
