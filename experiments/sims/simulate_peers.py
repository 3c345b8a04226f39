"""Other engines' prefix / chunk reuse, simulated on the ShareGPT token trace at equal cache capacity (in tokens).

    python -m experiments.sims.simulate_peers --conversations 200 --users 8 --capacity-tokens 8192 \\
        --out experiments/results/simulated_peers --max-turns 8

Each simulator replays the trace one request at a time: ``serve(token_ids)`` returns how many prompt tokens the
system would serve from its cache, then puts the request's prompt into the cache (evicting what its policy
evicts to stay within ``capacity_tokens``). Reuse ratio = reused prompt tokens / prompt tokens, as the engine's
``reuse_ratio`` (DESIGN.md, Metrics); reported token-weighted over all requests (``overall``) and per turn
number (``by_turn``), for both replay orders of ``experiments/sims/token_trace.py``: ``sequential`` (one conversation
after another) and ``interleaved`` (turn t of ``users`` conversations before turn t+1).

Systems (``SYSTEMS``); what each models, and from where:

- ``vllm``: automatic prefix caching, vLLM v1 (``docs/design/prefix_caching.md`` and
  ``vllm/v1/core/kv_cache_manager.py`` in vllm-project/vllm): 16-token blocks; a block's hash chains its
  parent's hash and its tokens; only full blocks are cached and hit; the hit is capped at ``len - 1`` tokens
  (``max_cache_hit_length = request.num_tokens - 1``) and counted in whole blocks. Blocks live in a free queue
  (head = least recently used); a request's hit blocks leave the queue while it runs, its new blocks are
  popped from the head (evicting the cached block there), and when it finishes all its blocks go back to the
  tail in *reverse* order, so among equally recent blocks a chain's tail is evicted first. Duplicate blocks
  (a full block recomputed although its hash is cached) are kept, as in v1.
- ``sglang``: RadixAttention (``python/sglang/srt/mem_cache/radix_cache.py`` in sgl-project/sglang,
  page size 1): token-level longest prefix match over ``len - 1`` tokens (``Req.adjust_max_prefix_ids``;
  ``_compute_max_prefix_len`` in newer versions), nodes split where a match ends; before a request runs, its
  ``len - matched`` new tokens are taken from the pool, evicting whole unlocked leaves by least recent access
  (a parent becomes evictable when its last child goes); the matched path is locked meanwhile; then the prompt
  is inserted.
- ``lmcache``: LMCache's ``ChunkedTokenDatabase`` (``lmcache/v1/token_database.py``): 256-token chunks keyed by a
  prefix-chained hash; ``save_unfull_chunk`` (default False, per ``docs/source/api_reference/configurations.rst``
  and ``lmcache/v1/config.py``) stores the last partial chunk too. Lookup walks the chunks from the start and
  stops at the first miss; plain LRU over chunks (``cache_policy/lru.py``: hits move to the end, eviction from
  the front, no leaves-first protection, so evicting a chain's first chunk strands the rest). A full-prompt hit
  is capped at ``len - 1`` (the vLLM connector recomputes the last token). Simulated as the only cache (vLLM's
  own prefix cache under it is not modelled).
- ``llamacpp``: llama.cpp server, one slot with ``cache_prompt``: reuse = common prefix with the slot's
  previous prompt, capped at ``len - 1`` ("we have to evaluate at least 1 token to generate logits",
  the server's ``server.cpp``); the slot keeps at most ``capacity_tokens`` tokens. ``--cache-reuse`` (KV
  shifting) and the host-memory prompt cache of recent versions are not modelled.
- ``kvboost``: the real thing, not a re-implementation (``experiments/sims/pool_model.py``): the engine's memory
  tier is its KV pool (issue 42), so the simulator runs a real ``KVPool`` (16-token blocks, meta tensors: no
  memory), a real ``PoolTier`` keeping at most ``capacity_tokens // 16`` idle cached blocks with ``lru`` eviction
  (``leaves_first``), a real ``KVStore`` over it, the engine's chunker (``fixed``, ``chunk_size`` 64) and hasher
  (``sha256``), and per request the engine core's book operations: the real ``kvboost.lookup.lookup`` (exact
  walk, token-level frontier match, content hits; ``max_reuse = len - 1``; hits referenced at once),
  ``pool.reclaim``, ``assemble_exact`` (shared blocks by reference, the partial last block copied on write), the
  prefill's ``prepare_write``, the engine's own ``kvboost.cache.sequence_store.store_sequence`` over runs of the
  request's blocks (partial last chunk stored, a shorter partial sibling dropped; the pool tier evicts idle entries
  in eviction order to make room, or refuses the chunk), then release. Hits are token-level; capacity is counted in whole blocks (a partial last
  block costs a block, a block two chunks share counts once), like vLLM's. ``recompute=none``: a content hit's
  successors are stored under segment keys only, as the engine does. ``tests/test_simulate_peers.py`` checks it
  against ``InferenceEngine.generate`` request by request (reuse, store counters, cached blocks). As in the
  engine, the capacity bounds the *cached* blocks kept between requests; the running request's own blocks are
  the pool's working set on top (vLLM's capacity here counts them too: its new blocks evict cached ones).

Common approximations: one request at a time (no batching, so nothing is shared or pinned between concurrent
requests); prompt tokens only, for every system: with dataset history the generated tokens never appear in a
later prompt, so they could only take capacity (all engines would store them; the engine's
``store_generated``); of a prompt longer than the whole cache, vLLM, SGLang, llama.cpp and kvboost keep the
leading part, LMCache (plain LRU while it stores) the last chunks (the engines themselves would refuse or
truncate such a prompt). Block / chunk hashes other than kvboost's are Python's ``hash`` of (parent hash, token
tuple): deterministic across processes for ints, collisions negligible at this scale.

Written into ``--out``: ``simulated_reuse.json`` (``{order: {system: {"overall": r, "by_turn": {turn: r}}}}``
and nothing else), ``simulated_reuse_meta.json`` (settings, trace statistics, timings), ``simulated_reuse.md``
(tables) and ``simulated_reuse.png`` (reuse by turn per system, one panel per order).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from experiments.sims.pool_model import PoolModel
from kvboost.cache.sequence_store import common_prefix_length

SYSTEMS: tuple[str, ...] = ("vllm", "sglang", "lmcache", "llamacpp", "kvboost")
ORDERS: tuple[str, ...] = ("sequential", "interleaved")

VLLM_BLOCK_SIZE = 16
LMCACHE_CHUNK_SIZE = 256
LMCACHE_SAVE_UNFULL_CHUNK = False  # LMCache's default (configurations.rst, lmcache/v1/config.py)
KVBOOST_CHUNK_SIZE = 64
KVBOOST_BLOCK_SIZE = 16  # the engine's kv.block_size default


class ReuseSimulator(Protocol):
    """One system's cache: ``serve`` returns the reused prompt tokens of a request, then caches its prompt."""

    name: str
    capacity_tokens: int

    def serve(self, token_ids: Sequence[int]) -> int: ...


