"""Prometheus metrics of one server, under vLLM's names where the meaning is the same, ``kvboost:`` otherwise.

Each app gets its own ``CollectorRegistry`` (tests build many apps in one process). Two sources:

- per request, when it ends (:meth:`ServerMetrics.observe`): token counters, finish reasons, latency histograms, and
  per tenant the prompt tokens served from the cache (``kvboost:tenant_prefix_cache_hits``; a tenant is a short hash
  of its salt, never the key or the salt);
- per scrape (:meth:`ServerMetrics.refresh`): the loop's snapshot (queue lengths, KV use, prefix-cache counters,
  preemptions) and, through ``loop.call`` with a short timeout, the cache tiers (``engine.cache_stats()``). A
  scrape while the loop thread is busy with a long step keeps the tiers' last values rather than waiting.

Counters appear with prometheus_client's ``_total`` suffix, as vLLM's do (``vllm:prefix_cache_queries_total``).
Differences from vLLM: ``finished_reason`` takes the loop's reasons (``stop``, ``length``, ``cancelled``,
``timeout``, ``error``, ``shutdown``) where vLLM has ``stop``/``length``/``abort``; ``vllm:prefix_cache_hits`` counts
exact prefix hits only (content hits, reused at another position, are ``kvboost:content_hit_tokens``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvboost.engine.requests import Completion

log = logging.getLogger(__name__)

#: how long a scrape waits for the loop thread to read the cache tiers
TIER_STATS_TIMEOUT_S = 0.5

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (and the context length itself)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= max_model_len:
                return tuple(out + [max_model_len])
            out.append(step * scale)
        scale *= 10


class ServerMetrics:
    """The metrics of one app (see the module docstring). ``render()`` gives the text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, loop: Any, *, model_name: str, max_model_len: int, tenant_ids: list[str] | None = None) -> None:
        self.loop = loop
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        m, r = ["model_name"], self.registry
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.", m,
                                         registry=r)  # fmt: skip
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       m + ["finished_reason"], registry=r)  # fmt: skip
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.", m,
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive generated tokens.", m,
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", m,
                             buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m,
                                               buckets=tokens, registry=r)  # fmt: skip
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                                   m, buckets=tokens, registry=r)  # fmt: skip
        self.tenant_hits = Counter("kvboost:tenant_prefix_cache_hits",
                                   "Prompt tokens served from the cache, per tenant (a hash prefix of its salt).",
                                   m + ["tenant"], registry=r)  # fmt: skip
        self.tenant_queries = Counter("kvboost:tenant_prefix_cache_queries", "Prompt tokens looked up, per tenant.",
                                      m + ["tenant"], registry=r)  # fmt: skip
        self.rejected = Counter("kvboost:requests_rejected", "Requests refused before queueing, by reason.",
                                m + ["reason"], registry=r)  # fmt: skip
        for tenant in tenant_ids or []:  # every configured tenant shows up at 0 before its first request
            self.tenant_hits.labels(model_name, tenant)
            self.tenant_queries.labels(model_name, tenant)
        self._stats: dict[str, Any] = {}
        self._tiers: list[dict[str, Any]] = []
        self._per_tier: dict[str, dict[str, Any]] = {}
        self._corrupt = 0
        self._layers = int(getattr(loop.engine, "layers", 0) or 0)
        r.register(_LoopCollector(self))

    # ------------------------------------------------------------------ per request
    def observe(self, completion: Completion, tenant_id: str) -> None:
        """Count one finished request (any finish reason)."""
        name = self.model_name
        self.request_success.labels(name, completion.finish_reason).inc()
        self.prompt_tokens.labels(name).inc(completion.prompt_tokens)
        self.generation_tokens.labels(name).inc(completion.completion_tokens)
        self.request_prompt_tokens.labels(name).observe(completion.prompt_tokens)
        self.request_generation_tokens.labels(name).observe(completion.completion_tokens)
        self.tenant_queries.labels(name, tenant_id).inc(completion.prompt_tokens)
        self.tenant_hits.labels(name, tenant_id).inc(completion.cached_tokens)
        if completion.first_token_at is not None:
            self.ttft.labels(name).observe(max(0.0, completion.first_token_at - completion.arrival))
        times = completion.token_times
        for a, b in itertools.pairwise(times):
            self.itl.labels(name).observe(max(0.0, b - a))
        if completion.finished_at:
            self.e2e.labels(name).observe(max(0.0, completion.finished_at - completion.arrival))

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------------ per scrape
    async def refresh(self) -> None:
        """Read the loop's snapshot now and the tiers' counters (through the loop thread, bounded wait)."""
        self._stats = self.loop.stats()
        try:
            future = self.loop.call(_tier_stats)
            tiers, per_tier, corrupt = await asyncio.wait_for(asyncio.wrap_future(future), TIER_STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a busy or stopped loop leaves the last values in place
            log.debug("tier stats not refreshed: %r", exc)
            return
        self._tiers, self._per_tier, self._corrupt = tiers, per_tier, corrupt

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _tier_stats(engine: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], int]:
    stats = engine.cache_stats()
    return list(stats.get("tiers", [])), dict(stats.get("per_tier", {})), int(stats.get("corrupt_entries_dropped", 0))


