"""The record format every tier below memory stores (disk now; Redis later): one ``KVEntry`` as bytes.

Layout (little-endian; the framing -- magic, version, the two lengths, the trailing checksum -- is kept by every
format version, so a reader can tell a damaged record from a record of another version)::

    offset  size  field
    0       8     MAGIC  b"\\x89KVB\\r\\n\\x1a\\n"  (PNG-style: catches text-mode and 7-bit mangling)
    8       2     format version (FORMAT_VERSION)
    10      2     flags (0)
    12      4     H: header length
    16      8     B: tensor section length
    24      8     xxh3_64 of bytes [0, 24) + header (lets a scan trust a header without reading the tensors)
    32      H     header: JSON (utf-8)
    32+H    B     tensors: ``safetensors.torch.save`` (never pickle)
    32+H+B  16    xxh3_128 of every byte before it

Header fields: ``format_version``, ``fingerprint`` (the engine's model/quantizer/chunker/hasher fingerprint),
``key``, ``segment_key``, ``parent_key``, ``exact``, ``pinned``, ``token_ids``, ``start`` (original position),
``nbytes`` and ``num_tokens`` (of the payload, so an index can account bytes without the tensors),
``payload_type`` (a name registered with ``register_payload_type``), ``payload_fields`` (the payload's
non-tensor fields: a quantizer's settings such as bits or group size), ``tensors`` (name -> dtype, shape,
device), ``quantizer`` (the settings the engine passed: name, fingerprint, ...).

A payload is encoded generically: a dataclass whose tensor fields go to the tensor section and whose other fields
(JSON values) go to ``payload_fields``; or any class with ``to_record() -> (tensors, fields)`` and a classmethod
``from_record(tensors, fields)``. ``RawKV`` (quant ``none``) is registered as ``"raw"``; a quantizer's payload
class registers itself with ``register_payload_type("kivi", KiviPayload)``.

Errors: ``CorruptRecord`` (bad magic, truncated or overlong, checksum or header mismatch: the record is damaged;
drop it), ``UnsupportedRecordVersion`` (an intact record of another format version: leave it), ``ForeignRecord``
(an intact record of another fingerprint: never serve it). All derive from ``RecordError``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import torch
import xxhash
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from kvboost.cache.entry import KVEntry

MAGIC = b"\x89KVB\r\n\x1a\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHHIQQ")  # magic, version, flags, header length, tensor length, header checksum
PREFIX_SIZE = _PREFIX.size  # 32
CHECKSUM_SIZE = 16
MAX_HEADER_BYTES = 64 * 2**20  # a header length above this is damage, not a header

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool,
}  # fmt: skip
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class RecordError(ValueError):
    """A byte string that cannot be served as a KV entry."""


class CorruptRecord(RecordError):
    """The record is damaged (magic, length, checksum or header): drop it and recompute the chunk."""


class UnsupportedRecordVersion(RecordError):
    """An intact record written in another format version (by another kvboost release)."""


class ForeignRecord(RecordError):
    """An intact record written under another fingerprint (another model, quantizer, chunker or hasher)."""


# ---------------------------------------------------------------------------------------------- payload types
_PAYLOAD_TYPES: dict[str, type] = {}


def register_payload_type(name: str, cls: type, *, override: bool = False) -> type:
    """Make ``cls`` storable under ``name`` (a dataclass, or a class with ``to_record``/``from_record``)."""
    existing = _PAYLOAD_TYPES.get(name)
    if existing is not None and existing is not cls and not override:
        raise ValueError(f"payload type {name!r} is already registered to {existing!r}")
    if not (dataclasses.is_dataclass(cls) or (hasattr(cls, "to_record") and hasattr(cls, "from_record"))):
        raise TypeError(f"payload type {cls!r} must be a dataclass or define to_record()/from_record()")
    _PAYLOAD_TYPES[name] = cls
    return cls


def payload_type_name(payload: Any) -> str:
    """The registered name of ``payload``'s type (TypeError if unregistered)."""
    _register_builtin_payloads()
    for name, cls in _PAYLOAD_TYPES.items():
        if type(payload) is cls:
            return name
    raise TypeError(
        f"cannot store a payload of type {type(payload).__qualname__}: register it with "
        "kvboost.cache.payload.register_payload_type(name, cls)"
    )


def _register_builtin_payloads() -> None:
    from kvboost.quant.none import RawKV

    if "raw" not in _PAYLOAD_TYPES:
        register_payload_type("raw", RawKV)