def _check_capacity(name: str, capacity_tokens: object, minimum: int = 1, unit: str = "") -> int:
    if not isinstance(capacity_tokens, int) or isinstance(capacity_tokens, bool) or capacity_tokens < minimum:
        what = f" (at least {minimum} tokens{unit})" if minimum > 1 else ""
        raise ValueError(f"{name}: capacity_tokens must be a positive integer{what}, got {capacity_tokens!r}")
    return capacity_tokens


def _reuse_cap(n: int) -> int:
    """Every engine computes at least the last prompt token (its logits give the first output token)."""
    return max(n - 1, 0)


def _chained_hashes(ids: Sequence[int], size: int, end: int) -> list[tuple[int, int, int]]:
    """``(start, end, hash)`` of ``ids[0:end]`` cut every ``size`` tokens, each hash chained on the previous."""
    out, parent = [], 0
    for start in range(0, end, size):
        stop = min(start + size, end)
        parent = hash((parent, tuple(ids[start:stop])))
        out.append((start, stop, parent))
    return out


# ------------------------------------------------------------------------------------------------ vLLM
class VLLMPrefixCache:
    """vLLM v1 automatic prefix caching over ``capacity_tokens // block_size`` blocks (see the module docstring).

    Eviction order: the free queue's head is the least recently used block. A finished request's blocks are
    appended to the tail last block first, so of one chain the deepest block is evicted first and the root
    last; a later hit takes its blocks out of the queue, and they come back at the tail when it finishes.
    """

    name = "vllm"

    def __init__(self, capacity_tokens: int, block_size: int = VLLM_BLOCK_SIZE) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"vllm: block_size must be a positive integer, got {block_size!r}")
        self.capacity_tokens = _check_capacity(self.name, capacity_tokens, block_size,
                                               f": one {block_size}-token block")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))  # head = LRU
        self._block_hash: list[int | None] = [None] * self.num_blocks
        self._cached: dict[int, dict[int, None]] = {}  # block hash -> physical blocks holding it (duplicates kept)

    def serve(self, token_ids: Sequence[int]) -> int:
        n, bs = len(token_ids), self.block_size
        full = _chained_hashes(token_ids, bs, n - n % bs)
        hits: list[int] = []
        for start, stop, h in full:
            if stop > _reuse_cap(n) or h not in self._cached:
                break
            hits.append(next(iter(self._cached[h])))
        for block in hits:  # in use: out of the free queue (touched)
            self._free.pop(block, None)
        blocks = list(hits)
        for i in range(len(hits), math.ceil(n / bs)):
            if not self._free:
                break  # the prompt is longer than the cache: only its leading blocks are kept
            block, _ = self._free.popitem(last=False)
            old = self._block_hash[block]
            if old is not None:  # evict the cached block at the head
                holders = self._cached[old]
                del holders[block]
                if not holders:
                    del self._cached[old]
                self._block_hash[block] = None
            if i < len(full):  # a full block: cached (under its hash, even if another block holds it)
                h = full[i][2]
                self._block_hash[block] = h
                self._cached.setdefault(h, {})[block] = None
            blocks.append(block)
        for block in reversed(blocks):  # freed in reverse order: the chain's tail is evicted first
            self._free[block] = None
        return len(hits) * bs


