"""Building the KV store from the engine's ``cache`` and ``eviction`` options."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from kvboost.cache.store import KVStore
from kvboost.cache.tier_base import CacheTier
from kvboost.registry import CACHE_TIERS


@dataclass
class TierStack:
    """The tiers of a store, fastest first, before the store is made (the engine puts its pool tier first)."""

    tiers: list[CacheTier]
    write_through: list[bool]

    def build(self) -> KVStore:
        return KVStore(self.tiers, write_through=self.write_through)


def build_tiers(cache: Any, eviction: Any = None) -> TierStack:
    """The tiers of ``cache``: one tier spec, or a list of tier specs fastest first (default: ``memory``).
    A spec's ``write_through`` flag is the store's setting for that tier; ``eviction`` is given to every tier that
    takes one and does not name its own."""
    specs = list(cache) if isinstance(cache, (list, tuple)) else [cache or {"name": "memory"}]
    specs, write_through = zip(*(_split_write_through(spec) for spec in specs))
    return TierStack([CACHE_TIERS.build(_with_eviction(spec, eviction)) for spec in specs], list(write_through))


def _is_mapping(spec: Any) -> bool:
    return isinstance(spec, dict) or type(spec).__module__.startswith("omegaconf")


def _split_write_through(spec: Any) -> tuple[Any, bool]:
    """A tier spec without its ``write_through`` flag (a store setting, not the tier's), and the flag."""
    if isinstance(spec, str) or not _is_mapping(spec):
        return spec, False
    spec = dict(spec)
    flag = spec.pop("write_through", False)
    if not isinstance(flag, bool):
        raise ValueError(f"cache tier {spec.get('name')!r}: write_through must be true or false, got {flag!r}")
    return spec, flag


def _with_eviction(spec: Any, eviction: Any) -> Any:
    """A tier spec with the engine-wide eviction policy, for tiers that take one and do not name their own."""
    if eviction is None or not isinstance(spec, str) and not _is_mapping(spec):
        return spec
    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    factory = CACHE_TIERS.get(spec["name"])
    if "eviction" in inspect.signature(factory).parameters and spec.get("eviction") is None:
        spec["eviction"] = eviction
    return spec
