"""Model fingerprints: what every cache key carries so no entry is served to another model (DESIGN.md invariant 3).

A fingerprint is the xxh3_128 of:

- the model identity string (path or hub id), the config (``to_dict()`` without private keys such as
  ``_name_or_path`` and without ``transformers_version``, the version that *saved* it), the parameter dtype and the
  weight quantization config;
- the versions of torch, transformers and kvboost (stores outlive the process: an upgrade may change the K/V a
  model produces, so entries written by other versions are not served);
- a digest of ALL weights: every parameter and persistent buffer, by name, dtype, shape and bytes (bf16 and
  quantized integer tensors included: the bytes are read as uint8). Tied tensors are hashed once and named as
  aliases after that. GPU tensors are copied to host in slices of 64 MiB;
- the weight format when it is not ``dense`` (``weights="gguf_int4"``: ``kvboost.models.gguf_weights``), so K/V
  stored under dense weights is never served to int4 weights of the same file, nor the reverse.

Hashing ~540 MB (SmolLM2-135M in fp32) takes a few tens of milliseconds on CPU, a 7B bf16 model about a second,
more from a GPU: so the weights digest is cached

- in memory, keyed by a cheap :func:`parameter_signature` (per tensor: name, id, data_ptr, autograd version
  counter, dtype, device, shape) that :meth:`ModelFingerprint.current` re-checks on every call (~0.25 ms for
  SmolLM2's 273 tensors): ``model.to(dtype)``, an in-place edit under ``torch.no_grad()`` (it bumps the tensor's
  version counter), or replacing a parameter / merging an adapter (new objects or names) all change it;
- on disk, beside the folder the weights were loaded from (``.kvboost-digests.json`` in it, or under
  ``kvboost_cache_dir()/digests`` when the folder is not writable), keyed by the folder's files (names, sizes,
  ``mtime_ns``), the tensor names/dtypes/shapes, the model class and the torch/transformers versions. It is only
  read or written while the in-memory parameters are exactly as loaded: the loader records the source folder and
  the load-time signature on the model (:func:`record_load`).

Not seen by the signature: writes through ``param.data`` (autograd does not count them) and in-place changes of
the config. Call :meth:`ModelFingerprint.invalidate` after such edits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash

log = logging.getLogger(__name__)

DIGEST_FILE = ".kvboost-digests.json"
_DIGEST_FORMAT = 1
_HOST_SLICE_BYTES = 64 << 20

Signature = tuple[tuple[Any, ...], ...]


# ---------------------------------------------------------------------------------------------- tensors
def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of ``model``, by qualified name, in module order.

    Tied tensors appear under each of their names (``remove_duplicate=False`` semantics); non-persistent buffers
    (RoPE ``inv_freq``: derived from the config) are left out.
    """
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        for name, param in module._parameters.items():
            if param is not None:
                yield prefix + name, param
        skip = module._non_persistent_buffers_set
        for name, buf in module._buffers.items():
            if buf is not None and name not in skip:
                yield prefix + name, buf
        children = [(prefix + name + ".", child) for name, child in module._modules.items() if child is not None]
        stack.extend(reversed(children))


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def parameter_signature(model: torch.nn.Module) -> Signature:
    """A cheap summary that changes whenever a weight tensor is replaced, moved, cast or edited in place.

    Per tensor (the same tensors as :func:`named_tensors`): (name, id, data_ptr, version counter, dtype, device,
    shape). Compare two signatures with ``==``; they only mean something within one process (ids and pointers).
    Called on every :meth:`ModelFingerprint.current`, so the walk is inlined (a generator costs ~1.6x).
    """
    out: list[tuple[Any, ...]] = []
    add = out.append
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        for name, t in module._parameters.items():
            if t is not None:
                add((prefix + name, id(t), t.data_ptr(), _version(t), t.dtype, t.device, t.shape))
        if module._buffers:
            skip = module._non_persistent_buffers_set
            for name, t in module._buffers.items():
                if t is not None and name not in skip:
                    add((prefix + name, id(t), t.data_ptr(), _version(t), t.dtype, t.device, t.shape))
        if module._modules:
            stack.extend([(prefix + n + ".", c) for n, c in reversed(module._modules.items()) if c is not None])
    return tuple(out)


def _tensor_bytes(t: torch.Tensor, name: str) -> Iterator[memoryview]:
    """The tensor's bytes in logical (row-major) order, as host buffers of at most 64 MiB each."""
    if t.device.type == "meta":
        raise ValueError(
            f"weight {name!r} is on the meta device (offloaded or not materialised): kvboost cannot fingerprint "
            "weights it cannot read; load the model fully into memory"
        )
    t = t.detach()
    if t.numel() == 0:
        return
    try:
        flat = t.contiguous().reshape(-1).view(torch.uint8)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise ValueError(f"cannot read the bytes of weight {name!r} ({type(t).__name__}, {t.dtype}): {exc}") from exc
    if flat.device.type == "cpu":
        yield memoryview(flat.numpy())
    else:
        yield from _host_slices(flat, _HOST_SLICE_BYTES)


