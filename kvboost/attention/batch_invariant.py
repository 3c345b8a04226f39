"""``batch_invariant``: every token's arithmetic independent of the forward it runs in (bit-exact reuse in bf16).

Why: in bf16 a prefix hit is not bit-equal to a cold prefill, because the kernels pick their blocking from the
shapes of the call. On AMX CPUs oneDNN's bf16 GEMM gives some rows other bits when the same rows sit in a
forward of another length (``experiments/results/bf16_exactness/``), and torch's flash-attention kernel splits
queries and keys by the call's lengths. A row computed in a cold prefill of n tokens and the same row
computed in a suffix prefill after a cached prefix then differ in their last bits, the difference grows
through the layers, and greedy outputs part ways (the "outputs change with prefix caching" reports of vLLM and
SGLang users). Thinking Machines' "Defeating Nondeterminism in LLM Inference" (He et al., 2025) names the cure:
kernels whose reduction order per row does not depend on the batch.

How, with stock torch kernels:

- projections: every ``nn.Linear`` of the decoder layers runs in GEMMs of exactly ``tile`` rows, the tiles
  aligned to the absolute cache position (row p always sits at offset ``p % tile`` of a tile; the tile is padded
  with zero rows). A GEMM of fixed shape reduces each output element in a fixed order whatever the other rows
  hold, so a token's projection no longer depends on how many tokens share the forward. Decode steps (one
  row) pay for a padded tile: that is the price of the guarantee.
- attention: fp32, queries in the same position-aligned tiles, keys in blocks of ``key_block`` rows. The row
  maximum is exact whatever the order; probabilities ``exp(s - max)`` are elementwise; each key block's
  contribution (a fixed-shape GEMM, with a column of ones in V giving the row sums in the same product) is
  added in block order. Blocks past a query's position contribute exact zeros, so the result depends only on
  the keys the query may see.

The LM head is left alone: the engine and the HF baselines both compute only the last row's logits.

Content reuse (layer-wise execution of selected rows) runs through the same code, correct but not aligned
(its result is an approximation anyway). Decoding goes through HF's forward (the fused decode step has its
own arithmetic). Models with attention soft-capping are refused; sliding windows come in the mask.
"""

from __future__ import annotations

import types
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvboost.attention.base import SELECTED_Q_POSITIONS, AttentionBackend
from kvboost.registry import ATTENTION

#: Upper bound on the fp32 score buffer of one group of query tiles (bytes); longer prompts loop over groups.
SCORE_BUDGET_BYTES = 64 * 2**20
_PATCHED = "_kvboost_tiled_linear"