# ------------------------------------------------------------------------------------------------ SGLang
class _RadixNode:
    __slots__ = ("children", "id", "key", "last_access", "lock", "parent")

    def __init__(self, key: tuple[int, ...], parent: _RadixNode | None, node_id: int, last_access: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _RadixNode] = {}
        self.id = node_id
        self.last_access = last_access
        self.lock = 0


class SGLangRadixCache:
    """SGLang's radix cache (page size 1, LRU), ``capacity_tokens`` tokens in the pool (see the module docstring).

    Access times are a logical clock (one tick per match or insert, like SGLang's one ``time.monotonic()`` per
    walk); ties between leaves go to the older node.
    """

    name = "sglang"

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = _check_capacity(self.name, capacity_tokens)
        self._ids = 0
        self._clock = 0
        self.root = self._node((), None)
        self.size = 0  # tokens in the tree
        self._leaves: set[_RadixNode] = set()

    def _node(self, key: tuple[int, ...], parent: _RadixNode | None) -> _RadixNode:
        self._ids += 1
        return _RadixNode(key, parent, self._ids, self._clock)

    def _walk(self, ids: Sequence[int], limit: int) -> tuple[int, _RadixNode]:
        """Longest cached prefix of ``ids[:limit]``: (its length, its last node); splits a node the match ends
        inside, and marks the path accessed."""
        self._clock += 1
        node, i = self.root, 0
        node.last_access = self._clock
        while i < limit:
            child = node.children.get(ids[i])
            if child is None:
                break
            child.last_access = self._clock
            common = common_prefix_length(child.key, ids[i:limit])
            i += common
            if common < len(child.key):
                node = self._split(child, common)
                break
            node = child
        return i, node

    def _split(self, child: _RadixNode, at: int) -> _RadixNode:
        parent = child.parent
        assert parent is not None
        mid = self._node(child.key[:at], parent)
        mid.lock, mid.last_access = child.lock, child.last_access
        parent.children[mid.key[0]] = mid
        child.key, child.parent = child.key[at:], mid
        mid.children[child.key[0]] = child
        return mid

    def _lock(self, node: _RadixNode, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            node = node.parent  # type: ignore[assignment]

    def _evict(self, num_tokens: int) -> None:
        heap = [(leaf.last_access, leaf.id, leaf) for leaf in self._leaves if leaf.lock == 0]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._leaves.discard(leaf)
            self.size -= len(leaf.key)
            evicted += len(leaf.key)
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock == 0:
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _insert(self, ids: Sequence[int]) -> None:
        matched, node = self._walk(ids, len(ids))
        if matched < len(ids):
            leaf = self._node(tuple(ids[matched:]), node)
            node.children[leaf.key[0]] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self.size += len(leaf.key)

    def serve(self, token_ids: Sequence[int]) -> int:
        n = len(token_ids)
        matched, last = self._walk(token_ids, _reuse_cap(n))
        self._lock(last, +1)
        need, free = n - matched, self.capacity_tokens - self.size
        if need > free:
            self._evict(need - free)
        keep = matched + min(need, self.capacity_tokens - self.size)
        self._insert(token_ids[:keep])
        self._lock(last, -1)
        return matched


# ------------------------------------------------------------------------------------------------ LMCache
class LMCacheChunks:
    """LMCache: prefix-hashed ``chunk_size`` chunks under plain LRU, ``capacity_tokens`` tokens (see the module
    docstring). An unfull chunk (``save_unfull_chunk``) weighs its own token count."""

    name = "lmcache"

    def __init__(
        self,
        capacity_tokens: int,
        chunk_size: int = LMCACHE_CHUNK_SIZE,
        save_unfull_chunk: bool = LMCACHE_SAVE_UNFULL_CHUNK,
    ) -> None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"lmcache: chunk_size must be a positive integer, got {chunk_size!r}")
        self.capacity_tokens = _check_capacity(self.name, capacity_tokens, chunk_size,
                                               f": one {chunk_size}-token chunk")
        self.chunk_size = chunk_size
        self.save_unfull_chunk = bool(save_unfull_chunk)
        self._lru: OrderedDict[int, int] = OrderedDict()  # chunk hash -> tokens; front = least recently used
        self.used = 0

    def serve(self, token_ids: Sequence[int]) -> int:
        n = len(token_ids)
        end = n if self.save_unfull_chunk else n - n % self.chunk_size
        chunks = _chained_hashes(token_ids, self.chunk_size, end)
        hit = 0
        for _, stop, h in chunks:
            if h not in self._lru:
                break
            self._lru.move_to_end(h)
            hit = stop
        for start, stop, h in chunks:  # store what is missing (already stored chunks are skipped, not touched)
            if h in self._lru:
                continue
            size = stop - start
            while self.used + size > self.capacity_tokens and self._lru:
                _, freed = self._lru.popitem(last=False)
                self.used -= freed
            self._lru[h] = size
            self.used += size
        return min(hit, _reuse_cap(n))


