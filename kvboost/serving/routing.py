"""Prefix-aware choice of a replica for a request: send it where its prompt's prefix was served before.

Pure Python (no Ray, no torch): the Ray Serve request router in :mod:`kvboost.serving.ray` calls it, and the tests
call it directly.

Keys. A prompt becomes a list of prefix-chained chunk keys (:func:`chunk_keys`): key ``i`` hashes chunk ``i``'s
units together with key ``i - 1``, so equal key ``i`` means an equal prompt up to the end of chunk ``i``, like the
engine's own prefix keys. Only full chunks get a key (the unfinished tail is what the next turn changes). Units are
token ids (:func:`token_chunk_keys`, the engine's view) or the characters of a canonical rendering of the prompt
(:func:`text_chunk_keys`: the router then needs no tokenizer, which is why the Ray ingress uses it; a chat turn's
messages extend the previous turn's, so its rendering extends the previous rendering and the keys chain the same
way). A ``salt`` (the tenant's cache salt) is mixed into the root: two tenants never look like a shared prefix,
just as they never share cache entries.

Index. Each replica has a bounded :class:`PrefixIndex` of the keys it was recently sent (LRU, ``capacity`` keys);
:meth:`PrefixIndex.match` is the number of leading chunks of a request the replica has seen: the deepest key of the
request present in the index (keys are chained, so a present key ``i`` vouches for the whole prefix even if an
older, shallower key was evicted).

The rule (:func:`choose_replica`):

1. the least-loaded queue length ``q_min`` is found; a replica whose queue exceeds ``q_min + max_imbalance`` is
   skipped (a long shared prefix must not pile every request onto one replica);
2. among the others, the one with the most matched chunks wins;
3. ties (including "nothing cached anywhere") go to the shortest queue, then to the next replica in a rotation,
   so equal replicas are used in turn rather than always the first.

This is a guess at where the KV is: the index records where requests were *sent*, not what the replica's cache
still holds (the engine may have evicted it; with a shared Redis tier a miss there still finds it in Redis).
:mod:`kvboost.serving.event_routing` applies the same rule (:func:`rank_replicas`) to what the replicas' KV events
say their caches hold.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_CHUNK_TOKENS = 16
DEFAULT_CHUNK_CHARS = 64
DEFAULT_INDEX_CAPACITY = 8192
DEFAULT_MAX_IMBALANCE = 4


# ------------------------------------------------------------------------------------------------------ keys
def chunk_keys(units: Sequence[int] | str, chunk_size: int, salt: str = "") -> list[str]:
    """Prefix-chained keys of the full ``chunk_size``-unit chunks of ``units`` (token ids or a string)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    parent = hashlib.blake2b(b"root\0" + salt.encode(), digest_size=12).hexdigest()
    keys = []
    for start in range(0, len(units) - chunk_size + 1, chunk_size):
        piece = units[start : start + chunk_size]
        data = piece.encode() if isinstance(piece, str) else b",".join(str(int(u)).encode() for u in piece)
        parent = hashlib.blake2b(parent.encode() + b"\0" + data, digest_size=12).hexdigest()
        keys.append(parent)
    return keys


def token_chunk_keys(token_ids: Sequence[int], chunk_size: int = DEFAULT_CHUNK_TOKENS, salt: str = "") -> list[str]:
    """Keys over token ids (``chunk_size`` tokens per chunk; the engine's default chunker is 16 or 64)."""
    return chunk_keys(list(token_ids), chunk_size, salt)


def prompt_text(prompt: str | Sequence[Mapping[str, Any]] | Sequence[int]) -> str:
    """A canonical string for a prompt: a completion prompt as is, chat messages as ``role\\x1fcontent\\x1e`` each
    (the order and content of the messages, nothing of a chat template), token ids as comma-separated numbers, a
    list of strings each followed by ``\\x1e``."""
    if isinstance(prompt, str):
        return prompt
    parts = []
    for item in prompt:
        if isinstance(item, Mapping):
            content = item.get("content", "")
            if not isinstance(content, str):  # OpenAI content parts: keep their text pieces, in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
            parts.append(f"{item.get('role', '')}\x1f{content}\x1e")
        elif isinstance(item, str):  # a completion prompt given as a list of strings
            parts.append(f"{item}\x1e")
        else:
            parts.append(f"{int(item)},")
    return "".join(parts)


def text_chunk_keys(prompt: str | Sequence[Any], chunk_chars: int = DEFAULT_CHUNK_CHARS, salt: str = "") -> list[str]:
    """Keys over the characters of :func:`prompt_text` (``chunk_chars`` characters per chunk)."""
    return chunk_keys(prompt_text(prompt), chunk_chars, salt)


