"""The A/B tool: two checkouts of kvboost (``--before``, a git worktree of an earlier commit, and ``--after``, by
default this one) measured on the same machine in alternating order (before-after, then after-before, ...), so
that the machine's drift (minutes-long swings of +-20% on a shared VM) falls on both sides of every pair. What one
pair measures is the ``--unit``:

``run``      one whole ``python run.py OVERRIDES`` per side (each checkout's own ``run.py``), compared through
             their ``summary.json`` (per mode: ``ttft_ms_p50``, ``decode_tok_s_p50``) and their ``records.jsonl``
             (the same request in both runs of a pair: ``ttft_ms``, ``prefill_ms``, ``decode_tok_s``).
``request``  one engine process per checkout, both alive for the whole A/B; each request of the run config's
             workload goes to both (the order alternating per request): a pair is one request. The run config
             is ``python run.py OVERRIDES``'s, composed here with this checkout's configs; each worker builds its
             engine from it with its checkout's ``kvboost.build.build_engine`` (a checkout older than that module:
             ``KVBoost.from_pretrained`` with the same options, those its engine does not know dropped and
             listed). Modes: ``kvboost`` (``engine.generate(mode="reuse")``) and ``kvboost_cold`` (``"cold"``).
``load``     one ``kvboost-server`` per side on ``--port`` (its checkout's, one server at a time, ``--server-args``
             passed to it), load-tested by this checkout's ``experiments.bench.load_test`` with the arguments
             after ``--``; compared through the load tests' summaries (throughput, TTFT, ITL, ...).

Examples::

    git worktree add /tmp/kvboost-before <commit>
    python -m experiments.bench.ab --unit request --before /tmp/kvboost-before --name replay_fp32 \\
        --out experiments/results/runtime_ab -- workload.num_conversations=8 workload.max_turns=6 model.dtype=float32
    python -m experiments.bench.ab --unit request --before /tmp/kvboost-before --name rag_query_aware \\
        --out experiments/results/runtime_ab -- workload=rag_reorder recompute=query_aware
    python -m experiments.bench.ab --unit run --before /tmp/kvboost-before --pairs 3 --name replay_bf16 \\
        --out experiments/results/runtime_ab -- logger=none model.dtype=bfloat16
    python -m experiments.bench.ab --unit load --before /tmp/kvboost-before --pairs 2 --name load \\
        --out /tmp/load_ab -- --users 32 --turns 4 --concurrency 32 --max-tokens 32 --warmup 4

One output for every unit, ``<out>/<name>.json`` and ``<out>/<name>.md``: per mode (``load``: one group) and
metric, the after / before ratio of every pair, their median, p10-p90 and min-max (``comparison``); facts that
should not change, per side (``sides``: greedy match, accuracy, reuse, identical tokens, cached tokens, output
tokens); every pair's measurements (``rows``). TTFT, prefill and latencies: a ratio below 1 is faster after;
decode rates and throughput: above 1. ``--pairs``: run and load: pairs of runs (default 3 and 2); request: the
first N requests of the workload (default all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# No kvboost import at module level: a request worker imports this module, then puts its checkout first on
# sys.path, and only then imports the kvboost it measures.

ROOT = Path(__file__).resolve().parents[2]  # the repository root (this checkout)
SIDES = ("before", "after")
UNITS = ("run", "request", "load")

#: (metric, higher is better) per unit; the ratio of each is after / before
RUN_METRICS = (("ttft_ms_p50", False), ("decode_tok_s_p50", True))
REQUEST_METRICS = (("ttft_ms", False), ("prefill_ms", False), ("decode_tok_s", True))
LOAD_METRICS: tuple[tuple[str, Callable[[dict[str, Any]], float], bool], ...] = (
    ("request throughput (req/s)", lambda s: s["request_throughput"], True),
    ("output token throughput (tok/s)", lambda s: s["output_token_throughput"], True),
    ("decode tok/s per request (1000 / TPOT p50)", lambda s: 1000.0 / s["tpot_ms"]["p50"], True),
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"], False),
    ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"], False),
    ("ITL p50 (ms)", lambda s: s["itl_ms"]["p50"], False),
    ("end-to-end p50 (ms)", lambda s: s["e2e_ms"]["p50"], False),
)
#: runner mode -> engine.generate mode (the request unit runs the engine's own modes only: the HF baselines of
#: the runner do not depend on kvboost's code)
ENGINE_MODES = {"kvboost": "reuse", "kvboost_cold": "cold"}


# ------------------------------------------------------------------------------------------------ the ratios
def paired_ratios(pairs: Sequence[tuple[float | None, float | None]], higher_is_better: bool) -> dict[str, Any] | None:
    """after / before of every ``(before, after)`` pair where both are measured and non-zero: the ratios, their
    median, p10-p90 (:func:`experiments.common.spread`) and min-max; None when no pair has both."""
    from experiments.common import spread

    ratios = [a / b for b, a in pairs if b and a is not None]
    if not ratios:
        return None
    return {"after_over_before": ratios, **spread(ratios), "min": min(ratios), "max": max(ratios),
            "higher_is_better": higher_is_better}  # fmt: skip


# ------------------------------------------------------------------------------------------------- unit: run
def run_once(checkout: Path, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """``python run.py`` of ``checkout`` with ``overrides``, into ``out_dir``: its ``summary.json``, its
    ``records.jsonl`` (first measurement of each request and mode) and its wall time."""
    start = time.perf_counter()
    cmd = [sys.executable, "run.py", *overrides, f"hydra.run.dir={out_dir}"]
    proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, check=False)  # its output in the error
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {checkout} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    return {"summary": json.loads((out_dir / "summary.json").read_text()), "wall_s": time.perf_counter() - start,
            "records": [r for r in records if r.get("repeat", 0) == 0]}  # fmt: skip


def _run_facts(summary: dict[str, Any], mode: str) -> dict[str, Any]:
    overall = summary["modes"][mode]["overall"]
    quality = (summary.get("quality") or {}).get(mode) or {}
    accuracy = (summary.get("accuracy") or {}).get(mode) or {}
    return {**{m: overall.get(m) for m, _ in RUN_METRICS}, "reuse_ratio": overall.get("reuse_ratio"),
            "greedy_match_rate": quality.get("greedy_match_rate", overall.get("greedy_match_rate")),
            "accuracy": accuracy.get("accuracy"), "n": overall.get("n")}  # fmt: skip


def measure_runs(sides: dict[str, Path], overrides: list[str], pairs: int, modes: list[str],
                 runs_dir: Path) -> list[dict[str, Any]]:  # fmt: skip
    """``pairs`` pairs of whole runs; one row per pair: each side's facts per mode and its per-request records."""
    rows = []
    for pair in range(pairs):
        row: dict[str, Any] = {"pair": pair, "order": _order(pair)}
        for side in row["order"]:
            result = run_once(sides[side], overrides, runs_dir / f"pair{pair}_{side}")
            row[side] = {"wall_s": result["wall_s"], "dir": str(runs_dir / f"pair{pair}_{side}"),
                         **{mode: _run_facts(result["summary"], mode) for mode in modes},
                         "records": {f"{r['mode']}/{r['request_id']}": {m: r.get(m) for m, _ in REQUEST_METRICS}
                                     for r in result["records"] if r["mode"] in modes}}  # fmt: skip
        rows.append(row)
        print(f"pair {pair}: " + "; ".join(f"{mode} ttft p50 {row['before'][mode]['ttft_ms_p50']:.1f} -> "
                                           f"{row['after'][mode]['ttft_ms_p50']:.1f} ms" for mode in modes),
              flush=True)  # fmt: skip
    return rows


