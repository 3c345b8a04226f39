"""kvboost beside llama.cpp and HF on the real ShareGPT replay: TTFT per turn, decode tokens/s, compute floor.

One process, the same prompts (the same token ids) for every system, users sequential and interleaved:

| system               | what runs                                                                                   |
| -------------------- | ------------------------------------------------------------------------------------------- |
| `llama_cpp_prefix`   | llama.cpp (llama-cpp-python) ``Llama.generate(ids, reset=True)``: one slot, the longest     |
|                      | common token prefix with what it evaluated last (prompt + answer) is kept, the rest is run  |
| `llama_cpp_ramcache` | llama.cpp ``create_completion(ids)`` with ``LlamaRAMCache``: the state after every request  |
|                      | is saved, the saved state with the longest common prefix is restored before the next        |
| `llama_server`       | llama.cpp's own ``llama-server`` (same llama.cpp version, ``peer_server.py``), one slot,     |
|                      | ``POST /completion`` with the ids and ``cache_prompt``: ``llama_cpp_prefix``'s reuse over HTTP |
| `hf_baseline`        | HF cold prefill (``kvboost/lab/hf_baselines.py: HFNoCache``, runner mode ``baseline``)      |
| `hf_prefix`          | HF carrying the previous request's cache (``HFPrefixCache``, runner mode ``hf_prefix``)     |
| `kvboost`            | the engine with its store (runner mode ``kvboost``), warmed only by earlier turns           |

Prompts are the ShareGPT replay's (``kvboost/lab/workloads/sharegpt_replay.py``, the dataset's own history),
tokenized once with the kvboost engine's tokenizer (chat template), and every system gets those token ids, so
TTFT runs from token ids in to the first token id out for all of them (no tokenization inside any timer).
llama.cpp runs the bundled Q4_1 GGUF (the file the HF model is dequantized from): its greedy tokens differ from
HF's; the match rate vs ``hf_baseline`` is reported for every system anyway. Decode tokens/s = (generated - 1)
/ time from the first to the last token (the engine's own definition). All greedy; llama.cpp ``n_threads`` =
``n_threads_batch`` = torch threads. Before timing every system serves one unrelated warm-up prompt with
``--max-new-tokens`` tokens and its state is then reset; the engine's ``warmup()`` (where it exists) runs first,
timed apart. The system order is shuffled per request (seeded), as the runner does.

Compute floor (kvboost): for a request of ``n`` prompt tokens whose first ``c`` come from the store,
``FLOPs = 2 * P * (n - c) + 4 * L * H * sum_{p=c}^{n-1} (p + 1) + 2 * V * H`` with ``P`` the non-embedding
parameters (every matmul weight of the layers: 2 FLOPs per weight per token), ``L`` layers, ``H`` the attention
width (heads x head_dim; QK^T and AV are 2 * H FLOPs per key each, a new token at position p reads p + 1 keys)
and the LM head for the last token only. ``floor_ms = FLOPs / R`` with ``R`` the matmul rate of the run's dtype,
measured in the same process on ``[m, hidden] x [hidden, intermediate]`` for ``m`` the median new-token count
of kvboost's requests. ``ttft_over_floor`` = TTFT / floor per request.

Why a script beside ``run.py`` and not a runner mode. It reuses the runner's pieces: the run config (the same
Hydra ``kvboost/configs/``, composed here), ``kvboost.build.engine_options`` / ``split_workload_config``, the workload
registry (the ShareGPT replay's requests), the runner's modes (``baseline``, ``hf_prefix``, ``kvboost`` from
``kvboost/lab/modes.py``) and its warm-up messages. What it does not share is the request loop, on purpose: every
system, llama.cpp included, gets the same pre-tokenized ids (the runner's modes take prompt text and time the
tokenization), each request is served by all systems in a shuffled order before the next, and the output adds
what only this comparison has (llama.cpp's build, the compute floor, both user orders). Statistics use the one
``percentile`` of ``experiments/common.py``.

Without llama-cpp-python the default ``--systems`` runs ``llama_server`` in place of the two ``llama_cpp_*``
systems (its binary is built once by ``peer_server.ensure_llama_server()``, needing only cmake and a compiler),
and the ratio column is kvboost / ``llama_server`` (kvboost / ``llama_cpp_prefix`` whenever that one ran).

Install llama.cpp (optional extra ``peers``, a ~15 min source build; see README "llama.cpp beside kvboost"):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
        pip install --no-cache-dir -e ".[peers]"

Run:

    python -m experiments.bench.bench_peers --num-conversations 2 --max-turns 2                       # smoke run
    python -m experiments.bench.bench_peers --num-conversations 4 --max-turns 6 --ignore-eos --dtype float32
    python -m experiments.bench.bench_peers --num-conversations 4 --max-turns 6 --ignore-eos --dtype bfloat16
    python -m experiments.bench.bench_peers --kvboost-arg decode=compiled      # extra engine kwargs (from_pretrained)
    python -m experiments.bench.bench_peers --systems hf_baseline,hf_prefix,kvboost   # without llama.cpp

Writes ``<out>/<name>.json`` (config, environment, llama.cpp build, matmul rate, per system and order: TTFT by
turn, decode tokens/s, reuse, greedy match, the kvboost / llama.cpp ratio and the compute floor, every
request with its greedy token ids) and ``<out>/<name>.md`` (the tables, the command at the top).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.common import percentile

SYSTEMS = ("llama_cpp_prefix", "llama_cpp_ramcache", "llama_server", "hf_baseline", "hf_prefix", "kvboost")
LLAMA_SYSTEMS = ("llama_cpp_prefix", "llama_cpp_ramcache")  # in-process (llama-cpp-python)
SERVER_SYSTEM = "llama_server"  # llama.cpp's own HTTP server (peer_server.py), no llama-cpp-python needed
ORDERS = ("sequential", "interleaved")
REFERENCE = "hf_baseline"
RATIO_PAIR = ("kvboost", "llama_cpp_prefix")
# the llama.cpp system kvboost's TTFT is divided by: the first of these that ran (both reuse one slot's prefix)
RATIO_DENOMINATORS = ("llama_cpp_prefix", SERVER_SYSTEM)
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "peers"
LLAMA_INSTALL_HINT = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
    "pip install --no-cache-dir -e '.[peers]'"
)


# ============================================================================================ pure functions
def describe(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """n, p50, mean, std (sample), p10, p90, min, max of the values that are not None."""
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return {"n": 0, "p50": None, "mean": None, "std": None, "p10": None, "p90": None, "min": None, "max": None}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"n": len(xs), "p50": percentile(xs, 50), "mean": mean, "std": std, "p10": percentile(xs, 10),
            "p90": percentile(xs, 90), "min": min(xs), "max": max(xs)}  # fmt: skip


def _group(records: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def aggregate_by_turn(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """``out[system][order][turn]`` = TTFT (``ttft_ms``: describe()), reuse ratio mean, prompt tokens mean."""
    out: dict[str, dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for (system, order, turn), rs in sorted(_group(records, "system", "order", "turn").items()):
        out[system][order][int(turn)] = {
            "ttft_ms": describe(r["ttft_ms"] for r in rs),
            "reuse_ratio_mean": sum(r["reused_tokens"] / r["prompt_tokens"] for r in rs) / len(rs),
            "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rs) / len(rs),
        }
    return {s: dict(v) for s, v in out.items()}


def aggregate_overall(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``out[system][order]`` = TTFT and decode tokens/s (describe()), tokens decoded, reuse (mean, token-weighted)."""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (system, order), rs in sorted(_group(records, "system", "order").items()):
        prompt = sum(r["prompt_tokens"] for r in rs)
        out[system][order] = {
            "requests": len(rs),
            "ttft_ms": describe(r["ttft_ms"] for r in rs),
            "decode_tok_s": describe(r.get("decode_tok_s") for r in rs),
            "generated_tokens_mean": sum(r["generated_tokens"] for r in rs) / len(rs),
            "reuse_ratio_mean": sum(r["reused_tokens"] / r["prompt_tokens"] for r in rs) / len(rs),
            "reuse_ratio_token_weighted": sum(r["reused_tokens"] for r in rs) / prompt if prompt else 0.0,
        }
    return dict(out)


