"""Layer streaming on CPU: peak RSS and decode tok/s, fully resident vs half the layers streamed from mmap.

    python -m experiments.bench.bench_streaming                      # bundled SmolLM2 (fp32 folder) + its AWQ folder if made
    python -m experiments.bench.bench_streaming --repeats 3 --prompts 3 --new-tokens 32

Each (model, configuration, repeat) runs in a fresh subprocess, so ``ru_maxrss`` is that configuration's own peak;
configurations are interleaved (the order rotates every repeat) because the CPU is shared with other jobs. Every
configuration decodes the same real ShareGPT prompts (first user turns), greedy, ``mode="cold"``, through HF's
forward (``decode="hf"``: a streamed model cannot use the fused step, so the resident baseline uses the same path).

Configurations: ``resident`` (streaming off), ``half_prefetch`` (first half of the layers resident, the rest read
from the safetensors files through mmap into 2 slots, next layer prefetched on a thread), ``half_sync`` (same,
prefetch off), ``resident_lookup`` and ``half_prefetch_lookup`` (the same with ``speculative=prompt_lookup``: several
tokens per pass over the streamed weights), ``half_prefetch_repack`` / ``half_sync_repack`` (AWQ: ``prepack: false``,
AutoAWQ's tensors streamed and repacked for the int4 kernel per forward, instead of the prepacked sidecar; the
sidecar is written by one discarded run before the measured ones). ``--configs`` picks a subset. Every configuration's greedy tokens are compared with ``resident``'s. Results: ``experiments/results/streaming/bench_streaming.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
OUT = ROOT / "experiments" / "results" / "streaming"
CONFIGS = {
    "resident": None,
    "half_prefetch": {"resident_layers": "half", "prefetch": True, "slots": 2, "source": "mmap"},
    "half_sync": {"resident_layers": "half", "prefetch": False, "slots": 2, "source": "mmap"},
    "resident_lookup": None,
    "half_prefetch_lookup": {"resident_layers": "half", "prefetch": True, "slots": 2, "source": "mmap"},
    # AWQ without the prepacked sidecar (streaming.prepack false): AutoAWQ's tensors streamed, repacked per forward
    "half_prefetch_repack": {"resident_layers": "half", "prefetch": True, "slots": 2, "source": "mmap",
                             "prepack": False},
    "half_sync_repack": {"resident_layers": "half", "prefetch": False, "slots": 2, "source": "mmap", "prepack": False},
}
#: configurations that decode speculatively (draft strategy of kvboost.speculative): tokens per target forward,
#: i.e. per pass over the streamed weights, is what speculation buys a streamed model
SPECULATIVE = {"resident_lookup": "prompt_lookup", "half_prefetch_lookup": "prompt_lookup"}


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _current_rss_kib() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def prompts(n: int) -> list[list[dict[str, str]]]:
    from kvboost.lab.sharegpt_data import load_conversations

    convs = load_conversations(min_turns=1, max_turns=1, num_conversations=n, seed=0, max_user_chars=800)
    return [[{"role": "user", "content": c.turns[0].user}] for c in convs]


def child(args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    from kvboost.build import build_engine

    torch.set_num_threads(args.threads)  # not experiments.common: the measured child imports nothing extra
    msgs = prompts(args.prompts)
    # Import the modeling code (and build the architecture on meta) before the baseline: both paths pay that
    # (~200 MiB of code and shared libraries), it is not the weights.
    from transformers import AutoConfig, AutoModelForCausalLM

    import kvboost.models.awq  # noqa: F401

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    rss_before = _current_rss_kib()
    spec = CONFIGS[args.config]
    # The run config's parts spelled out, not composed by Hydra: the measured child imports nothing extra (its RSS
    # after imports is the baseline of the table); groups left out take the engine's defaults.
    cfg: dict = {"model": {"name_or_path": args.model, "dtype": args.dtype, "device": "cpu"}, "engine": {"decode": "hf"}}
    if spec is not None:
        layers = AutoConfig.from_pretrained(args.model).num_hidden_layers
        spec = {**spec, "resident_layers": layers // 2}
        cfg["streaming"] = spec
    if args.config in SPECULATIVE:
        cfg["speculative"] = SPECULATIVE[args.config]
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    load_s = time.perf_counter() - t0
    rss_loaded = _current_rss_kib()
    engine.generate("Hello", max_new_tokens=4, mode="cold")  # one unmeasured request (allocations, kernels)
    rates, tokens, per_forward, outputs = [], [], [], []
    for m in msgs:
        r = engine.generate(m, max_new_tokens=args.new_tokens, mode="cold")
        rates.append(r.tokens_per_sec)
        tokens.append(r.generated_tokens)
        outputs.append(r.output_ids)
        per_forward.append(r.extra.get("tokens_per_target_forward", 1.0))
    out = {
        "config": args.config, "model": args.model, "streaming": spec, "load_s": load_s,
        "rss_after_imports_mib": rss_before / 1024, "rss_after_load_mib": rss_loaded / 1024,
        "peak_rss_mib": _rss_kib() / 1024, "decode_tok_s": rates, "generated_tokens": tokens,
        "decode_tok_s_mean": statistics.fmean(rates), "decode_info": engine.decode_info(),
        "speculative": SPECULATIVE.get(args.config), "tokens_per_target_forward": statistics.fmean(per_forward),
        "output_ids": outputs,
        "fingerprint": engine.fingerprint,
    }  # fmt: skip
    if engine.streamer is not None:
        out["streamer"] = engine.streamer.info()
        out["plan"] = engine.model._kvboost_streaming_plan.describe()
        out["prepacked"] = getattr(engine.model, "_kvboost_streaming_prepacked", None)
    return out


def models(args: argparse.Namespace) -> dict[str, str]:
    from kvboost.models.loading import bundled_model_dir
    from kvboost.paths import kvboost_cache_dir

    found = {"smollm2_fp32": str(bundled_model_dir())}
    for name in ("smollm2-135m-instruct-awq-g64", "smollm2-135m-instruct-rtn-g64"):
        folder = kvboost_cache_dir() / "models" / name
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            found["smollm2_" + name.split("-")[-2]] = str(folder)
            break
    if args.models:
        found = {k: v for k, v in found.items() if any(k.endswith(m) for m in args.models.split(","))}
    return found


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for model in dict.fromkeys(r["model_label"] for r in runs):
        for config in CONFIGS:
            rs = [r for r in runs if r["model_label"] == model and r["config"] == config]
            if not rs:
                continue
            rates = [r["decode_tok_s_mean"] for r in rs]
            peaks = [r["peak_rss_mib"] for r in rs]
            model_rss = [r["peak_rss_mib"] - r["rss_after_imports_mib"] for r in rs]
            rows.append({
                "model": model, "config": config, "repeats": len(rs),
                "peak_rss_mib_median": statistics.median(peaks), "peak_rss_mib_min": min(peaks), "peak_rss_mib_max": max(peaks),
                "model_rss_mib_median": statistics.median(model_rss),
                "decode_tok_s_median": statistics.median(rates), "decode_tok_s_min": min(rates), "decode_tok_s_max": max(rates),
                "planned_total_mib": rs[0].get("plan", {}).get("total_bytes", 0) / 2**20 or None,
                "load_wait_s": statistics.median([r.get("streamer", {}).get("wait_s", 0.0) for r in rs]),
                "tokens_per_target_forward": statistics.median([r.get("tokens_per_target_forward", 1.0) for r in rs]),
                # greedy tokens equal to the resident, plain-decoding run of the same model and repeat
                "same_tokens_as_resident": all(r.get("output_ids") == _resident_ids(runs, r) for r in rs),
            })  # fmt: skip
    return rows


def _resident_ids(runs: list[dict], run: dict) -> list | None:
    for r in runs:
        if r["model_label"] == run["model_label"] and r["config"] == "resident" and r.get("repeat") == run.get("repeat"):
            return r.get("output_ids")
    return None


def markdown(command: str, rows: list[dict], meta: dict) -> str:
    lines = [
        f"Command: `{command}`", "",
        (f"Host: {meta['cpus']} CPUs (shared with other jobs), torch threads {meta['threads']}, dtype {meta['dtype']}, "
         f"{meta['prompts']} ShareGPT prompts x {meta['new_tokens']} new tokens, greedy, decode=hf, {meta['repeats']} "
         "repeats, each configuration in a fresh subprocess, order rotated per repeat."), "",
        ("`model RSS` = peak RSS minus the RSS after imports (torch, transformers, the modeling code, the prompts): "
         "the model's weights, staging slots, KV, activations and the loader's transients. Decode tok/s: median over "
         "repeats of the per-run mean [min, max]."), "",
        ("| model | config | peak RSS MiB (median [min, max]) | model RSS MiB | decode tok/s (median [min, max]) | "
         "time waiting for loads s | tokens per target forward | same tokens as resident |"),
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['config']} | {r['peak_rss_mib_median']:.0f} [{r['peak_rss_mib_min']:.0f}, "
            f"{r['peak_rss_mib_max']:.0f}] | {r['model_rss_mib_median']:.0f} | {r['decode_tok_s_median']:.1f} "
            f"[{r['decode_tok_s_min']:.1f}, {r['decode_tok_s_max']:.1f}] | {r['load_wait_s']:.2f} | "
            f"{r['tokens_per_target_forward']:.2f} | {'yes' if r['same_tokens_as_resident'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--models", default="", help="comma-separated suffixes of model labels (fp32, awq, rtn)")
    parser.add_argument("--tag", default="", help="suffix of the result files (bench_streaming_<tag>.json/.md)")
    parser.add_argument("--configs", default="", help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    command = "python -m experiments.bench.bench_streaming " + " ".join(argv if argv is not None else sys.argv[1:])
    found = models(args)
    runs = []
    names = [c.strip() for c in args.configs.split(",") if c.strip()] or list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")

    def run_child(path: str, config: str, label: str) -> dict:
        cmd = [sys.executable, "-m", "experiments.bench.bench_streaming", "--child", "--model", path, "--config", config, "--prompts",
               str(args.prompts), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
               "--dtype", args.dtype]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"{label}/{config} failed:\n{proc.stderr[-3000:]}")
        return json.loads(line[len("RESULT ") :])

    # One discarded streamed run per model first: it writes the AWQ prepack sidecar (once per weights and dtype),
    # so no measured run pays for it.
    for label, path in found.items():
        if "half_prefetch" in CONFIGS:
            run_child(path, "half_prefetch", label)
    from experiments.common import rotated  # here, not at the top: the measured children import nothing extra

    for rep in range(args.repeats):
        for label, path in found.items():
            for config in rotated(names, rep):
                run = {**run_child(path, config, label), "model_label": label, "repeat": rep}
                runs.append(run)
                print(f"[{rep}] {label:14s} {config:14s} peak RSS {run['peak_rss_mib']:.0f} MiB, "
                      f"decode {run['decode_tok_s_mean']:.1f} tok/s", flush=True)  # fmt: skip
                write(command, runs, args, found)  # after every run: a cut-short benchmark keeps what it measured
    print(write(command, runs, args, found))


def write(command: str, runs: list[dict], args: argparse.Namespace, found: dict[str, str]) -> str:
    rows = summarize(runs)
    meta = {"cpus": os.cpu_count(), "threads": args.threads, "dtype": args.dtype, "prompts": args.prompts,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "models": found}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "bench_streaming" + (f"_{args.tag}" if args.tag else "")
    (OUT / f"{stem}.json").write_text(json.dumps({"command": command, **meta, "summary": rows, "runs": runs}, indent=1))
    text = markdown(command, rows, meta)
    (OUT / f"{stem}.md").write_text(text)
    return text

if __name__ == "__main__":
    main()