def payload_to_tensors(payload: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(named tensors, JSON-able settings) of a payload."""
    if hasattr(payload, "to_record"):
        tensors, fields = payload.to_record()
        return dict(tensors), dict(fields)
    if not dataclasses.is_dataclass(payload):
        raise TypeError(f"payload {type(payload).__qualname__} is neither a dataclass nor defines to_record()")
    tensors: dict[str, torch.Tensor] = {}
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(payload):
        value = getattr(payload, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f.name] = value
        else:
            fields[f.name] = value
    return tensors, fields


def payload_from_tensors(type_name: str, tensors: dict[str, torch.Tensor], fields: dict[str, Any]) -> Any:
    _register_builtin_payloads()
    cls = _PAYLOAD_TYPES.get(type_name)
    if cls is None:
        known = sorted(_PAYLOAD_TYPES)
        raise RecordError(f"record holds a payload of unknown type {type_name!r} (registered: {known})")
    if hasattr(cls, "from_record"):
        return cls.from_record(tensors, fields)
    return cls(**tensors, **fields)


def payload_to_device(payload: Any, device: torch.device) -> Any:
    """``payload`` with its tensors on ``device`` (the payload itself when they are there already)."""
    tensors, fields = payload_to_tensors(payload)
    if all(t.device == device for t in tensors.values()):
        return payload
    moved = {name: t.to(device) for name, t in tensors.items()}
    return payload_from_tensors(payload_type_name(payload), moved, fields)


# ---------------------------------------------------------------------------------------------- encode
def prepare_tensors(payload: Any) -> dict[str, torch.Tensor]:
    """The payload's tensors as standalone CPU tensors (what ``encode`` will write)."""
    tensors, _ = payload_to_tensors(payload)
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def build_header(entry: KVEntry, *, fingerprint: str, quantizer_settings: dict[str, Any] | None) -> dict[str, Any]:
    _register_builtin_payloads()
    payload = entry.payload
    type_name = payload_type_name(payload)
    tensors, fields = payload_to_tensors(payload)
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "key": entry.key,
        "segment_key": entry.segment_key,
        "parent_key": entry.parent_key,
        "exact": bool(entry.exact),
        "pinned": bool(entry.pinned),
        "token_ids": [int(t) for t in entry.token_ids],
        "start": int(entry.start),
        "nbytes": int(payload.nbytes),
        "num_tokens": int(payload.num_tokens),
        "payload_type": type_name,
        "payload_fields": fields,
        "tensors": {
            name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "device": str(t.device)}
            for name, t in tensors.items()
        },
        "quantizer": dict(quantizer_settings or {}),
    }


def encode(entry: KVEntry, *, fingerprint: str, quantizer_settings: dict[str, Any] | None = None) -> bytes:
    """The record of ``entry`` (see the module docstring)."""
    header = build_header(entry, fingerprint=fingerprint, quantizer_settings=quantizer_settings)
    return encode_prepared(header, prepare_tensors(entry.payload))


def encode_prepared(
    header: dict[str, Any], tensors: dict[str, torch.Tensor], *, version: int = FORMAT_VERSION
) -> bytes:
    """A record from a ready header and CPU tensors (``version`` other than the current one: tests only)."""
    try:
        head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a record header must be JSON (payload fields, quantizer settings): {exc}") from exc
    body = _st_save({name: t.contiguous() for name, t in tensors.items()}) if tensors else b""
    first = _PREFIX.pack(MAGIC, version, 0, len(head), len(body), 0)[:24]
    prefix = first + struct.pack("<Q", xxhash.xxh3_64_intdigest(first + head))
    h = xxhash.xxh3_128()
    for part in (prefix, head, body):
        h.update(part)
    return b"".join((prefix, head, body, h.digest()))


