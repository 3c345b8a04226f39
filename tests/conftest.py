"""Shared fixtures: tiny random decoder-only models built from configs in code, a toy tokenizer.

Nothing here touches the network. The Triton interpreter is switched on before anything imports
triton when there is no GPU (the kernels then run on CPU tensors).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvboost_testkit.shadowing import checkout_entries, find_shadowing, shadowing_message

# Before anything imports a library: a checkout folder on sys.path named like an installed package (tests/kernels
# once hid Hugging Face's `kernels` from transformers) would otherwise fail hundreds of tests far from the cause.
_CLASHES = find_shadowing(checkout_entries(sys.path, Path(__file__).resolve().parents[1]))
if _CLASHES:
    raise pytest.UsageError(shadowing_message(_CLASHES))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))

from kvboost_testkit.tiny import ToyTokenizer  # noqa: E402


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def arch(request) -> str:
    return request.param


@pytest.fixture
def toy_tokenizer() -> ToyTokenizer:
    return ToyTokenizer()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The bundled model's tokenizer (its chat template) without its weights."""
    from transformers import AutoTokenizer

    from kvboost.models.loading import bundled_model_dir

    return AutoTokenizer.from_pretrained(bundled_model_dir())


@pytest.fixture(scope="module")
def redis_url():
    """A private redis-server for a module's Redis examples (the engine state machines); None without
    redis-server, and those examples then use the disk tier."""
    from kvboost_testkit.redis_server import RedisServer, skip_reason

    if skip_reason():
        yield None
        return
    server = RedisServer()
    yield server.url
    server.close()
