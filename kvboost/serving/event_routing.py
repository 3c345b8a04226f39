"""Routing by what the replicas' caches hold: an index built from every replica's KV events (no guessing).

Pure Python (no Ray, no torch, no ZMQ): :mod:`kvboost.serving.ray` feeds it the batches its subscribers receive
(:class:`kvboost.cache.events.KVEventSubscriber`, one per replica), the tests feed it batches directly.

Why not :mod:`kvboost.serving.routing`'s index. That one records the keys of the requests a router *sent* to a
replica; the replica's cache may have evicted them since (a small memory tier, a long trace), and a replica that was
sent nothing may have the prefix from the shared Redis tier. This index holds, per replica and per medium, the block
hashes the replica's own store published (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), so after the
events arrive it equals the replica's cache (``tests/test_event_routing.py`` checks it against the engines' stores).

Matching a request against block hashes. Two ways were open: compute the engine's own chunk keys for the request
(tokenizer, chat template, chunker, hasher *and* the engine's fingerprint: model identity, dtype, device, attention
backend, KV quantizer..., which the router would have to obtain from a replica and recompute whenever it changes),
or follow the chain the events themselves describe, as llm-d's KV-cache manager does. This module does the second,
and it is exact without knowing the fingerprint or the hash function:

- a ``BlockStored`` carries ``(parent_block_hash, token_ids)``, and the engine's key of a chunk is a function of its
  parent key and its tokens only (``Hasher.chunk_keys``: digest of fingerprint, parent key, tokens; the fingerprint is
  the same for every block of one deployment), so the pair names the block: the index keeps
  ``(parent, tokens) -> block hash`` for every block some replica holds;
  With fixed blocks (``kv_events.block_size``, the default) an event holds several blocks, its tokens in
  ``block_size`` pieces, block ``i``'s parent block ``i-1``: the same pairs, one per block;
- a prompt's first block has ``parent_block_hash=None`` and the tenant salt's published form as its extra key
  (``(salt_tag(salt),)``, :func:`kvboost.cache.events.salt_tag`; ``None`` for the open tenant): its parent is the
  pair ``("salt", published salt)``, so tenants never share a first block here either (the ingress computes the
  published form with the replicas' ``kv_events.salt_key``);
- the request is tokenized as the engine does (:class:`RequestTokenizer`: ``prompt_text_or_ids`` with the chat
  template, then the engine's chunker) and split into the published blocks (or, with ``block_size: chunk``, into
  the engine's chunk spans, a variable chunker's boundaries included), and walked span by span: span ``i`` matches
  when ``(hash of span i-1, tokens of span i)`` is a known block. The walk yields the hashes the engine's lookup would ask its store for, in order; the number of
  leading ones a replica holds is what that replica would serve from cache (its prefix hits), up to 64-bit hash
  collisions (``block_hash="int"``) and the limits below.

Media (``kvboost.cache.events.MEDIA``). ``GPU`` (the KV pool / first memory tier), ``CPU`` (a memory tier below)
and ``DISK`` are the replica's own. A block in a *shared* medium (``EXTERNAL``: a Redis tier, every replica on one
namespace; :data:`SHARED_MEDIA`) is available to every
replica, whichever replica published it (each replica publishes the Redis entries it wrote, and those it finds others
wrote at each refresh): a replica's match counts a block it holds locally or that any replica holds in a shared
medium. Among replicas with equally long matches, the one holding more of them *locally* wins (no Redis round trip).

Limits (the index may differ from what a lookup finds): the events lag the store by the publisher's queue and the
network (a request routed before its previous turn's blocks were published does not see them); Redis's own eviction
(``maxmemory`` + LRU) publishes nothing; segment-only entries (content reuse) are not published; a tenant whose root key the hasher forgot (more than 65536 tenants) publishes a
parent hash no one links to, and its blocks are not matched.

The rule (:class:`EventRouter`) is :func:`kvboost.serving.routing.rank_replicas` with these scores: skip replicas
whose queue exceeds the shortest by more than ``max_imbalance``; among the others most matched blocks first, then
most matched locally, then the shortest queue, then a rotation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost.cache.events import SEGMENT_ONLY_EXTRA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvboost.serving.routing import DEFAULT_MAX_IMBALANCE, RouteDecision, rank_replicas

#: media whose blocks every replica can read (one Redis namespace shared by the deployment): ``EXTERNAL`` is what a
#: Redis tier publishes (``kvboost.cache.events.MEDIA``); ``redis`` is the name kvboost published before
SHARED_MEDIA = frozenset({"EXTERNAL", "redis"})


def medium_kind(medium: str | None) -> str:
    """``redis#2`` -> ``redis``: the tier kind of a medium name (the store numbers two tiers of one kind)."""
    return (medium or "memory").split("#", 1)[0]


