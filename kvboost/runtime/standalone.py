"""A model with a pool and a runner of its own, outside an engine (a speculative draft model, benchmarks).

It installs ``attention`` (default ``sdpa``) in the model, sizes a pool for one sequence of the model's context
(or ``max_tokens``), and builds the runner the engine would (:func:`kvboost.runtime.config.choose_runner`).
"""

from __future__ import annotations

from typing import Any

import torch

from kvboost.kv.block_table import BlockTable
from kvboost.kv.pool import DEFAULT_BLOCK_SIZE, KVPool


class StandaloneRunner:
    """``runner`` over ``pool`` for ``model``; :meth:`new_table` gives a sequence."""

    def __init__(self, model: Any, *, attention: Any = "sdpa", max_tokens: int | None = None, decode: str = "auto",
                 block_size: int = DEFAULT_BLOCK_SIZE, sequences: int = 1) -> None:  # fmt: skip
        from kvboost.registry import ATTENTION
        from kvboost.runtime.config import build_runner, choose_runner

        cfg = model.config.get_text_config(decoder=True)
        backend = ATTENTION.build(attention) if not hasattr(attention, "paged") else attention
        backend.check_available()
        config = choose_runner(model, backend, decode=decode)
        backend.install(model)
        rows = max_tokens or int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        param = next(model.parameters())
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.pool = KVPool(num_layers=int(cfg.num_hidden_layers), num_kv_heads=kv_heads, head_dim=head_dim,
                           num_blocks=sequences * (-(-rows // block_size) + 1), block_size=block_size,
                           dtype=param.dtype, device=param.device)  # fmt: skip
        self.attention = backend
        self.config = config
        self.runner = build_runner(config, model, self.pool, backend)

    def new_table(self) -> BlockTable:
        return BlockTable(self.pool)

    @torch.inference_mode()
    def warmup(self, max_tokens: int | None = None) -> float:
        return self.runner.warmup(max_tokens)
