"""A prefill without HF's per-layer Python, on the fused decode step's weights (``engine.prefill``).

After reuse the usual prefill is a suffix of tens to hundreds of new tokens over a cached prefix. HF's forward
runs it through its module tree, mask builders and cache objects; this runs the same arithmetic as one loop over
the layers, writing K/V straight into the request's preallocated buffers: ``F.rms_norm`` (HF's bits, as in the
decode step), ``F.linear`` per projection, RoPE in the model dtype, and torch's SDPA with the causal-by-position
mask (query ``i`` sees key ``j`` iff ``j <= start + i``; built once per forward as the additive 0/-inf tensor SDPA
would make of a bool mask in every layer) and ``enable_gqa``. Its logits and K/V equal HF's
forward to the bit on the supported architectures (llama, mistral, qwen2; tested in fp32 and bf16, with and
without a cached prefix). ``experiments/bench_prefill_paths.py`` (2 threads, AMX CPU, SmolLM2-135M): TTFT
of HF's forward / this 1.09-1.13x in bf16 and 1.02-1.07x in fp32 for 42-255 new tokens (HF's Python is a fixed
~5-10 ms per forward).

AWQ int4 models: where the decode step fuses the int4 projections (q/k/v and gate/up as one packed matrix), so
does this prefill. With dense prefill on (``model.awq_prefill: dense``, :func:`kvboost.models.awq.enable_dense_prefill`)
a forward of ``dense_min_rows`` tokens or more multiplies fused dequantized copies instead (one ``F.linear`` for
q/k/v and one for gate/up, the modules holding views of the same copies): torch's int4 CPU kernel does not use
the matrix units, and a 255-token suffix took 420 ms through it against 148 ms dense (bf16, same machine). Those
products round differently from the int4 kernel's; prefix reuse still equals a cold prefill, since both run here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvboost.models.awq import AWQLinear, fuse_dense, fused_bias
from kvboost.models.decode_step import (
    FusedDecodeStep,
    _rms_norm_fused,
    _rotate_half,
    has_int4_projections,
    unsupported_reason,
)
from kvboost.models.prealloc_cache import PreallocatedKV
from kvboost.models.prepack import pack_layer, plain_projections

#: ``graphed``: short suffixes replayed as CUDA graphs (:class:`kvboost.models.graphed_decode.GraphedPrefill`).
PREFILL_MODES = ("hf", "fused", "graphed")
#: Attention backends the fused prefill runs: ``sdpa`` (torch's SDPA, HF's bits) and those that offer a
#: ``prefill_attention(q, keys, values, start, scale)`` kernel call (``cpu_kernel``).
PREFILL_ATTENTION_BACKENDS = ("sdpa", "cpu_kernel")


def _has_forward_hooks(model: nn.Module) -> bool:
    return any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def choose_prefill(requested: str, model: Any, attention: Any, decode_mode: str | None = None) -> tuple[str, str]:
    """(mode, why) for the engine's ``prefill`` option: ``"fused"`` (:class:`StepPrefill`), ``"graphed"`` (CUDA
    graphs, :class:`kvboost.models.graphed_decode.GraphedPrefill`) or ``"hf"``.

    ``"auto"`` (the default) picks ``"fused"`` on CPU where the model is supported, the attention backend is plain
    ``sdpa`` or ``cpu_kernel`` (whose kernel the prefill calls; other backends, and ``sdpa`` with ``key_tile``, keep
    their own attention through HF's forward) and no module has forward hooks (a layer streamer swaps weights in
    hooks that only HF's forward fires). On CUDA ``auto`` picks ``"graphed"`` where the decode step is graphed
    (``decode_mode``) under plain ``sdpa``, else HF's forward. A mode that cannot run here is an error.
    """
    if requested not in ("auto", *PREFILL_MODES):
        raise ValueError(f"prefill must be 'auto' or one of {PREFILL_MODES}, got {requested!r}")
    if requested == "hf":
        return "hf", "requested"
    name = getattr(attention, "name", attention)
    device = next(model.parameters()).device.type
    on_cuda = device == "cuda"
    reasons = [
        unsupported_reason(model),
        None if name in PREFILL_ATTENTION_BACKENDS else f"attention backend {name!r} runs through HF's forward",
        "attn.key_tile pads the keys of HF's attention calls" if getattr(attention, "key_tile", 0) else None,
        "forward hooks on the model (e.g. a layer streamer) run only in HF's forward" if _has_forward_hooks(model)
        else None,
    ]  # fmt: skip
    reason = next((r for r in reasons if r), None)
    if requested == "graphed":
        reason = reason or (None if on_cuda else "the model is not on a CUDA device")
        reason = reason or (None if name == "sdpa" else f"attention backend {name!r}: the graphs run their own SDPA")
        reason = reason or ("AWQ int4 projections" if has_int4_projections(model) else None)
        if reason is not None:
            raise ValueError(f"prefill='graphed' cannot run here: {reason}; use prefill='hf' (or 'auto')")
        return "graphed", "requested"
    if requested == "fused":
        if reason is not None:
            raise ValueError(f"prefill='fused' cannot run here: {reason}; use prefill='hf' (or 'auto')")
        return "fused", "requested"
    if reason is not None:
        return "hf", reason
    if on_cuda:
        if decode_mode == "graphed" and name == "sdpa":
            return "graphed", "auto: CUDA, the decode step is graphed (suffixes up to its max_graph_tokens)"
        return "hf", "CUDA: the fused prefill is CPU-only and the decode step is not graphed"
    if device != "cpu":
        return "hf", "not validated on this device (CPU only)"
    return "fused", "auto"


class StepPrefill:
    """``prefill(ids, start, kv) -> logits``: run ``ids`` at positions ``start ..`` over the ``start`` rows already
    in ``kv``, writing their K/V rows; returns the last position's logits (fp32 ``[vocab]``). The caller then
    exposes the rows with ``kv.set_length(start + len(ids))``.

    Args:
        step: the engine's :class:`FusedDecodeStep` (its per-layer weights are reused, fused int4 packs included);
            an eager one is built when the engine decodes through HF.
        prepacked: multiply plain projections with prepacked copies of their weights
            (:mod:`kvboost.models.prepack`: oneDNN in bf16, MKL in fp32, CPU): faster, but no longer HF's bits.
        attention: the engine's attention backend when it offers ``prefill_attention`` (``cpu_kernel``): the
            layers' attention calls it instead of torch's SDPA. None (or ``sdpa``): SDPA, HF's bits.
    """

    def __init__(self, step: FusedDecodeStep, *, prepacked: bool = False, attention: Any = None) -> None:
        self.step = step
        self._kernel_attention = getattr(attention, "prefill_attention", None)
        model = step.model
        inner = model.model
        self.inner, self.lm_head = inner, model.lm_head
        self.num_layers = len(inner.layers)
        self._packed_layers: list[tuple] | None = None
        if prepacked:
            if step.int4_fused or not plain_projections(inner.layers):
                raise ValueError("prepacked prefill weights need plain nn.Linear projections (not AWQ int4)")
            self._packed_layers = [pack_layer(layer) for layer in inner.layers]
        self._packed_dtype = inner.norm.weight.dtype
        self.dense_min_rows: int | None = None
        self._dense_layers: list[tuple] | None = None
        self._module_layers: list[tuple] | None = None
        if step.int4_fused:
            # Row counts the modules do not send to the int4 kernel (fp32 calls of more than a few rows go to
            # dequantize + F.linear) run through the modules themselves: HF's calls.
            self._module_layers = [self._modules(layer) for layer in inner.layers]
            rows = {m.dense_min_rows for m in model.modules() if isinstance(m, AWQLinear)}
            if rows != {None}:
                if len(rows) != 1:
                    raise ValueError(
                        f"dense prefill: the AWQ linears disagree on dense_min_rows ({sorted(rows, key=str)})"
                    )
                self.dense_min_rows = rows.pop()
                dtype = inner.norm.weight.dtype
                self._dense_layers = [self._dense_weights(layer, dtype) for layer in inner.layers]

    @staticmethod
    def _dense_weights(layer: Any, dtype: torch.dtype) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        return (
            layer.input_layernorm.weight, fuse_dense(qkv, dtype), fused_bias(qkv, dtype),
            fuse_dense((attn.o_proj,), dtype), fused_bias((attn.o_proj,), dtype),
            layer.post_attention_layernorm.weight, fuse_dense((mlp.gate_proj, mlp.up_proj), dtype),
            fuse_dense((mlp.down_proj,), dtype),
        )  # fmt: skip

    @staticmethod
    def _modules(layer: Any) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        return (
            layer.input_layernorm.weight, attn.q_proj, None, attn.k_proj, None, attn.v_proj, None, attn.o_proj,
            layer.post_attention_layernorm.weight, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
        )  # fmt: skip

    @property
    def packed_bytes(self) -> int:
        """Bytes of the prepacked copies of the projection weights this prefill holds (0 without them)."""
        if self._packed_layers is None:
            return 0
        return sum(int(getattr(w, "nbytes", 0)) for layer in self._packed_layers for w in layer
                   if not isinstance(w, torch.Tensor))  # fmt: skip

    def _int4_kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the modules' call on ``x``'s rows is torch's int4 kernel (what the fused packs compute)."""
        return self.inner.layers[0].self_attn.q_proj._use_int4pack(x)

    # ------------------------------------------------------------------ the arithmetic
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _rms_norm_fused(x, weight, self.step.eps)

    def _attend(self, q, k, v, start: int, keys, values, mask: torch.Tensor) -> torch.Tensor:
        """``q`` ``[heads, T, d]``, ``k``/``v`` ``[kv_heads, T, d]`` (after RoPE): writes the rows ``[start, start+T)``
        and attends over rows ``[0, start+T)`` under ``mask`` (:func:`causal_additive_mask`). Returns
        ``[T, heads * d]``."""
        t = q.shape[1]
        end = start + t
        keys[:, start:end] = k
        values[:, start:end] = v
        if self._kernel_attention is not None:
            return self._kernel_attention(q, keys, values, start, self.step.scale)
        out = F.scaled_dot_product_attention(
            q[None], keys[None, :, :end], values[None, :, :end], attn_mask=mask, scale=self.step.scale,
            enable_gqa=self.step.grouped_query,
        )[0]  # fmt: skip
        return out.transpose(0, 1).reshape(t, -1)

    def _qk_rope(self, q, k, cos, sin):
        t, h, kvh, d = q.shape[0], self.step.num_heads, self.step.num_kv_heads, self.step.head_dim
        q, k = q.view(t, h, d).transpose(0, 1), k.view(t, kvh, d).transpose(0, 1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _layer(self, x, cos, sin, mask, start, keys, values, ln1, wq, bq, wk, bk, wv, bv, wo, ln2, wg, wu, wd):
        """One decoder layer, one projection per call: the calls HF's forward makes."""
        t, kvh, d = x.shape[0], self.step.num_kv_heads, self.step.head_dim
        a = self._norm(x, ln1)
        q, k = self._qk_rope(_linear(a, wq, bq), _linear(a, wk, bk), cos, sin)
        v = _linear(a, wv, bv).view(t, kvh, d).transpose(0, 1)
        x = x + _linear(self._attend(q, k, v, start, keys, values, mask), wo, None)
        m = self._norm(x, ln2)
        return x + _linear(F.silu(_linear(m, wg, None)) * _linear(m, wu, None), wd, None)

    def _fused_layer(self, x, cos, sin, mask, start, keys, values, ln1, qkv_fn, o_fn, ln2, gate_up_fn, down_fn):
        """One decoder layer with q/k/v and gate/up each one product (``*_fn`` apply them)."""
        t, h, kvh, d = x.shape[0], self.step.num_heads, self.step.num_kv_heads, self.step.head_dim
        a = self._norm(x, ln1)
        qkv = qkv_fn(a)
        # q and k are adjacent: one RoPE over their heads, as in the decode step.
        qk = qkv[:, : (h + kvh) * d].view(t, h + kvh, d).transpose(0, 1)
        qk = qk * cos + _rotate_half(qk) * sin
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d).transpose(0, 1)
        x = x + o_fn(self._attend(qk[:h], qk[h:], v, start, keys, values, mask))
        m = self._norm(x, ln2)
        gate, up = gate_up_fn(m).split((self.step.intermediate, self.step.intermediate), dim=-1)
        return x + down_fn(F.silu(gate) * up)

    def _run_layer(self, i: int, x, cos, sin, mask, start: int, keys, values, path: str) -> torch.Tensor:
        step = self.step
        if path == "modules":
            return self._layer(x, cos, sin, mask, start, keys, values, *self._module_layers[i])
        if path == "dense":
            ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd = self._dense_layers[i]
            return self._fused_layer(
                x, cos, sin, mask, start, keys, values, ln1, lambda a: F.linear(a, wqkv, bqkv),
                lambda a: F.linear(a, wo, bo), ln2, lambda a: F.linear(a, wgu), lambda a: F.linear(a, wd),
            )  # fmt: skip
        if self._packed_layers is not None:  # (ln1, qkv, o, ln2, gate_up, down), each packed product a callable
            return self._fused_layer(x, cos, sin, mask, start, keys, values, *self._packed_layers[i])
        weights = step._layer_weights[i]
        if step.int4_fused:
            ln1, wqkv, sqkv, bqkv, wo, so, bo, ln2, wgu, sgu, wd, sd = weights

            def int4(w, s, b):  # the decode step's fused int4 call, any number of rows
                return lambda a: step._int4(a, w, s, b)

            return self._fused_layer(x, cos, sin, mask, start, keys, values, ln1, int4(wqkv, sqkv, bqkv), int4(wo, so, bo),
                                     ln2, int4(wgu, sgu, None), int4(wd, sd, None))  # fmt: skip
        return self._layer(x, cos, sin, mask, start, keys, values, *weights)

    def fits(self, start: int, count: int) -> bool:
        """Whether this prefill runs ``count`` tokens after ``start`` rows (always: it has no size limit)."""
        return True

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, start: int, kv: PreallocatedKV) -> torch.Tensor:
        t = int(ids.numel())
        if t < 1:
            raise ValueError("prefill needs at least one token")
        if start + t > kv.capacity:
            raise ValueError(f"the KV buffer holds {kv.capacity} rows; {start} + {t} do not fit")
        step, inner = self.step, self.inner
        ids = ids.reshape(-1).to(kv.keys.device)
        x = inner.embed_tokens.weight.index_select(0, ids)
        if self._packed_layers is not None and x.dtype != self._packed_dtype:
            raise RuntimeError(
                f"the prefill packed {self._packed_dtype} copies of the weights, but the model now runs in {x.dtype}: "
                "the model was converted after the engine was built; build a new engine"
            )
        # HF's rotary embedding: positions times inverse frequencies in fp32 (one product each), cos/sin scaled
        # and cast to the model dtype.
        positions = torch.arange(start, start + t, device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * inner.rotary_emb.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * step.attention_scaling).to(x.dtype)
        sin = (emb.sin() * step.attention_scaling).to(x.dtype)
        mask = causal_additive_mask(start, t, x.dtype, x.device)
        path = "weights"
        if self._dense_layers is not None and t >= self.dense_min_rows:
            path = "dense"
        elif self._module_layers is not None and not self._int4_kernel_takes(x):
            path = "modules"
        for i in range(self.num_layers):
            x = self._run_layer(i, x, cos, sin, mask, start, kv.keys[i], kv.values[i], path)
        # The head's own call (nn.Linear or the int8 head), on the last position only, as HF's logits_to_keep=1.
        return self.lm_head(self._norm(x[-1:], inner.norm.weight))[0].float()


def causal_additive_mask(start: int, t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[t, start + t]``: 0 where query ``i`` (at position ``start + i``) may see key ``j`` (``j <= start + i``),
    ``-inf`` elsewhere, in the model dtype.

    Built once per forward and shared by every layer. SDPA turns a bool mask into exactly this tensor on each
    call (``where(mask, 0, -inf)`` in the query dtype), so the results are the same bits; building it once saves
    that conversion and the comparison in every layer (~0.1-0.2 ms per layer at a few hundred tokens on 2 cores),
    and the flash kernel reads an additive mask a little faster than it reads a converted one.
    """
    allowed = torch.arange(start + t, device=device)[None, :] <= torch.arange(start, start + t, device=device)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, or the callable the step keeps instead of a weight tensor (AWQ linears it does not fuse, a
    head, a prepacked weight): it applies its own bias."""
    if not isinstance(weight, torch.Tensor):
        return weight(x)
    return F.linear(x, weight, bias)
