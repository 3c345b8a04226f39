"""Build a model whose non-resident decoder layers are streamed (see :mod:`kvboost.streaming`).

The model is built on the ``meta`` device (no weight is allocated), AWQ linears are put in place for an AWQ
checkpoint (as :func:`kvboost.models.awq.load_awq_model` does), the planner picks the resident layers, and only the
resident tensors (embeddings, final norm, head, resident layers) are read from the safetensors files, converted to
the model's dtype (AWQ int buffers and fp16 scales as stored), onto the device. Streamed layers keep meta
placeholders; a :class:`~kvboost.streaming.streamer.LayerStreamer` fills them per forward.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from kvboost.streaming.planner import StreamingConfig, StreamingPlan, plan_streaming
from kvboost.streaming.source import HostCopySource, MmapSource, SafetensorsIndex
from kvboost.streaming.streamer import LayerStreamer, layer_nbytes, layer_tensors

STREAMER_ATTR = "_kvboost_streamer"
RESOLVER_ATTR = "_kvboost_weight_resolver"  # read by kvboost.models.fingerprint for meta (streamed) tensors


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"layer streaming: cannot find the decoder layers of {type(model).__name__}")  # noqa: TRY004
    for name, module in model.named_modules():
        if module is layers:
            return name, layers
    raise ValueError("layer streaming: the decoder layers are not a submodule of the model")


def _build_skeleton(folder: str, config: Any, dtype: torch.dtype, index: SafetensorsIndex) -> nn.Module:
    """``config``'s causal LM on the meta device, with AWQ linears where the checkpoint has ``*.qweight``."""
    from transformers import AutoModelForCausalLM

    from kvboost.models.loading import _awq_config

    awq = _awq_config(config)
    plain = copy.deepcopy(config)
    if awq is not None:
        del plain.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain, dtype=dtype, attn_implementation="sdpa")
    if awq is not None:
        from kvboost.models.awq import AWQLinear

        for name in sorted(n[: -len(".qweight")] for n in index.tensors if n.endswith(".qweight")):
            linear = model.get_submodule(name)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"AWQ: {name!r} is a {type(linear).__name__}, not an nn.Linear")  # noqa: TRY004
            with torch.device("meta"):
                module = AWQLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                   group_size=awq.group_size)  # fmt: skip
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module)
        model.config.quantization_config = awq.to_dict()
    return model


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Rotary embeddings hold derived, non-persistent buffers (``inv_freq``): rebuild them from the config."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            cfg = getattr(module, "config", None) or model.config
            with torch.device(device):
                fresh = type(module)(config=cfg)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, fresh)


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    cfg = config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def build_streamed_model(
    folder: str | os.PathLike[str],
    streaming: Any,
    *,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = None,
    trace: bool = False,
) -> nn.Module:
    """A model from the safetensors ``folder`` with the layers the ``streaming`` config does not keep resident
    streamed. ``model._kvboost_streamer`` is the :class:`LayerStreamer` (``None`` when every layer is resident);
    ``model._kvboost_streaming_plan`` the :class:`StreamingPlan`."""
    from transformers import AutoConfig

    from kvboost.models.compat import check_architecture
    from kvboost.models.fingerprint import record_load
    from kvboost.models.loading import _default_device, resolve_dtype

    cfg = StreamingConfig.parse(streaming)
    if cfg is None:
        raise ValueError("build_streamed_model: streaming is off ('none')")
    folder = str(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"layer streaming reads a local safetensors folder; {folder!r} is not one")
    config = AutoConfig.from_pretrained(folder)
    check_architecture(config)
    device = _default_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    source_kind = cfg.resolve_source(device.type)
    index = SafetensorsIndex(folder)
    model = _build_skeleton(folder, config, torch_dtype, index)
    layers_name, layers = _decoder_layers(model)
    in_layers = {f"{layers_name}.{i}." for i in range(len(layers))}

    # ---- the plan: bytes of everything outside the layers (tied tensors once), of each layer, of the KV
    seen: set[int] = set()
    base = 0
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if id(t) in seen or any(name.startswith(p) for p in in_layers):
            continue
        seen.add(id(t))
        base += t.numel() * t.element_size()
    plan = plan_streaming(cfg, base_bytes=base, layer_bytes=[layer_nbytes(layer) for layer in layers],
                          kv_bytes_per_token=_kv_bytes_per_token(config, torch_dtype))  # fmt: skip

    # ---- streamed AWQ linears in the int4 kernel's layout, from a prepacked sidecar (int4pack_sidecar). The plan
    # above counted them in AutoAWQ's layout (the packed one is ~1-2% larger per layer: fp-typed scale-and-zero
    # pairs instead of fp16 scales + int4 zeros); the slots are sized from the packed placeholders.
    prepacked = _prepack_streamed_awq(model, layers_name, layers, plan.streamed, index, cfg, torch_dtype, device)

    # ---- resident tensors from the files; streamed layers keep their meta placeholders
    reader = MmapSource(index)
    streamed_prefixes = tuple(f"{layers_name}.{i}." for i in plan.streamed)
    try:
        for mod_name, mod in model.named_modules():
            prefix = mod_name + "." if mod_name else ""
            if prefix.startswith(streamed_prefixes):
                continue
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if prefix + pname not in index:  # tied (lm_head): tie_weights below; else reported below
                    continue
                t = reader.read(prefix + pname, p.dtype if p.is_floating_point() or p.dtype == torch.bool else None)
                if t.dtype != p.dtype:
                    raise ValueError(f"{prefix + pname}: the file holds {t.dtype}, the model expects {p.dtype}")
                mod._parameters[pname] = nn.Parameter(t.to(device), requires_grad=False)
            for bname, b in list(mod._buffers.items()):
                if b is None or bname in mod._non_persistent_buffers_set:
                    continue
                if prefix + bname not in index:
                    continue
                t = reader.read(prefix + bname, b.dtype if b.is_floating_point() else None)
                if t.dtype != b.dtype:
                    raise ValueError(f"{prefix + bname}: the file holds {t.dtype}, the model expects {b.dtype}")
                mod._buffers[bname] = t.to(device)
    finally:
        reader.close()
    _rebuild_rotary(model, device)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    still_meta = [
        n for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
        if t.device.type == "meta" and not n.startswith(streamed_prefixes)
    ]  # fmt: skip
    if still_meta:
        raise ValueError(f"layer streaming: {folder} lacks tensors the model needs: {sorted(set(still_meta))[:8]}")
    streamed_missing = [
        f"{layers_name}.{i}.{local}"
        for i in plan.streamed
        for *_, local in layer_tensors(layers[i])
        if f"{layers_name}.{i}.{local}" not in index
    ]
    if streamed_missing:
        raise ValueError(f"layer streaming: {folder} lacks tensors of streamed layers: {streamed_missing[:8]}")
    # (no model.to(device): resident tensors were read onto the device, and the placeholders must stay on meta)

    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):
        pass

    streamer = None
    if plan.streamed:
        if source_kind == "mmap":
            source: Any = MmapSource(index)
        else:
            dtypes = {
                f"{layers_name}.{i}.{local}": (mod._parameters if is_param else mod._buffers)[attr].dtype
                for i in plan.streamed
                for mod, attr, is_param, local in layer_tensors(layers[i])
            }
            source = HostCopySource(index, dtypes, pin=source_kind == "pinned")
        streamer = LayerStreamer(layers, layers_name, plan.streamed, source, slots=cfg.slots,
                                 prefetch=cfg.resolve_prefetch(device.type),
                                 device=device, trace=trace)  # fmt: skip
    model.eval()
    setattr(model, STREAMER_ATTR, streamer)
    model._kvboost_streaming_plan = plan
    model._kvboost_streaming_prepacked = prepacked
    if streamer is not None:
        setattr(model, RESOLVER_ATTR, streamer.resolve)
    record_load(model, folder)
    return model


