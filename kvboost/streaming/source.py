"""Where streamed weights come from: the safetensors files of a model folder.

:class:`SafetensorsIndex` reads the headers of a folder's ``*.safetensors`` files (the format is an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw bytes), so any
tensor can be located without reading the others.

Sources (``streaming.source``):

- :class:`MmapSource` (``mmap``, the CPU default): each file is memory-mapped read-only; a tensor is copied from
  its mapped bytes straight into its destination (a staging slot, converted to the model's dtype on the way), then
  the pages are dropped from this process's mapping (``madvise(MADV_DONTNEED)``). Without that, every page the
  process ever read would stay mapped and count in its RSS (the whole model after one forward), although the kernel
  could drop it; with it the pages stay in the page cache (a re-read is a memcpy, not disk I/O) but RSS holds only
  the resident weights and the slots.
- :class:`HostCopySource` (``resident``: a plain host copy of every streamed tensor in the model's dtype, read once;
  ``pinned``: the same copy page-locked, so host-to-GPU copies run asynchronously on a side stream).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorLocation:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsIndex:
    """Every tensor of a folder's safetensors files: name -> :class:`TensorLocation` (headers only are read)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"layer streaming reads safetensors files; {self.folder} has none")
        self.tensors: dict[str, TensorLocation] = {}
        for path in files:
            self.add_file(path)

    def add_file(self, path: str | os.PathLike[str]) -> None:
        """Index one more safetensors file (a sidecar of derived tensors); its names must be new."""
        path = Path(path)
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        base = 8 + size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which streaming cannot read")
            if name in self.tensors:
                raise ValueError(f"{path}: tensor {name!r} is already in {self.tensors[name].file}")
            begin, end = info["data_offsets"]
            self.tensors[name] = TensorLocation(path, _DTYPES[info["dtype"]], tuple(info["shape"]), base + begin,
                                                end - begin)  # fmt: skip

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorLocation:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the safetensors files of {self.folder}") from None


class WeightSource:
    """Reads tensors by their checkpoint name into destination tensors (any device, any dtype: converted)."""

    name = "base"

    def read_into(self, name: str, out: torch.Tensor, *, non_blocking: bool = False) -> None:
        raise NotImplementedError

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new CPU tensor holding ``name`` (in ``dtype``, default: the file's)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MmapSource(WeightSource):
    """Reads from memory-mapped safetensors files and drops the pages from the mapping after each read."""

    name = "mmap"

    def __init__(self, index: SafetensorsIndex) -> None:
        self.index = index
        self._maps: dict[Path, mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, path: Path) -> mmap.mmap:
        with self._lock:
            mm = self._maps.get(path)
            if mm is None:
                with open(path, "rb") as handle:
                    mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[path] = mm
            return mm

    def _view(self, name: str) -> tuple[torch.Tensor, mmap.mmap, TensorLocation]:
        loc = self.index[name]
        mm = self._map(loc.file)
        count = loc.nbytes // torch.empty((), dtype=loc.dtype).element_size()
        with warnings.catch_warnings():  # the mapping is read-only; the view is only ever read
            warnings.simplefilter("ignore", UserWarning)
            flat = (
                torch.frombuffer(mm, dtype=loc.dtype, count=count, offset=loc.start)
                if count
                else torch.empty(0, dtype=loc.dtype)
            )
        return flat.view(loc.shape), mm, loc

    def _drop(self, mm: mmap.mmap, loc: TensorLocation) -> None:
        begin = loc.start - loc.start % _PAGE
        length = loc.start + loc.nbytes - begin
        if length > 0 and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED, begin, length)

    def read_into(self, name: str, out: torch.Tensor, *, non_blocking: bool = False) -> None:
        view, mm, loc = self._view(name)
        if tuple(out.shape) != loc.shape:
            raise ValueError(f"{name}: the file holds shape {loc.shape}, the model expects {tuple(out.shape)}")
        out.copy_(view)  # converts dtype; a CUDA destination gets a synchronous copy from pageable memory
        del view
        self._drop(mm, loc)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        view, mm, loc = self._view(name)
        out = view.to(dtype) if dtype is not None and dtype != view.dtype else view.clone()
        del view
        self._drop(mm, loc)
        return out

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for mm in maps.values():
            try:
                mm.close()
            except BufferError:  # a tensor still views it (read() callers hold clones only; defensive)
                pass


class HostCopySource(WeightSource):
    """A host copy of the named tensors (in the dtypes given), read once; ``pin=True`` page-locks it."""

    def __init__(self, index: SafetensorsIndex, dtypes: dict[str, torch.dtype], *, pin: bool = False) -> None:
        self.name = "pinned" if pin else "resident"
        reader = MmapSource(index)
        self.tensors: dict[str, torch.Tensor] = {}
        try:
            for name, dtype in dtypes.items():
                t = reader.read(name, dtype)
                self.tensors[name] = t.pin_memory() if pin else t
        finally:
            reader.close()
        self.index = index

    def read_into(self, name: str, out: torch.Tensor, *, non_blocking: bool = False) -> None:
        out.copy_(self.tensors[name], non_blocking=non_blocking)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.tensors[name]
        return t.to(dtype) if dtype is not None and dtype != t.dtype else t.clone()
