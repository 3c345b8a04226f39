"""Redis tier: the same records as the disk tier (``kvboost/cache/payload.py``) in a Redis server, so processes on
several machines share one KV cache.

Layout in Redis (``ns`` is the ``namespace`` option; one namespace per deployment, ideally per model):

- ``ns:<key>``: one string per entry, the record bytes (header with the fingerprint, tensors, checksum);
- ``ns#index``: a hash, key -> the entry's books as compact JSON (nbytes, parent, segment, token ids, start,
  flags, fingerprint): what a process needs to index the entry without loading its tensors;
- ``ns#log``: a sorted set, key -> a sequence number (``ns#seq``, INCR) taken when it was written, so a process
  can ask cheaply for the entries written since it last looked (``ZRANGEBYSCORE``).
A write is one Lua script (SET record + HSET index + INCR + ZADD), so the record and its index entry appear
together; a delete is one script too. All keys of a namespace live on one server: Redis Cluster is not supported.

What a process sees. At construction the tier reads the index (``ns#log`` in write order, ``ns#index``) and checks
that the records still exist (index entries whose record is gone -- Redis evicted it under ``maxmemory`` -- are
removed); if the index hash itself is missing while ``ns#seq`` says records were written (Redis evicted the hash,
or someone deleted it), it is rebuilt by SCAN over ``ns:*`` reading only the record headers (GETRANGE). The ``KVStore`` builds its books (children and segment indexes) from this at its own
construction, so a new engine sees everything stored before it started. Entries other processes store *later*
are not in its books: ``refresh()`` asks for them (one ZRANGEBYSCORE + HMGET), and ``refresh_store(store)`` adds
them to a store's books (call it between requests, e.g. every few seconds; the lookup only asks the store).
A record another process deleted (evicted) is a miss when read (``missing_dropped``), and the store forgets it.

Writes: like the disk tier, ``put`` books the entry and hands a snapshot to a writer thread (the encode and the
network write are off the request path); a ``get`` of an entry still queued is served from the queue. A write that
fails (server down, out of memory under ``maxmemory-policy noeviction``) is dropped and counted
(``write_errors``): the entry later reads as missing, a miss. ``flush()`` waits for the queue.

Reads: ``get``/``peek`` GET the record and check it like the disk tier (framing, checksum, key, and the fingerprint
bound with ``bind_context``). A damaged record is deleted (DEL + index), counted (``corrupt_dropped``) and missed;
one of another fingerprint is never served (``foreign_skipped``; left in Redis). A read that fails with a
connection error or a timeout is a miss (``read_errors``, logged once); after such an error the tier does not
try the server again for ``retry_after_s`` seconds (reads miss, writes are dropped and counted), so a dead server
costs one timeout, not one per chunk. Nothing raises into a request.

Pipelined reads. ``prefetch(keys)`` loads the records of a chain of chunks in one round trip (a pipeline of GETs,
split into pipelines of at most ``pipeline_bytes`` of payload: pipelining saves round trips, which matter for small
records -- quantized KV, a remote server -- not for multi-MiB ones)
into a small buffer (``prefetch_bytes``) that the next ``get`` of each key consumes; ``prefetch_store(store,
keys)`` does it for the keys a store holds in its Redis tiers (what the lookup can call with the prompt's prefix
keys before its walk). Without that call, a ``get`` that goes to Redis reads ahead along the chain by itself: the
key plus up to ``readahead`` descendants, following the only child of each entry in this tier's index (a chain
with no branch; it stops at a branch), as many as fit in one pipeline. Measured on loopback
(experiments/results/redis_tier/), a round trip (0.09 ms) is small next to moving and decoding a record of a few
MiB (1.5-5 ms/MiB), and holding several prefetched records costs more than it saves there: pipelining pays for
small records (quantized KV) and for a server across a network.

Capacity. ``capacity`` is a byte budget (payload bytes, like the other tiers) that this process enforces with its
eviction policy over the entries it knows (evicting deletes the record for everyone). Several processes share the
namespace, each with its own view and budget, so Redis may hold more than one ``capacity``: set Redis's own
``maxmemory`` (to about capacity x 1.1 for the record headers, plus the index) with ``maxmemory-policy
allkeys-lru`` as the backstop; a record Redis evicts is a miss, never an error. ``remove`` (a promotion to a faster
tier, the engine dropping a redundant chunk) only forgets the entry in this process and leaves the record for the
others (``delete_on_remove=True`` deletes it). Persistence: the tier works with none (``save ""``,
``appendonly no``: a restarted server starts empty, the cache refills); with RDB snapshots a restart keeps the
cache, and AOF buys nothing worth its write cost for a cache (a lost record is only a miss).

Stacked as ``cache=[memory, redis]`` new entries live in the process's memory tier and reach Redis when evicted
from memory or at ``engine.close()`` (spill): other processes see them then. ``cache=redis`` alone shares every
entry as soon as the writer has sent it (every hit then pays a network load).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvboost.cache import payload as fmt
from kvboost.cache.entry import KVEntry
from kvboost.cache.record_tier import Loaded, RecordStats, RecordTier, _Job, _Rec, _Writer, decode_record
from kvboost.kv.sizing import parse_bytes
from kvboost.registry import CACHE_TIERS

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
_BATCH = 1000  # keys per index read / existence check at start
_HEAD_PROBE = 4096  # bytes GETRANGE reads of a record to parse its header (more when the header is longer)

# KEYS: record, index, log, seq; ARGV: key, meta, record bytes
_PUT_LUA = """
redis.call('SET', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local seq = redis.call('INCR', KEYS[4])
redis.call('ZADD', KEYS[3], seq, ARGV[1])
return seq
"""
# KEYS: record, index, log; ARGV: key
_DEL_LUA = """
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""
# KEYS: record, index, log; ARGV: key. Drops the index entry of a record that is gone (not one just rewritten).
_UNINDEX_IF_GONE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 1
end
return 0
"""
# KEYS: index, log, seq; ARGV: key, meta (index a record found by SCAN, when the index was lost)
_INDEX_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local seq = redis.call('INCR', KEYS[3])
redis.call('ZADD', KEYS[2], seq, ARGV[1])
return seq
"""


@dataclass
class RedisStats(RecordStats):
    read_errors: int = 0
    round_trips: int = 0  # network calls made for reads (a pipeline counts once)
    prefetched: int = 0  # records loaded by prefetch or read-ahead
    prefetch_hits: int = 0  # gets served from the prefetch buffer
    stale_index_dropped: int = 0  # index entries whose record was gone
    rebuilt_from_records: int = 0  # records indexed by SCAN (the index hash was missing)
    skipped_over_capacity: int = 0  # entries in Redis not indexed here: this process's budget was full
    refreshed: int = 0  # entries other processes wrote, indexed by refresh()
    connection_errors: int = 0


class _Link:
    """The client, scripts and the "server is down" state, shared by the tier and its writer thread."""

    def __init__(self, url: str, namespace: str, socket_timeout_s: float, retry_after_s: float,
                 stats: RedisStats) -> None:  # fmt: skip
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - redis is a dependency
            raise ImportError("the redis cache tier needs the redis package: pip install 'redis>=5'") from exc
        self.errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self.url = url
        # One immediate retry (a pooled connection a restarted server closed), then the error is ours.
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                           socket_connect_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 1),
                                           health_check_interval=0)  # fmt: skip
        self.ns = namespace
        self.index_key = f"{namespace}#index"
        self.log_key = f"{namespace}#log"
        self.seq_key = f"{namespace}#seq"
        self.put_script = self.client.register_script(_PUT_LUA)
        self.del_script = self.client.register_script(_DEL_LUA)
        self.unindex_script = self.client.register_script(_UNINDEX_IF_GONE_LUA)
        self.index_script = self.client.register_script(_INDEX_LUA)
        self.retry_after_s = retry_after_s
        self.stats = stats
        self._down_until = 0.0
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def record_key(self, key: str) -> str:
        return f"{self.ns}:{key}"

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, what: str, exc: BaseException) -> None:
        """A network error: count it, log the first of each kind, stop trying for ``retry_after_s``."""
        with self._lock:
            self.stats.connection_errors += 1
            self._down_until = time.monotonic() + self.retry_after_s
            first = what not in self._warned
            self._warned.add(what)
        if first:
            log.warning("kvboost redis tier (%s): %s failed: %s: %s (a miss; further errors are only counted)",
                        self.url, what, type(exc).__name__, exc)  # fmt: skip

    def put(self, key: str, meta: bytes, data: bytes) -> None:
        self.put_script(keys=[self.record_key(key), self.index_key, self.log_key, self.seq_key],
                        args=[key, meta, data])  # fmt: skip

    def delete(self, key: str) -> None:
        self.del_script(keys=[self.record_key(key), self.index_key, self.log_key], args=[key])


