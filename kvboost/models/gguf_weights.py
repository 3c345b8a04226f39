"""``weights="gguf_int4"``: a GGUF model's 4-bit linears run as shipped, in torch's int4 CPU kernel.

The default, ``weights="dense"``, loads a GGUF model as transformers does: every tensor dequantized (the folder
converted once, ``kvboost.models.loading.converted_gguf_dir``). With ``"gguf_int4"`` the model is loaded the same
way (config, tokenizer, norms, embeddings, and every tensor of another type come from that folder, in the model's
dtype), then the raw GGUF file is read (``gguf.GGUFReader``, memory-mapped) and every ``nn.Linear`` whose GGUF
tensor is Q4_0, Q4_1 or Q4_K is replaced by a :class:`kvboost.models.gguf_int4.GGUFInt4Linear` holding that
tensor's blocks (the dense copy is dropped). Those are AWQ-compatible int4 linears: the runtime fuses their q/k/v
and gate/up into one packed matrix each, as for AWQ; ``awq_prefill="dense"`` and ``lm_head="int8"`` apply.

Names: ``blk.N.attn_q/attn_k/attn_v/attn_output/ffn_gate/ffn_up/ffn_down.weight`` ->
``model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj``, ``mlp.gate_proj/up_proj/down_proj``;
``output.weight`` -> ``lm_head`` (only when the head is not tied to the embeddings, and not with
``lm_head="int8"``, which quantizes the dense head instead). The embedding stays a gather over its dense table.

Row order: llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` for the ``llama`` architecture (rotary
halves interleaved); transformers undoes it when loading (``LlamaTensorProcessor._reverse_permute_weights``) and
so does this module, on the blocks' rows (a block never spans rows, so codes, scales and zeros move together).
Other architectures (qwen2, ...) are not permuted, as in transformers. Each kind of projection's first replaced
linear is checked against the dense weight it replaces (same values, up to the dtype's rounding), so a wrong row
order fails the load instead of producing noise; ``tests/test_gguf_weights.py`` checks every one bit for bit.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

WEIGHTS_CHOICES = ("dense", "gguf_int4")
#: GGUF architectures whose attn_q / attn_k rows llama.cpp permutes (transformers' TENSOR_PROCESSORS["llama"])
PERMUTED_ARCHITECTURES = ("llama",)
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def check_weights(kind: Any) -> str:
    """``kind`` as one of :data:`WEIGHTS_CHOICES` (``None`` means ``"dense"``); anything else raises a ValueError
    naming the accepted values."""
    if kind is None:
        return "dense"
    if kind not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {list(WEIGHTS_CHOICES)}, got {kind!r}")
    return str(kind)


def gguf_source(model_name_or_path: str | os.PathLike[str] | None) -> Path:
    """The GGUF file ``weights="gguf_int4"`` reads for this model name; a ValueError naming why for a model that
    is not loaded from a GGUF file (checked before any weight is read)."""
    from kvboost.models.loading import gguf_file_of

    path = gguf_file_of(model_name_or_path)
    if path is None:
        raise ValueError(
            f"weights='gguf_int4' runs a GGUF file's 4-bit tensors, and {str(model_name_or_path)!r} is not loaded "
            "from a GGUF file (use None for the bundled model, 'gguf:NAME' for a catalog model or a path to a "
            ".gguf file; or weights='dense')"
        )
    return Path(path)


def hf_linear_name(gguf_name: str) -> str | None:
    """The HF module a GGUF linear weight belongs to (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj``,
    ``output.weight`` -> ``lm_head``), or None for any other tensor."""
    if gguf_name == "output.weight":
        return "lm_head"
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"


def llama_row_order(rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation: HF's row ``r`` is GGUF's row ``order[r]`` (as
    transformers' ``_reverse_permute_weights``: ``w.reshape(n_head, rows / n_head / 2, 2, ...).swapaxes(2, 1)``)."""
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"GGUF int4: {rows} rows are not {n_head} heads of an even size")
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def gguf_reader(path: str | os.PathLike[str]) -> Any:
    """A ``gguf.GGUFReader`` of ``path``, parsed once per file version: gguf-py reads every metadata field up front
    (the bundled model's 49,152-token vocabulary: ~2.8 s on a 2-core Zen 4), and an engine's set-up asks three
    times (which runner, the quantized step, its weights). Keyed by the resolved path, size and modification
    time, so a rewritten file is read again; the reader maps the file read-only and callers only read it."""
    resolved = Path(path).resolve()
    st = resolved.stat()
    return _cached_reader(str(resolved), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def _field_str(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return str(field.contents())
    except (AttributeError, TypeError, ValueError):  # older gguf-py: the string is the last part
        return bytes(field.parts[-1]).decode("utf-8")


def _check_replacement(module: Any, linear: nn.Linear, gguf_name: str) -> None:
    """The int4 module dequantizes to the dense weight it replaces (in the dense weight's dtype): a wrong row
    order or a mismatched file fails here. Where the fp32 zero is inexact (``zeros_exact``) values may differ by
    an ulp, so the bound is a few ulps of the largest weight, far below any misplaced row."""
    dense = linear.weight.detach()
    ours = module.dequantized_weight(torch.float32).to(dense.dtype)
    if torch.equal(ours, dense):
        return
    eps = torch.finfo(dense.dtype).eps
    bound = 4 * eps * float(dense.abs().max())
    diff = float((ours.float() - dense.float()).abs().max())
    if diff > bound:
        raise RuntimeError(f"GGUF int4: {gguf_name} does not dequantize to the weight the model loaded for it (max "
                           f"|diff| {diff:.3g} > {bound:.3g}): a row order or file mismatch")  # fmt: skip


def apply_gguf_int4(
    model: nn.Module, gguf_path: str | os.PathLike[str], *, keep_dense: tuple[str, ...] = (), check: bool = True,
) -> dict[str, list[str]]:  # fmt: skip
    """Replace, in place, every ``nn.Linear`` of ``model`` whose tensor in ``gguf_path`` is Q4_0 / Q4_1 / Q4_K by a
    :class:`~kvboost.models.gguf_int4.GGUFInt4Linear` of that tensor's blocks (module docstring). ``model`` must
    have been loaded from that file (its dense weights are the reference of the check). ``keep_dense``: module
    names left as they are. Biases are the model's own (moved into the int4 module).

    Records on the model: ``_kvboost_weights = "gguf_int4"``, ``_kvboost_gguf_file`` and ``_kvboost_gguf_types``
    ({module: GGUF type} for every linear the file names). Returns :func:`weight_formats`.
    """
    from kvboost.models.awq import _int4pack_supported, _set_submodule, linear_named
    from kvboost.models.gguf_int4 import GROUP_SIZE, SUPPORTED_TYPES, GGUFInt4Linear

    reader = gguf_reader(gguf_path)
    arch = _field_str(reader, "general.architecture") or ""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    types: dict[str, str] = {}
    checked: set[str] = set()
    for tensor in reader.tensors:
        name = hf_linear_name(tensor.name)
        if name is None:
            continue
        type_name = tensor.tensor_type.name
        types[name] = type_name
        if type_name not in SUPPORTED_TYPES or name in keep_dense or (name == "lm_head" and tied):
            continue
        linear = linear_named(model, name, f"GGUF int4: {gguf_path} has {tensor.name}")
        out_features, in_features = linear.weight.shape
        if tuple(int(n) for n in tensor.shape) != (in_features, out_features):  # ggml ne = [in, out]
            raise ValueError(f"GGUF int4: {tensor.name} has shape {list(tensor.shape)} (ne), the model's {name} "
                             f"[{out_features}, {in_features}]")  # fmt: skip
        if not _int4pack_supported(in_features, out_features, GROUP_SIZE):
            log.info(
                "kvboost: %s stays dense: torch's int4 kernel does not take %dx%d", name, out_features, in_features
            )
            continue
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else tensor.name
        rows = None
        if arch in PERMUTED_ARCHITECTURES and kind in ("attn_q", "attn_k"):
            rows = llama_row_order(out_features, heads if kind == "attn_q" else kv_heads)
        module = GGUFInt4Linear.from_gguf(tensor.tensor_type, tensor.data, bias=linear.bias, rows=rows)
        module.to(linear.weight.device)
        if check and kind not in checked:
            _check_replacement(module, linear, tensor.name)
            checked.add(kind)
        _set_submodule(model, name, module)
    model._kvboost_weights = "gguf_int4"
    model._kvboost_gguf_file = str(gguf_path)
    model._kvboost_gguf_types = types
    return weight_formats(model)


def weight_formats(model: nn.Module) -> dict[str, list[str]]:
    """{format: module names} of every linear of ``model``: ``gguf_int4:Q4_1`` (a GGUF tensor run as int4),
    ``awq_int4``, ``int4pack`` (a streamed AWQ layer's packed form), ``int8`` (``lm_head="int8"``), and
    ``dense:<dtype>`` (with ``(gguf <type>)`` when the model records the GGUF type it was dequantized from)."""
    from kvboost.models.awq import AWQLinear, Int4PackedLinear
    from kvboost.models.gguf_int4 import GGUFInt4Linear
    from kvboost.models.int8_head import Int8Linear

    gguf_types = getattr(model, "_kvboost_gguf_types", None) or {}
    out: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, GGUFInt4Linear):
            key = f"gguf_int4:{module.tensor_type}"
        elif isinstance(module, AWQLinear):
            key = "awq_int4"
        elif isinstance(module, Int4PackedLinear):
            key = "int4pack"
        elif isinstance(module, Int8Linear):
            key = "int8"
        elif isinstance(module, nn.Linear):
            key = f"dense:{str(module.weight.dtype).replace('torch.', '')}"
            if name in gguf_types:
                key += f" (gguf {gguf_types[name]})"
        else:
            continue
        out.setdefault(key, []).append(name)
    return out


def weight_format_counts(model: nn.Module) -> dict[str, int]:
    """:func:`weight_formats` as counts (what a run's summary reports as ``run.weight_formats``)."""
    return {key: len(names) for key, names in weight_formats(model).items()}


__all__ = [
    "PERMUTED_ARCHITECTURES", "WEIGHTS_CHOICES", "apply_gguf_int4", "check_weights", "gguf_source",
    "hf_linear_name", "llama_row_order", "weight_format_counts", "weight_formats",
]  # fmt: skip