def ratio_by_turn(
    records: Sequence[dict[str, Any]], numerator: str = RATIO_PAIR[0], denominator: str = RATIO_PAIR[1],
    metric: str = "ttft_ms",
) -> dict[str, dict[int, dict[str, Any]]]:  # fmt: skip
    """``out[order][turn]``: per-request ratio numerator/denominator of ``metric`` (same request, same order),
    described across conversations (p50, mean, min, max...)."""
    by_request = _group(records, "order", "request_id")
    ratios: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (order, _), rs in by_request.items():
        by_system = {r["system"]: r for r in rs}
        if numerator in by_system and denominator in by_system and by_system[denominator][metric] > 0:
            ratios[order][int(by_system[numerator]["turn"])].append(
                by_system[numerator][metric] / by_system[denominator][metric]
            )
    return {order: {turn: describe(v) for turn, v in sorted(turns.items())} for order, turns in ratios.items()}


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python can be imported (looked up, not imported: the import loads the library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def default_systems(have_llama_cpp: bool) -> tuple[str, ...]:
    """``--systems``' default: every in-process system, or ``llama_server`` in place of the ``llama_cpp_*``
    ones when llama-cpp-python is missing (the server is the same llama.cpp, built apart)."""
    if have_llama_cpp:
        return tuple(s for s in SYSTEMS if s != SERVER_SYSTEM)
    return tuple(s for s in SYSTEMS if s not in LLAMA_SYSTEMS)


def ratio_pair(systems: Iterable[str]) -> tuple[str, str]:
    """(kvboost, the llama.cpp system that ran): ``llama_cpp_prefix`` if it ran, else ``llama_server``."""
    ran = set(systems)
    return RATIO_PAIR[0], next((s for s in RATIO_DENOMINATORS if s in ran), RATIO_PAIR[1])


def truncate_at_eos(ids: Sequence[int], eos_ids: Iterable[int]) -> list[int]:
    """The ids up to and including the first EOS (what a chat server returns)."""
    eos = set(eos_ids)
    out: list[int] = []
    for t in ids:
        out.append(int(t))
        if t in eos:
            break
    return out


def greedy_match(
    records: Sequence[dict[str, Any]], eos_ids: Iterable[int], reference: str = REFERENCE
) -> dict[str, dict[str, dict[str, Any]]]:
    """``out[system][order]``: share of requests whose greedy tokens (cut after the first EOS) equal the
    reference system's on the same request, and the mean share of the reference's tokens matched before the
    first difference."""
    eos = set(eos_ids)
    refs = {(r["order"], r["request_id"]): truncate_at_eos(r["output_ids"], eos) for r in records
            if r["system"] == reference}  # fmt: skip
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (system, order), rs in sorted(_group(records, "system", "order").items()):
        same, prefix_share, n = 0, 0.0, 0
        for r in rs:
            ref = refs.get((order, r["request_id"]))
            if ref is None:
                continue
            ids = truncate_at_eos(r["output_ids"], eos)
            common = 0
            while common < min(len(ids), len(ref)) and ids[common] == ref[common]:
                common += 1
            same += ids == ref
            prefix_share += common / len(ref) if ref else 1.0
            n += 1
        if n:
            out[system][order] = {"requests": n, "match_rate": same / n, "matched_prefix_share_mean": prefix_share / n}
    return dict(out)


@dataclass(frozen=True)
class Arch:
    """What the compute floor needs of a model (``from_model`` reads it off a HF causal LM)."""

    non_embedding_params: int
    num_layers: int
    attn_width: int  # heads x head_dim (query side)
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_model(cls, model: Any) -> Arch:
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = sum(p.numel() for name, p in model.named_parameters()
                     if "embed_tokens" not in name and "lm_head" not in name)  # fmt: skip
        # AWQ int4 linears keep their weights in buffers: count their multiply-adds too (else the floor of an
        # AWQ model would count only its norms).
        from kvboost.models.awq import AWQLinear

        params += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, AWQLinear))
        return cls(int(params), int(cfg.num_hidden_layers), int(cfg.num_attention_heads * head_dim),
                   int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.vocab_size))  # fmt: skip