def is_shared(medium: str | None) -> bool:
    return medium_kind(medium) in SHARED_MEDIA


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def _root(salt: str) -> tuple[str, str]:
    return ("salt", salt)


def stored_parent(event: BlockStored) -> Any | None:
    """The chain parent of a stored block: the parent hash, ``("salt", salt)`` for a prompt's first chunk, or None
    for a block that is on no prefix chain (a segment-only entry)."""
    extra = (event.extra_keys or [None])[0]
    if extra and SEGMENT_ONLY_EXTRA in extra:
        return None
    if event.parent_block_hash is None:
        return _root(str(extra[0]) if extra else "")
    return _hashable(event.parent_block_hash)


def _block_tokens(event: BlockStored) -> list[tuple[int, ...] | None]:
    """Each block's tokens: the event's token ids in ``block_size`` pieces (vLLM's multi-block events, kvboost's
    fixed blocks), or the whole for a one-block event (a kvboost chunk); None where they cannot be told apart."""
    hashes, tokens = event.block_hashes, [int(t) for t in event.token_ids]
    if len(hashes) == 1:
        return [tuple(tokens)]
    size = int(event.block_size or 0)
    if size > 0 and len(tokens) == size * len(hashes):
        return [tuple(tokens[i * size : (i + 1) * size]) for i in range(len(hashes))]
    return [None] * len(hashes)


