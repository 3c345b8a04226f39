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
a ``put`` that would exceed it waits for the writer (counted in ``write_stalls`` and ``write_stall_ms``): an
entry is never dropped for a full queue (see ``record_tier._Writer.submit_write``).

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

import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvboost.cache import payload as fmt
from kvboost.cache.entry import KVEntry
from kvboost.cache.record_tier import Loaded, RecordStats, RecordTier, _Job, _Rec, _Writer, decode_record
from kvboost.kv.sizing import parse_bytes
from kvboost.registry import CACHE_TIERS

log = logging.getLogger(__name__)

SUFFIX = ".kvr"
TMP_PREFIX = ".tmp-"
#: A temp file older than this is a leftover even if its writer's pid is alive (pid reuse, other hosts).
STALE_TMP_SECONDS = 3600.0
_HOST = socket.gethostname().replace("-", "_")[:32] or "host"


def record_name(key: str) -> str:
    """File name (without folder) of the record of ``key``."""
    return xxhash.xxh3_128_hexdigest(key.encode()) + SUFFIX


def record_path(root: Path, key: str) -> Path:
    """The record file of ``key`` under ``root`` (``<root>/<2 hex>/<32 hex>.kvr``)."""
    name = record_name(key)
    return root / name[:2] / name


@dataclass
class DiskStats(RecordStats):
    scan_evicted: int = 0
    tmp_cleaned: int = 0


class _DiskWriter(_Writer):
    """The write queue's thread writing record files (atomic renames, fsync)."""

    def __init__(self, root: Path, fsync: bool, max_pending_bytes: int, stats: DiskStats) -> None:
        super().__init__(max_pending_bytes, stats)
        self.root = root
        self.fsync = fsync
        self._warned = False

    def _store(self, job: _Job, header: dict[str, Any], data: bytes) -> None:
        atomic_write(record_path(self.root, job.key), data, fsync=self.fsync)

    def _remove(self, job: _Job) -> bool:
        try:
            os.unlink(record_path(self.root, job.key))
            return True
        except FileNotFoundError:
            return False

    def _report(self, job: _Job, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kvboost disk tier: cannot %s %s: %s (further errors are only counted)", job.kind,
                        record_path(self.root, job.key), exc)  # fmt: skip


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
        self.disk_stats = DiskStats()  # the tier's record_stats
        super().__init__(capacity=capacity, eviction=eviction, device=device, background_bytes=background_bytes,
                         stats=self.disk_stats)  # fmt: skip
        pending = parse_bytes(max_pending_bytes)
        self.root, private = resolve_path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.persistent = not private
        self._writer = _DiskWriter(self.root, bool(fsync), pending, self.disk_stats)
        self._finalizer = weakref.finalize(self, _shutdown, self._writer, self.root if private else None)
        self._scan()

    # ------------------------------------------------------------------ the medium (the rest: RecordTier)
    @property
    def location(self) -> str:
        return str(self.root)

    def _stats_place(self) -> dict[str, Any]:
        return {"path": str(self.root)}

    def _file(self, key: str) -> Path:
        return record_path(self.root, key)

    def _load(self, key: str, *, drop_on_error: bool, ahead: bool = True) -> KVEntry | None:
        loaded = self._take_ahead(key)
        if loaded is None:
            loaded = _read_record(self._file(key), key, self._current_fingerprint(), self.device)
        return self._settle(key, loaded, drop_on_error=drop_on_error)

    def _drop_damaged(self, key: str, loaded: Loaded) -> None:
        """Forget ``key`` and delete its file now, if the name still holds the inode read (another process may
        have renamed a new record over it meanwhile)."""
        file = self._file(key)
        log.warning("kvboost disk tier: dropping damaged record %s: %s", file, loaded.error)
        self._forget(key)
        _unlink(file, loaded.ino)

    def _read_failed(self, key: str, exc: BaseException, *, drop_on_error: bool) -> bool:
        if not isinstance(exc, OSError):
            return False
        if not isinstance(exc, FileNotFoundError):  # a vanished file (another process deleted it) is routine
            log.warning("kvboost disk tier: cannot read %s: %s", self._file(key), exc)
        if drop_on_error:
            self.disk_stats.missing_dropped += 1
        return True

    def _read_job(self, keys: list[str]) -> Iterator[tuple[str, Loaded]]:
        files = [(k, self._file(k)) for k in keys]

        def job() -> Iterator[tuple[str, Loaded]]:
            for key, file in files:
                yield key, _read_bytes(file)

        return job()

    def _scan(self) -> None:
        """Index the records under ``root`` from their headers; clean temp files of dead writers."""
        found: list[tuple[float, str, _Rec]] = []
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
                if not name.endswith(SUFFIX) or not name.startswith(sub.name):
                    continue  # not a record, or one out of its place (reads look for it at record_path)
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
                    rec = _Rec.from_meta(header)
                    rec.meta_entry(header["key"])  # validates (an exact entry has a parent, ...)
                except (TypeError, ValueError, OverflowError) as exc:
                    log.warning("kvboost disk tier: dropping damaged record %s: %s", file, exc)
                    if _unlink(file, ino):
                        self.disk_stats.corrupt_dropped += 1
                    continue
                found.append((st.st_mtime, header["key"], rec))
        found.sort(key=lambda x: (x[0], x[1]))
        for _, key, rec in found:
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