def _host_slices(flat: torch.Tensor, slice_bytes: int) -> Iterator[memoryview]:
    """``flat`` (uint8, any device) copied to host through one reused (pinned, for CUDA) buffer of
    ``slice_bytes``: bounded host memory. Each view is valid until the next one is produced."""
    staging = torch.empty(min(slice_bytes, flat.numel()), dtype=torch.uint8, pin_memory=flat.is_cuda)
    for start in range(0, flat.numel(), slice_bytes):
        part = flat[start : start + slice_bytes]
        host = staging[: part.numel()]
        host.copy_(part)  # synchronous: the bytes are there when hashed
        yield memoryview(host.numpy())


def digest_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]] | list[tuple[str, torch.Tensor]],
    resolve: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> str:
    """xxh3_128 (hex, 32 chars) of the names, dtypes, shapes and bytes of ``tensors``; aliases hashed once.

    ``resolve(name, placeholder)`` gives the real value of a tensor on the ``meta`` device (a streamed layer's
    weight, read from its file: ``kvboost.streaming``), so a streamed model digests exactly like the same weights
    fully resident. Placeholders are distinct objects, never aliases of one another.
    """
    h = xxhash.xxh3_128()
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in tensors:
        if resolve is not None and t.device.type == "meta":
            real = resolve(name, t)
            if real.dtype != t.dtype or tuple(real.shape) != tuple(t.shape):
                raise ValueError(f"weight {name!r}: resolved as {real.dtype}{tuple(real.shape)}, expected "
                                 f"{t.dtype}{tuple(t.shape)}")  # fmt: skip
            header = json.dumps([name, str(t.dtype), list(t.shape), None], separators=(",", ":")).encode()
            h.update(len(header).to_bytes(8, "little"))
            h.update(header)
            for chunk in _tensor_bytes(real, name):
                h.update(chunk)
            continue
        alias_key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        alias = seen.get(alias_key) if t.numel() else None
        header = json.dumps([name, str(t.dtype), list(t.shape), alias], separators=(",", ":")).encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        if alias is not None:
            continue
        seen[alias_key] = name
        for chunk in _tensor_bytes(t, name):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- environment
def library_versions() -> dict[str, str]:
    """The versions whose code shapes the K/V a model produces: torch, transformers, kvboost."""
    import transformers

    kvboost = getattr(sys.modules.get("kvboost"), "__version__", None)
    if kvboost is None:
        from importlib import metadata

        try:
            kvboost = metadata.version("kvboost")
        except metadata.PackageNotFoundError:
            kvboost = "unknown"
    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__), "kvboost": str(kvboost)}


def record_load(model: torch.nn.Module, source_dir: str | os.PathLike[str] | None) -> None:
    """Mark ``model`` as freshly loaded from ``source_dir`` (call right after loading, before any edit).

    Sets ``model._kvboost_source_dir`` (an absolute folder, or None for a hub id / non-folder source) and
    ``model._kvboost_load_signature``; :class:`ModelFingerprint` uses the on-disk digest cache only while the
    parameters still have that signature.
    """
    folder = Path(source_dir).resolve() if source_dir is not None and Path(source_dir).is_dir() else None
    model._kvboost_source_dir = str(folder) if folder is not None else None
    model._kvboost_load_signature = parameter_signature(model)