class _RedisWriter(_Writer):
    """The record tiers' write queue and thread, writing to Redis (one Lua script a write or delete)."""

    def __init__(self, link: _Link, max_pending_bytes: int, stats: RedisStats) -> None:
        super().__init__(max_pending_bytes, stats)
        self.link = link

    def _ready(self) -> bool:
        return self.link.available()  # a server just found down is not tried again for retry_after_s

    def _store(self, job: _Job, header: dict[str, Any], data: bytes) -> None:
        self.link.put(job.key, _meta_json(header), data)

    def _remove(self, job: _Job) -> bool:
        self.link.delete(job.key)
        return True

    def _report(self, job: _Job, exc: Exception) -> None:
        if isinstance(exc, self.link.errors):  # the server is gone or refuses: the entry becomes a miss later
            self.link.failed(job.kind, exc)
        else:
            log.warning("kvboost redis tier: cannot %s %s: %s", job.kind, job.key[:16], exc)


def _meta_json(header: dict[str, Any]) -> bytes:
    """The index's books on one record (a record header without the tensor description)."""
    meta = {name: header.get(name) for name in ("nbytes", "segment_key", "parent_key", "exact", "pinned",
                                                   "start", "token_ids", "fingerprint")}  # fmt: skip
    return json.dumps(meta, separators=(",", ":")).encode()