# ------------------------------------------------------------------------------------------------ llama.cpp
class LlamaCppSlot:
    """llama.cpp server, one slot with ``cache_prompt``: the previous prompt (at most ``capacity_tokens``)."""

    name = "llamacpp"

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = _check_capacity(self.name, capacity_tokens)
        self._slot: tuple[int, ...] = ()

    def serve(self, token_ids: Sequence[int]) -> int:
        reused = min(common_prefix_length(self._slot, token_ids), _reuse_cap(len(token_ids)))
        self._slot = tuple(token_ids[: self.capacity_tokens])
        return reused


# ------------------------------------------------------------------------------------------------ kvboost
class KVBoostStore:
    """kvboost's real memory tier, lookup and store path, tensor-free (``experiments/sims/pool_model.py``; see the
    module docstring): the pool's blocks are the cache, ``capacity_tokens // block_size`` cached blocks at most,
    made room for in eviction order as each chunk is stored, as the engine does.

    Args:
        capacity_tokens: the cache's budget in tokens (whole blocks: ``capacity_tokens // block_size`` of them).
        chunk_size: the ``fixed`` chunker's size (ignored when ``chunker`` is given).
        block_size: tokens per KV pool block (the engine's ``kv.block_size``, default 16).
        chunker, hasher, eviction: plugin specs as ``InferenceEngine`` takes them.
        content: look up content hits after the exact frontier (the engine does when the model's RoPE allows).
        num_blocks: the pool's size (default: the capacity plus the engine's minimum working set); a test passes
            the engine's own.
    """

    name = "kvboost"

    def __init__(
        self,
        capacity_tokens: int,
        chunk_size: int = KVBOOST_CHUNK_SIZE,
        *,
        block_size: int = KVBOOST_BLOCK_SIZE,
        chunker: Any = None,
        hasher: Any = "sha256",
        eviction: Any = None,
        content: bool = True,
        num_blocks: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"kvboost: block_size must be a positive integer, got {block_size!r}")
        self.capacity_tokens = _check_capacity(self.name, capacity_tokens, block_size,
                                               f": one {block_size}-token block")  # fmt: skip
        self.model = PoolModel(capacity_tokens // block_size, block_size=block_size, num_blocks=num_blocks,
                               chunker=chunker if chunker is not None else {"name": "fixed", "chunk_size": chunk_size},
                               hasher=hasher, eviction=eviction, content=content)  # fmt: skip
        self.store, self.pool, self.chunker = self.model.store, self.model.pool, self.model.chunker

    @property
    def used_blocks(self) -> int:
        """Idle cached blocks (between requests: every cached block)."""
        return self.model.used_blocks

    def serve(self, token_ids: Sequence[int]) -> int:
        return self.model.serve(token_ids).reused_tokens