# ----------------------------------------------------------------------------------------------------- index
class PrefixIndex:
    """The chunk keys recently sent to one replica: an LRU set of at most ``capacity`` keys."""

    def __init__(self, capacity: int = DEFAULT_INDEX_CAPACITY) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[str]) -> None:
        """Record a request's keys (most recent last; the oldest keys go when over capacity)."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def match(self, keys: Sequence[str]) -> int:
        """How many leading chunks of ``keys`` this replica has seen (the deepest present key + 1; 0 for none)."""
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in self._keys:
                return i + 1
        return 0

    def clear(self) -> None:
        self._keys.clear()


# ---------------------------------------------------------------------------------------------------- choice
@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why: ``matched`` chunks of its prefix were sent to ``replica`` before;
    ``skipped`` replicas had a longer match but too long a queue."""

    replica: Hashable
    matched: int
    ranking: tuple[Hashable, ...]
    skipped: tuple[Hashable, ...] = ()


def choose_replica(
    keys: Sequence[str],
    replicas: Sequence[Hashable],
    indexes: Mapping[Hashable, PrefixIndex],
    queue_lens: Mapping[Hashable, int],
    *,
    max_imbalance: int = DEFAULT_MAX_IMBALANCE,
    rotation: int = 0,
) -> RouteDecision:
    """Apply the module's rule. ``replicas`` in a fixed order (the rotation breaks final ties in it); a replica
    missing from ``indexes`` has seen nothing, one missing from ``queue_lens`` has an empty queue.

    ``ranking`` lists every replica, best first: the eligible ones by (matched desc, queue asc, rotation), then the
    skipped ones by queue (so a caller that finds the first one full can fall back in order).
    """
    matched = {r: indexes[r].match(keys) if r in indexes else 0 for r in replicas}
    return rank_replicas(replicas, matched, queue_lens, max_imbalance=max_imbalance, rotation=rotation)


def rank_replicas(
    replicas: Sequence[Hashable],
    matched: Mapping[Hashable, int],
    queue_lens: Mapping[Hashable, int],
    *,
    max_imbalance: int = DEFAULT_MAX_IMBALANCE,
    rotation: int = 0,
    secondary: Mapping[Hashable, int] | None = None,
) -> RouteDecision:
    """The module's rule over given match lengths (``matched[r]``: leading chunks of the request at ``r``, by
    whatever index; :mod:`kvboost.serving.event_routing` passes what the replicas' KV events say). ``secondary``
    (optional, higher first) breaks ties between equal matches before the queue length does."""
    if not replicas:
        raise ValueError("no replica to choose from")
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance!r}")
    n = len(replicas)
    queue = {r: max(0, int(queue_lens.get(r, 0) or 0)) for r in replicas}
    matched = {r: int(matched.get(r, 0) or 0) for r in replicas}
    second = {r: int((secondary or {}).get(r, 0) or 0) for r in replicas}
    turn = {r: (i - rotation) % n for i, r in enumerate(replicas)}
    limit = min(queue.values()) + max_imbalance
    eligible = [r for r in replicas if queue[r] <= limit]
    overloaded = [r for r in replicas if queue[r] > limit]
    eligible.sort(key=lambda r: (-matched[r], -second[r], queue[r], turn[r]))
    overloaded.sort(key=lambda r: (queue[r], turn[r]))
    best = eligible[0]
    skipped = tuple(r for r in overloaded if matched[r] > matched[best])
    return RouteDecision(replica=best, matched=matched[best], ranking=tuple(eligible + overloaded), skipped=skipped)


class PrefixRouter:
    """The rule with its state: one :class:`PrefixIndex` per replica and the rotation counter.

    ``choose(keys, queue_lens)`` decides (and by default records the keys on the chosen replica); a caller that
    learns the request went elsewhere (the first choice was full) calls ``record(actual, keys)`` instead.
    """

    def __init__(self, *, capacity: int = DEFAULT_INDEX_CAPACITY, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        self.capacity = capacity
        self.max_imbalance = max_imbalance
        self.indexes: dict[Hashable, PrefixIndex] = {}
        self._rotation = 0

    def choose(self, keys: Sequence[str], replicas: Sequence[Hashable], queue_lens: Mapping[Hashable, int],
               *, record: bool = True) -> RouteDecision:  # fmt: skip
        decision = choose_replica(keys, replicas, self.indexes, queue_lens, max_imbalance=self.max_imbalance,
                                  rotation=self._rotation)  # fmt: skip
        self._rotation += 1
        if record:
            self.record(decision.replica, keys)
        return decision

    def record(self, replica: Hashable, keys: Sequence[str]) -> None:
        """Note that ``replica`` was sent a request with these keys."""
        index = self.indexes.get(replica)
        if index is None:
            index = self.indexes[replica] = PrefixIndex(self.capacity)
        index.add(keys)

    def forget(self, replica: Hashable) -> None:
        """Drop a replica's index (it died: its cache is gone)."""
        self.indexes.pop(replica, None)
