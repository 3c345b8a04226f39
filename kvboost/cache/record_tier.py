"""What the tiers below memory (``disk``, ``redis``) share: books of serialised records keyed like the store, the
write queue that puts records on the medium off the request path, and the read side.

A subclass owns only its medium: where a record lives (a file, a Redis key), how its writer thread stores and
deletes one (``_Writer._store``/``_remove``), how a record is read now (``_load``) or in the background
(``_read_job``), and what it does with a damaged or missing one (``_drop_damaged``, ``_read_failed``). What this
module owns:

- The books. ``_index`` maps a key to its ``_Rec`` (size, segment, parent, flags, start, token ids: what a
  payload-less ``meta_entry`` needs, so the store and the eviction guard never load tensors); ``_used`` (payload
  bytes), ``_pinned`` and the eviction policy follow it through ``_add``/``_forget``. ``put`` (evict to fit,
  replace, queue the write), ``remove``, ``discard``, ``clear``, ``get``/``peek`` (the write queue first, then the
  last record read -- peek then get, get then remove -- then the medium), ``stats()`` and ``close`` are written
  once here. A subclass that keeps more books (redis: the children for read-ahead, a prefetch buffer) extends
  ``_add``/``_forget``.
- The counters both tiers keep (``RecordStats``; each tier's stats dataclass adds its own) and the outcome of a
  read (``_settle``): served, damaged (deleted: it will never decode), of another fingerprint or format version
  (left for whoever can read it), or gone from the medium.
- The writer (``_Writer``): a queue and one thread. ``put`` books the entry and queues a snapshot (``_detach``),
  the thread encodes and stores it; a ``get`` of a key still queued is served from the queue; deletes go through
  the same queue, in order, so a delete never overtakes the write of the same key. ``max_pending_bytes`` bounds
  the queue (a ``put`` that would exceed it waits: ``write_stalls``). A failed write is counted
  (``write_errors``), never raised: the entry is a miss later.

Background reads (``prefetch_async``): the store hands a tier the keys of a prompt's chain before the lookup walks
it; the tier reads those records' bytes, in chain order, on one worker thread, so waiting on the medium for chunk
``i + 1`` (a file read, a Redis round trip: calls that release the GIL) overlaps what the request does with chunk
``i``. Decoding (checksum, tensors) stays on the caller's thread when the key is consumed (``_take_ahead`` inside
the subclass's load): it is CPU work that would only contend for the GIL, and the books (a damaged record dropped,
stats) change on one thread, so the tier needs no lock. A subclass implements ``_read_job(keys)``: a generator of
``(key, Loaded)`` with the raw bytes, run on the worker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import abstractmethod
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvboost.cache import payload as fmt
from kvboost.cache.entry import KVEntry
from kvboost.cache.tier_base import CacheTier, choose_victims
from kvboost.kv.sizing import parse_bytes
from kvboost.registry import EVICTION


@dataclass
class Loaded:
    """One record read off the request path: the decoded entry, or the error that stopped the read or decode."""

    entry: KVEntry | None
    error: BaseException | None
    read_bytes: int  # bytes of the record read (0 when the read failed)
    ms: float  # time the read (and decode, once decoded) took
    ino: int | None = None  # disk: the inode read (a damaged file is deleted only if it is still that one)
    round_trips: int = 0  # redis: pipelines sent for this record's group (counted on its first record)
    data: bytes | None = None  # a background read's raw record, not decoded yet


@dataclass
class BackgroundReadStats:
    """Counters of ``prefetch_async`` (merged into the tier's ``stats()``)."""

    background_queued: int = 0  # records handed to the worker
    background_used: int = 0  # reads served from a background read
    background_wait_ms: float = 0.0  # time reads waited for the worker (0 when it was ahead)


@dataclass
class RecordStats:
    """The counters every record tier keeps (first in its ``stats()``; a tier's own dataclass adds its own)."""

    writes: int = 0
    write_bytes: int = 0
    write_errors: int = 0
    write_stalls: int = 0  # puts that found the queue full and waited for the writer (backpressure)
    write_stall_ms: float = 0.0  # time those puts waited
    deletes: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_ms: float = 0.0
    served_from_queue: int = 0
    corrupt_dropped: int = 0
    missing_dropped: int = 0
    foreign_skipped: int = 0
    other_version_skipped: int = 0
    scanned: int = 0  # entries indexed at start


class _MetaPayload:
    """Stands for a payload that was not loaded (``peek_meta``, entries evicted out of the store)."""

    __slots__ = ("nbytes", "num_tokens")

    def __init__(self, nbytes: int, num_tokens: int) -> None:
        self.nbytes, self.num_tokens = nbytes, num_tokens

    def __repr__(self) -> str:
        return f"<payload not loaded: {self.nbytes} bytes, {self.num_tokens} tokens>"


@dataclass(slots=True)
class _Rec:
    """The index's books on one record (no tensors)."""

    nbytes: int
    segment: str
    parent: str | None
    exact: bool
    pinned: bool
    start: int
    tokens: array

    @classmethod
    def from_entry(cls, entry: KVEntry) -> _Rec:
        return cls(entry.nbytes, entry.segment_key, entry.parent_key, entry.exact, entry.pinned, entry.start,
                   array("q", entry.token_ids))  # fmt: skip

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> _Rec:
        """From a record header, or the redis index's JSON books (the same field names)."""
        return cls(int(meta["nbytes"]), str(meta["segment_key"]), meta.get("parent_key"), bool(meta["exact"]),
                   bool(meta.get("pinned", False)), int(meta["start"]), array("q", meta["token_ids"]))  # fmt: skip

    def meta_entry(self, key: str) -> KVEntry:
        ids = tuple(self.tokens)
        return KVEntry(key, self.segment, self.parent, ids, self.start, _MetaPayload(self.nbytes, len(ids)),
                       pinned=self.pinned, exact=self.exact)  # fmt: skip


# ---------------------------------------------------------------------------------------------- writes
@dataclass(eq=False)
class _Job:
    kind: str  # "write" | "delete"
    key: str
    entry: KVEntry | None = None
    fingerprint: str = ""
    quantizer: dict[str, Any] | None = None
    nbytes: int = 0
    cancelled: bool = False


class _Writer:
    """The write queue and its thread; a subclass stores and deletes records on its medium (``_store``,
    ``_remove``, ``_report``). Holds no reference to the tier (so the tier can be collected)."""

    thread_name = "kvboost-disk-writer"  # the redis tier's writer thread has always been named so too

    def __init__(self, max_pending_bytes: int, stats: RecordStats) -> None:
        self.max_pending_bytes = max_pending_bytes
        self.stats = stats
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._pending: dict[str, _Job] = {}  # key -> its latest write not yet on the medium
        self._pending_bytes = 0
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the medium (the writer's thread)
    def _ready(self) -> bool:
        """Whether to try the medium now (False: the job is dropped and counted as a write error)."""
        return True

    def _store(self, job: _Job, header: dict[str, Any], data: bytes) -> None:
        """Store the encoded record ``data`` (whose header is ``header``) of ``job.key``; raise on failure."""
        raise NotImplementedError

    def _remove(self, job: _Job) -> bool:
        """Delete the record of ``job.key``; whether there was one to delete (counted in ``deletes``)."""
        raise NotImplementedError

    def _report(self, job: _Job, exc: Exception) -> None:
        """Log a failed job (already counted in ``write_errors``)."""

    # ------------------------------------------------------------------ producer side (the tier's thread)
    def submit_write(self, job: _Job) -> None:
        with self._cv:
            self._cancel_locked(job.key)
            if self._pending_bytes and self._pending_bytes + job.nbytes > self.max_pending_bytes:
                # Backpressure: wait for the writer rather than drop the entry. A put here is an entry some tier
                # above gave up (an eviction, a refused put, a spill at close): dropping it would lose a pinned
                # entry or a spill that should persist, and the wait is bounded by max_pending_bytes of writes.
                self.stats.write_stalls += 1
                t0 = time.perf_counter()
                self._ensure_thread_locked()
                while self._pending_bytes and self._pending_bytes + job.nbytes > self.max_pending_bytes:
                    if not self._thread_alive():
                        break
                    self._cv.wait(0.1)
                self.stats.write_stall_ms += (time.perf_counter() - t0) * 1e3
            self._pending[job.key] = job
            self._pending_bytes += job.nbytes
            self._queue.append(job)
            self._ensure_thread_locked()
            self._cv.notify_all()

    def submit_delete(self, key: str) -> None:
        with self._cv:
            self._cancel_locked(key)
            self._queue.append(_Job("delete", key))
            self._ensure_thread_locked()
            self._cv.notify_all()

    def pending_entry(self, key: str) -> KVEntry | None:
        with self._cv:
            job = self._pending.get(key)
            return job.entry if job is not None else None

    def pending_count(self) -> tuple[int, int]:
        with self._cv:
            return len(self._pending), self._pending_bytes

    def flush(self) -> None:
        """Return once every queued write and delete is done."""
        with self._cv:
            while self._queue or self._busy:
                if not self._thread_alive():
                    break
                self._cv.wait(0.1)
        self._drain_here()  # no live thread (interpreter exit, or it died): do the rest in this thread

    def close(self, *, discard: bool = False) -> None:
        if discard:
            with self._cv:
                for job in self._queue:
                    job.cancelled = True
                self._queue.clear()
                self._pending.clear()
                self._pending_bytes = 0
        self.flush()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # ------------------------------------------------------------------ internals
    def _cancel_locked(self, key: str) -> None:
        job = self._pending.pop(key, None)
        if job is not None:
            job.cancelled = True
            self._pending_bytes -= job.nbytes

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _ensure_thread_locked(self) -> None:
        if self._thread_alive():
            return
        self._stop = False
        try:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
        except RuntimeError:  # interpreter shutting down: flush() drains in the caller's thread
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
            try:
                self._do(job)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _drain_here(self) -> None:
        while True:
            with self._cv:
                if not self._queue or self._busy:
                    return
                job = self._queue.popleft()
            self._do(job)

    def _do(self, job: _Job) -> None:
        try:
            if job.kind == "write" and job.cancelled:
                return
            if not self._ready():
                self.stats.write_errors += 1
                return
            if job.kind == "delete":
                if self._remove(job):
                    self.stats.deletes += 1
            else:
                assert job.entry is not None
                header = fmt.build_header(job.entry, fingerprint=job.fingerprint, quantizer_settings=job.quantizer)
                data = fmt.encode_prepared(header, fmt.prepare_tensors(job.entry.payload))
                if job.cancelled:  # replaced or removed while it was encoded
                    return
                self._store(job, header, data)
                self.stats.writes += 1
                self.stats.write_bytes += len(data)
        except Exception as exc:  # noqa: BLE001 - a full disk or a gone server must not kill the thread (a miss later)
            self.stats.write_errors += 1
            self._report(job, exc)
        finally:
            if job.kind == "write":
                with self._cv:
                    if self._pending.get(job.key) is job:
                        del self._pending[job.key]
                        self._pending_bytes -= job.nbytes


def _detach(payload: Any) -> Any:
    """``payload`` with every tensor that is a view into a larger buffer cloned (so later writes to that buffer
    cannot reach the queued record); payloads whose tensors own their storage are returned as they are."""
    if not dataclasses.is_dataclass(payload):
        return payload
    changes = {}
    for f in dataclasses.fields(payload):
        t = getattr(payload, f.name)
        if isinstance(t, torch.Tensor) and not _owns_storage(t):
            changes[f.name] = t.clone(memory_format=torch.contiguous_format)
    return dataclasses.replace(payload, **changes) if changes else payload


def _owns_storage(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


# ---------------------------------------------------------------------------------------------- reads
def record_device(preferred: str | None, data: bytes) -> str | None:
    """Where a record's tensors go: ``preferred`` if set, else the device they were stored from when this process
    has CUDA and they were all on one device, else None (CPU)."""
    if preferred is not None:
        return preferred
    if not torch.cuda.is_available():
        return None
    try:
        header = fmt.decode_header(data)
        devices = {spec.get("device", "cpu") for spec in header["tensors"].values()}
    except fmt.RecordError:
        return None
    device = next(iter(devices)) if len(devices) == 1 else "cpu"
    return device if device != "cpu" else None


def decode_record(data: bytes, key: str, fingerprint: str | None, device: str | None, t0: float,
                  **extra: Any) -> Loaded:  # fmt: skip
    """``fmt.decode`` as a :class:`Loaded` (the error caught, not raised): pure, safe on any thread."""
    try:
        entry = fmt.decode(data, expected_fingerprint=fingerprint, expected_key=key,
                           device=record_device(device, data))  # fmt: skip
    except fmt.RecordError as exc:
        return Loaded(None, exc, len(data), (time.perf_counter() - t0) * 1e3, **extra)
    return Loaded(entry, None, len(data), (time.perf_counter() - t0) * 1e3, **extra)


def _run_read_job(job: Iterator[tuple[str, Loaded]], futures: dict[str, Future]) -> None:
    """Worker: resolve each key's future as soon as its record is read; a key the job did not reach (it raised)
    resolves to None (the caller reads it itself)."""
    try:
        for key, loaded in job:
            fut = futures.get(key)
            if fut is not None and not fut.done():
                fut.set_result(loaded)
    finally:
        for fut in futures.values():
            if not fut.done():
                fut.set_result(None)


class RecordTier(CacheTier):
    """The books, writes, reads and background reads common to record tiers (see the module docstring)."""

    may_lose_entries = True
    #: ``remove`` (a promotion to a faster tier) deletes the record too; the redis tier leaves it for the other
    #: processes unless asked (only eviction deletes).
    delete_on_remove: bool = True
    #: Bytes of records ``prefetch_async`` keeps in flight or waiting at most (the rest of a chain is read on
    #: demand); records, not decoded tensors, so a dequantized copy is not counted.
    background_bytes: int
    _closed: bool = False
    _ahead: dict[str, Future] | None = None
    _pool: ThreadPoolExecutor | None = None
    _background: BackgroundReadStats | None = None
    _writer: _Writer
    _finalizer: Callable[[], Any]  # flushes and stops the writer (a weakref.finalize, also run at exit)

    def __init__(self, *, capacity: int | str, eviction: Any, device: str | None, background_bytes: int | str,
                 stats: RecordStats) -> None:  # fmt: skip
        """The books, empty (the subclass then makes its ``_writer`` and ``_finalizer`` and indexes what the
        medium holds)."""
        self.capacity_bytes = parse_bytes(capacity)
        self.eviction = EVICTION.build("lru" if eviction is None else eviction)
        self.device = device
        self.background_bytes = parse_bytes(background_bytes, allow_zero=True)
        self.record_stats = stats
        self._index: dict[str, _Rec] = {}
        self._used = 0
        self._pinned: set[str] = set()
        self._fingerprint: Callable[[], str] | None = None
        self._quantizer: dict[str, Any] | None = None
        self._last: tuple[str, KVEntry] | None = None  # the last entry read (peek then get; get then remove)

    # ------------------------------------------------------------------ the medium
    @property
    @abstractmethod
    def location(self) -> str:
        """Where the records live (for messages)."""

    @abstractmethod
    def _stats_place(self) -> dict[str, Any]:
        """Where the records live, as ``stats()`` keys (disk: ``path``; redis: ``url``, ``namespace``)."""

    # ------------------------------------------------------------------ writes and books
    def put(self, entry: KVEntry) -> list[KVEntry]:
        if self._closed:
            raise RuntimeError(f"{self.registry_name} tier {self.location} is closed")
        if entry.nbytes > self.capacity_bytes:
            return [entry]  # rejected: it could never fit
        old = self._index.get(entry.key)
        freed = old.nbytes if old is not None else 0
        need = self._used - freed + entry.nbytes - self.capacity_bytes
        victims: list[str] = []
        if need > 0:
            victims = choose_victims(self, self.eviction, self._pinned, entry, need, self._meta_of)
            if victims is None:  # everything left is protected: reject, evict nothing
                return [entry]
        evicted = [self._evict(k) for k in victims]
        if old is not None:
            self._forget(entry.key)  # the new record replaces the old one (no delete queued)
        self._add(entry.key, self._queue_write(entry))
        return evicted

    def _queue_write(self, entry: KVEntry) -> _Rec:
        """Hand ``entry`` to the writer (a snapshot of its tensors); returns its books."""
        snapshot = dataclasses.replace(entry, payload=_detach(entry.payload))
        fp = self._current_fingerprint()
        self._writer.submit_write(_Job("write", entry.key, snapshot, fp or "", self._quantizer, entry.nbytes))
        return _Rec.from_entry(entry)

    def remove(self, key: str) -> KVEntry | None:
        rec = self._index.get(key)
        if rec is None:
            return None
        entry = self._writer.pending_entry(key) or self._cached(key)
        if entry is None:
            entry = self._load(key, drop_on_error=False, ahead=False) or rec.meta_entry(key)
        if self.delete_on_remove:
            self._discard(key)
        else:
            self._forget(key)
        return entry

    def discard(self, key: str) -> None:
        """Drop ``key`` and delete its record, without reading it."""
        if key in self._index:
            self._discard(key)

    def clear(self) -> None:
        for key in list(self._index):
            self._discard(key)

    def _add(self, key: str, rec: _Rec) -> None:
        """Book ``rec`` under ``key`` (size, pins, eviction policy)."""
        self._index[key] = rec
        self._used += rec.nbytes
        if rec.pinned:
            self._pinned.add(key)
        self.eviction.on_insert(key)

    def _forget(self, key: str) -> _Rec | None:
        """Drop ``key`` from the books (the record is left as it is); its books, or None."""
        rec = self._index.pop(key, None)
        if rec is not None:
            self._used -= rec.nbytes
            self._pinned.discard(key)
            self.eviction.on_remove(key)
        if self._last is not None and self._last[0] == key:
            self._last = None
        self._drop_ahead(key)
        return rec

    def _discard(self, key: str) -> None:
        """Drop ``key`` from the books and delete its record (queued behind any write of it)."""
        if self._forget(key) is not None:
            self._writer.submit_delete(key)

    def _evict(self, key: str) -> KVEntry:
        """Evict ``key`` during a put: its entry with the payload when a slower tier takes it, else its books."""
        rec = self._index[key]
        entry = None
        if not self.last_in_store:
            entry = (self._writer.pending_entry(key) or self._cached(key)
                     or self._load(key, drop_on_error=False, ahead=False))  # fmt: skip
        self._discard(key)
        return entry if entry is not None else rec.meta_entry(key)

    # ------------------------------------------------------------------ context from the engine
    def bind_context(self, *, fingerprint: str | Callable[[], str] | None = None,
                     quantizer_settings: dict[str, Any] | None = None) -> None:  # fmt: skip
        """The engine's fingerprint (a string, or a callable giving the current one): written into every record
        and required of every record read. Unbound, records carry an empty fingerprint and any is read (the keys
        hold the fingerprint anyway)."""
        if fingerprint is None or callable(fingerprint):
            self._fingerprint = fingerprint
        else:
            self._fingerprint = lambda fp=str(fingerprint): fp
        self._quantizer = dict(quantizer_settings) if quantizer_settings else None

    def _current_fingerprint(self) -> str | None:
        return self._fingerprint() if self._fingerprint is not None else None

    def _meta_of(self, key: str) -> KVEntry | None:
        """The books of ``key`` as a payload-less entry (for the eviction guard), or None."""
        rec = self._index.get(key)
        return rec.meta_entry(key) if rec is not None else None

    # ------------------------------------------------------------------ lifecycle and stats
    def flush(self) -> None:
        """Wait until every queued write and delete is done (on disk; sent to Redis, or failed and counted)."""
        self._writer.flush()

    def close(self) -> None:
        """Stop the background reader, flush and stop the writer (the disk tier deletes a private folder
        instead of flushing it). Idempotent."""
        self._closed = True
        self._stop_background()
        self._finalizer()

    def stats(self) -> dict[str, Any]:
        pending, pending_bytes = self._writer.pending_count()
        out: dict[str, Any] = dataclasses.asdict(self.record_stats)
        out.update(dataclasses.asdict(self.background_stats))
        out.update(self._stats_place())
        out.update(persistent=self.persistent, pending_writes=pending, pending_bytes=pending_bytes)
        out["read_ms_per_mib"] = out["read_ms"] / (out["read_bytes"] / 2**20) if out["read_bytes"] else None
        return out

    # ------------------------------------------------------------------ background reads
    @property
    def background_stats(self) -> BackgroundReadStats:
        if self._background is None:
            self._background = BackgroundReadStats()
        return self._background

    def _needs_fetch(self, key: str) -> bool:
        """Whether reading ``key`` would go to the medium (held, not in the write queue, not the last read)."""
        return key in self._index and self._cached(key) is None and self._writer.pending_entry(key) is None

    @abstractmethod
    def _read_job(self, keys: list[str]) -> Iterator[tuple[str, Loaded]]:
        """A generator, run on the worker thread, that reads the raw records of ``keys`` in order (``Loaded`` with
        ``data``, or the read's error). It must capture on the calling thread whatever books it needs (files)
        and touch none later."""

    def prefetch_async(self, keys: Iterable[str]) -> int:
        """Start reading the records of ``keys`` (in this order; those the tier holds and has not at hand) on the
        tier's worker thread; the next ``get``/``peek`` of each waits for that read instead of starting its own.
        Stops once ``background_bytes`` of records are queued. Returns how many were queued."""
        if self._closed:
            return 0
        if self._ahead is None:
            self._ahead = {}
        size = sum(self._index[k].nbytes for k in self._ahead if k in self._index)
        want: list[str] = []
        for key in dict.fromkeys(keys):
            if key in self._ahead or not self._needs_fetch(key):
                continue
            size += self._index[key].nbytes
            if size > self.background_bytes:
                break
            want.append(key)
        if not want:
            return 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvboost-{self.registry_name}-read")
        futures: dict[str, Future] = {k: Future() for k in want}
        self._ahead.update(futures)
        self._pool.submit(_run_read_job, self._read_job(want), futures)
        self.background_stats.background_queued += len(want)
        return len(want)

    def _take_ahead(self, key: str) -> Loaded | None:
        """The background read of ``key`` (waiting for it if the worker is behind), decoded here against the
        current fingerprint; None when there is none."""
        fut = self._ahead.pop(key, None) if self._ahead else None
        if fut is None:
            return None
        t0 = time.perf_counter()
        loaded = fut.result()
        stats = self.background_stats
        stats.background_wait_ms += (time.perf_counter() - t0) * 1e3
        if loaded is None:
            return None
        stats.background_used += 1
        if loaded.data is None:  # the read failed: its error
            return loaded
        decoded = decode_record(loaded.data, key, self._current_fingerprint(), self.device, time.perf_counter(),
                                ino=loaded.ino, round_trips=loaded.round_trips)  # fmt: skip
        decoded.ms += loaded.ms
        return decoded

    def _drop_ahead(self, key: str) -> None:
        """Forget a background read of ``key`` (its record was replaced or dropped)."""
        if self._ahead:
            self._ahead.pop(key, None)

    def _stop_background(self) -> None:
        """Drop the queued reads and stop the worker (waits for the record it is reading)."""
        if self._ahead:
            self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------------ reads
    @abstractmethod
    def _load(self, key: str, *, drop_on_error: bool, ahead: bool = True) -> KVEntry | None:
        """Read (or take the background read of) and check the record of ``key`` (then ``_settle``); on failure
        None, and (``drop_on_error``) the key forgotten and a damaged record deleted. ``ahead``: the tier may
        read the next records of the chain with it (a ``get``; not a removal or an eviction)."""

    def _settle(self, key: str, loaded: Loaded, *, drop_on_error: bool) -> KVEntry | None:
        """Count a read and act on its outcome (on the caller's thread: the books change here only)."""
        stats = self.record_stats
        exc = loaded.error
        if exc is None:
            stats.reads += 1
            stats.read_bytes += loaded.read_bytes
            stats.read_ms += loaded.ms
            return loaded.entry
        if isinstance(exc, fmt.CorruptRecord):  # it will never decode: deleted, whatever the caller
            stats.corrupt_dropped += 1
            self._drop_damaged(key, loaded)
            return None
        if drop_on_error:
            self._forget(key)
        if isinstance(exc, fmt.ForeignRecord):  # left for the processes of that fingerprint
            stats.foreign_skipped += 1
        elif not self._read_failed(key, exc, drop_on_error=drop_on_error):  # another format version, an unknown
            stats.other_version_skipped += 1  # payload type
        return None

    @abstractmethod
    def _drop_damaged(self, key: str, loaded: Loaded) -> None:
        """Log the damaged record of ``key`` (``loaded.error``), forget it and delete it (counted already)."""

    @abstractmethod
    def _read_failed(self, key: str, exc: BaseException, *, drop_on_error: bool) -> bool:
        """Count a read that the medium failed (the record is gone, the medium is away; ``drop_on_error``: the key
        is forgotten already); False when ``exc`` is not the medium's."""

    def _read(self, key: str) -> KVEntry | None:
        """The entry of ``key``: from the write queue, the last record read, or the medium; None when unknown,
        gone or damaged."""
        if key not in self._index:
            return None
        entry = self._writer.pending_entry(key)
        if entry is not None:
            self.record_stats.served_from_queue += 1
            return entry
        entry = self._cached(key)
        if entry is None:
            entry = self._load(key, drop_on_error=True)
            if entry is not None:
                self._last = (key, entry)
        return entry

    def get(self, key: str) -> KVEntry | None:
        entry = self._read(key)
        if entry is not None:
            self.eviction.on_access(key)
        return entry

    def peek(self, key: str) -> KVEntry | None:
        return self._read(key)

    def peek_meta(self, key: str) -> KVEntry | None:
        """The entry's books without its tensors (payload not loaded: ``nbytes`` and ``num_tokens`` only)."""
        return self._meta_of(key)

    def _cached(self, key: str) -> KVEntry | None:
        return self._last[1] if self._last is not None and self._last[0] == key else None

    def touch(self, key: str) -> None:
        if key in self._index:
            self.eviction.on_access(key)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> Iterator[str]:
        return iter(list(self._index))

    @property
    def used_bytes(self) -> int:
        return self._used