class _Missing:
    """A prefetched key whose record was not in Redis."""


_MISSING = _Missing()


class _Unavailable(Exception):
    """The server could not be reached (already counted and logged)."""


class _RecordGone(Exception):
    """An indexed key whose record was not in Redis (evicted by the server, or deleted by another process)."""


@CACHE_TIERS.register("redis")
class RedisTier(RecordTier):
    """Entries as records in a Redis server under ``namespace``, within a byte budget, evicting by a policy.

    Args:
        url: the server (``redis://host:port/db``, ``rediss://`` for TLS, ``unix:///path``).
        capacity: byte budget of the payloads this process keeps in the namespace (int or ``"20GiB"``).
        namespace: key prefix (records are ``<namespace>:<key>``); processes that share one share the cache.
        eviction: eviction policy, as for ``MemoryTier`` (default ``lru``).
        readahead: descendants a ``get`` that goes to Redis loads with it along a chain (0: none).
        prefetch_bytes: size of the buffer prefetched records wait in until read.
        pipeline_bytes: payload bytes one pipeline carries at most (a chain of larger records takes several round
            trips: a round trip is negligible next to moving a few MiB, and redis-py buffers a pipeline's whole
            reply, which measured slower than one GET at a time for large records).
        max_pending_bytes: payload bytes the write queue may hold before ``put`` waits for the writer.
        socket_timeout_s: connect and read timeout of each call.
        retry_after_s: after a network error, how long reads miss and writes are dropped without trying.
        delete_on_remove: ``remove`` (promotion to a faster tier) deletes the record too (default: it stays for
            the other processes; only eviction deletes).
        device: where loaded tensors go (default: the device they were stored from, when available, else CPU).
        background_bytes: records a prompt's lookup may have read ahead on the tier's reader thread at once
            (``prefetch_async``; 0 turns background reads off).

    See the module docstring for what another process sees, capacity and the Redis-side settings.
    """

    persistent = True

    def __init__(
        self,
        url: str = DEFAULT_URL,
        capacity: int | str = "8GiB",
        namespace: str = "kvboost",
        eviction: Any = "lru",
        readahead: int = 16,
        prefetch_bytes: int | str = "64MiB",
        pipeline_bytes: int | str = "4MiB",
        max_pending_bytes: int | str = "256MiB",
        socket_timeout_s: float = 5.0,
        retry_after_s: float = 2.0,
        delete_on_remove: bool = False,
        device: str | None = None,
        background_bytes: int | str = "256MiB",
    ) -> None:
        if not namespace or any(c in namespace for c in ":#"):
            raise ValueError(f"redis tier namespace must be non-empty without ':' or '#', got {namespace!r}")
        self.redis_stats = RedisStats()  # the tier's record_stats
        super().__init__(capacity=capacity, eviction=eviction, device=device, background_bytes=background_bytes,
                         stats=self.redis_stats)  # fmt: skip
        self.namespace = namespace
        self.readahead = max(0, int(readahead))
        self.prefetch_bytes = parse_bytes(prefetch_bytes)
        self.pipeline_bytes = parse_bytes(pipeline_bytes)
        self.delete_on_remove = bool(delete_on_remove)
        self._link = _Link(url, namespace, float(socket_timeout_s), float(retry_after_s), self.redis_stats)
        self._writer = _RedisWriter(self._link, parse_bytes(max_pending_bytes), self.redis_stats)
        self._children: dict[str, dict[str, None]] = {}  # parent -> exact children in this tier (read-ahead)
        self._buffer: OrderedDict[str, bytes | _Missing] = OrderedDict()  # prefetched records
        self._buffer_bytes = 0
        self._seq = 0  # the highest ns#log sequence number this process has indexed
        self._finalizer = weakref.finalize(self, self._writer.close)
        self._load_index()

    @property
    def url(self) -> str:
        return self._link.url

    @property
    def client(self) -> Any:
        """The ``redis.Redis`` client (for tests and tools)."""
        return self._link.client

    # ------------------------------------------------------------------ contract (put: RecordTier)
    @property
    def location(self) -> str:
        return f"{self.namespace} at {self.url}"

    def _stats_place(self) -> dict[str, Any]:
        return {"url": _redact(self.url), "namespace": self.namespace}

    # ------------------------------------------------------------------ pipelined reads, other processes' writes
    def prefetch(self, keys: Iterable[str]) -> int:
        """Load the records of ``keys`` (those this tier holds and has not at hand) in one round trip into the
        prefetch buffer, which the next ``get``/``peek`` of each consumes. Returns how many were requested."""
        want = [k for k in dict.fromkeys(keys) if self._needs_fetch(k)]
        if not want:
            return 0
        try:
            self._fetch_into_buffer(want)
        except _Unavailable:
            return 0
        return len(want)

    def refresh(self) -> list[KVEntry]:
        """Index the entries other processes wrote since this tier last looked (within the budget); returns
        their books (``peek_meta`` entries). A ``KVStore`` does not see them until they are added to its books:
        use ``refresh_store``."""
        if not self._link.available():
            return []
        try:
            added = self._sync()
        except self._link.errors as exc:
            self._link.failed("refresh", exc)
            return []
        self.redis_stats.refreshed += len(added)
        return [self._index[k].meta_entry(k) for k in added if k in self._index]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush and stop the writer; close the connections. Idempotent."""
        super().close()
        try:
            self._link.client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass

    # ------------------------------------------------------------------ books (the children and the buffer too)
    def _add(self, key: str, rec: _Rec) -> None:
        super()._add(key, rec)
        if rec.exact and rec.parent is not None:
            self._children.setdefault(rec.parent, {})[key] = None

    def forget(self, key: str) -> None:
        """Drop ``key`` from this process's books, leaving the record in Redis for the others."""
        self._forget(key)

    def _forget(self, key: str) -> _Rec | None:
        """Drop ``key`` from the books (the record in Redis is left as it is)."""
        rec = super()._forget(key)
        if rec is not None and rec.exact and rec.parent is not None:
            kids = self._children.get(rec.parent)
            if kids is not None:
                kids.pop(key, None)
                if not kids:
                    del self._children[rec.parent]
        self._unbuffer(key)
        return rec

    def _unbuffer(self, key: str) -> bytes | _Missing | None:
        data = self._buffer.pop(key, None)
        if isinstance(data, bytes):
            self._buffer_bytes -= len(data)
        return data

    def _needs_fetch(self, key: str) -> bool:
        return key not in self._buffer and super()._needs_fetch(key)

    # ------------------------------------------------------------------ reads
    def _chain_after(self, key: str) -> list[str]:
        """Up to ``readahead`` descendants of ``key`` along its only-child chain, not at hand yet, as long as they
        fit with ``key`` in one pipeline (``pipeline_bytes``): read-ahead saves round trips, which only matter
        for small records; loading multi-MiB records early only holds memory."""
        out: list[str] = []
        node = key
        size = self._index[key].nbytes if key in self._index else 0
        while len(out) < self.readahead:
            kids = self._children.get(node)
            if not kids or len(kids) != 1:
                break
            node = next(iter(kids))
            if self._needs_fetch(node):
                size += self._index[node].nbytes
                if size > self.pipeline_bytes:
                    break
                out.append(node)
        return out

    def _fetch(self, keys: list[str]) -> list[bytes | None]:
        """GET ``keys`` in pipelines of at most ``pipeline_bytes`` of payload each (one round trip for a chain of
        small records; raises ``_Unavailable``, counted and logged)."""
        link = self._link
        if not link.available():
            self.redis_stats.read_errors += 1
            raise _Unavailable
        groups = self._pipeline_groups(keys)
        t0 = time.perf_counter()
        values: list[bytes | None] = []
        try:
            for group in groups:
                pipe = link.client.pipeline(transaction=False)
                for k in group:
                    pipe.get(link.record_key(k))
                values.extend(pipe.execute())
                self.redis_stats.round_trips += 1
        except link.errors as exc:
            self.redis_stats.read_errors += 1
            link.failed("read", exc)
            raise _Unavailable from None
        self.redis_stats.read_ms += (time.perf_counter() - t0) * 1e3
        self.redis_stats.read_bytes += sum(len(v) for v in values if v is not None)
        return values

    def _pipeline_groups(self, keys: list[str]) -> list[list[str]]:
        """``keys`` cut into pipelines of at most ``pipeline_bytes`` of payload (one key at least each)."""
        groups: list[list[str]] = [[]]
        size = 0
        for k in keys:
            rec = self._index.get(k)
            n = rec.nbytes if rec is not None else 0
            if groups[-1] and size + n > self.pipeline_bytes:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += n
        return groups

    def _buffer_put(self, keys: list[str], values: list[bytes | None]) -> None:
        for k, value in zip(keys, values):
            self._unbuffer(k)
            if value is None:
                self._buffer[k] = _MISSING
            else:
                self._buffer[k] = value
                self._buffer_bytes += len(value)
                self.redis_stats.prefetched += 1
        while self._buffer_bytes > self.prefetch_bytes and self._buffer:  # oldest first
            self._unbuffer(next(iter(self._buffer)))

    def _fetch_into_buffer(self, keys: list[str]) -> None:
        self._buffer_put(keys, self._fetch(keys))

    def _load(self, key: str, *, drop_on_error: bool, ahead: bool = True) -> KVEntry | None:
        """Read (from a background read, the prefetch buffer, or Redis reading ahead along the chain: ``ahead``)
        and check the record of ``key``; on failure None, and (``drop_on_error``) the key forgotten and a damaged
        record deleted."""
        loaded = self._take_ahead(key)
        if loaded is None:
            data = self._unbuffer(key)
            if isinstance(data, bytes):
                self.redis_stats.prefetch_hits += 1
            elif data is None:
                later = self._chain_after(key) if ahead else []
                try:
                    values = self._fetch([key, *later])  # counts bytes, time and errors itself
                except _Unavailable:
                    if drop_on_error:
                        self._forget(key)  # the store forgets it too (a miss)
                    return None
                data = values[0]
                self._buffer_put(later, values[1:])
            if not isinstance(data, bytes):
                loaded = Loaded(None, _RecordGone(), 0, 0.0)
            else:
                loaded = decode_record(data, key, self._current_fingerprint(), self.device, time.perf_counter())
                loaded.read_bytes = 0  # _fetch counted it
        return self._settle(key, loaded, drop_on_error=drop_on_error)

    def _settle(self, key: str, loaded: Loaded, *, drop_on_error: bool) -> KVEntry | None:
        """``RecordTier._settle``; the bytes moved and the round trips count whether or not the record is served
        (the network carried them)."""
        stats = self.redis_stats
        stats.round_trips += loaded.round_trips
        if loaded.error is not None:
            stats.read_bytes += loaded.read_bytes
            stats.read_ms += loaded.ms
        return super()._settle(key, loaded, drop_on_error=drop_on_error)

    def _drop_damaged(self, key: str, loaded: Loaded) -> None:
        """Forget ``key`` and delete its record (DEL + index, queued behind any write of it)."""
        log.warning("kvboost redis tier: dropping damaged record %s:%s: %s", self.namespace, key[:16], loaded.error)
        self._discard(key)

    def _read_failed(self, key: str, exc: BaseException, *, drop_on_error: bool) -> bool:
        if isinstance(exc, _Unavailable):  # a background read found the server away (logged by the link)
            self.redis_stats.read_errors += 1
            return True
        if isinstance(exc, _RecordGone):
            if drop_on_error:
                self.redis_stats.missing_dropped += 1
                self._unindex_if_gone(key)
            return True
        return False

    def _read_job(self, keys: list[str]) -> Iterator[tuple[str, Loaded]]:
        groups = self._pipeline_groups(keys)
        link = self._link
        record_keys = {k: link.record_key(k) for k in keys}

        def job() -> Iterator[tuple[str, Loaded]]:
            for n, group in enumerate(groups):
                t0 = time.perf_counter()
                try:
                    if not link.available():
                        raise _Unavailable
                    pipe = link.client.pipeline(transaction=False)
                    for k in group:
                        pipe.get(record_keys[k])
                    values = pipe.execute()
                except (_Unavailable, *link.errors) as exc:
                    if not isinstance(exc, _Unavailable):
                        link.failed("read", exc)
                    for k in (k for g in groups[n:] for k in g):
                        yield k, Loaded(None, _Unavailable(), 0, 0.0)
                    return
                fetch_ms = (time.perf_counter() - t0) * 1e3
                total = sum(len(v) for v in values if v is not None) or 1
                for i, (k, value) in enumerate(zip(group, values)):
                    trips = 1 if i == 0 else 0
                    if value is None:
                        yield k, Loaded(None, _RecordGone(), 0, 0.0, round_trips=trips)
                        continue
                    share = fetch_ms * len(value) / total  # its share of the pipeline's network time
                    yield k, Loaded(None, None, len(value), share, round_trips=trips, data=value)

        return job()

    def _unindex_if_gone(self, key: str) -> None:
        link = self._link
        if not link.available():
            return
        try:
            if link.unindex_script(keys=[link.record_key(key), link.index_key, link.log_key], args=[key]):
                self.redis_stats.stale_index_dropped += 1
        except link.errors as exc:
            link.failed("index cleanup", exc)

    # ------------------------------------------------------------------ the index in Redis
    def _load_index(self) -> None:
        """Index what the namespace holds (write order into the eviction policy); rebuild a lost index hash."""
        link = self._link
        try:
            client = link.client
            # Every write INCRs ns#seq: a namespace with a counter but no index hash lost its index (Redis evicted
            # it, or someone deleted it); the records are still there to be indexed from their headers.
            if not client.exists(link.index_key) and client.exists(link.seq_key):
                self._rebuild_index()
            self._sync()
        except link.errors as exc:  # no server: start empty; every read misses, every write is counted
            link.failed("start-up index read", exc)
        self.redis_stats.scanned = len(self._index)

    def _sync(self) -> list[str]:
        """Index the entries of ``ns#log`` after ``self._seq`` that this process does not know; checks that each
        record exists (index entries of records Redis evicted are removed). Returns the keys added."""
        link, client = self._link, self._link.client
        added: list[str] = []
        while True:
            rows = client.zrangebyscore(link.log_key, f"({self._seq}", "+inf", start=0, num=_BATCH, withscores=True)
            if not rows:
                break
            self._seq = max(self._seq, int(max(score for _, score in rows)))
            keys = []
            for raw, _ in rows:
                try:
                    key = raw.decode()
                except UnicodeDecodeError:
                    continue
                if key not in self._index:
                    keys.append(key)
            if keys:
                pipe = client.pipeline(transaction=False)
                pipe.hmget(link.index_key, keys)
                for k in keys:
                    pipe.exists(link.record_key(k))
                metas, *exists = pipe.execute()
                for key, meta, present in zip(keys, metas, exists):
                    if meta is None or not present:
                        if not present:
                            self._unindex_if_gone(key)
                        continue
                    try:
                        info = json.loads(meta)
                        rec = _Rec.from_meta(info)
                        rec.meta_entry(key)  # validates (an exact entry has a parent, ...)
                    except (ValueError, TypeError, KeyError, OverflowError) as exc:
                        log.warning("kvboost redis tier: dropping damaged index entry %s: %s", key[:16], exc)
                        self.redis_stats.corrupt_dropped += 1
                        link.delete(key)
                        continue
                    if self._used + rec.nbytes > self.capacity_bytes:
                        self.redis_stats.skipped_over_capacity += 1
                        continue
                    self._add(key, rec)
                    added.append(key)
            if len(rows) < _BATCH:
                break
        return added

    def _rebuild_index(self) -> None:
        """The index hash is missing (a new namespace, or Redis evicted it): index the records found by SCAN from
        their headers (GETRANGE; no tensor byte is read). Damaged records are deleted and counted."""
        link, client = self._link, self._link.client
        pattern = _glob_escape(self.namespace) + ":*"
        prefix = len(self.namespace) + 1
        batch: list[bytes] = []

        def index_batch(names: list[bytes]) -> None:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.getrange(name, 0, _HEAD_PROBE - 1)
                pipe.strlen(name)
            out = pipe.execute()
            for name, head, size in zip(names, out[0::2], out[1::2]):
                key = name[prefix:].decode(errors="replace")
                if not size:
                    continue  # gone meanwhile
                try:
                    if len(head) >= fmt.PREFIX_SIZE:
                        _, head_len, _, _ = fmt.read_prefix(head)
                        if fmt.PREFIX_SIZE + head_len > len(head):
                            head = client.getrange(name, 0, fmt.PREFIX_SIZE + head_len - 1)
                    header = fmt.decode_header(head, file_size=size)
                    if header["key"] != key:
                        raise fmt.CorruptRecord(f"record {key[:16]}... holds key {header['key'][:16]}...")
                    _Rec.from_meta(header).meta_entry(key)
                except fmt.CorruptRecord as exc:
                    log.warning("kvboost redis tier: dropping damaged record %s:%s: %s", self.namespace, key[:16],
                                exc)  # fmt: skip
                    self.redis_stats.corrupt_dropped += 1
                    client.delete(name)
                    continue
                except (fmt.RecordError, ValueError, TypeError, KeyError, OverflowError):
                    self.redis_stats.other_version_skipped += 1
                    continue
                link.index_script(keys=[link.index_key, link.log_key, link.seq_key], args=[key, _meta_json(header)])
                self.redis_stats.rebuilt_from_records += 1

        for name in client.scan_iter(match=pattern, count=_BATCH):
            batch.append(name)
            if len(batch) >= _BATCH:
                index_batch(batch)
                batch = []
        if batch:
            index_batch(batch)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _redact(url: str) -> str:
    """``url`` without a password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


# ---------------------------------------------------------------------------------------------- store helpers
def prefetch_store(store: Any, keys: Iterable[str]) -> int:
    """Prefetch, in one round trip per Redis tier, the records of ``keys`` that ``store``'s tiers hold below
    memory (e.g. a prompt's prefix keys before the lookup walks them). Returns the number requested."""
    keys = list(keys)
    total = 0
    for tier in store.tiers:
        fetch = getattr(tier, "prefetch", None)
        if fetch is not None:
            total += fetch([k for k in keys if k in tier])
    return total


def refresh_store(store: Any) -> int:
    """``store.refresh()``: add the entries other processes wrote to its shared tiers since they last looked."""
    return store.refresh()
