"""Streamed AWQ layers on CPU in the int4 kernel's own layout: a sidecar file of prepacked tensors.

torch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``) multiplies with a packed form of the weights, not
AutoAWQ's. A resident :class:`kvboost.models.awq.AWQLinear` derives it once and keeps it; a streamed one gets
fresh AutoAWQ tensors in a staging slot for every forward and would derive it again each time (unpack, repack:
measured 7-10x slower decode than resident on the bundled model). So the streamed layers' AWQ linears are built
as :class:`kvboost.models.awq.Int4PackedLinear` instead, and their packed tensors are derived once, written to a
safetensors sidecar in kvboost's cache folder and streamed from there like any other tensor; norms and biases
still come from the checkpoint.

The sidecar is keyed by the checkpoint's files (path, size, modification time), the activation dtype, the
group size and torch's version (the packed layout is torch's, not a file format): any change writes a new one.
Writes are atomic (temporary file, rename), so concurrent processes at worst both write the same file.

Used where it applies: CPU, bf16/fp16 activations (the dtypes whose every call goes to the int4 kernel;
fp32 sends prefill to dequantize + matmul, which needs AutoAWQ's tensors) and ``AWQLinear.cpu_kernel`` not
``dequant``. ``streaming.prepack: false`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvboost.streaming.source import MmapSource, SafetensorsIndex

log = logging.getLogger(__name__)

FORMAT = 1
PACKED_DTYPES = (torch.bfloat16, torch.float16)
SUFFIXES = ("int4pack_weight", "int4pack_scale_zero")


def prepack_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why streamed AWQ layers cannot use prepacked tensors here (``None`` when they can)."""
    from kvboost.models.awq import AWQLinear, _int4pack_supported

    if device.type != "cpu":
        return f"device {device.type} (the packed layout is torch's int4 CPU kernel's)"
    if dtype not in PACKED_DTYPES:
        return f"{dtype} activations (only bf16/fp16 send every call to the int4 kernel)"
    if AWQLinear.cpu_kernel == "dequant":
        return "AWQLinear.cpu_kernel is 'dequant'"
    if not _int4pack_supported(64, 64, 64):
        return "this torch has no int4 CPU kernel"
    return None


def sidecar_key(index: SafetensorsIndex, dtype: torch.dtype, group_size: int) -> str:
    """What the sidecar depends on: the checkpoint files, the dtype, the group size, torch's version."""
    files = sorted({loc.file for loc in index.tensors.values() if not loc.file.name.startswith("int4pack-")})
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(f"{dtype}|{group_size}|{torch.__version__}|{FORMAT}".encode())
    return h.hexdigest()[:20]


def sidecar_path(index: SafetensorsIndex, dtype: torch.dtype, group_size: int) -> Path:
    from kvboost.paths import kvboost_cache_dir

    name = str(dtype).replace("torch.", "")
    return kvboost_cache_dir() / "int4pack" / f"int4pack-{name}-{sidecar_key(index, dtype, group_size)}.safetensors"


def ensure_sidecar(index: SafetensorsIndex, prefixes: list[str], dtype: torch.dtype, group_size: int) -> Path:
    """The sidecar holding ``<prefix>.int4pack_weight`` / ``.int4pack_scale_zero`` for every AWQ linear
    ``prefix`` (checkpoint names), written now if missing or incomplete. Returns its path."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvboost.models.awq import int4pack_tensors

    path = sidecar_path(index, dtype, group_size)
    wanted = {f"{p}.{s}" for p in prefixes for s in SUFFIXES}
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                if wanted <= set(f.keys()):
                    return path
        except Exception as exc:  # noqa: BLE001 - a damaged sidecar is rewritten below
            log.warning("kvboost: rewriting the damaged int4pack sidecar %s (%s)", path, exc)
    reader = MmapSource(index)
    tensors: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    try:
        for prefix in tqdm(sorted(prefixes), desc="int4pack sidecar", unit="linear", leave=False):
            packed, scale_zero = int4pack_tensors(
                reader.read(f"{prefix}.qweight"), reader.read(f"{prefix}.qzeros"), reader.read(f"{prefix}.scales"),
                dtype,
            )  # fmt: skip
            tensors[f"{prefix}.int4pack_weight"] = packed.contiguous()
            tensors[f"{prefix}.int4pack_scale_zero"] = scale_zero
    finally:
        reader.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": str(FORMAT), "dtype": str(dtype), "group_size": str(group_size), "torch": torch.__version__,
            "source": str(index.folder), "build_s": f"{time.perf_counter() - start:.2f}"}  # fmt: skip
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"kvboost": json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