# ------------------------------------------------------------------------------------------------ replay
def build_simulator(
    name: str,
    capacity_tokens: int,
    *,
    chunk_size: int = KVBOOST_CHUNK_SIZE,
    lmcache_save_unfull_chunk: bool = LMCACHE_SAVE_UNFULL_CHUNK,
) -> ReuseSimulator:
    """A fresh simulator of ``name`` (one of ``SYSTEMS``); ``chunk_size`` is kvboost's."""
    if name == "vllm":
        return VLLMPrefixCache(capacity_tokens)
    if name == "sglang":
        return SGLangRadixCache(capacity_tokens)
    if name == "lmcache":
        return LMCacheChunks(capacity_tokens, save_unfull_chunk=lmcache_save_unfull_chunk)
    if name == "llamacpp":
        return LlamaCppSlot(capacity_tokens)
    if name == "kvboost":
        return KVBoostStore(capacity_tokens, chunk_size)
    raise ValueError(f"unknown system {name!r}; use one of {', '.join(SYSTEMS)}")


def replay(simulator: ReuseSimulator, prompts: Iterable[Sequence[int]], *, progress: bool = False,
           desc: str | None = None) -> list[int]:  # fmt: skip
    """Reused prompt tokens of each prompt, served in order."""
    prompts = list(prompts)
    bar = tqdm(prompts, desc=desc or simulator.name, unit="req", disable=not progress, leave=False)
    return [simulator.serve(ids) for ids in bar]