# ------------------------------------------------------------------------------------------------- the index
class ClusterKVIndex:
    """Every replica's cache as its KV events describe it, and the chain of blocks to walk requests along.

    ``media(replica)`` equals ``kvboost.cache.events.store_index(store)`` of that replica's store once its batches
    were applied (the same content as a :class:`~kvboost.cache.events.KVEventIndex` per replica). Block structure
    (``(parent, tokens) -> hash``) is kept while at least one replica holds the block in some medium."""

    def __init__(self) -> None:
        self._media: dict[Hashable, dict[str, set[Any]]] = {}
        self._holders: Counter[Any] = Counter()  # hash -> (replica, medium) pairs holding it
        self._shared: Counter[Any] = Counter()  # hash -> (replica, shared medium) pairs holding it
        self._node: dict[Any, tuple[Any, tuple[int, ...]]] = {}  # hash -> (parent, tokens)
        self._link: dict[tuple[Any, tuple[int, ...]], Any] = {}  # (parent, tokens) -> hash
        self.batches: Counter[Hashable] = Counter()

    # -------------------------------------------------------------- feeding
    def apply(self, replica: Hashable, batch: KVEventBatch) -> None:
        """Apply one batch of ``replica``'s events, in its publisher's order."""
        self.batches[replica] += 1
        media = self._media.setdefault(replica, {})
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._drop_all(replica)
                media = self._media.setdefault(replica, {})
            elif isinstance(event, BlockStored):
                parent = stored_parent(event)
                held = media.setdefault(event.medium, set())
                for h, tokens in zip(event.block_hashes, _block_tokens(event)):
                    h = _hashable(h)
                    # block i's parent is block i-1 of the event (the first's: the event's parent)
                    if parent is not None and tokens is not None and h not in self._node:
                        self._node[h] = (parent, tokens)
                        self._link[self._node[h]] = h
                    parent = h
                    if h not in held:
                        held.add(h)
                        self._count(h, event.medium, +1)
            elif isinstance(event, BlockRemoved):
                held = media.get(event.medium)
                if held is None:
                    continue
                for h in event.block_hashes:
                    h = _hashable(h)
                    if h in held:
                        held.discard(h)
                        self._count(h, event.medium, -1)
                if not held:
                    del media[event.medium]

    def forget(self, replica: Hashable) -> None:
        """Drop a replica (it died, or restarted and its new stream will rebuild it)."""
        self._drop_all(replica)
        self._media.pop(replica, None)
        self.batches.pop(replica, None)

    def _drop_all(self, replica: Hashable) -> None:
        for medium, held in self._media.get(replica, {}).items():
            for h in held:
                self._count(h, medium, -1)
        self._media[replica] = {}

    def _count(self, h: Any, medium: str | None, delta: int) -> None:
        self._holders[h] += delta
        if is_shared(medium):
            self._shared[h] += delta
            if self._shared[h] <= 0:
                del self._shared[h]
        if self._holders[h] <= 0:  # nobody holds it: forget its place in the chain too
            del self._holders[h]
            node = self._node.pop(h, None)
            if node is not None and self._link.get(node) == h:
                del self._link[node]

    # -------------------------------------------------------------- reading
    @property
    def replicas(self) -> list[Hashable]:
        return list(self._media)

    def media(self, replica: Hashable) -> dict[str, set[Any]]:
        """Per medium, the hashes ``replica`` holds (empty media left out)."""
        return {m: set(hs) for m, hs in self._media.get(replica, {}).items() if hs}

    def held(self, replica: Hashable, h: Any) -> bool:
        """Whether ``replica`` can serve block ``h``: in one of its own media, or in a shared medium anywhere."""
        if h in self._shared:
            return True
        return any(h in hs for m, hs in self._media.get(replica, {}).items() if not is_shared(m))

    def held_locally(self, replica: Hashable, h: Any) -> bool:
        return any(h in hs for m, hs in self._media.get(replica, {}).items() if not is_shared(m))

    def chain(self, token_ids: Sequence[int], spans: Iterable[tuple[int, int]], salt: str = "") -> list[Any]:
        """The block hashes of the request's leading chunks that some replica holds, in order: span ``i`` is
        followed while ``(hash of span i-1, its tokens)`` is a known block (``spans``: (start, end) pairs, or
        objects with ``.start`` / ``.end``, the engine's chunk spans)."""
        out: list[Any] = []
        parent: Any = _root(salt)
        for span in spans:
            start, end = (span.start, span.end) if hasattr(span, "start") else span
            h = self._link.get((parent, tuple(int(t) for t in token_ids[start:end])))
            if h is None:
                break
            out.append(h)
            parent = h
        return out

    def match(self, replica: Hashable, chain: Sequence[Any]) -> tuple[int, int]:
        """``(matched, local)``: how many leading blocks of ``chain`` ``replica`` can serve, and how many of those
        it holds in its own media."""
        matched = local = 0
        for h in chain:
            if not self.held(replica, h):
                break
            matched += 1
            local += self.held_locally(replica, h)
        return matched, local

    def check(self) -> None:
        """Internal consistency (tests): the counters equal what the media say; every link is a held block's."""
        holders: Counter[Any] = Counter()
        shared: Counter[Any] = Counter()
        for media in self._media.values():
            for m, hs in media.items():
                for h in hs:
                    holders[h] += 1
                    shared[h] += is_shared(m)
        assert holders == +self._holders, "holder counts differ from the media"
        assert +shared == self._shared, "shared counts differ from the media"
        assert set(self._node) <= set(holders), "a block nobody holds is still in the chain"
        assert all(self._node[h] == node for node, h in self._link.items()), "links and nodes disagree"