def tiled_linear(module: torch.nn.Linear, x: torch.Tensor, offset: int, tile: int) -> torch.Tensor:
    """``F.linear(x, module.weight, module.bias)`` in GEMMs of exactly ``tile`` rows aligned to ``offset``.

    The rows of ``x`` (all leading dims flattened) are the tokens at cache positions ``offset, offset + 1, ...``;
    row p is computed at row ``p % tile`` of a zero-padded tile, so its bits do not depend on the call's length.
    """
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    front = offset % tile
    padded = F.pad(rows, (0, 0, front, -(front + n) % tile))
    out = torch.cat(
        [F.linear(padded[i : i + tile], module.weight, module.bias) for i in range(0, padded.shape[0], tile)]
    )
    return out[front : front + n].reshape(*x.shape[:-1], out.shape[-1])


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    *,
    front: int,
    tile: int,
    key_block: int,
    scaling: float,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, Lq, D]`` over ``key``/``value [B, Hkv, Lk, D]`` where ``allowed
    [B or 1, 1, Lq, Lk]`` (bool) says which key each query may see; ``front`` zero rows are put before the
    queries so that they sit at their position-aligned tile offsets. Returns ``[B, Lq, Hq, D]`` in the query's
    dtype. Rows that may see no key give zeros."""
    batch, heads, q_len, dim = query.shape
    k_len = key.shape[2]
    groups = heads // key.shape[1]
    back = -(front + q_len) % tile
    k_pad = -k_len % key_block
    q = F.pad(query.float(), (0, 0, front, back))
    q = q.view(batch, heads, -1, tile, dim)  # [B, H, tiles, tile, D]
    n_tiles = q.shape[2]
    k = F.pad(key.float(), (0, 0, 0, k_pad)).repeat_interleave(groups, 1)
    v = F.pad(value.float(), (0, 0, 0, k_pad)).repeat_interleave(groups, 1)
    v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # the ones column gives the row sums
    blocks = k.shape[2] // key_block
    v_blocks = v.view(batch, heads, blocks, key_block, dim + 1)
    mask = F.pad(allowed, (0, k_pad, front, back), value=False)
    mask = mask.view(mask.shape[0], 1, n_tiles, tile, -1)
    k_t = k.transpose(-1, -2)[:, :, None]  # [B, H, 1, D, Lk']

    per_tile = heads * tile * k.shape[2] * 4 * batch
    step = max(1, SCORE_BUDGET_BYTES // max(per_tile, 1))
    out = q.new_empty(batch, heads, n_tiles, tile, dim)
    for a in range(0, n_tiles, step):
        b = min(n_tiles, a + step)
        s = (q[:, :, a:b] @ k_t) * scaling  # fixed-shape GEMMs: [tile, D] x [D, Lk'] per (batch, head, tile)
        s = s.masked_fill(~mask[:, :, a:b], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        acc = None
        for j in range(blocks):  # in block order: the same additions for every call that sees these keys
            part = p[..., j * key_block : (j + 1) * key_block] @ v_blocks[:, :, j : j + 1]
            acc = part if acc is None else acc + part
        total = acc[..., dim:]
        out[:, :, a:b] = torch.where(total > 0, acc[..., :dim] / total.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    out = out.view(batch, heads, -1, dim)[:, :, front : front + q_len]
    return out.transpose(1, 2).to(query.dtype).contiguous()


@ATTENTION.register("batch_invariant")
class BatchInvariantBackend(AttentionBackend):
    """Attention and decoder-layer projections whose per-token bits do not depend on the call's length.

    With it, a bf16 prefix hit gives the same logits and greedy tokens as a cold prefill, bit for bit (the
    HF baselines of a run use the same arithmetic, since the backend is installed in the model they share).

    Args:
        tile: rows per GEMM tile, aligned to cache positions (projections and attention queries). Larger
            tiles mean fewer GEMM calls per prefill and more padding per decode step.
        key_block: keys per block of the attention's in-order accumulation.
    """

    name = "batch_invariant"
    mask_kind = "sdpa"
    #: Goes into the engine's fingerprint: KV computed here has other bits than under the other backends.
    fingerprint_tag: ClassVar[str] = "batch_invariant"

    def __init__(self, tile: int = 64, key_block: int = 64) -> None:
        super().__init__()
        for field, value in (("tile", tile), ("key_block", key_block)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"attn.{field} must be a positive integer, got {value!r}")
        self.tile, self.key_block = tile, key_block
        self._offset = 0  # cache position of the first row of the forward that runs now
        self._hooks: list[Any] = []

    def check_available(self) -> None:
        """Plain torch ops; always available."""

    def check_model(self, model: torch.nn.Module) -> None:
        config = model.config.get_text_config(decoder=True)
        # Sliding windows need nothing here: transformers hands a mask whenever the window hides a key.
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError(
                "attention backend 'batch_invariant' does not support attention soft-capping; use attn=sdpa"
            )

    # ------------------------------------------------------------------ install: projections and offsets
    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Install the attention (as every backend does), tile the decoder layers' projections, and record each
        forward's first cache position (the tiles' alignment)."""
        super().install(model)
        if self._hooks:
            return model
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._hooks.append(base.register_forward_pre_hook(self._record_offset, with_kwargs=True))
        for layer in getattr(base, "layers", []):
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear) and not hasattr(module, _PATCHED):
                    module.forward = types.MethodType(self._linear_forward, module)
                    setattr(module, _PATCHED, self)
        return model

    def uninstall(self, model: torch.nn.Module) -> torch.nn.Module:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for module in model.modules():
            if getattr(module, _PATCHED, None) is self:
                del module.forward  # back to the class's forward
                delattr(module, _PATCHED)
        return super().uninstall(model)

    def _record_offset(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        position = kwargs.get("cache_position")
        if position is not None and position.numel():
            self._offset = int(position.reshape(-1)[0])
            return
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers renames it to ``cache``
        self._offset = int(cache.get_seq_length()) if cache is not None else 0

    def _linear_forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(module, x, self._offset, self.tile)

    # ------------------------------------------------------------------ attention
    def attention_forward(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if dropout:
            raise ValueError("attention backend 'batch_invariant' runs inference only (dropout must be 0)")
        q_len, k_len = query.shape[2], key.shape[2]
        q_positions = kwargs.pop(SELECTED_Q_POSITIONS, None)
        keys = torch.arange(k_len, device=query.device)
        if q_positions is not None:  # layer-wise execution: selected rows, by their own positions
            allowed = (keys[None, :] <= q_positions.to(query.device)[:, None])[None, None]
            front = 0
        elif attention_mask is not None:
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            front = (k_len - q_len) % self.tile
        else:  # causal, aligned bottom-right: the queries are the last q_len positions
            positions = torch.arange(k_len - q_len, k_len, device=query.device)
            allowed = (keys[None, :] <= positions[:, None])[None, None]
            front = (k_len - q_len) % self.tile
        out = invariant_attention(
            query, key, value, allowed, front=front, tile=self.tile, key_block=self.key_block,
            scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
        )  # fmt: skip
        self.kernel_calls += 1
        return out, None