def _prepack_streamed_awq(
    model: nn.Module, layers_name: str, layers: nn.ModuleList, streamed: tuple[int, ...], index: SafetensorsIndex,
    cfg: StreamingConfig, dtype: torch.dtype, device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """Replace the streamed layers' AWQ linears by :class:`~kvboost.models.awq.Int4PackedLinear` placeholders and
    index their sidecar, where that applies (see :mod:`kvboost.streaming.int4pack_sidecar`). Returns what was done
    (``{"used": bool, "reason" | "sidecar", "linears"}``), for ``engine.streamer.info()`` and the benchmarks."""
    from kvboost.models.awq import AWQLinear, Int4PackedLinear
    from kvboost.streaming.int4pack_sidecar import ensure_sidecar, prepack_unsupported

    awq = [(f"{layers_name}.{i}.{name}", mod) for i in streamed for name, mod in layers[i].named_modules()
           if isinstance(mod, AWQLinear)]  # fmt: skip
    if not awq:
        return {"used": False, "reason": "no streamed AWQ linears"}
    reason = "streaming.prepack is false" if not cfg.prepack else prepack_unsupported(device, dtype)
    if reason is None and len({m.group_size for _, m in awq}) != 1:
        reason = "AWQ linears with different group sizes"
    if reason is None:
        from kvboost.models.awq import _int4pack_supported

        bad = [n for n, m in awq if not _int4pack_supported(m.in_features, m.out_features, m.group_size)]
        reason = f"shapes the int4 kernel does not take: {bad[:3]}" if bad else None
    if reason is not None:
        return {"used": False, "reason": reason}
    group = awq[0][1].group_size
    sidecar = ensure_sidecar(index, [name for name, _ in awq], dtype, group)
    index.add_file(sidecar)
    for name, mod in awq:
        with torch.device("meta"):
            packed = Int4PackedLinear(mod.in_features, mod.out_features, mod.bias is not None, group_size=group,
                                      dtype=dtype)  # fmt: skip
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, packed)
    return {"used": True, "sidecar": str(sidecar), "linears": len(awq)}


def load_streamed_model_and_tokenizer(
    model_name_or_path: str | os.PathLike[str] | None,
    streaming: Any,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
) -> tuple[nn.Module, Any, str]:
    """(model, tokenizer, resolved path), like :func:`kvboost.models.loading.load_model_and_tokenizer`, with
    layer streaming. Only local safetensors folders (the bundled model's converted folder included)."""
    from transformers import AutoTokenizer

    from kvboost.models.loading import resolve_model_path

    path = resolve_model_path(model_name_or_path)
    model = build_streamed_model(path, streaming, dtype=dtype, device=device)
    return model, AutoTokenizer.from_pretrained(path), path


def streaming_plan(model: nn.Module) -> StreamingPlan | None:
    return getattr(model, "_kvboost_streaming_plan", None)