# ------------------------------------------------------------------------------------------ tokenizing requests
class RequestTokenizer:
    """A request's token ids and chunk spans as the engine computes them (``InferenceEngine.tokenize_with_spans``):
    the prompt rendered by ``kvboost.prompts.prompt_text_or_ids`` (chat messages with the chat template and the
    generation prompt), tokenized by the engine's chunker (which owns tokenization), token ids split by it.
    Build it from the served model's tokenizer and the engine's chunker config, bound to that tokenizer."""

    def __init__(self, tokenizer: Any, chunker: Any, chat: bool | None = None, block_size: int | None = None) -> None:
        self.tokenizer, self.chunker, self.chat = tokenizer, chunker, chat
        #: the replicas' published block size (``kv_events.block_size``): spans are its blocks; None: the chunks
        self.block_size = block_size

    @classmethod
    def from_config(cls, tokenizer: Any, chunker: Any = "fixed", chat: bool | None = None,
                    block_size: int | None = None) -> RequestTokenizer:  # fmt: skip
        """``chunker``: a config (name or mapping, the ``chunker`` group of the server's config) or an instance."""
        from kvboost.registry import CHUNKERS

        built = CHUNKERS.build(chunker) if isinstance(chunker, (str, Mapping)) else chunker
        built.bind_tokenizer(tokenizer)
        return cls(tokenizer, built, chat, block_size)

    def __call__(self, prompt: Any, *, chat: bool | None = None) -> tuple[list[int], list[Any]]:
        from kvboost.prompts import prompt_text_or_ids

        what = prompt_text_or_ids(self.tokenizer, prompt, chat=self.chat if chat is None else chat)
        ids, spans = self.chunker.tokenize(self.tokenizer, what) if isinstance(what, str) else (list(what), None)
        if self.block_size:  # the replicas publish fixed blocks from the prompt start: walk those
            from kvboost.types import ChunkSpan

            size = self.block_size
            return list(ids), [ChunkSpan(i, i + size) for i in range(0, len(ids) - size + 1, size)]
        return list(ids), list(spans if spans is not None else self.chunker.split(ids))


# ---------------------------------------------------------------------------------------------------- choice
@dataclass(frozen=True)
class EventRouteDecision(RouteDecision):
    """A :class:`~kvboost.serving.routing.RouteDecision` plus ``local``: how many of the ``matched`` chunks the
    chosen replica holds in its own media (the rest come from a shared medium)."""

    local: int = 0


class EventRouter:
    """The rule of this module over a :class:`ClusterKVIndex` (state: the index and the rotation counter)."""

    def __init__(self, *, max_imbalance: int = DEFAULT_MAX_IMBALANCE, index: ClusterKVIndex | None = None) -> None:
        self.max_imbalance = max_imbalance
        self.index = index if index is not None else ClusterKVIndex()
        self._rotation = 0

    def scores(self, token_ids: Sequence[int], spans: Iterable[Any], replicas: Sequence[Hashable],
               salt: str = "") -> dict[Hashable, tuple[int, int]]:  # fmt: skip
        """Per replica ``(matched, local)`` chunks of the request."""
        chain = self.index.chain(token_ids, spans, salt)
        return {r: self.index.match(r, chain) for r in replicas}

    def choose(self, token_ids: Sequence[int] | None, spans: Iterable[Any] | None, replicas: Sequence[Hashable],
               queue_lens: Mapping[Hashable, int], salt: str = "") -> EventRouteDecision:  # fmt: skip
        """Rank ``replicas`` for a request (``token_ids`` None: nothing to match, balance only)."""
        if token_ids is None or spans is None:
            scores = {r: (0, 0) for r in replicas}
        else:
            scores = self.scores(token_ids, spans, replicas, salt)
        decision = rank_replicas(replicas, {r: scores[r][0] for r in replicas}, queue_lens,
                                 max_imbalance=self.max_imbalance, rotation=self._rotation,
                                 secondary={r: scores[r][1] for r in replicas})  # fmt: skip
        self._rotation += 1
        return EventRouteDecision(**decision.__dict__, local=scores[decision.replica][1] if replicas else 0)

    def forget(self, replica: Hashable) -> None:
        self.index.forget(replica)
