"""The Ray Serve ingress's ``/metrics``: every replica's Prometheus text merged into one exposition, and the book of
which replicas the ingress's request router currently routes to (whom to ask). Ray-free, so it is tested without
Ray; :mod:`kvboost.serving.ray` serves it.

Each replica's samples keep their own values and get a ``replica`` label (summing in PromQL: ``sum without
(replica) (rate(vllm:prompt_tokens_total[1m]))``): summing in the ingress would be wrong for gauges such as the KV
cache usage fraction, and a per-replica view is what shows a replica that stopped serving. The ingress adds its own
series (:func:`ingress_families`): how many replicas answered the fan-out and how many requests it re-sent to
another replica because the first one's engine loop had stopped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger("kvboost.serving.ray")


def merge_metrics(texts: Mapping[str, str], extra: Iterable[Any] = ()) -> str:
    """One Prometheus text exposition of several replicas' ``/metrics``: every sample gets a ``replica`` label
    (its key in ``texts``), families of one name are merged (one ``# HELP`` / ``# TYPE`` each). Parsed with
    prometheus_client's text parser; a replica whose text does not parse is left out (and logged). ``extra``:
    metric families (prometheus_client's ``*MetricFamily``) appended as they are."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Any] = {}
    for replica, text in sorted(texts.items()):
        try:
            parsed = list(text_string_to_metric_families(text))
        except Exception as exc:  # noqa: BLE001 - one bad replica must not hide the others
            log.warning("replica %s: unreadable /metrics: %r", replica, exc)
            continue
        for family in parsed:
            samples = [Sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value, sample.timestamp,
                              sample.exemplar) for sample in family.samples]  # fmt: skip
            merged = families.setdefault(family.name, family)
            merged.samples = (merged.samples if merged is not family else []) + samples
    collected = [*families.values(), *extra]

    class _Merged:  # generate_latest takes any object with collect(): the text is prometheus_client's own
        def collect(self) -> Any:
            return collected

    return generate_latest(_Merged()).decode()  # type: ignore[arg-type]


def ingress_families(answered: int, failed: int, retried: Mapping[str, int]) -> list[Any]:
    """The ingress's own series: ``kvboost:ray_replicas{state="answered"|"failed"}`` (replicas that answered this
    scrape's fan-out, and those that did not) and ``kvboost:ray_ingress_retries_total{reason}`` (requests re-sent
    to another replica, by the first replica's error code)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    replicas = GaugeMetricFamily("kvboost:ray_replicas", "Engine replicas asked for /metrics by this scrape, by "
                                 "whether they answered.", labels=["state"])  # fmt: skip
    replicas.add_metric(["answered"], answered)
    replicas.add_metric(["failed"], failed)
    retries = CounterMetricFamily("kvboost:ray_ingress_retries", "Requests the ingress re-sent to another replica "
                                  "because the first one refused them unstarted (its engine loop had stopped).",
                                  labels=["reason"])  # fmt: skip
    for reason, count in sorted(retried.items()):
        retries.add_metric([reason], count)
    return [replicas, retries]


class RouterHub:
    """The replicas the request routers of this process route to (Ray creates a handle's router in the process that
    holds the handle, the ingress's): the ingress asks it which replicas to fan ``/metrics`` out to. Ray tells the
    router the current set (``update_replicas``: :meth:`sync`), so a replica Serve replaced leaves the book."""

    def __init__(self) -> None:
        self._replicas: set[str] = set()
        self._lock = threading.Lock()  # the router runs on Ray's event loop thread, the ingress on its own

    def seen(self, replica_ids: Sequence[str]) -> None:
        """Replicas the router was offered for a request (they are running)."""
        with self._lock:
            self._replicas.update(replica_ids)

    def sync(self, replica_ids: Sequence[str]) -> None:
        """The whole current set, as Ray's controller last announced it: replicas not in it are gone."""
        with self._lock:
            self._replicas = set(replica_ids)

    def gone(self, replica_id: str) -> None:
        with self._lock:
            self._replicas.discard(replica_id)

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)


HUB = RouterHub()


def hub() -> RouterHub:
    """This process's hub, looked up in the imported module: Ray Serve may ship the deployment classes by value
    (cloudpickle copies the globals they use), and a copied hub would never see the router's replicas."""
    import importlib

    return importlib.import_module("kvboost.serving.ray_metrics").HUB