# ---------------------------------------------------------------------------------------------- the fingerprint
class ModelFingerprint:
    """The fingerprint of a model as it is now; cheap to ask again (see the module docstring).

    Args:
        model: the loaded model.
        identity: names the weights (path or hub id); part of the fingerprint.
        source_dir: the folder the weights were loaded from (defaults to what :func:`record_load` recorded). The
            on-disk digest cache is used only for the folder :func:`record_load` recorded on the model, and only
            while the model's parameters still have the signature recorded then.
        disk_cache: set False to never read or write digest files.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        identity: str,
        source_dir: str | os.PathLike[str] | None = None,
        *,
        disk_cache: bool = True,
    ) -> None:
        self.model = model
        self.identity = str(identity)
        src = source_dir if source_dir is not None else getattr(model, "_kvboost_source_dir", None)
        self.source_dir = Path(src).resolve() if src is not None and Path(src).is_dir() else None
        self.disk_cache = disk_cache
        self._signature: Signature | None = None
        self._weights: str | None = None
        self._fingerprint: str | None = None
        self.weights_source: str | None = None  # "disk" or "computed": how the last weights digest was obtained

    # ------------------------------------------------------------------ public
    def signature(self) -> Signature:
        """The model's current :func:`parameter_signature`."""
        return parameter_signature(self.model)

    def current(self) -> str:
        """The fingerprint (hex, 32 chars) of the model as it is now; recomputed when the signature changed."""
        sig = self.signature()
        if self._fingerprint is None or sig != self._signature:
            self._refresh(sig)
        assert self._fingerprint is not None
        return self._fingerprint

    def weights_digest(self) -> str:
        """The digest (hex, 32 chars) of all weights as they are now."""
        self.current()
        assert self._weights is not None
        return self._weights

    def invalidate(self) -> None:
        """Forget the cached values (after edits the signature cannot see: ``param.data`` writes, config edits)."""
        self._signature = self._weights = self._fingerprint = None

    def describe(self) -> dict[str, Any]:
        """Everything the fingerprint hashes, as a JSON-able dict (the weights as their digest)."""
        return self._describe(self.weights_digest())

    # ------------------------------------------------------------------ internals
    def _describe(self, weights: str) -> dict[str, Any]:
        cfg = self.model.config
        quantization = getattr(cfg, "quantization_config", None)
        if hasattr(quantization, "to_dict"):
            quantization = quantization.to_dict()
        config = {
            k: v for k, v in cfg.to_dict().items() if not k.startswith("_") and k != "transformers_version"
        }
        described = {
            "identity": self.identity,
            "config": config,
            "dtype": str(getattr(self.model, "dtype", None) or next(self.model.parameters()).dtype),
            "quantization": quantization,
            "versions": library_versions(),
            "weights": weights,
        }
        # The weight format of a GGUF model (kvboost.models.gguf_weights): its int4 blocks already hash differently
        # from dense weights; named too, so the difference does not rest on the bytes alone. Absent for "dense", so
        # the fingerprints of dense models are unchanged.
        weight_format = getattr(self.model, "_kvboost_weights", "dense")
        if weight_format != "dense":
            described["weights_format"] = weight_format
        return described

    def _refresh(self, sig: Signature) -> None:
        weights = self._weights_digest(sig)
        described = json.dumps(self._describe(weights), sort_keys=True, default=str, separators=(",", ":"))
        self._signature, self._weights = sig, weights
        self._fingerprint = xxhash.xxh3_128(described.encode()).hexdigest()

    def _weights_digest(self, sig: Signature) -> str:
        # Only the folder the loader recorded, and only while the weights are exactly as loaded from it: a digest
        # written under another folder's key would be served to whoever loads that folder next.
        recorded = getattr(self.model, "_kvboost_source_dir", None)
        as_loaded = (
            self.disk_cache
            and self.source_dir is not None
            and recorded is not None
            and Path(recorded) == self.source_dir
            and getattr(self.model, "_kvboost_load_signature", None) == sig
        )
        key = self._disk_key(sig) if as_loaded else None
        if key is not None:
            cached = self._read_disk(key)
            if cached is not None:
                self.weights_source = "disk"
                return cached
        # A streamed model (kvboost.streaming) resolves its meta placeholders from the weight files.
        resolve = getattr(self.model, "_kvboost_weight_resolver", None)
        tensors = named_tensors(self.model)
        digest = digest_tensors(tensors, resolve) if resolve is not None else digest_tensors(tensors)
        self.weights_source = "computed"
        if key is not None:
            self._write_disk(key, digest)
        return digest

    def _disk_key(self, sig: Signature) -> str | None:
        assert self.source_dir is not None
        try:
            files = sorted(
                (e.name, st.st_size, st.st_mtime_ns)
                for e in os.scandir(self.source_dir)
                if not e.name.startswith(".") and e.is_file() and (st := e.stat())
            )
        except OSError:
            return None
        versions = library_versions()
        payload = {
            "format": _DIGEST_FORMAT,
            "files": files,
            "class": type(self.model).__name__,
            "tensors": [(name, str(dtype), list(shape)) for name, _, _, _, dtype, _, shape in sig],
            "torch": versions["torch"],
            "transformers": versions["transformers"],
        }
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()

    def _digest_files(self) -> list[Path]:
        from kvboost.paths import kvboost_cache_dir

        assert self.source_dir is not None
        name = hashlib.sha256(str(self.source_dir).encode()).hexdigest()[:24] + ".json"
        return [self.source_dir / DIGEST_FILE, kvboost_cache_dir() / "digests" / name]

    def _read_disk(self, key: str) -> str | None:
        for path in self._digest_files():
            try:
                entry = json.loads(path.read_text()).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(entry, dict) and isinstance(entry.get("weights"), str) and len(entry["weights"]) == 32:
                return entry["weights"]
        return None

    def _write_disk(self, key: str, digest: str) -> None:
        for path in self._digest_files():
            try:
                try:
                    entries = json.loads(path.read_text())
                    entries = entries if isinstance(entries, dict) else {}
                except (OSError, ValueError):
                    entries = {}
                entries[key] = {"weights": digest, "class": type(self.model).__name__}
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
                try:
                    with os.fdopen(fd, "w") as handle:
                        json.dump(entries, handle, indent=1, sort_keys=True)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
                return
            except OSError as exc:  # read-only model folder: try the next place
                log.debug("kvboost: cannot write weights digest cache %s: %s", path, exc)