class _LoopCollector:
    """Series read from the loop's snapshot and the tiers at scrape time (not kept as prometheus objects)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Any]:
        return []  # nothing to check for clashes; collect() must not run at registration (the loop may be busy)

    def collect(self) -> Any:
        m, s = self.m, self.m._stats
        label = [m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to start.", s.get("num_waiting", 0))
        yield gauge(
            "vllm:kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0-1).", s.get("kv_usage", 0.0)
        )
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_query_tokens", 0))  # fmt: skip
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served by exact prefix hits.",
                      s.get("prefix_hit_tokens", 0))  # fmt: skip
        yield counter("vllm:num_preemptions", "Preemptions (a running request's blocks freed, recomputed later).",
                      s.get("num_preempted_total", 0))  # fmt: skip
        yield counter("kvboost:content_hit_tokens", "Prompt tokens served by content hits (reused at another "
                      "position, re-rotated and repaired).", s.get("content_hit_tokens", 0))  # fmt: skip
        yield counter("kvboost:prefill_tokens", "Prompt tokens computed by prefills (what the cache and forks did not "
                      "serve).", s.get("prefill_tokens", 0))  # fmt: skip
        yield counter("kvboost:forked_samples", "Samples of n > 1 requests that forked a prefilled prompt's blocks "
                      "instead of prefilling it.", s.get("forked_samples", 0))  # fmt: skip
        yield counter("kvboost:forked_prompt_tokens", "Prompt tokens those samples shared by reference.",
                      s.get("forked_prompt_tokens", 0))  # fmt: skip
        queried = s.get("prefix_query_tokens", 0) * m._layers
        yield gauge("kvboost:recompute_ratio", "Recomputed (token, layer) pairs of cached tokens / (prompt tokens x "
                    "layers), since start.", s.get("recompute_pairs", 0) / queried if queried else 0.0)  # fmt: skip
        hits = CounterMetricFamily(
            "kvboost:tier_hits", "Chunk hits served per cache tier.", labels=["model_name", "tier"]
        )
        used = GaugeMetricFamily("kvboost:tier_bytes", "Bytes held per cache tier.", labels=["model_name", "tier"])
        entries = GaugeMetricFamily(
            "kvboost:tier_entries", "Entries held per cache tier.", labels=["model_name", "tier"]
        )
        for row in m._tiers:
            tier = str(row.get("tier"))
            hits.add_metric([m.model_name, tier], m._per_tier.get(tier, {}).get("hits", 0))
            used.add_metric([m.model_name, tier], row.get("used_bytes", 0))
            entries.add_metric([m.model_name, tier], row.get("entries", 0))
        yield hits
        yield used
        yield entries
        sink = getattr(m.loop.engine, "kv_events", None)
        if sink is not None:  # KV events on (engine.kv_events): what the publisher did, read without the loop
            ev = sink.stats()
            yield counter("kvboost:kv_events_batches", "KV-event batches the cache emitted.", ev["batches"])
            yield counter("kvboost:kv_events", "KV events (BlockStored, BlockRemoved, AllBlocksCleared) emitted.",
                          ev["events"])  # fmt: skip
            yield counter("kvboost:kv_events_published", "KV-event batches the publisher sent.", ev["published"])
            yield counter("kvboost:kv_events_dropped", "KV-event batches dropped because the publisher's queue was "
                          "full (subscribers then get a fresh snapshot).", ev["dropped"])  # fmt: skip
            yield counter("kvboost:kv_events_resyncs", "Snapshots (AllBlocksCleared + every entry) sent again after "
                          "dropped batches.", ev["resyncs"])  # fmt: skip
            yield gauge("kvboost:kv_events_pending", "KV-event batches waiting in the publisher's queue.",
                        ev["pending"])  # fmt: skip
        budget = m.loop.core.budget_info()  # the step budget object is replaced whole, never mutated: no lock needed
        yield gauge("kvboost:step_budget_max_batch_tokens", "Tokens a step may carry when no request is decoding "
                    "(the step budget, kvboost.engine.budget).", budget["max_batch_tokens"])  # fmt: skip
        chunk = GaugeMetricFamily(
            "kvboost:step_budget_prompt_tokens", "Prompt tokens a step may carry beside R decode rows with no prompt "
            "backlog (the CPU budget sizes this chunk to the measured decode step, and raises it to 1/drain_steps of "
            "the admitted prompts' pending tokens; a fixed budget is max_batch_tokens - R).",
            labels=["model_name", "mode", "decode_rows"],
        )  # fmt: skip
        for rows in (1, 8, 32):
            value = budget.get(f"chunk_at_{rows}", max(budget["max_batch_tokens"] - rows, 0))
            chunk.add_metric([m.model_name, str(budget["mode"]), str(rows)], value)
        yield chunk
        yield counter("kvboost:cache_corrupt_entries_dropped", "Damaged records a tier below memory found, deleted and "
                      "recomputed (never served).", m._corrupt)  # fmt: skip