def summarize(turns: Sequence[int], prompt_tokens: Sequence[int], reused: Sequence[int]) -> dict[str, Any]:
    """``{"overall": ratio, "by_turn": {turn: ratio}}``, token-weighted (reused tokens / prompt tokens)."""
    if not (len(turns) == len(prompt_tokens) == len(reused)):
        raise ValueError("turns, prompt_tokens and reused must have one entry per request")
    num, den = defaultdict(int), defaultdict(int)
    for t, n, r in zip(turns, prompt_tokens, reused):
        num[int(t)] += r
        den[int(t)] += n
    total = sum(den.values())
    return {
        "overall": sum(num.values()) / total if total else 0.0,
        "by_turn": {t: num[t] / den[t] if den[t] else 0.0 for t in sorted(den)},
    }


def simulate_trace(
    trace: Sequence[Any],
    capacity_tokens: int,
    *,
    systems: Sequence[str] = SYSTEMS,
    factory: Callable[[str], ReuseSimulator] | None = None,
    progress: bool = False,
    desc: str = "",
) -> dict[str, dict[str, Any]]:
    """Every system's ``summarize`` on one trace (``TraceRequest``s: ``turn``, ``token_ids``), each from an
    empty cache. ``factory(name)`` builds a simulator (default ``build_simulator(name, capacity_tokens)``)."""
    build = factory or (lambda name: build_simulator(name, capacity_tokens))
    turns = [r.turn for r in trace]
    lengths = [len(r.token_ids) for r in trace]
    out = {}
    for name in systems:
        reused = replay(build(name), (r.token_ids for r in trace), progress=progress, desc=f"{desc}{name}")
        out[name] = summarize(turns, lengths, reused)
    return out


