"""Disk tier: one record file per entry (``kvboost/cache/payload.py`` format), written off the request path.

Layout: ``<path>/<2 hex>/<32 hex>.kvr``, the file name being xxh3_128 of the entry's key (the header holds the
key itself and is checked on read, so a name collision is a miss, never a wrong hit).

Writes: ``put`` books the entry, hands a snapshot of it to a writer thread and returns (``store_ms`` pays the
hand-off only: a shallow copy, plus a clone of any tensor that is a view into a larger buffer). The writer
encodes the record, writes it to a temp file in the target folder (``.tmp-<host>-<pid>-<random>``), fsyncs it,
``os.replace``-s it over the final name and fsyncs the folder: a reader, in this process or another, sees the
old record, the new one or none, never a torn one. A ``get`` of an entry still queued is served from the queue.
Removals (eviction, promotion to a faster tier) go through the same queue, in order. ``flush()`` waits for the
queue; ``close()`` flushes and stops the thread; both also run at interpreter exit (``weakref.finalize``), and
the engine calls ``close`` from ``engine.close()`` / its context manager. ``max_pending_bytes`` bounds the queue:
a ``put`` that would exceed it waits for the writer (counted in ``write_stalls``).

Start-up: the tier rebuilds its index from the record headers found under ``path`` (the header checksum is
checked; tensors are not read), oldest file first into the eviction policy, so a new process reuses the cache
of the previous one. Temp files of dead local writers (or older than an hour) are deleted; damaged records
(bad magic, length, header checksum, a name that does not match the key) are deleted and counted; intact records
of another format version are left alone and not indexed.

Reads: ``get``/``peek`` read and check the whole record (checksum, key, and the fingerprint the engine bound
with ``bind_context``). A damaged record is deleted, counted (``corrupt_dropped``) and reported as missing: the
store forgets the entry and the engine recomputes the chunk. A record that vanished (deleted by another
process) is a miss too (``missing_dropped``); one of another fingerprint is never served (``foreign_skipped``).

Sharing a folder between processes: safe (atomic renames; every read is checked), but each process's index is
a snapshot taken at start plus its own writes, so it does not see later writes of the others, and a ``get`` of
an entry another process evicted or promoted is a miss. Capacity is accounted per process over the files it
knows of (payload bytes, like ``MemoryTier``; each file adds a header of ~0.5 KiB + ~8 bytes per token): with N
processes the folder may hold up to about N x capacity until they restart and rescan.

``path=None`` gives a private temporary folder, deleted at close (nothing persists; this is what a bare
``{"name": "disk"}`` gets); ``path="auto"`` is ``$KVBOOST_CACHE_DIR/kv`` (default ``~/.cache/kvboost/kv``);
other paths have ``~`` and ``$VARS`` expanded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvboost.cache import payload as fmt
from kvboost.cache.entry import KVEntry
from kvboost.cache.memory import parse_bytes
from kvboost.cache.record_tier import Loaded, RecordTier, decode_record
from kvboost.registry import CACHE_TIERS, EVICTION

log = logging.getLogger(__name__)

SUFFIX = ".kvr"
TMP_PREFIX = ".tmp-"
#: A temp file older than this is a leftover even if its writer's pid is alive (pid reuse, other hosts).
STALE_TMP_SECONDS = 3600.0
_HOST = socket.gethostname().replace("-", "_")[:32] or "host"


def record_name(key: str) -> str:
    """File name (without folder) of the record of ``key``."""
    return xxhash.xxh3_128_hexdigest(key.encode()) + SUFFIX


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
    file: Path
    segment: str
    parent: str | None
    exact: bool
    pinned: bool
    start: int
    tokens: array

    def meta_entry(self, key: str) -> KVEntry:
        ids = tuple(self.tokens)
        return KVEntry(key, self.segment, self.parent, ids, self.start, _MetaPayload(self.nbytes, len(ids)),
                       pinned=self.pinned, exact=self.exact)  # fmt: skip


@dataclass(eq=False)
class _Job:
    kind: str  # "write" | "delete"
    key: str
    file: Path
    entry: KVEntry | None = None
    fingerprint: str = ""
    quantizer: dict[str, Any] | None = None
    nbytes: int = 0
    cancelled: bool = False


@dataclass
class DiskStats:
    writes: int = 0
    write_bytes: int = 0
    write_errors: int = 0
    write_stalls: int = 0
    deletes: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_ms: float = 0.0
    served_from_queue: int = 0
    corrupt_dropped: int = 0
    missing_dropped: int = 0
    foreign_skipped: int = 0
    other_version_skipped: int = 0
    scanned: int = 0
    scan_evicted: int = 0
    tmp_cleaned: int = 0


class _Writer:
    """The write queue and its thread. Holds no reference to the tier (so the tier can be collected)."""

    def __init__(self, fsync: bool, max_pending_bytes: int, stats: DiskStats) -> None:
        self.fsync = fsync
        self.max_pending_bytes = max_pending_bytes
        self.stats = stats
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._pending: dict[str, _Job] = {}  # key -> its latest write not yet on disk
        self._pending_bytes = 0
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warned = False

    # ------------------------------------------------------------------ producer side (the tier's thread)
    def submit_write(self, job: _Job) -> None:
        with self._cv:
            self._cancel_locked(job.key)
            if self._pending_bytes and self._pending_bytes + job.nbytes > self.max_pending_bytes:
                self.stats.write_stalls += 1
                self._ensure_thread_locked()
                while self._pending_bytes and self._pending_bytes + job.nbytes > self.max_pending_bytes:
                    if not self._thread_alive():
                        break
                    self._cv.wait(0.1)
            self._pending[job.key] = job
            self._pending_bytes += job.nbytes
            self._queue.append(job)
            self._ensure_thread_locked()
            self._cv.notify_all()

    def submit_delete(self, key: str, file: Path) -> None:
        with self._cv:
            self._cancel_locked(key)
            self._queue.append(_Job("delete", key, file))
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
            self._thread = threading.Thread(target=self._run, name="kvboost-disk-writer", daemon=True)
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
            if job.kind == "delete":
                try:
                    os.unlink(job.file)
                    self.stats.deletes += 1
                except FileNotFoundError:
                    pass
            elif not job.cancelled:
                assert job.entry is not None
                header = fmt.build_header(job.entry, fingerprint=job.fingerprint, quantizer_settings=job.quantizer)
                data = fmt.encode_prepared(header, fmt.prepare_tensors(job.entry.payload))
                if not job.cancelled:
                    atomic_write(job.file, data, fsync=self.fsync)
                    self.stats.writes += 1
                    self.stats.write_bytes += len(data)
        except Exception as exc:  # a full disk must not kill the thread: the entry becomes a miss later
            self.stats.write_errors += 1
            if not self._warned:
                self._warned = True
                log.warning("kvboost disk tier: cannot %s %s: %s (further errors are only counted)", job.kind,
                            job.file, exc)  # fmt: skip
        finally:
            if job.kind == "write":
                with self._cv:
                    if self._pending.get(job.key) is job:
                        del self._pending[job.key]
                        self._pending_bytes -= job.nbytes


def atomic_write(file: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``file`` atomically: temp file in the same folder, fsync, rename, fsync the folder."""
    folder = file.parent
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{TMP_PREFIX}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, file)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _tmp_is_stale(name: str, mtime: float, now: float) -> bool:
    """A temp file whose writer is gone: a dead local pid, or older than ``STALE_TMP_SECONDS``."""
    if now - mtime > STALE_TMP_SECONDS:
        return True
    parts = name[len(TMP_PREFIX) :].split("-")
    if len(parts) < 3 or parts[0] != _HOST:
        return False
    try:
        pid = int(parts[1])
    except ValueError:
        return False
    if pid == os.getpid():
        return False  # maybe another tier of this process is writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, another user's
        return False
    return False


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
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def resolve_path(path: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """(folder, private) for the ``path`` option."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="kvboost-disk-")), True
    if str(path) == "auto":
        from kvboost.paths import kvboost_cache_dir

        return kvboost_cache_dir() / "kv", False
    return Path(os.path.expandvars(os.path.expanduser(str(path)))), False


def _shutdown(writer: _Writer, private_dir: Path | None) -> None:
    if private_dir is not None:
        writer.close(discard=True)
        shutil.rmtree(private_dir, ignore_errors=True)
    else:
        writer.close()


@CACHE_TIERS.register("disk")
class DiskTier(RecordTier):
    """Entries as record files under ``path`` within a byte budget (payload bytes), evicting by the given policy.

    Args:
        path: the folder (created if missing); ``None``: a private temporary folder deleted at close; ``"auto"``:
            ``$KVBOOST_CACHE_DIR/kv`` (default ``~/.cache/kvboost/kv``).
        capacity: byte budget of the payloads (int or a string such as ``"20GiB"``).
        eviction: eviction policy, as for ``MemoryTier`` (default ``lru``).
        fsync: fsync each record and its folder (False: faster, but a power loss may lose recent records;
            they are still never torn, and a damaged one is detected on read).
        max_pending_bytes: payload bytes the write queue may hold before ``put`` waits for the writer.
        device: where loaded tensors go (default: the device they were stored from, when available, else CPU).
        background_bytes: records a prompt's lookup may have read ahead on the tier's reader thread at once
            (``prefetch_async``; 0 turns background reads off).

    See the module docstring for the file layout, crash safety and sharing a folder between processes.
    """


    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        capacity: int | str = "16GiB",
        eviction: Any = "lru",
        fsync: bool = True,
        max_pending_bytes: int | str = "256MiB",
        device: str | None = None,
        background_bytes: int | str = "256MiB",
    ) -> None:
        self.capacity_bytes = parse_bytes(capacity)
        self.eviction = EVICTION.build("lru" if eviction is None else eviction)
        self.root, private = resolve_path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.persistent = not private
        self.device = device
        self.background_bytes = parse_bytes(background_bytes, allow_zero=True)
        self.disk_stats = DiskStats()
        self._writer = _Writer(bool(fsync), parse_bytes(max_pending_bytes), self.disk_stats)
        self._index: dict[str, _Rec] = {}
        self._used = 0
        self._pinned: set[str] = set()
        self._fingerprint: Callable[[], str] | None = None
        self._quantizer: dict[str, Any] | None = None
        self._last: tuple[str, KVEntry] | None = None  # the last entry read (peek then get; get then remove)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._writer, self.root if private else None)
        self._scan()

    # ------------------------------------------------------------------ contract (put: RecordTier)
    @property
    def location(self) -> str:
        return str(self.root)

    def _queue_write(self, entry: KVEntry) -> _Rec:
        """Hand ``entry`` to the writer (a snapshot of its tensors); returns its books."""
        snapshot = dataclasses.replace(entry, payload=_detach(entry.payload))
        file = self._file(entry.key)
        fp = self._current_fingerprint()
        self._writer.submit_write(_Job("write", entry.key, file, snapshot, fp or "", self._quantizer, entry.nbytes))
        return _Rec(entry.nbytes, file, entry.segment_key, entry.parent_key, entry.exact, entry.pinned, entry.start,
                    array("q", entry.token_ids))  # fmt: skip

    def remove(self, key: str) -> KVEntry | None:
        rec = self._index.get(key)
        if rec is None:
            return None
        entry = self._writer.pending_entry(key) or self._cached(key)
        if entry is None:
            entry = self._load(key, rec, drop_on_error=False) or rec.meta_entry(key)
        self._discard(key)
        return entry

    # ------------------------------------------------------------------ lifecycle and stats
    def flush(self) -> None:
        """Wait until every queued write and delete is on disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and stop the writer (a private folder is deleted instead). Idempotent."""
        self._closed = True
        self._stop_background()
        self._finalizer()

    def stats(self) -> dict[str, Any]:
        pending, pending_bytes = self._writer.pending_count()
        out: dict[str, Any] = dataclasses.asdict(self.disk_stats)
        out.update(self._background_stats())
        out.update(path=str(self.root), persistent=self.persistent, pending_writes=pending,
                   pending_bytes=pending_bytes)  # fmt: skip
        out["read_ms_per_mib"] = out["read_ms"] / (out["read_bytes"] / 2**20) if out["read_bytes"] else None
        return out

    # ------------------------------------------------------------------ internals
    def _file(self, key: str) -> Path:
        name = record_name(key)
        return self.root / name[:2] / name

    def _add(self, key: str, rec: _Rec) -> None:
        self._index[key] = rec
        self._used += rec.nbytes
        if rec.pinned:
            self._pinned.add(key)
        self.eviction.on_insert(key)

    def _forget(self, key: str) -> _Rec | None:
        """Drop ``key`` from the books (its file is left as it is)."""
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
        """Drop ``key`` and delete its record (queued behind any write of it)."""
        rec = self._forget(key)
        if rec is not None:
            self._writer.submit_delete(key, rec.file)

    def _evict(self, key: str) -> KVEntry:
        """Evict ``key`` during a put: its entry with the payload when a slower tier takes it, else its books."""
        rec = self._index[key]
        entry = None
        if not self.last_in_store:
            entry = self._writer.pending_entry(key) or self._cached(key) or self._load(key, rec, drop_on_error=False)
        self._discard(key)
        return entry if entry is not None else rec.meta_entry(key)

    def _read(self, key: str) -> KVEntry | None:
        rec = self._index.get(key)
        if rec is None:
            return None
        entry = self._writer.pending_entry(key)
        if entry is not None:
            self.disk_stats.served_from_queue += 1
            return entry
        entry = self._cached(key)
        if entry is None:
            entry = self._load(key, rec, drop_on_error=True)
            if entry is not None:
                self._last = (key, entry)
        return entry

    def _load(self, key: str, rec: _Rec, *, drop_on_error: bool) -> KVEntry | None:
        """Read (or take the background read of) and check the record of ``key``; on failure None, and
        (``drop_on_error``) the key forgotten and a damaged file deleted."""
        loaded = self._take_ahead(key)
        if loaded is None:
            loaded = _read_record(rec.file, key, self._current_fingerprint(), self.device)
        exc = loaded.error
        if exc is None:
            self.disk_stats.reads += 1
            self.disk_stats.read_bytes += loaded.read_bytes
            self.disk_stats.read_ms += loaded.ms
            return loaded.entry
        if isinstance(exc, fmt.CorruptRecord):
            log.warning("kvboost disk tier: dropping damaged record %s: %s", rec.file, exc)
            self.disk_stats.corrupt_dropped += 1
            self._forget(key)
            _unlink(rec.file, loaded.ino)
            return None
        if isinstance(exc, OSError):
            if not isinstance(exc, FileNotFoundError):
                log.warning("kvboost disk tier: cannot read %s: %s", rec.file, exc)
            if drop_on_error:
                self.disk_stats.missing_dropped += 1
        elif isinstance(exc, fmt.ForeignRecord):
            self.disk_stats.foreign_skipped += 1
        else:  # another format version, an unknown payload type
            self.disk_stats.other_version_skipped += 1
        if drop_on_error:
            self._forget(key)
        return None

    def _read_job(self, keys: list[str]) -> Iterator[tuple[str, Loaded]]:
        files = [(k, self._index[k].file) for k in keys]

        def job() -> Iterator[tuple[str, Loaded]]:
            for key, file in files:
                yield key, _read_bytes(file)

        return job()

    def _scan(self) -> None:
        """Index the records under ``root`` from their headers; clean temp files of dead writers."""
        found: list[tuple[float, str, _Rec, Path]] = []
        now = time.time()
        for sub in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            with os.scandir(sub) as it:
                items = list(it)
            for item in items:
                name = item.name
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue
                if name.startswith(TMP_PREFIX):
                    if _tmp_is_stale(name, st.st_mtime, now) and _unlink(Path(item.path)):
                        self.disk_stats.tmp_cleaned += 1
                    continue
                if not name.endswith(SUFFIX):
                    continue
                file = Path(item.path)
                try:
                    header, ino = _read_header(file)
                    if record_name(header["key"]) != name:
                        raise _Damaged(f"record {name} holds key {header['key'][:16]}...", ino)
                except FileNotFoundError:
                    continue
                except _Damaged as exc:
                    log.warning("kvboost disk tier: dropping damaged record %s: %s", file, exc)
                    if _unlink(file, exc.ino):
                        self.disk_stats.corrupt_dropped += 1
                    continue
                except (fmt.RecordError, OSError):
                    self.disk_stats.other_version_skipped += 1
                    continue
                try:
                    rec = _Rec(int(header["nbytes"]), file, header["segment_key"], header.get("parent_key"),
                               bool(header["exact"]), bool(header.get("pinned", False)), int(header["start"]),
                               array("q", header["token_ids"]))  # fmt: skip
                    rec.meta_entry(header["key"])  # validates (an exact entry has a parent, ...)
                except (TypeError, ValueError, OverflowError) as exc:
                    log.warning("kvboost disk tier: dropping damaged record %s: %s", file, exc)
                    if _unlink(file, ino):
                        self.disk_stats.corrupt_dropped += 1
                    continue
                found.append((st.st_mtime, header["key"], rec, file))
        found.sort(key=lambda x: (x[0], x[1]))
        for _, key, rec, _ in found:
            if key in self._index:  # the same key twice cannot happen (the name is the key's hash)
                continue
            self._add(key, rec)
        self.disk_stats.scanned = len(self._index)
        self._fit_capacity()

    def _fit_capacity(self) -> None:
        """After a scan: evict (delete) the oldest leaves until the records found fit the budget."""
        if self._used <= self.capacity_bytes:
            return
        children = Counter(rec.parent for rec in self._index.values() if rec.exact and rec.parent is not None)
        leaves_first = getattr(self.eviction, "leaves_first", True)

        class _Protected:
            def __contains__(_, key: object) -> bool:
                return key in self._pinned or (leaves_first and children.get(key, 0) > 0)

        while self._used > self.capacity_bytes:
            key = self.eviction.victim(protected=_Protected())
            if key is None:
                break
            rec = self._index[key]
            if rec.exact and rec.parent is not None:
                children[rec.parent] -= 1
            self._discard(key)
            self.disk_stats.scan_evicted += 1
        self.flush()


def _read_header(file: Path) -> tuple[dict[str, Any], int]:
    """(header, inode) of a record file; the size checked is the opened file's (another process may replace the
    name meanwhile: records are never modified in place, only replaced)."""
    with open(file, "rb") as handle:
        st = os.fstat(handle.fileno())
        data = handle.read(4096)
        if len(data) >= fmt.PREFIX_SIZE:
            try:
                _, head_len, _, _ = fmt.read_prefix(data)
            except fmt.CorruptRecord as exc:
                raise _Damaged(str(exc), st.st_ino) from None
            if fmt.PREFIX_SIZE + head_len > len(data):
                data += handle.read(fmt.PREFIX_SIZE + head_len - len(data))
    try:
        return fmt.decode_header(data, file_size=st.st_size), st.st_ino
    except fmt.CorruptRecord as exc:
        raise _Damaged(str(exc), st.st_ino) from None


class _Damaged(fmt.CorruptRecord):
    """A damaged record file, with the inode that was read (so only that version of the name is deleted)."""

    def __init__(self, message: str, ino: int) -> None:
        super().__init__(message)
        self.ino = ino


def _unlink(file: Path, ino: int | None = None) -> bool:
    """Delete ``file``; with ``ino``, only if the name still holds that inode (not a newer record another process
    renamed over it meanwhile; a tiny window remains between the check and the unlink)."""
    try:
        if ino is not None and os.stat(file).st_ino != ino:
            return False
        os.unlink(file)
        return True
    except FileNotFoundError:
        return False


def _read_bytes(file: Path) -> Loaded:
    """Read one record file, not decoded (pure: no books touched, so it runs on the background reader too)."""
    t0 = time.perf_counter()
    try:
        with open(file, "rb") as handle:
            ino = os.fstat(handle.fileno()).st_ino
            data = handle.read()
    except OSError as exc:
        return Loaded(None, exc, 0, (time.perf_counter() - t0) * 1e3)
    return Loaded(None, None, len(data), (time.perf_counter() - t0) * 1e3, ino=ino, data=data)


def _read_record(file: Path, key: str, fingerprint: str | None, device: str | None) -> Loaded:
    """Read and decode one record file."""
    t0 = time.perf_counter()
    raw = _read_bytes(file)
    if raw.data is None:
        return raw
    return decode_record(raw.data, key, fingerprint, device, t0, ino=raw.ino)