def prefill_flops(prompt_tokens: int, reused_tokens: int, arch: Arch) -> float:
    """FLOPs of a prefill that computes positions ``reused_tokens .. prompt_tokens - 1`` (see module docstring)."""
    c, n = int(reused_tokens), int(prompt_tokens)
    new = n - c
    if new <= 0:
        return 0.0
    keys_read = (c + 1 + n) * new / 2  # sum_{p=c}^{n-1} (p + 1)
    return 2.0 * arch.non_embedding_params * new + 4.0 * arch.num_layers * arch.attn_width * keys_read \
        + 2.0 * arch.vocab * arch.hidden  # fmt: skip


def compute_floor_ms(prompt_tokens: int, reused_tokens: int, arch: Arch, flops_per_s: float) -> float:
    """The fastest a prefill of the new tokens could run at the measured matmul rate, in ms."""
    return prefill_flops(prompt_tokens, reused_tokens, arch) / flops_per_s * 1e3


def add_floor(records: Sequence[dict[str, Any]], arch: Arch, flops_per_s: float, system: str = "kvboost") -> None:
    """Adds ``new_tokens``, ``floor_ms`` and ``ttft_over_floor`` to ``system``'s records (in place)."""
    for r in records:
        if r["system"] != system:
            continue
        r["new_tokens"] = r["prompt_tokens"] - r["reused_tokens"]
        r["floor_ms"] = compute_floor_ms(r["prompt_tokens"], r["reused_tokens"], arch, flops_per_s)
        r["ttft_over_floor"] = r["ttft_ms"] / r["floor_ms"] if r["floor_ms"] > 0 else None


def floor_by_turn(records: Sequence[dict[str, Any]], system: str = "kvboost") -> dict[str, dict[int, dict[str, Any]]]:
    """``out[order][turn]``: new tokens, floor_ms, TTFT and TTFT/floor (describe()) of ``system``'s records."""
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for (order, turn), rs in sorted(_group([r for r in records if r["system"] == system], "order", "turn").items()):
        out[order][int(turn)] = {k: describe(r.get(k) for r in rs)
                                 for k in ("new_tokens", "floor_ms", "ttft_ms", "ttft_over_floor")}  # fmt: skip
    return dict(out)


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _spread(d: dict[str, Any], digits: int = 2) -> str:
    if not d or d.get("n", 0) == 0:
        return "-"
    return f"{_fmt(d['p50'], digits)} [{_fmt(d['min'], digits)}-{_fmt(d['max'], digits)}]"


def markdown_report(result: dict[str, Any]) -> str:
    """The tables of a result (``run()``'s dict): TTFT by turn per order, decode, reuse, match, floor."""
    lines = [f"# Peers on the ShareGPT replay ({result.get('title', '')})", ""]
    if result.get("command"):
        lines += ["```", result["command"], "```", ""]
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    if result.get("notes"):
        lines.append("")
    by_turn, ratios, floors = result["by_turn"], result["ratio_by_turn"], result["floor_by_turn"]
    systems = [s for s in SYSTEMS if s in by_turn]
    num, den = result.get("ratio_pair") or RATIO_PAIR
    for order in result["orders"]:
        turns = sorted({t for s in systems for t in by_turn[s].get(order, {})})
        lines += [f"## {order}: TTFT p50 / mean (ms) by turn", ""]
        head = ["turn", "n", *systems]
        if num in systems and den in systems:
            head.append(f"{num} / {den} p50 [min-max]")
        if floors.get(order):
            head += ["kvboost new tokens p50", "floor ms p50", "kvboost TTFT / floor p50 [min-max]"]
        lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for t in turns:
            n = max(
                (by_turn[s][order][t]["ttft_ms"]["n"] for s in systems if t in by_turn[s].get(order, {})), default=0
            )
            row = [str(t), str(n)]
            for s in systems:
                d = by_turn[s].get(order, {}).get(t, {}).get("ttft_ms")
                row.append(f"{_fmt(d['p50'])} / {_fmt(d['mean'])}" if d and d["n"] else "-")
            if num in systems and den in systems:
                row.append(_spread(ratios.get(order, {}).get(t, {})))
            if floors.get(order):
                f = floors[order].get(t)
                row += (
                    [_fmt(f["new_tokens"]["p50"]), _fmt(f["floor_ms"]["p50"], 1), _spread(f["ttft_over_floor"], 2)]
                    if f
                    else ["-", "-", "-"]
                )
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    overall, match = result["overall"], result["greedy_match"]
    lines += ["## Decode tokens/s, reuse, greedy match vs hf_baseline", "",
              ("| system | order | requests | decode tok/s p50 | mean ± std | p10-p90 | tokens decoded mean | "
               "TTFT p50 ms | reuse (mean / token-weighted) | greedy match vs hf_baseline | matched prefix |"),
              "|" + " --- |" * 11]  # fmt: skip
    for s in systems:
        for order in result["orders"]:
            o = overall.get(s, {}).get(order)
            if not o:
                continue
            d = o["decode_tok_s"]
            m = match.get(s, {}).get(order, {})
            lines.append(
                f"| {s} | {order} | {o['requests']} | {_fmt(d['p50'], 1)} | {_fmt(d['mean'], 1)} ± {_fmt(d['std'], 1)} "
                f"| {_fmt(d['p10'], 1)}-{_fmt(d['p90'], 1)} | {o['generated_tokens_mean']:.1f} | {_fmt(o['ttft_ms']['p50'])} "
                f"| {o['reuse_ratio_mean']:.3f} / {o['reuse_ratio_token_weighted']:.3f} "
                f"| {_fmt(m.get('match_rate'), 3)} | {_fmt(m.get('matched_prefix_share_mean'), 3)} |"
            )
    lines.append("")
    rate = result.get("matmul_rate")
    if rate:
        lines += [f"Matmul rate ({rate['dtype']}, [{rate['m']}, {rate['k']}] x [{rate['k']}, {rate['n']}]): "
                  f"{rate['gflop_s']:.0f} GFLOP/s; other sizes: "
                  + ", ".join(f"m={m}: {g:.0f}" for m, g in sorted(rate.get("other_m_gflop_s", {}).items(), key=lambda kv: int(kv[0])))
                  + " GFLOP/s. Floor = new tokens x FLOPs per token / that rate (see the script's docstring).", ""]  # fmt: skip
    return "\n".join(lines)