def trace_stats(trace: Sequence[Any]) -> dict[str, Any]:
    """Size of a trace: requests, conversations, prompt tokens, and requests / tokens per turn."""
    per_turn_n, per_turn_tokens = defaultdict(int), defaultdict(int)
    last: dict[str, int] = {}
    for r in trace:
        per_turn_n[r.turn] += 1
        per_turn_tokens[r.turn] += len(r.token_ids)
        last[r.conversation_id] = len(r.token_ids)
    finals = sorted(last.values())
    return {
        "requests": len(trace),
        "conversations": len(last),
        "prompt_tokens": sum(per_turn_tokens.values()),
        "max_prompt_tokens": max((len(r.token_ids) for r in trace), default=0),
        "last_prompt_tokens_mean": sum(finals) / len(finals) if finals else 0.0,
        "last_prompt_tokens_median": finals[len(finals) // 2] if finals else 0,
        "requests_by_turn": {t: per_turn_n[t] for t in sorted(per_turn_n)},
        "prompt_tokens_by_turn": {t: per_turn_tokens[t] for t in sorted(per_turn_tokens)},
    }


# ------------------------------------------------------------------------------------------------ outputs
def render_markdown(results: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    orders = [o for o in ORDERS if o in results] + [o for o in results if o not in ORDERS]
    systems = list(dict.fromkeys(s for o in orders for s in results[o]))
    s = meta.get("settings", {})
    lines = [
        "# Simulated prefix / chunk reuse of other engines",
        "",
        f"ShareGPT trace: {s.get('conversations')} conversations, up to {s.get('max_turns')} turns, seed "
        f"{s.get('seed')}, interleaved over {s.get('users')} users; cache capacity {s.get('capacity_tokens')} "
        f"tokens for every system; kvboost chunk size {s.get('chunk_size')}. Reuse ratio = prompt tokens served "
        "from cache / prompt tokens, token-weighted. Prompt tokens only (see `experiments/sims/simulate_peers.py`).",
        "",
        "## Overall",
        "",
        "| system | " + " | ".join(orders) + " |",
        "| --- | " + " | ".join("---:" for _ in orders) + " |",
    ]
    for name in systems:
        cells = [f"{results[o][name]['overall']:.3f}" if name in results[o] else "-" for o in orders]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    stats = meta.get("trace", {})
    for order in orders:
        st = stats.get(order, {})
        turns = sorted({int(t) for name in systems for t in results[order].get(name, {}).get("by_turn", {})})
        lines += [
            "",
            f"## By turn, {order}",
            "",
            "| turn | requests | prompt tokens | " + " | ".join(systems) + " |",
            "| ---: | ---: | ---: | " + " | ".join("---:" for _ in systems) + " |",
        ]
        n_by, tok_by = st.get("requests_by_turn", {}), st.get("prompt_tokens_by_turn", {})
        for t in turns:
            cells = []
            for name in systems:
                by_turn = results[order].get(name, {}).get("by_turn", {})
                v = by_turn.get(t, by_turn.get(str(t)))
                cells.append(f"{v:.3f}" if v is not None else "-")
            n = n_by.get(t, n_by.get(str(t), "-"))
            tok = tok_by.get(t, tok_by.get(str(t), "-"))
            lines.append(f"| {t} | {n} | {tok} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_results(results: Mapping[str, Mapping[str, Any]], path: str | Path, capacity_tokens: int) -> Path:
    """Reuse by turn per system, one panel per order (Agg canvas: no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    from kvboost.lab.report import line_styles

    orders = [o for o in ORDERS if o in results] + [o for o in results if o not in ORDERS]
    systems = list(dict.fromkeys(s for o in orders for s in results[o]))
    styles = line_styles(systems)
    fig = Figure(figsize=(6 * len(orders), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(orders), squeeze=False, sharey=True)[0]
    for ax, order in zip(axes, orders):
        for name in systems:
            by_turn = results[order].get(name, {}).get("by_turn", {})
            pts = sorted((int(t), v) for t, v in by_turn.items())
            if pts:
                overall = results[order][name]["overall"]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{name} ({overall:.1%})", **styles[name])
        ax.set_title(f"{order} (capacity {capacity_tokens} tokens)")
        ax.set_xlabel("turn")
        ax.set_ylim(-0.02, 1.02)
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(title="system (overall)", fontsize=8)
    axes[0].set_ylabel("prompt tokens served from cache")
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def run(
    *,
    conversations: int,
    users: int,
    capacity_tokens: int,
    out: str | Path,
    max_turns: int = 8,
    min_turns: int = 1,
    seed: int = 0,
    chunk_size: int = KVBOOST_CHUNK_SIZE,
    max_prompt_tokens: int | None = 4096,
    lmcache_save_unfull_chunk: bool = LMCACHE_SAVE_UNFULL_CHUNK,
    systems: Sequence[str] = SYSTEMS,
    traces: Mapping[str, Sequence[Any]] | None = None,
    progress: bool = True,
    command: str | None = None,
) -> dict[str, Any]:
    """Build both traces (or take ``traces``: ``{order: [TraceRequest]}``), simulate every system on each, and
    write the four files into ``out``. Returns the results (the content of ``simulated_reuse.json``)."""
    for name in systems:  # fail before the trace is built
        build_simulator(name, capacity_tokens, chunk_size=chunk_size,
                        lmcache_save_unfull_chunk=lmcache_save_unfull_chunk)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, Any] = {}
    if traces is None:
        from experiments.sims.token_trace import build_trace, bundled_tokenizer

        tokenizer = bundled_tokenizer()
        traces = {}
        for order in ORDERS:
            t0 = time.perf_counter()
            traces[order] = build_trace(
                num_conversations=conversations, max_turns=max_turns, min_turns=min(min_turns, max_turns),
                interleave=order == "interleaved",
                users=users if order == "interleaved" else None, seed=seed, max_prompt_tokens=max_prompt_tokens,
                tokenizer=tokenizer, progress=progress,
            )  # fmt: skip
            timings[f"trace_{order}_s"] = round(time.perf_counter() - t0, 3)

    def factory(name: str) -> ReuseSimulator:
        return build_simulator(name, capacity_tokens, chunk_size=chunk_size,
                               lmcache_save_unfull_chunk=lmcache_save_unfull_chunk)  # fmt: skip

    results: dict[str, Any] = {}
    for order, trace in traces.items():
        t0 = time.perf_counter()
        results[order] = simulate_trace(trace, capacity_tokens, systems=systems, factory=factory, progress=progress,
                                        desc=f"{order}: ")  # fmt: skip
        timings[f"simulate_{order}_s"] = round(time.perf_counter() - t0, 3)
    timings["total_s"] = round(time.perf_counter() - started, 3)
    meta = {
        "command": command,
        "settings": {
            "conversations": conversations, "users": users, "max_turns": max_turns, "min_turns": min_turns,
            "seed": seed,
            "max_prompt_tokens": max_prompt_tokens, "capacity_tokens": capacity_tokens, "chunk_size": chunk_size,
            "systems": list(systems), "vllm_block_size": VLLM_BLOCK_SIZE, "lmcache_chunk_size": LMCACHE_CHUNK_SIZE,
            "lmcache_save_unfull_chunk": lmcache_save_unfull_chunk, "kvboost_eviction": "lru (leaves_first)",
            "kvboost_block_size": KVBOOST_BLOCK_SIZE, "kvboost_capacity_blocks": capacity_tokens // KVBOOST_BLOCK_SIZE,
            "kvboost_memory_tier": "KV pool blocks (experiments/sims/pool_model.py)",
            "tokens_simulated": "prompt tokens only",
        },  # fmt: skip
        "trace": {order: trace_stats(trace) for order, trace in traces.items()},
        "timings": timings,
    }
    (out / "simulated_reuse.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "simulated_reuse_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "simulated_reuse.md").write_text(render_markdown(results, meta))
    plot_results(results, out / "simulated_reuse.png", capacity_tokens)
    return results


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.sims.simulate_peers",
        description="Simulate vLLM, SGLang, LMCache, llama.cpp and kvboost prefix reuse on the ShareGPT token "
        "trace at equal cache capacity, in sequential and interleaved order.",
    )
    p.add_argument("--conversations", type=_positive_int, required=True, help="ShareGPT conversations to replay")
    p.add_argument("--users", type=_positive_int, required=True,
                   help="conversations interleaved turn by turn in the interleaved order")  # fmt: skip
    p.add_argument("--capacity-tokens", type=_positive_int, required=True, help="every system's cache size, in tokens")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-turns", type=_positive_int, default=8)
    p.add_argument("--min-turns", type=_positive_int, default=1,
                   help="keep conversations with at least this many turns")  # fmt: skip
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--chunk-size", type=_positive_int, default=KVBOOST_CHUNK_SIZE, help="kvboost's fixed chunk size")
    p.add_argument("--max-prompt-tokens", type=_positive_int, default=4096,
                   help="drop turns whose prompt is longer (the replay's filter)")  # fmt: skip
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--lmcache-save-unfull-chunk", action="store_true",
                   help="LMCache stores the last partial chunk too (LMCache's default: off)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if not systems or unknown:
        p.error(f"--systems: unknown {unknown or 'empty list'}; use a subset of {','.join(SYSTEMS)}")
    args.systems = list(dict.fromkeys(systems))
    try:
        for name in args.systems:
            build_simulator(name, args.capacity_tokens, chunk_size=args.chunk_size)
    except ValueError as exc:
        p.error(f"--capacity-tokens {args.capacity_tokens}: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI entry point; returns the results written to ``simulated_reuse.json``."""
    args = parse_args(argv)
    command = "python -m experiments.sims.simulate_peers " + " ".join(sys.argv[1:] if argv is None else list(argv))
    results = run(
        conversations=args.conversations, users=args.users, capacity_tokens=args.capacity_tokens, out=args.out,
        max_turns=args.max_turns, min_turns=args.min_turns, seed=args.seed, chunk_size=args.chunk_size,
        max_prompt_tokens=args.max_prompt_tokens,
        lmcache_save_unfull_chunk=args.lmcache_save_unfull_chunk, systems=args.systems,
        progress=not args.no_progress, command=command,
    )  # fmt: skip
    print(render_markdown(results, json.loads((Path(args.out) / "simulated_reuse_meta.json").read_text())))
    return results


if __name__ == "__main__":
    main()
