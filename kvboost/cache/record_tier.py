"""What the tiers below memory (``disk``, ``redis``) share: books of serialised records keyed like the store.

A subclass keeps ``self._index`` (key -> its record's books, with ``nbytes`` and ``meta_entry(key)``),
``self._used`` (payload bytes), ``self.eviction``, ``self._writer`` (its write queue, with
``pending_entry(key)``), ``self._last`` (the last record it loaded, as ``(key, entry)`` or None) and implements
``_read(key)`` (load and check one record: the entry, or None).

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
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvboost.cache import payload as fmt
from kvboost.cache.entry import KVEntry
from kvboost.cache.tier_base import CacheTier, choose_victims


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
    """The read side and the books common to record tiers (see the module docstring)."""

    may_lose_entries = True
    _index: dict[str, Any]
    _used: int
    _pinned: set[str]
    _last: tuple[str, KVEntry] | None = None
    _fingerprint: Callable[[], str] | None = None
    _quantizer: dict[str, Any] | None = None
    eviction: Any
    device: str | None = None
    #: Bytes of records ``prefetch_async`` keeps in flight or waiting at most (the rest of a chain is read on
    #: demand); records, not decoded tensors, so a dequantized copy is not counted.
    background_bytes: int = 256 * 2**20
    _ahead: dict[str, Future] | None = None
    _pool: ThreadPoolExecutor | None = None
    _background: BackgroundReadStats | None = None

    # ------------------------------------------------------------------ writes
    @property
    @abstractmethod
    def location(self) -> str:
        """Where the records live (for messages)."""

    @abstractmethod
    def _queue_write(self, entry: KVEntry) -> Any:
        """Hand ``entry``'s record to the tier's writer; return its books (what ``_add`` takes)."""

    @abstractmethod
    def _add(self, key: str, rec: Any) -> None:
        """Book ``rec`` under ``key`` (size, pins, eviction policy)."""

    @abstractmethod
    def _forget(self, key: str) -> Any:
        """Drop ``key`` from the books (the record is left as it is); its books, or None."""

    @abstractmethod
    def _evict(self, key: str) -> KVEntry:
        """Evict ``key`` during a put: its entry with the payload when a slower tier takes it, else its books."""

    def put(self, entry: KVEntry) -> list[KVEntry]:
        if getattr(self, "_closed", False):
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

    def clear(self) -> None:
        for key in list(self._index):
            self._discard(key)

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
        if getattr(self, "_closed", False):
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

    def _background_stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.background_stats)

    # ------------------------------------------------------------------ reads
    @abstractmethod
    def _read(self, key: str) -> KVEntry | None:
        """Load and check the record of ``key``: the entry, or None (unknown, vanished or damaged)."""

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

    def discard(self, key: str) -> None:
        """Drop ``key`` and delete its record, without reading it."""
        if key in self._index:
            self._discard(key)

    @abstractmethod
    def _discard(self, key: str) -> None:
        """Drop ``key`` from the books and delete its record (queued behind any write of it)."""

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