def compare_runs(rows: list[dict[str, Any]], modes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(comparison, sides) of :func:`measure_runs`'s rows: per mode, the pairs' run-level ratios, and the
    per-request ratios (the same request in both runs of a pair, every pair pooled)."""
    comparison: dict[str, Any] = {}
    sides: dict[str, Any] = {}
    for mode in modes:
        cell = {metric: paired_ratios([(r["before"][mode][metric], r["after"][mode][metric]) for r in rows], hib)
                for metric, hib in RUN_METRICS}  # fmt: skip
        for metric, hib in REQUEST_METRICS:
            per_request = [(r["before"]["records"][key][metric], after.get(metric)) for r in rows
                           for key, after in r["after"]["records"].items()
                           if key.startswith(f"{mode}/") and key in r["before"]["records"]]  # fmt: skip
            cell[f"{metric} per request"] = paired_ratios(per_request, hib)
        comparison[mode] = {k: v for k, v in cell.items() if v is not None}
        sides[mode] = {field: {side: [r[side][mode][field] for r in rows] for side in SIDES}
                       for field in ("greedy_match_rate", "accuracy", "reuse_ratio")}  # fmt: skip
    return comparison, sides


# --------------------------------------------------------------------------------------------- unit: request
def worker(root: str) -> None:
    """One engine of checkout ``root``: JSON commands on stdin, one JSON answer per line on stdout."""
    root = str(Path(root).resolve())
    sys.path.insert(0, root)  # this checkout's kvboost is the one measured (nothing imported kvboost yet)
    import torch

    import kvboost

    if not kvboost.__file__.startswith(root):
        raise RuntimeError(f"kvboost came from {kvboost.__file__}, not {root}")
    engine: Any = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "init":
            torch.set_num_threads(cmd.get("threads") or torch.get_num_threads())
            engine, ignored = _worker_engine(cmd["config"], cmd["options"])
            engine.warmup(max_tokens=cmd["max_tokens"])
            for text in cmd["warm"]:
                engine.warm(text)
            engine.generate([{"role": "user", "content": "Warm-up request, not measured: name three colours."}],
                            max_new_tokens=4, mode="cold")  # fmt: skip
            answer: dict[str, Any] = {"kvboost": kvboost.__file__, "ignored_options": ignored}
        elif cmd["op"] == "generate":
            r = engine.generate(cmd["prompt"], max_new_tokens=cmd["max_new_tokens"], mode=cmd["mode"])
            answer = {"ttft_ms": r.ttft_ms, "decode_tok_s": r.tokens_per_sec, "prefill_ms": r.extra.get("prefill_ms"),
                      "cached_tokens": r.cached_tokens, "output_ids": r.output_ids, "output_text": r.output_text,
                      "prompt_tokens": r.prompt_tokens}  # fmt: skip
        else:
            break
        print(json.dumps(answer), flush=True)


def _worker_engine(cfg: dict[str, Any], options: dict[str, Any]) -> tuple[Any, list[str]]:
    """The engine of the run config ``cfg`` in the imported checkout, and the options it had to leave out."""
    try:
        from kvboost.build import build_engine
    except ImportError:  # a checkout before the one builder: the public API, with the options it knows
        import inspect

        from kvboost import KVBoost

        known = set(inspect.signature(KVBoost.__init__).parameters) | {"streaming", "lm_head", "awq_prefill", "weights"}
        ignored = sorted(set(options) - known)
        model = cfg.get("model") or {}
        if model.get("random_init"):
            raise RuntimeError("this checkout has no kvboost.build: it cannot build model.random_init") from None
        engine = KVBoost.from_pretrained(model.get("name_or_path"), dtype=model.get("dtype", "auto"),
                                         device=model.get("device"),
                                         **{k: v for k, v in options.items() if k not in ignored})  # fmt: skip
        return engine, ignored
    cfg, ignored = _known_kv_events(cfg)
    return build_engine(cfg), ignored


def _known_kv_events(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``cfg`` without the ``engine.kv_events`` options the imported checkout does not know, while events are off (a
    later checkout's config has more of them, and an older engine refuses unknown ones; off, they change nothing),
    and their names as ``kv_events.NAME``."""
    import dataclasses

    engine = dict(cfg.get("engine") or {})
    events = dict(engine.get("kv_events") or {})
    try:
        from kvboost.cache.events import KVEventsConfig
    except ImportError:
        return cfg, []
    if events.get("enabled") or not dataclasses.is_dataclass(KVEventsConfig):
        return cfg, []
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    dropped = sorted(set(events) - known)
    engine["kv_events"] = {k: v for k, v in events.items() if k in known}
    return {**cfg, "engine": engine}, [f"kv_events.{k}" for k in dropped]


class Worker:
    """A request worker (:func:`worker`) seen from the coordinator."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # this checkout's module (``-m`` from ROOT); the worker then puts ``root`` first on sys.path
        self.proc = subprocess.Popen([sys.executable, "-m", "experiments.bench.ab", "--worker", str(root)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip

    def ask(self, **cmd: Any) -> dict[str, Any]:
        """Send one command, return the worker's answer."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker of {self.root} died (rc {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        """Ask the worker to quit; end it when it does not."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def build_workload(cfg: dict[str, Any]) -> Any:
    """The run config's workload, built once here (this checkout's code), so both sides get the same prompts."""
    from transformers import AutoTokenizer

    from kvboost.lab.config_check import split_workload_config
    from kvboost.lab.workloads import WORKLOADS
    from kvboost.lab.workloads.base import WorkloadEnv
    from kvboost.models.loading import bundled_model_dir

    tokenizer = AutoTokenizer.from_pretrained((cfg.get("model") or {}).get("name_or_path") or bundled_model_dir())

    def count(prompt: Any) -> int:
        if isinstance(prompt, str):
            return len(tokenizer(prompt)["input_ids"])
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    name, fields, _, _ = split_workload_config(cfg)
    return WORKLOADS.build({"name": name, **fields}, env=WorkloadEnv(tokenizer=tokenizer, count_tokens=count))


def measure_requests(sides: dict[str, Any], workload: Any, pairs: int | None, modes: list[str],
                     init: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Every request (the first ``pairs``) on both ``sides`` (objects with ``ask``, :class:`Worker`), in
    alternating order; one row per request and mode. Returns (rows, the workers' init answers)."""
    inits = {side: sides[side].ask(**init) for side in SIDES}
    print(inits, flush=True)
    rows = []
    for i, request in enumerate(list(workload.requests())[:pairs]):
        for mode in modes:
            row: dict[str, Any] = {"pair": i, "request_id": request.request_id, "turn": request.turn, "mode": mode,
                                   "order": _order(i)}  # fmt: skip
            for side in row["order"]:
                row[side] = sides[side].ask(op="generate", prompt=request.prompt, mode=ENGINE_MODES[mode],
                                            max_new_tokens=workload.max_new_tokens)  # fmt: skip
                row[side]["correct"] = workload.is_correct(request, row[side]["output_text"])
            rows.append(row)
            b, a = row["before"], row["after"]
            print(f"{i:3d} {mode:12s} ttft {b['ttft_ms']:7.1f} -> {a['ttft_ms']:7.1f} ms, decode "
                  f"{b['decode_tok_s']:5.1f} -> {a['decode_tok_s']:5.1f} tok/s, same tokens "
                  f"{a['output_ids'] == b['output_ids']}", flush=True)  # fmt: skip
    return rows, inits


def compare_requests(rows: list[dict[str, Any]], modes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(comparison, sides) of :func:`measure_requests`'s rows: per mode, the per-request ratios."""
    comparison: dict[str, Any] = {}
    sides: dict[str, Any] = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        cell = {metric: paired_ratios([(r["before"].get(metric), r["after"].get(metric)) for r in mine], hib)
                for metric, hib in REQUEST_METRICS}  # fmt: skip
        comparison[mode] = {k: v for k, v in cell.items() if v is not None}
        facts: dict[str, Any] = {"requests": {side: len(mine) for side in SIDES},
                                 "same tokens": {side: sum(r["after"]["output_ids"] == r["before"]["output_ids"]
                                                           for r in mine) for side in SIDES},
                                 "cached tokens": {side: sum(r[side]["cached_tokens"] for r in mine) for side in SIDES},
                                 "TTFT p50 (ms)": {side: statistics.median(r[side]["ttft_ms"] for r in mine)
                                                   for side in SIDES}}  # fmt: skip
        judged = {side: [r[side]["correct"] for r in mine if r[side]["correct"] is not None] for side in SIDES}
        if any(judged.values()):
            facts["accuracy"] = {side: sum(v) / len(v) if v else None for side, v in judged.items()}
        sides[mode] = facts
    return comparison, sides


# ------------------------------------------------------------------------------------------------ unit: load
def serve_and_load(checkout: Path, port: int, server_args: list[str], load_args: list[str], name: str,
                   out_dir: Path, ready_s: float = 600.0) -> dict[str, Any]:  # fmt: skip
    """Start ``checkout``'s ``kvboost-server`` on ``port``, run this checkout's load test against it, stop the
    server; the load test's summary."""
    from experiments.common import stop_process

    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # its kvboost, not the one installed
    with open(out_dir / f"server_{name}.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "kvboost.serving", "--host", "127.0.0.1", "--port",
                                   str(port), *server_args], cwd=checkout, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_ready(f"http://127.0.0.1:{port}/v1/models", server, ready_s)
        cmd = [sys.executable, "-m", "experiments.bench.load_test", "--url", f"http://127.0.0.1:{port}/v1",
               "--name", name, "--out", str(out_dir), *load_args]  # fmt: skip
        with open(out_dir / f"client_{name}.log", "w") as log:
            subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    finally:
        stop_process(server)
    return json.loads((out_dir / f"{name}.json").read_text())["summary"]


def _wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited (rc {server.returncode}) before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"no answer from {url} in {timeout_s:.0f} s")


def measure_loads(sides: dict[str, Path], pairs: int,
                  run: Callable[[Path, str], dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """``pairs`` pairs of load tests, ``run(checkout, name)`` giving each one's summary; one row per pair."""
    rows = []
    for pair in range(pairs):
        row: dict[str, Any] = {"pair": pair, "order": _order(pair)}
        for side in row["order"]:
            row[side] = run(sides[side], f"pair{pair}_{side}")
        rows.append(row)
    return rows


def compare_loads(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(comparison, sides) of :func:`measure_loads`'s rows: the pairs' ratios per load-test metric; output tokens
    and the cached fraction per side (they should not differ)."""
    cell = {label: paired_ratios([(read(r["before"]), read(r["after"])) for r in rows], hib)
            for label, read, hib in LOAD_METRICS}  # fmt: skip
    facts = {"output tokens": {side: [r[side]["output_tokens"] for r in rows] for side in SIDES},
             "cached fraction of prompt tokens": {side: [r[side]["cached"]["fraction"] for r in rows]
                                                  for side in SIDES}}  # fmt: skip
    return {"load": {k: v for k, v in cell.items() if v is not None}}, {"load": facts}


# ------------------------------------------------------------------------------------------------- the tool
def _order(pair: int) -> list[str]:
    """before-after on even pairs, after-before on odd ones."""
    return ["before", "after"] if pair % 2 == 0 else ["after", "before"]


def build_parser() -> argparse.ArgumentParser:
    """The command line (the overrides or load-test arguments come after ``--``)."""
    p = argparse.ArgumentParser(prog="python -m experiments.bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--unit", choices=UNITS, required=True, help="what one pair measures (see above)")
    p.add_argument("--before", required=True, help="the other checkout (a git worktree of the earlier commit)")
    p.add_argument("--after", default=str(ROOT), help="the new checkout (default: this one)")
    p.add_argument("--pairs", type=int, default=None,
                   help="run: pairs of runs (3); load: pairs of load tests (2); request: the first N requests (all)")  # fmt: skip
    p.add_argument("--name", required=True, help="the output's name: <out>/<name>.json and .md")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "runtime_ab"))
    p.add_argument("--modes", nargs="+", default=None,
                   help="run: the runner's modes compared (default kvboost); request: kvboost and/or kvboost_cold")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="request: torch threads of each worker")
    p.add_argument("--port", type=int, default=8123, help="load: the servers' port (one server at a time)")
    p.add_argument("--server-args", nargs="*", default=[], help="load: kvboost-server flags and overrides")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the A/B; write and return its result (``{"unit", "command", ..., "comparison", "sides", "rows"}``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1])
        return {}
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    sides = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    out = Path(args.out).resolve()
    extra: dict[str, Any] = {}
    if args.unit == "run":
        modes = args.modes or ["kvboost"]
        rows = measure_runs(sides, rest, args.pairs or 3, modes, out / args.name / "runs")
        comparison, facts = compare_runs(rows, modes)
    elif args.unit == "request":
        modes = args.modes or ["kvboost"]
        unknown = sorted(set(modes) - set(ENGINE_MODES))
        if unknown:
            raise SystemExit(f"--unit request runs the engine's modes only ({', '.join(ENGINE_MODES)}), not {unknown}")
        from experiments.common import compose_run_config
        from kvboost.build import check_engine_config, engine_options

        cfg = compose_run_config(rest)
        check_engine_config(cfg)
        workload = build_workload(cfg)
        init = {"op": "init", "config": cfg, "options": engine_options(cfg), "threads": args.threads,
                "max_tokens": int(getattr(workload.cfg, "max_prompt_tokens", None) or 2048) + workload.max_new_tokens,
                "warm": workload.shared_context()}  # fmt: skip
        workers = {side: Worker(path) for side, path in sides.items()}
        try:
            rows, extra["workers"] = measure_requests(workers, workload, args.pairs, modes, init)
        finally:
            for w in workers.values():
                w.close()
        comparison, facts = compare_requests(rows, modes)
    else:
        modes = ["load"]
        runs_dir = out / args.name / "runs"
        rows = measure_loads(sides, args.pairs or 2, lambda checkout, name: serve_and_load(
            checkout, args.port, args.server_args, rest, name, runs_dir))  # fmt: skip
        comparison, facts = compare_loads(rows)
    result = {"unit": args.unit, "command": "python -m experiments.bench.ab " + " ".join(argv),
              "before": str(sides["before"]), "after": str(sides["after"]), "overrides": rest, "pairs": len(rows),
              "modes": modes, **extra, "comparison": comparison, "sides": facts, "rows": rows}  # fmt: skip
    from experiments.common import write_json, write_markdown

    write_json(out / f"{args.name}.json", result)
    print(write_markdown(out / f"{args.name}.md", to_markdown(result)).read_text())
    return result


def to_markdown(result: dict[str, Any]) -> str:
    """The result as one ratio table (and one table of the per-side facts), whatever the unit."""
    lines = [f"# A/B ({result['unit']}): {' '.join(result['overrides']) or 'defaults'}", "", "```", result["command"],
             "```", "", (f"before: `{result['before']}`, after: `{result['after']}`; {result['pairs']} "
             f"{'requests' if result['unit'] == 'request' else 'pairs'}, order alternating. Ratio = after / before "
             "of each pair; `better` says which way is better after."), "",
             "| mode | metric | pairs | after / before median [p10-p90] | min-max | better |", "|---|---|---|---|---|---|"]  # fmt: skip
    for mode, cell in result["comparison"].items():
        for metric, c in cell.items():
            lines.append(f"| {mode} | {metric} | {c['n']} | {c['median']:.3f} [{c['p10']:.3f}-{c['p90']:.3f}] | "
                         f"{c['min']:.3f}-{c['max']:.3f} | {'> 1' if c['higher_is_better'] else '< 1'} |")  # fmt: skip
    facts = [(mode, field, values) for mode, cell in result["sides"].items() for field, values in cell.items()
             if any(v is not None for v in values.values())]  # fmt: skip
    if facts:
        lines += ["", "| mode | per side | before | after |", "|---|---|---|---|"]
        lines += [f"| {mode} | {field} | {_fmt(v['before'])} | {_fmt(v['after'])} |" for mode, field, v in facts]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


if __name__ == "__main__":
    main()