# ---------------------------------------------------------------------------------------------- decode
def read_prefix(prefix: bytes) -> tuple[int, int, int, int]:
    """(version, header length, tensor length, header checksum) from a record's first ``PREFIX_SIZE`` bytes."""
    if len(prefix) < PREFIX_SIZE:
        raise CorruptRecord(f"truncated record: {len(prefix)} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, flags, head_len, body_len, head_sum = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptRecord(f"not a kvboost KV record: magic {magic!r}, expected {MAGIC!r}")
    if flags != 0 and version == FORMAT_VERSION:
        raise CorruptRecord(f"record flags {flags:#x} are not used by format version {FORMAT_VERSION}")
    if head_len > MAX_HEADER_BYTES:
        raise CorruptRecord(f"record header length {head_len} is implausible")
    return version, head_len, body_len, head_sum


def record_size(head_len: int, body_len: int) -> int:
    return PREFIX_SIZE + head_len + body_len + CHECKSUM_SIZE


def decode_header(data: bytes, *, file_size: int | None = None) -> dict[str, Any]:
    """The header of a record from its first ``PREFIX_SIZE + H`` bytes (or more), checked by the header checksum.

    No tensor byte is read: an index can be rebuilt from headers alone. ``file_size`` (when the caller knows the
    record's full length) is checked against the lengths in the prefix, which catches a truncated file. Raises
    ``CorruptRecord``, or ``UnsupportedRecordVersion`` for an intact prefix of another version.
    """
    version, head_len, body_len, head_sum = read_prefix(data)
    if file_size is not None and file_size != record_size(head_len, body_len):
        raise CorruptRecord(
            f"truncated or overlong record: {file_size} bytes, its prefix says {record_size(head_len, body_len)}"
        )
    if len(data) < PREFIX_SIZE + head_len:
        raise CorruptRecord(f"truncated record: the header needs {PREFIX_SIZE + head_len} bytes, got {len(data)}")
    head = data[PREFIX_SIZE : PREFIX_SIZE + head_len]
    if xxhash.xxh3_64_intdigest(data[:24] + head) != head_sum:
        raise CorruptRecord("record header checksum mismatch")
    if version != FORMAT_VERSION:
        raise UnsupportedRecordVersion(
            f"record format version {version}; this kvboost reads version {FORMAT_VERSION} only"
        )
    return _parse_header(head)


def _parse_header(head: bytes) -> dict[str, Any]:
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptRecord(f"record header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptRecord("record header is not a JSON object")
    if header.get("format_version") != FORMAT_VERSION:
        raise CorruptRecord(f"record header says format version {header.get('format_version')!r}")
    need = {"fingerprint": str, "key": str, "segment_key": str, "exact": bool, "token_ids": list, "start": int,
            "nbytes": int, "payload_type": str, "tensors": dict}  # fmt: skip
    for name, kind in need.items():
        if not isinstance(header.get(name), kind):
            raise CorruptRecord(f"record header field {name!r} is missing or not a {kind.__name__}")
    return header


def verify(data: bytes) -> tuple[int, int, int]:
    """Check framing and the whole-record checksum; returns (version, header length, tensor length)."""
    version, head_len, body_len, _ = read_prefix(data)
    size = record_size(head_len, body_len)
    if len(data) != size:
        raise CorruptRecord(f"truncated or overlong record: {len(data)} bytes, its prefix says {size}")
    if xxhash.xxh3_128_digest(memoryview(data)[: size - CHECKSUM_SIZE]) != data[size - CHECKSUM_SIZE :]:
        raise CorruptRecord("record checksum mismatch")
    if version != FORMAT_VERSION:
        raise UnsupportedRecordVersion(
            f"record format version {version}; this kvboost reads version {FORMAT_VERSION} only"
        )
    return version, head_len, body_len


def decode(
    data: bytes,
    *,
    expected_fingerprint: str | None = None,
    expected_key: str | None = None,
    device: torch.device | str | None = None,
) -> KVEntry:
    """The ``KVEntry`` of a record (tensors on ``device``, default CPU).

    Raises ``CorruptRecord`` (damaged), ``UnsupportedRecordVersion``, ``ForeignRecord`` (header fingerprint is not
    ``expected_fingerprint``) or ``CorruptRecord`` when the header's key is not ``expected_key``.
    """
    _, head_len, body_len = verify(data)
    header = decode_header(data[: PREFIX_SIZE + head_len])
    return entry_from(header, data[PREFIX_SIZE + head_len : PREFIX_SIZE + head_len + body_len],
                      expected_fingerprint=expected_fingerprint, expected_key=expected_key, device=device)  # fmt: skip


def entry_from(
    header: dict[str, Any],
    body: bytes,
    *,
    expected_fingerprint: str | None = None,
    expected_key: str | None = None,
    device: torch.device | str | None = None,
) -> KVEntry:
    """The entry of a checked header and its tensor section."""
    if expected_fingerprint is not None and header["fingerprint"] != expected_fingerprint:
        raise ForeignRecord(
            f"record of fingerprint {header['fingerprint'][:48]!r}..., expected {expected_fingerprint[:48]!r}..."
        )
    if expected_key is not None and header["key"] != expected_key:
        raise CorruptRecord(f"record holds key {header['key'][:16]}..., expected {expected_key[:16]}...")
    try:
        tensors = _st_load(bytes(body)) if body else {}
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptRecord(f"record tensor section is unreadable: {exc}") from None
    described = header["tensors"]
    if set(tensors) != set(described):
        raise CorruptRecord(f"record tensors {sorted(tensors)} differ from its header's {sorted(described)}")
    for name, t in tensors.items():
        spec = described[name]
        if _dtype_name(t.dtype) != spec.get("dtype") or list(t.shape) != spec.get("shape"):
            raise CorruptRecord(f"record tensor {name!r}: {t.dtype} {list(t.shape)}, header says {spec}")
    if device is not None:
        tensors = {name: t.to(device) for name, t in tensors.items()}
    try:
        payload = payload_from_tensors(header["payload_type"], tensors, dict(header.get("payload_fields") or {}))
        entry = KVEntry(
            key=header["key"],
            segment_key=header["segment_key"],
            parent_key=header.get("parent_key"),
            token_ids=tuple(int(t) for t in header["token_ids"]),
            start=int(header["start"]),
            payload=payload,
            pinned=bool(header.get("pinned", False)),
            exact=bool(header["exact"]),
        )
    except RecordError:
        raise
    except (TypeError, ValueError) as exc:
        raise CorruptRecord(f"record does not describe a valid entry: {exc}") from None
    if entry.nbytes != header["nbytes"] or entry.num_tokens != header.get("num_tokens", entry.num_tokens):
        raise CorruptRecord(f"record payload is {entry.nbytes} bytes, header says {header['nbytes']}")
    return entry


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"cannot store tensors of dtype {dtype}") from None