# ============================================================================================ measurement
def measure_matmul_rate(m: int, k: int, n: int, dtype: Any, *, min_seconds: float = 0.3) -> float:
    """FLOP/s of ``[m, k] x [k, n]`` in ``dtype`` (median of repeated calls, after a warm-up)."""
    import torch

    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 5:
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * m * k * n / percentile(times, 50)


def parse_assignments(items: Sequence[str] | None) -> dict[str, Any]:
    """``key=value`` strings -> dict, values parsed as YAML (``decode=compiled``, ``flash_attn=true``)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


def _record(system: str, order: str, request: Any, ids: list[int], m: dict[str, Any]) -> dict[str, Any]:
    return {
        "system": system, "order": order, "request_id": request.request_id,
        "conversation_id": request.conversation_id, "turn": request.turn, "prompt_tokens": len(ids), **m,
    }  # fmt: skip


class TorchSystem:
    """A runner mode of ``kvboost/lab/modes.py`` (hf_baseline = ``baseline``, hf_prefix, kvboost) on token ids."""

    def __init__(self, name: str, mode: Any, *, ignore_eos: bool) -> None:
        self.name, self.mode = name, mode
        if ignore_eos:  # decode_loop stops on these ids; empty = always max_new_tokens
            holder = mode.engine if hasattr(mode, "engine") else mode.runner
            holder.eos_ids = set()

    def reset(self) -> None:
        self.mode.reset()

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        r = self.mode.generate(list(ids), max_new_tokens)
        out = {
            "ttft_ms": r.ttft_ms, "total_ms": r.total_ms,
            "decode_tok_s": r.tokens_per_sec if r.generated_tokens > 1 else None,
            "generated_tokens": r.generated_tokens, "reused_tokens": r.cached_tokens, "output_ids": list(r.output_ids),
        }  # fmt: skip
        for key in ("prefill_ms", "lookup_ms", "assemble_ms", "tokenize_ms"):
            if key in r.extra:
                out[key] = r.extra[key]
        if r.store_ms:
            out["store_ms"] = r.store_ms
        return out


class LlamaPrefixSystem:
    """llama.cpp's one slot: ``Llama.generate(ids, reset=True)`` keeps the longest common prefix with what it
    evaluated last (the previous prompt and answer) and evaluates the rest."""

    name = "llama_cpp_prefix"

    def __init__(self, llm: Any, *, eos_ids: set[int], ignore_eos: bool) -> None:
        self.llm, self.eos_ids, self.ignore_eos = llm, set(eos_ids), ignore_eos

    def reset(self) -> None:
        self.llm.reset()

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        from kvboost.cache.sequence_store import common_prefix_length

        reused = min(common_prefix_length(list(self.llm._input_ids), ids), len(ids) - 1)
        room = self.llm.n_ctx() - len(ids)
        t0 = time.perf_counter()
        gen = self.llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True)
        tokens = [next(gen)]
        t_first = time.perf_counter()
        while len(tokens) < min(max_new_tokens, room) and (self.ignore_eos or tokens[-1] not in self.eos_ids):
            tokens.append(next(gen))
        t_end = time.perf_counter()
        gen.close()
        return _llama_result(t0, t_first, t_end, t_end, tokens, reused)


def _llama_result(
    t0: float, t_first: float, t_last: float, t_end: float, tokens: list[int], reused: int
) -> dict[str, Any]:
    return {
        "ttft_ms": (t_first - t0) * 1e3, "total_ms": (t_end - t0) * 1e3,
        "decode_tok_s": (len(tokens) - 1) / (t_last - t_first) if len(tokens) > 1 and t_last > t_first else None,
        "generated_tokens": len(tokens), "reused_tokens": reused, "output_ids": [int(t) for t in tokens],
    }  # fmt: skip


class LlamaRamCacheSystem:
    """llama.cpp's multi-prompt state cache: ``create_completion(ids)`` with ``LlamaRAMCache``.

    ``create_completion`` restores the saved state with the longest common prefix (when it beats what is
    evaluated now), runs the rest, and saves the state after the answer. Tokens and their times are recorded by
    wrapping the instance's ``generate`` (which ``create_completion`` iterates), so TTFT is the first token's
    yield, cache lookup and state restore included; the state save after the answer is ``save_ms``.
    ``create_completion`` always stops at an end-of-generation token: with ``ignore_eos`` those are masked
    (-inf logits) instead, so the answer after that point differs from the other systems' (which feed EOS).
    """

    name = "llama_cpp_ramcache"

    def __init__(self, llm: Any, *, capacity_bytes: int, eog_ids: set[int], ignore_eos: bool) -> None:
        self.llm, self.capacity_bytes, self.ignore_eos = llm, capacity_bytes, ignore_eos
        self.eog_ids = sorted(eog_ids)
        self._tokens: list[int] = []
        self._stamps: list[float] = []
        original = llm.generate

        def recording_generate(*args: Any, **kwargs: Any):
            inner = original(*args, **kwargs)
            try:
                for token in inner:
                    self._stamps.append(time.perf_counter())
                    self._tokens.append(int(token))
                    yield token
            finally:
                inner.close()

        llm.generate = recording_generate
        self.reset()

    def reset(self) -> None:
        from llama_cpp import LlamaRAMCache

        self.llm.reset()
        self.llm.set_cache(LlamaRAMCache(capacity_bytes=self.capacity_bytes))

    def _reused(self, ids: list[int]) -> int:
        """The prefix create_completion will not recompute (its own rule, evaluated before timing)."""
        from kvboost.cache.sequence_store import common_prefix_length

        evaluated = common_prefix_length(list(self.llm._input_ids), ids)
        cache = self.llm.cache
        try:
            key = cache._find_longest_prefix_key(tuple(ids))
            cached = common_prefix_length(cache.cache_state[key].input_ids.tolist(), ids) if key is not None else 0
        except (AttributeError, KeyError):
            cached = 0
        return min(max(evaluated, cached), len(ids) - 1)

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        import numpy as np
        from llama_cpp import LogitsProcessorList

        reused = self._reused(ids)
        processors = None
        if self.ignore_eos:
            eog = np.asarray(self.eog_ids, dtype=np.int64)

            def mask_eog(_input_ids: Any, scores: Any) -> Any:
                scores[eog] = -np.inf
                return scores

            processors = LogitsProcessorList([mask_eog])
        self._tokens, self._stamps = [], []
        t0 = time.perf_counter()
        self.llm.create_completion(list(ids), max_tokens=max_new_tokens, temperature=0.0, repeat_penalty=1.0,
                                   logits_processor=processors, seed=0)  # fmt: skip
        t_end = time.perf_counter()
        if not self._tokens:
            raise RuntimeError("llama_cpp_ramcache: create_completion produced no token")
        out = _llama_result(t0, self._stamps[0], self._stamps[-1], t_end, list(self._tokens), reused)
        out["save_ms"] = (t_end - self._stamps[-1]) * 1e3
        return out


def parse_completion(response: dict[str, Any], wall_ms: float) -> dict[str, Any]:
    """A record's measurements from llama-server's ``POST /completion`` answer (``return_tokens``: ``tokens``).

    ``timings`` is the slot's own clock (``tools/server/server-common.h: server_slot_stats``): ``prompt_ms`` runs
    from the start of prompt processing to the first sampled token, so it is the TTFT without HTTP, JSON and
    queueing (``wall_ms``, the client's time for the whole request, has them); ``predicted_ms`` runs from that
    first token to the last and ``predicted_n`` counts the first token too, so ``(predicted_n - 1) /
    predicted_ms`` is the engine's decode tokens/s (the server's own ``predicted_per_second`` is the same).
    ``cache_n`` = prompt tokens taken from the slot's cache (at most prompt - 1: the server always evaluates one).
    """
    timings = response.get("timings") or {}
    tokens = [int(t) for t in response.get("tokens") or []]
    if not tokens:
        raise RuntimeError(f"llama-server returned no token ids (return_tokens unsupported?): {response!r:.300}")
    n, predicted_ms = int(timings.get("predicted_n", len(tokens))), float(timings.get("predicted_ms", 0.0))
    return {
        "ttft_ms": float(timings["prompt_ms"]), "total_ms": wall_ms,
        "decode_tok_s": (n - 1) / predicted_ms * 1e3 if n > 1 and predicted_ms > 0 else None,
        "generated_tokens": len(tokens), "reused_tokens": int(timings.get("cache_n", 0)), "output_ids": tokens,
        "server_wall_ms": wall_ms, "server_prompt_n": int(timings.get("prompt_n", 0)),
        "server_predicted_n": n, "server_predicted_ms": predicted_ms, "stop_type": response.get("stop_type"),
    }  # fmt: skip


def llama_server_args(slot_dir: str | Path) -> list[str]:
    """llama-server flags of ``llama_server`` beyond ``peer_server``'s: ``--cache-ram 0`` (no host-memory prompt
    cache: one slot's prefix only, as ``llama_cpp_prefix``) and ``--slot-save-path`` (without it the ``/slots``
    actions, erase included, answer 501; erase writes nothing there)."""
    return ["--cache-ram", "0", "--slot-save-path", str(slot_dir)]


class LlamaServerSystem:
    """llama.cpp's ``llama-server`` with one slot (``-np 1``): ``POST /completion`` with the prompt's token ids and
    ``cache_prompt``, which keeps the longest common prefix of the slot's tokens (the previous prompt and answer)
    and evaluates the rest, the reuse of ``llama_cpp_prefix`` behind HTTP. The server is started with
    ``--cache-ram 0`` (:func:`llama_server_args`): its default host-memory prompt cache would save the slot's state and restore the best saved
    one on a new conversation, i.e. ``llama_cpp_ramcache``'s behaviour instead.

    TTFT is the server's ``timings.prompt_ms`` (see :func:`parse_completion`: no HTTP overhead, comparable to the
    in-process systems'); the client's wall time of the non-streamed request is kept as ``server_wall_ms``.
    ``ignore_eos`` makes the server mask end-of-generation tokens (a -inf logit bias), like
    ``llama_cpp_ramcache`` and unlike the systems that feed EOS back. ``reset()`` erases the slot
    (``POST /slots/0?action=erase``), as ``llama_cpp_prefix``'s ``reset()`` forgets what it evaluated.
    """

    name = SERVER_SYSTEM

    def __init__(self, base_url: str, *, ignore_eos: bool, timeout_s: float = 600.0) -> None:
        self.base_url, self.ignore_eos, self.timeout_s = base_url.rstrip("/"), ignore_eos, timeout_s

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        import urllib.request

        request = urllib.request.Request(f"{self.base_url}{path}", data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
        with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        self._post("/slots/0?action=erase")

    def request_body(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        return {"prompt": [int(t) for t in ids], "n_predict": int(max_new_tokens), "temperature": 0.0, "top_k": 1,
                "repeat_penalty": 1.0, "seed": 0, "cache_prompt": True, "ignore_eos": self.ignore_eos,
                "return_tokens": True, "id_slot": 0}  # fmt: skip

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        body = self.request_body(ids, max_new_tokens)
        t0 = time.perf_counter()
        response = self._post("/completion", body)
        return parse_completion(response, (time.perf_counter() - t0) * 1e3)


# ============================================================================================ the run
def compose_config(dtype: str, overrides: Sequence[str], **parts: Any) -> dict[str, Any]:
    """The project's run config (kvboost/configs/config.yaml, what ``python run.py`` uses) with overrides (and
    ``parts``: ``--kvboost-arg`` values, set as :func:`experiments.common.compose_run_config` sets them)."""
    from experiments.common import compose_run_config

    return compose_run_config(["logger=none", f"model.dtype={dtype}", *overrides], **parts)


def build_requests(
    engine: Any, workload_fields: dict[str, Any], orders: Sequence[str]
) -> dict[str, list[tuple[Any, list[int]]]]:
    """Per order, the replay's requests with their token ids (the engine's tokenizer, chat template)."""
    from kvboost.lab.workloads import WORKLOADS
    from kvboost.lab.workloads.base import WorkloadEnv

    if workload_fields.get("history_source", "dataset") != "dataset":
        raise ValueError("bench_peers replays the dataset's own history (workload.history_source=dataset)")
    env = WorkloadEnv(tokenizer=engine.tokenizer, count_tokens=lambda prompt: len(engine.tokenize(prompt)))
    out: dict[str, list[tuple[Any, list[int]]]] = {}
    for order in orders:
        workload = WORKLOADS.build({"name": "sharegpt_replay", **workload_fields, "interleave": order == "interleaved"},
                                   env=env)  # fmt: skip
        out[order] = [(request, engine.tokenize(request.prompt)) for request in workload.requests()]
    ids_by_order = [sorted((r.request_id, tuple(ids)) for r, ids in reqs) for reqs in out.values()]
    if any(x != ids_by_order[0] for x in ids_by_order):
        raise RuntimeError("the orders do not replay the same prompts")
    return out


def _llama_eog_ids(llm: Any) -> set[int]:
    import llama_cpp

    vocab = llm._model.vocab
    return {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def _llama_info(
    llm: Any, eos_ids: set[int], eog_ids: set[int], first_text: str, first_ids: list[int]
) -> dict[str, Any]:
    import llama_cpp

    own = llm.tokenize(first_text.encode("utf-8"), add_bos=False, special=True)
    return {
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "n_ctx": llm.n_ctx(), "n_vocab": llm.n_vocab(),
        "eog_ids": sorted(eog_ids), "kvboost_eos_ids": sorted(eos_ids),
        "own_tokenizer_matches_first_prompt": list(own) == list(first_ids),
    }  # fmt: skip


def _build_llama(model_path: str, n_ctx: int, threads: int, llama_args: dict[str, Any]) -> Any:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise SystemExit(f"llama-cpp-python is not installed ({exc}); install it with:\n  {LLAMA_INSTALL_HINT}\n"
                         "or leave the llama_cpp_* systems out (--systems hf_baseline,hf_prefix,kvboost)") from exc  # fmt: skip
    kwargs = {"n_ctx": n_ctx, "n_threads": threads, "n_threads_batch": threads, "seed": 0, "verbose": False}
    kwargs.update(llama_args)
    return Llama(model_path=model_path, **kwargs)


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    from kvboost.build import build_engine, engine_options
    from kvboost.lab.config_check import split_workload_config
    from kvboost.lab.environment import describe_environment
    from kvboost.lab.modes import MODES
    from kvboost.lab.runner import WARMUP_MESSAGES
    from kvboost.models.gguf_weights import weight_format_counts
    from kvboost.models.loading import bundled_gguf_path

    if args.systems is None:
        have = llama_cpp_available()
        if not have:
            print("llama-cpp-python is not installed: running llama_server in place of llama_cpp_prefix and "
                  "llama_cpp_ramcache")  # fmt: skip
        args.systems = ",".join(default_systems(have))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"unknown systems {unknown or systems}; choose from {', '.join(SYSTEMS)}")
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    if not orders or any(o not in ORDERS for o in orders):
        raise SystemExit(f"--orders takes {', '.join(ORDERS)}")
    torch.manual_seed(args.seed)
    from experiments.common import set_threads

    set_threads(args.threads)

    kvboost_args = parse_assignments(args.kvboost_arg)
    cfg = compose_config(args.dtype, args.override, **kvboost_args)
    _, workload_fields, _, _ = split_workload_config(cfg)
    workload_fields.update(num_conversations=args.num_conversations, max_turns=args.max_turns,
                           max_new_tokens=args.max_new_tokens, seed=args.seed)  # fmt: skip
    options = engine_options(cfg)  # for the report: what the engine was built with
    model_cfg = cfg.get("model") or {}
    t_load = time.perf_counter()
    engine = build_engine(cfg)
    load_s = time.perf_counter() - t_load
    servers = contextlib.ExitStack()  # llama_server's process: started once, stopped with the engine
    try:
        eos_ids = set(engine.eos_ids)  # before --ignore-eos empties the runners' sets
        requests = build_requests(engine, workload_fields, orders)
        first_request, first_ids = requests[orders[0]][0]
        max_len = max(len(ids) for reqs in requests.values() for _, ids in reqs)

        # ------------------------------------------------------------------ systems
        modes = {"hf_baseline": "baseline", "hf_prefix": "hf_prefix", "kvboost": "kvboost"}
        runners: dict[str, Any] = {}
        for s in systems:
            if s in modes:
                runners[s] = TorchSystem(s, MODES.get(modes[s])(engine), ignore_eos=args.ignore_eos)
        llama_info: dict[str, Any] = {}
        n_ctx = int(math.ceil((max_len + args.max_new_tokens + 64) / 256) * 256)
        gguf = args.gguf
        if any(s in LLAMA_SYSTEMS or s == SERVER_SYSTEM for s in systems) and not gguf:
            if model_cfg.get("name_or_path") is not None:
                raise SystemExit("a model other than the bundled one needs --gguf PATH for llama.cpp")
            gguf = str(bundled_gguf_path())
        if SERVER_SYSTEM in systems:
            from experiments.bench.peer_server import build_info, ensure_llama_server, start_llama_server

            binary = ensure_llama_server()
            slot_dir = servers.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-llama-slots-"))
            server = servers.enter_context(
                start_llama_server(binary, gguf, parallel=1, ctx=n_ctx, threads=args.threads,
                                   extra=llama_server_args(slot_dir))
            )  # fmt: skip
            runners[SERVER_SYSTEM] = LlamaServerSystem(server.base_url, ignore_eos=args.ignore_eos)
            llama_info.update(gguf=gguf, llama_server={"command": server.command, "log": str(server.log_path),
                                                       "build": build_info(binary)})  # fmt: skip
        if any(s in LLAMA_SYSTEMS for s in systems):
            llama_args = parse_assignments(args.llama_arg)
            eog: set[int] = set()
            for s in systems:
                if s not in LLAMA_SYSTEMS:
                    continue
                llm = _build_llama(gguf, n_ctx, args.threads, llama_args)
                eog = eog or _llama_eog_ids(llm)
                if s == "llama_cpp_prefix":
                    runners[s] = LlamaPrefixSystem(llm, eos_ids=eos_ids | eog, ignore_eos=args.ignore_eos)
                else:
                    runners[s] = LlamaRamCacheSystem(llm, capacity_bytes=int(args.ramcache_bytes), eog_ids=eog,
                                                     ignore_eos=args.ignore_eos)  # fmt: skip
                if "version" not in llama_info:
                    text = engine.tokenizer.apply_chat_template(first_request.prompt, add_generation_prompt=True,
                                                                tokenize=False)  # fmt: skip
                    llama_info.update(_llama_info(llm, eos_ids, eog, text, first_ids))
            llama_info.update(gguf=gguf, llama_args={"n_threads": args.threads, "n_threads_batch": args.threads,
                                                     "n_ctx": n_ctx, **llama_args})  # fmt: skip

        # ------------------------------------------------------------------ warm-up (never a measured prompt)
        warmup: dict[str, Any] = {}
        if hasattr(engine, "warmup"):
            t0 = time.perf_counter()
            returned = engine.warmup()
            warmup["engine_warmup_s"] = time.perf_counter() - t0
            warmup["engine_warmup_returned"] = (
                returned if isinstance(returned, (int, float, str, dict, list)) else repr(returned)
            )
        text_cfg = engine.model.config.get_text_config(decoder=True)
        t0 = time.perf_counter()
        engine.attention.warmup(
            num_q_heads=text_cfg.num_attention_heads,
            num_kv_heads=getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads,
            head_dim=getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads,
            dtype=engine.adapter.dtype, device=engine.adapter.device, max_len=max_len + args.max_new_tokens,
        )  # fmt: skip
        warmup["attention_warmup_s"] = time.perf_counter() - t0
        warm_ids = engine.tokenize(WARMUP_MESSAGES)
        replay_ids = {tuple(ids) for reqs in requests.values() for _, ids in reqs}
        assert tuple(warm_ids) not in replay_ids
        for s, runner in runners.items():
            t0 = time.perf_counter()
            runner.generate(list(warm_ids), args.max_new_tokens)
            warmup[f"{s}_warmup_request_s"] = time.perf_counter() - t0
            runner.reset()

        # ------------------------------------------------------------------ the replay, both orders
        records: list[dict[str, Any]] = []
        order_rng = random.Random(args.seed)
        # Other processes on the machine skew every system's times: the load and this process's share of the
        # CPU are recorded, so a run on a busy machine shows it.
        machine = {"loadavg_start": list(os.getloadavg()), "replay_wall_s": -time.perf_counter(),
                   "replay_cpu_s": -time.process_time()}  # fmt: skip
        total = sum(len(r) for r in requests.values()) * len(runners)
        with tqdm(total=total, desc="peers", unit="req") as progress:
            for order in orders:
                for runner in runners.values():  # every order starts from empty state
                    runner.reset()
                engine.reseed()
                for request, ids in requests[order]:
                    names = list(runners)
                    order_rng.shuffle(names)
                    for s in names:
                        records.append(
                            _record(s, order, request, ids, runners[s].generate(list(ids), args.max_new_tokens))
                        )
                        progress.update(1)
                    progress.set_postfix(order=order[:3], req=request.request_id[-12:])
                    for r in records[-len(names) :]:
                        r["loadavg_1m"] = os.getloadavg()[0]
        machine["replay_wall_s"] += time.perf_counter()
        machine["replay_cpu_s"] += time.process_time()
        machine["loadavg_end"] = list(os.getloadavg())
        machine["cpu_share_of_threads"] = machine["replay_cpu_s"] / machine["replay_wall_s"] / args.threads

        # ------------------------------------------------------------------ compute floor (kvboost)
        arch = Arch.from_model(engine.model)
        new_tokens = [r["prompt_tokens"] - r["reused_tokens"] for r in records if r["system"] == "kvboost"]
        rate: dict[str, Any] = {}
        if new_tokens:
            m = max(1, round(percentile(new_tokens, 50)))
            flops = measure_matmul_rate(m, arch.hidden, arch.intermediate, engine.adapter.dtype)
            others = {str(x): measure_matmul_rate(x, arch.hidden, arch.intermediate, engine.adapter.dtype) / 1e9
                      for x in (16, 64, 256, 1024) if x != m}  # fmt: skip
            rate = {"dtype": str(engine.adapter.dtype).replace("torch.", ""), "m": m, "k": arch.hidden,
                    "n": arch.intermediate, "flops_per_s": flops, "gflop_s": flops / 1e9, "other_m_gflop_s": others}  # fmt: skip
            add_floor(records, arch, flops)
        decode_info = engine.decode_info() if hasattr(engine, "decode_info") else {}
        linears = weight_format_counts(engine.model)
    finally:
        servers.close()
        engine.close()

    pair = ratio_pair(runners)
    notes = [
        (
            f"{len(requests[orders[0]])} requests per order ({args.num_conversations} conversations x up to "
            f"{args.max_turns} turns), {args.max_new_tokens} new tokens{' (EOS ignored)' if args.ignore_eos else ''}, "
            f"greedy; dtype {args.dtype} (kvboost and HF); llama.cpp on the Q4_1 GGUF; {args.threads} threads everywhere."
        ),
        (
            f"machine load (1 min) {machine['loadavg_start'][0]:.2f} at the start, {machine['loadavg_end'][0]:.2f} at the "
            f"end; this process used {machine['cpu_share_of_threads']:.0%} of {args.threads} cores' time during the replay"
            f"{' (other processes shared the CPU)' if machine['cpu_share_of_threads'] < 0.9 else ''}."
        ),
        "TTFT: token ids in -> first token id out for every system (prompts tokenized once, before timing).",
        (
            "hf_baseline / hf_prefix: HF's forward over the engine's own model object, so on the weights kvboost "
            f"loaded (linears by format: {json.dumps(linears)})."
        ),
        (
            f"kvboost engine options {json.dumps(options, default=str)}; decode {json.dumps(decode_info, default=str)}; "
            f"engine.warmup() {warmup.get('engine_warmup_s', 0.0):.1f} s (before timing)."
        ),
        f"{pair[0]} / {pair[1]}: per-request ratio of TTFT, median [min-max] across conversations.",
    ]
    if SERVER_SYSTEM in runners:
        notes.append(
            "llama_server: TTFT = the server's timings.prompt_ms (prompt processing to the first token, no HTTP); "
            "decode tok/s = (predicted_n - 1) / predicted_ms; one slot, cache_prompt, --cache-ram 0; the "
            "client's wall time per request is each record's server_wall_ms."
        )
    result = {
        "title": f"{args.dtype}, {'EOS ignored' if args.ignore_eos else 'stop at EOS'}",
        "command": command,
        "notes": notes,
        "config": {**vars(args), "engine_options": options, "workload": workload_fields},
        "environment": describe_environment(),
        "llama_cpp": llama_info,
        "kvboost": {
            "dtype": str(engine.adapter.dtype).replace("torch.", ""),
            "fingerprint": engine.fingerprint,
            "model_load_s": load_s,
            "extra_from_pretrained_kwargs": kvboost_args,
            "decode_info": decode_info,
        },
        "warmup": warmup,
        "machine_load": machine,
        "arch": arch.__dict__,
        "matmul_rate": rate,
        "systems": list(runners),
        "orders": orders,
        "by_turn": aggregate_by_turn(records),
        "overall": aggregate_overall(records),
        "ratio_pair": list(pair),
        "ratio_by_turn": ratio_by_turn(records, *pair),
        "floor_by_turn": floor_by_turn(records),
        "greedy_match": greedy_match(records, eos_ids),
        "records": records,
    }
    return result


def _json_default(x: Any) -> Any:
    if isinstance(x, (set, tuple)):
        return sorted(x) if isinstance(x, set) else list(x)
    return str(x)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-conversations", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="decode exactly --max-new-tokens tokens (EOS fed back; llama_cpp_ramcache masks it)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="kvboost engine and HF model dtype (llama.cpp runs the Q4_1 GGUF)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads = llama.cpp n_threads = n_threads_batch")
    p.add_argument("--systems", default=None,
                   help=f"comma list of {', '.join(SYSTEMS)} (default: all but llama_server, or all but the "
                        "llama_cpp_* ones when llama-cpp-python is missing)")  # fmt: skip
    p.add_argument("--orders", default=",".join(ORDERS), help="sequential,interleaved")
    p.add_argument(
        "--kvboost-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra kwarg of KVBoost.from_pretrained (repeatable), e.g. decode=compiled",
    )
    p.add_argument("--override", action="append", default=[], metavar="HYDRA_OVERRIDE",
                   help="override of the project's run config (repeatable), e.g. chunker.chunk_size=32, "
                        "workload.max_prompt_tokens=1024")  # fmt: skip
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra kwarg of llama_cpp.Llama (repeatable), e.g. flash_attn=true",
    )
    p.add_argument("--ramcache-bytes", type=float, default=float(2 << 30), help="LlamaRAMCache capacity (bytes)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the bundled one, for the bundled model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--name", default=None, help="output file stem (default peers_<dtype>)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    command = "python -m experiments.bench.bench_peers " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    result = run(args, command)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"peers_{args.dtype}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    report = markdown_report(result)
    (args.out / f"{stem}.md").write_text(report + "\n")
    print(report)
    print(f"results: {args.out / stem}.json, .md")
    return result


if __name__ == "__main__":
    main()
