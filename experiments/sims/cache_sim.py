"""Cache simulation: token hit ratio vs capacity for every eviction policy, on a ShareGPT trace, without a model.

Replays a request trace (``experiments/sims/token_trace.py``: real ShareGPT conversations, one request per turn,
``users`` conversations interleaved, token ids only) through the engine's own memory tier and request path,
tensor-free (``experiments/sims/pool_model.py``): since issue 42 the memory tier *is* the KV pool, so each run is
a real ``KVPool`` of ``--block-size``-token blocks on torch's meta device (the true shape ``[layers, kv_heads,
slots, head_dim]`` float32 of the bundled SmolLM2-135M, read from its ``config.json``: 46080 B/token, 737,280 B per
16-token block; no memory is used), a real ``PoolTier`` keeping at most ``capacity_bytes // block_bytes`` idle
cached blocks with the eviction policy under test, and a real ``KVStore`` over it.

Per request, what the engine core does for ``InferenceEngine.generate(mode="reuse")`` with its defaults
(``fixed`` chunker, ``sha256`` hasher, ``none`` quantizer, ``none`` recompute, a RoPE model so content lookups are
on), by ``PoolModel.serve``:

1. spans = ``chunker.split(ids)``, keys = ``hasher.chunk_keys(ids, spans, fingerprint)``;
2. ``lookup(ids, spans, keys, store, quantizer, max_reuse=n - 1, content=True)`` (exact hits referenced at once);
3. ``pool.reclaim(need)``, ``assemble_exact`` (cached blocks by reference, the partial last one copied on
   write), the prefill's ``prepare_write`` of the rest (rows after the first content hit are approximate: the
   ``none`` strategy recomputes no content hit);
4. ``store_sequence(prompt ids [+ generated], ...)`` (the engine's own) over runs of the request's blocks: the pool
   tier makes room for each chunk's blocks not cached yet by evicting idle entries in the policy's order (or refuses
   the chunk);
5. the request's blocks released.

Capacity is therefore whole blocks: a chunk's partial last block costs a whole block, and a block that two
entries index (a chunk not aligned to the blocks, a redundant sibling) is counted once. Before issue 42 the
memory tier was a byte budget of token-granular payloads (``MemoryTier``); ``experiments/results/cache_sim/
pool_tier/`` compares the two at equal bytes.

``--generated-tokens G`` appends G synthetic answer tokens per request (decode rows) to what is stored (the
engine stores the KV of its generated tokens, ``store_generated=True``); the next turn's prompt holds the
dataset's answer, not the model's, so these only take room. Default 0: prompts only.

Hit ratios: ``token_hit_ratio`` = exact-hit tokens / prompt tokens (KV equal to a cold prefill's; the metric
plotted); ``reuse_ratio`` = (exact + content) / prompt tokens, the engine's ``reuse_ratio``. With the fixed
chunker a segment is the whole prompt, so a content hit is a chunk whose whole prefix is identical but whose
exact chain has a gap (an ancestor evicted before it: ``leaves_first=false`` strands descendants).
``ideal`` is the same trace with an unbounded tier (a pool that holds the whole trace: no eviction): the upper
bound of every curve; its cached bytes (the trace's footprint, in blocks) set the default capacities,
log-spaced from a few conversations' worth to 80% of the footprint.

Usage::

    python -m experiments.sims.cache_sim --conversations 1000 --users 16 --out experiments/results/cache_sim
    python -m experiments.sims.cache_sim --conversations 50 --users 8 --out /tmp/sim --capacities 64MiB 1GiB \\
        --policies lru s3fifo s3fifo:small_ratio=0.3 --leaves-first true --block-size 16

Writes ``cache_sim.json`` (settings, trace summary, one record per run, curves) and ``hit_ratio.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from experiments.sims import pool_model
from experiments.sims.pool_model import PoolModel, blocks_to_hold
from kvboost.kv.pool import DEFAULT_BLOCK_SIZE
from kvboost.kv.sizing import parse_bytes
from kvboost.kv.sizing import MIN_WORKING_ROWS
from kvboost.registry import CHUNKERS, EVICTION, HASHERS, KV_QUANT

DEFAULT_POLICIES = ("lru", "lfu", "s3fifo")


class SimError(ValueError):
    """A bad setting or input, reported as one line by the CLI."""


def parse_policy(spec: str) -> tuple[str, dict[str, Any]]:
    """``"s3fifo"`` or ``"s3fifo:small_ratio=0.3,move_to_main_threshold=2"`` -> (name, constructor arguments);
    checked by building the policy once."""
    from kvboost.registry import UnknownPluginError

    name, _, rest = spec.partition(":")
    args: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SimError(f"policy {spec!r}: arguments are key=value pairs separated by commas")
        try:
            args[key.strip()] = json.loads(value.strip().lower() if value.strip().lower() in ("true", "false") else value)
        except json.JSONDecodeError:
            args[key.strip()] = value.strip()
    if "leaves_first" in args:
        raise SimError(f"policy {spec!r}: set leaves_first with --leaves-first")
    try:
        EVICTION.validate({"name": name, **args})
        EVICTION.build({"name": name, **args})  # its own value checks
    except UnknownPluginError as exc:
        raise SimError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise SimError(f"policy {spec!r}: {exc}") from None
    return name, args


# ---------------------------------------------------------------------------------------------- model shape
class KVShape(pool_model.KVShape):
    """The per-token KV layout of a model: what one cached token costs (``layers``, ``kv_heads``, ``head_dim``,
    ``dtype``; ``bytes_per_token``)."""

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> KVShape:
        text = config.get("text_config", config)
        try:
            layers = int(text["num_hidden_layers"])
            heads = int(text["num_attention_heads"])
            kv_heads = int(text.get("num_key_value_heads") or heads)
            head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError) as exc:
            raise SimError(f"model config lacks the KV shape ({exc}); pass the shape explicitly") from None
        return cls(layers, kv_heads, head_dim, dtype)


def bundled_kv_shape() -> tuple[KVShape, str]:
    """The bundled SmolLM2-135M's KV shape (fp32, the engine's default dtype) and the config file it came from."""
    from kvboost.models.loading import bundled_model_dir

    path = Path(bundled_model_dir()) / "config.json"
    return KVShape.from_config(json.loads(path.read_text())), str(path)


# ---------------------------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    policy: str
    leaves_first: bool | None  # None: the ideal run
    capacity_bytes: int | None  # None: unbounded
    capacity_tokens: float | None
    capacity_blocks: int | None = None  # idle cached blocks the tier keeps at most (capacity_bytes // block_bytes)
    block_size: int = DEFAULT_BLOCK_SIZE
    requests: int = 0
    prompt_tokens: int = 0
    exact_tokens: int = 0
    content_tokens: int = 0
    token_hit_ratio: float = 0.0
    reuse_ratio: float = 0.0
    stored: int = 0
    rejected: int = 0
    evicted: int = 0
    exact_hits: int = 0
    partial_hits: int = 0
    content_hits: int = 0
    misses: int = 0
    entries_at_end: int = 0
    used_blocks_at_end: int = 0  # cached blocks (all idle between requests)
    used_bytes_at_end: int = 0  # used_blocks_at_end x the model's block bytes
    cached_tokens_at_end: int = 0  # tokens of the cached entries (their rows' bytes: the pre-pool tier's measure)
    shared_blocks: int = 0  # blocks taken by reference at assembly, over the run
    copied_blocks: int = 0  # partial blocks copied on write, over the run
    orphans_at_end: int = 0  # resident exact entries whose parent is gone: unreachable by the exact walk
    seconds: float = 0.0
    us_per_request: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.leaves_first is None:
            return self.policy
        return f"{self.policy} (leaves_first={'true' if self.leaves_first else 'false'})"


class Simulator:
    """The engine's chunk, key, lookup, assembly and store path over one pool tier, request by request
    (``experiments/sims/pool_model.PoolModel``)."""

    def __init__(
        self,
        *,
        kv_shape: KVShape,
        chunk_size: int = 64,
        generated_tokens: int = 0,
        content: bool = True,
        vocab_size: int = 49152,
        salt: str = "",
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if generated_tokens < 0:
            raise SimError(f"generated_tokens must be >= 0, got {generated_tokens}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise SimError(f"block_size must be a positive integer, got {block_size!r}")
        self.kv_shape = kv_shape
        self.block_size = block_size
        self.chunker_spec = {"name": "fixed", "chunk_size": chunk_size}
        try:
            self.chunker = CHUNKERS.build(self.chunker_spec)
        except ValueError as exc:
            raise SimError(str(exc)) from None
        self.hasher = HASHERS.build("sha256")
        self.quantizer = KV_QUANT.build("none")
        self.generated_tokens = generated_tokens
        self.content = content
        self.vocab_size = vocab_size
        self.salt = salt
        # The engine's fingerprint has the same parts; the model part only has to be constant here.
        parts = [f"kvq={self.quantizer.fingerprint()}", f"chunk={self.chunker.fingerprint()}",
                 f"hash={self.hasher.fingerprint()}", f"block={block_size}"]  # fmt: skip
        self.fingerprint = "|".join(["cache_sim", *parts])
        self.root_key = self.hasher.root_key(self.fingerprint, salt)

    @property
    def block_bytes(self) -> int:
        """Bytes of one pool block of the model (K and V, every layer)."""
        return self.block_size * self.kv_shape.bytes_per_token

    def capacity_blocks(self, capacity_bytes: int) -> int:
        """Cached blocks a tier of ``capacity_bytes`` keeps."""
        return capacity_bytes // self.block_bytes

    def new_model(self, capacity_bytes: int | None, policy: str, leaves_first: bool, *, num_blocks: int | None = None,
                  working_rows: int = MIN_WORKING_ROWS, **policy_args: Any) -> PoolModel:  # fmt: skip
        """A fresh pool tier of ``capacity_bytes`` (None: unbounded, a pool of ``num_blocks``)."""
        eviction = EVICTION.build({"name": policy, "leaves_first": leaves_first, **policy_args})
        capacity = None if capacity_bytes is None else self.capacity_blocks(capacity_bytes)
        return PoolModel(capacity, block_size=self.block_size, num_blocks=num_blocks, working_rows=working_rows,
                         kv_shape=self.kv_shape, chunker=self.chunker_spec, hasher="sha256", eviction=eviction,
                         content=self.content, salt=self.salt, fingerprint=self.fingerprint)  # fmt: skip

    def generated(self, index: int) -> list[int]:
        """Request ``index``'s synthetic answer: ids the next turn's prompt (the dataset's answer) does not hold."""
        if not self.generated_tokens:
            return []
        rng = random.Random(index)
        return [rng.randrange(self.vocab_size) for _ in range(self.generated_tokens)]

    def request(self, model: PoolModel, index: int, ids: list[int]) -> pool_model.Served:
        """One request, as the engine core serves it (lookup, assembly, prefill, store, release)."""
        return model.serve(ids, self.generated(index))

    def run(
        self,
        trace: Sequence[Sequence[int]],
        *,
        policy: str,
        leaves_first: bool | None,
        capacity_bytes: int | None,
        check: bool = False,
        progress: Callable[[int], None] | None = None,
        **policy_args: Any,
    ) -> RunResult:
        """Replay ``trace`` (token ids per request) into a fresh pool tier; ``capacity_bytes=None``: unbounded.
        ``check`` verifies the pool's and the store's books after every request (slow; for tests)."""
        rows = [len(ids) + self.generated_tokens for ids in trace]
        working = max([MIN_WORKING_ROWS, *(r + 2 * self.block_size for r in rows)])
        model = self.new_model(capacity_bytes, policy, True if leaves_first is None else leaves_first,
                               num_blocks=blocks_to_hold(rows, self.block_size) if capacity_bytes is None else None,
                               working_rows=working, **policy_args)  # fmt: skip
        bpt = self.kv_shape.bytes_per_token
        result = RunResult(policy if leaves_first is not None else "ideal", leaves_first, capacity_bytes,
                           None if capacity_bytes is None else capacity_bytes / bpt,
                           None if capacity_bytes is None else self.capacity_blocks(capacity_bytes),
                           self.block_size)  # fmt: skip
        start = time.perf_counter()
        for i, ids in enumerate(trace):
            ids = list(ids)
            if len(ids) < 1:
                raise SimError(f"request {i} of the trace has no tokens")
            served = self.request(model, i, ids)
            result.requests += 1
            result.prompt_tokens += len(ids)
            result.exact_tokens += served.exact_tokens
            result.content_tokens += served.content_tokens
            result.shared_blocks += served.shared_blocks
            result.copied_blocks += served.copied_blocks
            if check:
                model.verify()
            if progress is not None:
                progress(1)
        result.seconds = time.perf_counter() - start
        result.us_per_request = 1e6 * result.seconds / max(result.requests, 1)
        store = model.store
        stats = store.stats
        for name in ("stored", "rejected", "evicted", "exact_hits", "partial_hits", "content_hits", "misses"):
            setattr(result, name, getattr(stats, name))
        result.token_hit_ratio = result.exact_tokens / max(result.prompt_tokens, 1)
        result.reuse_ratio = (result.exact_tokens + result.content_tokens) / max(result.prompt_tokens, 1)
        result.entries_at_end = len(store)
        result.used_blocks_at_end = model.used_blocks
        result.used_bytes_at_end = model.used_blocks * self.block_bytes
        result.cached_tokens_at_end = model.cached_tokens()
        result.orphans_at_end = self.orphans(store)
        return result

    def orphans(self, store: Any) -> int:
        """Resident exact entries whose parent is neither the root nor resident (stranded)."""
        count = 0
        for tier in store.tiers:
            for key in tier.keys():
                e = tier.peek(key)
                if e is not None and e.exact and e.parent_key != self.root_key and e.parent_key not in store:
                    count += 1
        return count


# ---------------------------------------------------------------------------------------------- sweep
def default_capacities(footprint_bytes: int, conversations: int, count: int = 5, low_conversations: float = 3.0,
                       high_fraction: float = 0.8) -> list[int]:  # fmt: skip
    """``count`` byte budgets log-spaced from ``low_conversations`` conversations' worth of the footprint to
    ``high_fraction`` of it."""
    if footprint_bytes <= 0:
        raise SimError("the trace stores nothing: no capacity to sweep")
    high = high_fraction * footprint_bytes
    low = min(low_conversations * footprint_bytes / max(conversations, 1), high / 4)
    if count == 1:
        return [int(high)]
    step = (math.log(high) - math.log(low)) / (count - 1)
    return [int(math.exp(math.log(low) + i * step)) for i in range(count)]


def sweep(
    trace: Sequence[Sequence[int]],
    sim: Simulator,
    *,
    policies: Iterable[str],
    leaves_first: Iterable[bool],
    capacities: Sequence[int] | None,
    conversations: int,
    check: bool = False,
    show_progress: bool = False,
) -> dict[str, Any]:
    """The ideal run, then every (policy, leaves_first, capacity); returns the JSON-ready result."""
    policies, leaves_first = list(policies), list(leaves_first)
    parsed = {spec: parse_policy(spec) for spec in policies}  # unknown names and arguments fail here
    total = len(trace) * (1 + len(policies) * len(leaves_first) * (len(capacities) if capacities else 5))
    bar = tqdm(total=total, desc="simulating", unit="req", disable=not show_progress, file=sys.stderr)
    try:
        bar.set_postfix_str("ideal")
        ideal = sim.run(trace, policy="lru", leaves_first=None, capacity_bytes=None, check=check, progress=bar.update)
        footprint = ideal.used_bytes_at_end
        caps = list(capacities) if capacities else default_capacities(footprint, conversations)
        runs: list[RunResult] = []
        for spec in policies:
            name, policy_args = parsed[spec]
            for lf in leaves_first:
                for cap in caps:
                    bar.set_postfix_str(f"{spec} leaves_first={lf} {cap / 2**20:.0f}MiB")
                    run = sim.run(trace, policy=name, leaves_first=lf, capacity_bytes=cap, check=check,
                                  progress=bar.update, **policy_args)  # fmt: skip
                    run.policy = spec
                    run.extra["policy_args"] = policy_args
                    runs.append(run)
    finally:
        bar.close()
    bpt = sim.kv_shape.bytes_per_token
    curves: dict[str, list[float]] = {}
    for r in runs:
        curves.setdefault(r.label, []).append(r.token_hit_ratio)
    sim_seconds = ideal.seconds + sum(r.seconds for r in runs)
    n_requests = ideal.requests + sum(r.requests for r in runs)
    return {
        "trace": {
            "requests": len(trace),
            "conversations": conversations,
            "prompt_tokens": ideal.prompt_tokens,
            "footprint_bytes": footprint,  # the unbounded tier's cached blocks x block bytes
            "footprint_tokens": footprint / bpt,
            "footprint_blocks": ideal.used_blocks_at_end,
            "footprint_cached_tokens": ideal.cached_tokens_at_end,  # tokens of its entries (no block rounding)
            "ideal_token_hit_ratio": ideal.token_hit_ratio,
            "ideal_reuse_ratio": ideal.reuse_ratio,
        },
        "capacities": [{"bytes": c, "tokens": c / bpt, "blocks": sim.capacity_blocks(c),
                        "fraction_of_footprint": c / footprint if footprint else None} for c in caps],  # fmt: skip
        "ideal": _record(ideal),
        "runs": [_record(r) for r in runs],
        "curves": curves,
        "timing": {
            "simulated_requests": n_requests,
            "simulation_seconds": sim_seconds,
            "us_per_request": 1e6 * sim_seconds / max(n_requests, 1),
        },
    }


def _record(r: RunResult) -> dict[str, Any]:
    out = asdict(r)
    out["label"] = r.label
    out.update(out.pop("extra"))
    return out


# ---------------------------------------------------------------------------------------------- outputs
def table(result: dict[str, Any]) -> str:
    """Markdown table: token hit ratio per policy (rows) and capacity (columns)."""
    caps = result["capacities"]
    head = ["policy"] + [f"{c['bytes'] / 2**20:,.0f} MiB ({c['tokens']:,.0f} tok, {c.get('blocks', 0):,} blocks, "
                         f"{c['fraction_of_footprint']:.1%})" for c in caps]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, values in result["curves"].items():
        lines.append("| " + " | ".join([label] + [f"{v:.3f}" for v in values]) + " |")
    ideal = f"{result['trace']['ideal_token_hit_ratio']:.3f}"
    lines.append("| " + " | ".join(["ideal (unbounded)"] + [ideal] * len(caps)) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    caps_mib = [c["bytes"] / 2**20 for c in result["capacities"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = {}
    for ax, metric, title in ((axes[0], "token_hit_ratio", "exact token hit ratio"),
                              (axes[1], "reuse_ratio", "exact + content (engine reuse_ratio)")):  # fmt: skip
        by_label: dict[str, list[float]] = {}
        style: dict[str, tuple[str, str]] = {}
        for r in result["runs"]:
            by_label.setdefault(r["label"], []).append(r[metric])
            color = colors.setdefault(r["policy"], f"C{len(colors)}")
            style[r["label"]] = (color, "-" if r["leaves_first"] else "--")
        for label, values in by_label.items():
            color, linestyle = style[label]
            ax.plot(caps_mib, values, marker="o", color=color, linestyle=linestyle, label=label)
        ax.axhline(result["ideal"][metric], color="black", linewidth=0.8, linestyle=":", label="ideal (unbounded)")
        ax.set_xscale("log")
        ax.set_xticks(caps_mib, [f"{c:,.0f}" for c in caps_mib])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("memory tier capacity (MiB)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of prompt tokens")
    axes[0].legend(fontsize=8)
    t = result["trace"]
    fig.suptitle(f"KV store hit ratio vs capacity: {t['requests']} requests, {t['conversations']} ShareGPT "
                 f"conversations, {result.get('settings', {}).get('users', '?')} users interleaved")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
def _bool_list(value: str) -> list[bool]:
    options = {"both": [True, False], "true": [True], "false": [False]}
    if value.lower() not in options:
        raise argparse.ArgumentTypeError(f"--leaves-first takes both, true or false, not {value!r}")
    return options[value.lower()]


def _positive_int(value: str) -> int:
    try:
        out = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if out < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return out


def _capacity(value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.sims.cache_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=_positive_int, required=True, help="ShareGPT conversations in the trace")
    p.add_argument("--users", type=_positive_int, required=True, help="conversations interleaved at a time")
    p.add_argument("--out", type=Path, required=True, help="output folder (created)")
    p.add_argument("--capacities", type=_capacity, nargs="+", default=None,
                   help="memory tier budgets (e.g. 64MiB 1GiB); default: 5 log-spaced from a few conversations' "
                        "worth to 80%% of the trace's footprint")  # fmt: skip
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                   help="eviction policies: EVICTION names, optionally with arguments (s3fifo:small_ratio=0.3)")
    p.add_argument("--leaves-first", type=_bool_list, default=[True, False], help="both (default), true or false")
    p.add_argument("--max-turns", type=_positive_int, default=8)
    p.add_argument("--min-turns", type=_positive_int, default=1)
    p.add_argument("--max-prompt-tokens", type=_positive_int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=_positive_int, default=64, help="the fixed chunker's chunk size")
    p.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens per KV pool block (the engine's kv.block_size; default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--generated-tokens", type=int, default=0,
                   help="synthetic answer tokens stored after each prompt (store_generated); default 0")  # fmt: skip
    p.add_argument("--no-content", action="store_true", help="exact lookups only (a model without RoPE)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.command = "python -m experiments.sims.cache_sim " + " ".join(argv)
    try:
        return _main(args)
    except SimError as exc:
        print(f"cache_sim: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args: argparse.Namespace) -> dict[str, Any]:
    for spec in args.policies:
        parse_policy(spec)  # before the trace is built
    if args.generated_tokens < 0:
        raise SimError(f"--generated-tokens must be >= 0, got {args.generated_tokens}")
    args.out.mkdir(parents=True, exist_ok=True)
    shape, config_path = bundled_kv_shape()

    from experiments.sims.token_trace import build_trace

    t0 = time.perf_counter()
    trace = build_trace(num_conversations=args.conversations, max_turns=args.max_turns, min_turns=args.min_turns,
                        interleave=True, users=args.users, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens,
                        chunker={"name": "fixed", "chunk_size": args.chunk_size},
                        progress=not args.no_progress)  # fmt: skip
    trace_seconds = time.perf_counter() - t0
    if not trace:
        raise SimError("the trace is empty (no conversation passed the filters)")
    conversations = len({r.conversation_id for r in trace})
    sim = Simulator(kv_shape=shape, chunk_size=args.chunk_size, generated_tokens=args.generated_tokens,
                    content=not args.no_content, block_size=args.block_size)  # fmt: skip
    result = sweep([r.token_ids for r in trace], sim, policies=args.policies, leaves_first=args.leaves_first,
                   capacities=args.capacities, conversations=conversations,
                   show_progress=not args.no_progress)  # fmt: skip
    result["settings"] = {
        "conversations": args.conversations, "users": args.users, "max_turns": args.max_turns,
        "min_turns": args.min_turns, "max_prompt_tokens": args.max_prompt_tokens, "seed": args.seed,
        "chunker": {"name": "fixed", "chunk_size": args.chunk_size}, "hasher": "sha256", "quant": "none",
        "recompute": "none", "content_lookups": not args.no_content, "generated_tokens": args.generated_tokens,
        "policies": args.policies, "leaves_first": args.leaves_first,
        "kv_shape": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                     "dtype": str(shape.dtype).removeprefix("torch.")},
        "bytes_per_token": shape.bytes_per_token, "model_config": config_path,
        "memory_tier": "pool (experiments/sims/pool_model.py)", "block_size": args.block_size,
        "block_bytes": sim.block_bytes,
        "command": args.command,
    }  # fmt: skip
    result["timing"]["trace_seconds"] = trace_seconds
    (args.out / "cache_sim.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "hit_ratio.png")
    timing = result["timing"]
    print(table(result))
    print(f"\ntrace: {len(trace)} requests ({result['trace']['prompt_tokens']:,} prompt tokens) from {conversations} "
          f"conversations in {trace_seconds:.1f} s; simulation: {timing['simulated_requests']:,} requests in "
          f"{timing['simulation_seconds']:.1f} s ({timing['us_per_request']:.0f} us/request)")  # fmt: skip
    print(f"wrote {args.out / 'cache_sim.json'} and {args.out / 'hit_ratio.png'}")
    return result


if __name__ == "__main__":
    main()
