"""A one-token decode step with few launches, for Llama-structured models (llama, mistral, qwen2).

HF's forward runs ~15 small kernels per layer plus its Python (masks, cache objects, output classes) around
them: on the bundled 135M model that overhead, not the weights, set the decode rate (~25 tokens/s on the
project's CPUs). This step is the same arithmetic written as one function over the engine's preallocated KV
buffers ``[layers, kv_heads, capacity, head_dim]``, compiled once with ``torch.compile`` (inductor):

- every projection is written as ``(W * x).sum(-1)``: for one token that is a matrix-vector product, and
  inductor turns it into a fused, vectorised reduction that streams the weights at about twice the rate of
  the BLAS ``gemv`` behind ``F.linear`` on these CPUs (fp32 10 -> 24 GB/s, bf16 12 -> 20 GB/s, measured on
  [1536, 576] weights); norms, RoPE, SiLU and residuals fuse around them;
- the new token's K/V rows are written straight into the buffers at its position and attention reads rows
  ``[0, position]``; the graph is compiled with dynamic shapes, so a new position or a new buffer size does
  not recompile;
- with ``compile=False`` (or when inductor is not available) the step runs eagerly with ``F.linear`` and
  transformers' SDPA call: HF's arithmetic to the bit (bf16 included), without HF's per-layer Python.

Numbers: the compiled step computes what HF's forward computes (RMSNorm in fp32, RoPE in the model dtype) in
another summation order, with fp32 attention: logits agree to ~3e-5 in fp32, but in bf16 a projection's result
now and then rounds to the neighbouring bf16 value, and greedy outputs drift from HF's after a near-tie (about
0.5 in logits on SmolLM2). ``decode=eager`` is the exact choice; the tests check both against HF's forward on
every supported architecture. Architectures the step does not cover (sliding windows, fused projections, scaled
embeddings, RoPE types whose frequencies depend on the length) keep HF's forward: ``unsupported_reason``
says why. AWQ int4 projections (``kvboost.models.awq.AWQLinear``) run in the eager step through their own
module (torch's int4 kernel on CPU, the Triton dequant-GEMM on CUDA): the call HF's forward makes, without HF's
per-layer Python around it. Where the modules' one-row call is torch's int4 CPU kernel (on CPU unless
``AWQLinear.cpu_kernel`` is ``dequant``), the step fuses them per input instead (q/k/v and gate/up as one packed
matrix each: four int4 calls per layer instead of seven, the modules keeping views of the same codes), eager or
compiled; the fused call is the modules' arithmetic to the bit. Elsewhere (``dequant``, CUDA) each projection
runs through its own module and the compiled step refuses them. ``auto`` picks the eager step for AWQ models
(faster than compiled here, see :func:`choose_decode`).

Under ``attn=batch_invariant`` the eager step hands the backend what HF's forward would: each projection goes
through its (tiled) module at the token's position, and attention through the backend's own kernel with no mask
(the call HF makes for one query), so the step's logits equal HF's decode under that backend, bit for bit,
without HF's Python around each token.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import torch
import torch.nn.functional as F

from kvboost.models.awq import AWQLinear, fuse_int4pack, fused_int4pack_unsupported, int4pack_mm
from kvboost.models.int8_head import Int8Linear, int8pack_mm
from kvboost.models.prealloc_cache import PreallocatedKV

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE types whose inverse frequencies are fixed once built (the step reads ``rotary_emb.inv_freq`` once).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: ``graphed``: the step replayed as one CUDA graph per token (``kvboost.models.graphed_decode``; CUDA only).
DECODE_MODES = ("hf", "eager", "compiled", "graphed")
#: Attention backends whose arithmetic the eager step runs by calling them (projections and attention).
DELEGATING_BACKENDS = ("batch_invariant",)
#: Attention backends under which the fused step runs its own single-query SDPA: ``sdpa`` itself, and
#: ``cpu_kernel``, whose kernel serves prefill-shaped calls (the fused prefill calls it); a decode step's one
#: query per head reads the cache at memory speed through SDPA, and the compiled step cannot call an extension.
STEP_SDPA_BACKENDS = ("sdpa", "cpu_kernel")


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`FusedDecodeStep` cannot run ``model`` (``None`` when it can)."""
    cfg = model.config.get_text_config(decoder=True)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "biases in the MLP"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding with inv_freq"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} (frequencies may depend on the length)"
    layer = inner.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            if not isinstance(getattr(owner, name, None), (torch.nn.Linear, *_int4_linear_types())):
                return f"{type(owner).__name__}.{name} is neither an nn.Linear nor an AWQ int4 linear (fused weights?)"
    if any(hasattr(attn, name) for name in ("q_norm", "k_norm")):
        return "query/key norms"
    if not isinstance(getattr(model, "lm_head", None), (torch.nn.Linear, Int8Linear)):
        return "no plain (or int8) lm_head"
    return None


def _int4_linear_types() -> tuple[type, ...]:
    return (AWQLinear,)


def has_int4_projections(model: Any) -> bool:
    """Whether ``model``'s decoder projections are AWQ int4 linears (the step then runs them eagerly)."""
    return any(isinstance(m, _int4_linear_types()) for m in model.model.layers[0].modules())


def fused_int4_reason(model: Any) -> str | None:
    """Why the step cannot run ``model``'s AWQ int4 projections fused (``None`` when it can; see
    :func:`kvboost.models.awq.fused_int4pack_unsupported`)."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    dtype = layer.input_layernorm.weight.dtype
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,))
    sizes = {m.group_size for g in groups for m in g if hasattr(m, "group_size")}
    if len(sizes) > 1:
        return f"projections with different group sizes {sorted(sizes)}"
    for group in groups:
        reason = fused_int4pack_unsupported(group, dtype)
        if reason is not None:
            return reason
    return None


def inductor_unavailable_reason() -> str | None:
    """Why ``torch.compile`` cannot build CPU kernels here (``None`` when it can): inductor needs a C++ compiler."""
    if torch.cuda.is_available():
        return None
    if not any(shutil.which(cc) for cc in (os.environ.get("CXX") or "g++", "g++", "c++", "clang++")):
        return "no C++ compiler on PATH (inductor builds its CPU kernels with one)"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's LlamaRMSNorm: statistics in fp32, the weight applied in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The same in one kernel (F.rms_norm computes x * rsqrt(mean(x^2) + eps) in fp32: HF's bits, tested).
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedDecodeStep:
    """``step(token_id) -> logits`` for one request, writing into its :class:`PreallocatedKV`.

    Use: ``step.begin(kv, length)`` (``length`` rows of ``kv`` are filled), then one call per token;
    ``step.length`` is the number of filled rows after the calls. The caller exposes the new rows to HF's cache
    objects with ``kv.set_length(step.length)`` when it is done (the step itself never touches them).

    Args:
        model: a loaded Llama-structured ``*ForCausalLM`` (see :func:`unsupported_reason`).
        compile: compile the step with ``torch.compile`` (inductor, dynamic shapes); False runs it eagerly,
            and then computes what HF's forward computes to the bit (``F.linear``, transformers' SDPA call,
            the same roundings), bf16 included.
        backend: an installed attention backend of :data:`DELEGATING_BACKENDS` whose projections and attention
            the (eager) step calls instead of its own, for HF's bits under that backend.
    """

    def __init__(self, model: Any, *, compile: bool = True, backend: Any = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fused decode step does not support this model: {reason}")
        self.backend = backend
        if backend is not None:
            if getattr(backend, "name", None) not in DELEGATING_BACKENDS:
                raise ValueError(f"the decode step delegates only to {DELEGATING_BACKENDS}, not {backend!r}")
            if compile:
                raise ValueError(f"attn={backend.name}: the compiled decode step has its own arithmetic; use eager")
            if has_int4_projections(model):
                raise ValueError(f"attn={backend.name}: AWQ int4 projections are not tiled; decode through HF")
        self.int4 = has_int4_projections(model)
        # AWQ int4 projections: fused per input (q/k/v, gate/up) for torch's int4 CPU kernel where the modules'
        # one-row call is that kernel; elsewhere each runs through its own module.
        self.int4_fused = self.int4 and fused_int4_reason(model) is None
        if compile and self.int4 and not self.int4_fused:
            raise ValueError(f"the compiled decode step runs AWQ int4 projections fused through torch's int4 CPU "
                             f"kernel, which does not apply here ({fused_int4_reason(model)}); use decode='eager'")
        self.model = model
        cfg = model.config.get_text_config(decoder=True)
        inner = model.model
        self.eps = float(cfg.rms_norm_eps)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.grouped_query = self.num_kv_heads != self.num_heads  # a plain bool: the compiler would make it symbolic
        self.attention_scaling = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.compiled = compile
        # Exact: HF's arithmetic to the bit (BLAS projections, SDPA). The compiled step is not: its fused
        # reductions and fp32 attention sum in another order. (Compiling the exact arithmetic was tried: bit-equal,
        # but no faster than eager, 23 vs 26 tok/s in bf16; the BLAS gemv, not the per-op overhead, sets its rate.)
        self.exact = not compile
        self._norm = _rms_norm if compile else _rms_norm_fused  # eager: one kernel, the same bits
        self.compile_seconds = 0.0
        self.fallback_reason: str | None = None
        self.warmed = False
        self._kv: PreallocatedKV | None = None
        self.length = 0
        self.intermediate = int(cfg.intermediate_size)
        self.group_size = int(inner.layers[0].self_attn.q_proj.group_size) if self.int4 else 0
        self._layer_weights = [self._weights(layer) for layer in inner.layers]
        self._head = self._head_args()
        # Three small graphs, each compiled once and reused: every layer runs the same graph on its own
        # weights (compiling the 30-layer model as one graph took minutes; one layer takes seconds).
        wrap = (lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)) if compile else (lambda fn: fn)
        self._layer_impl = self._layer_int4 if self.int4_fused else self._layer
        self._prologue_fn, self._layer_fn, self._epilogue_fn = (
            wrap(self._prologue), wrap(self._layer_impl), wrap(self._epilogue)
        )
        self._fn = self._forward
        self._compiled_once = False

    # ------------------------------------------------------------------ the arithmetic
    def _weights(self, layer: Any) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        if self.int4_fused:
            dtype = layer.input_layernorm.weight.dtype
            qkv = fuse_int4pack((attn.q_proj, attn.k_proj, attn.v_proj), dtype)
            o, gate_up = fuse_int4pack((attn.o_proj,), dtype), fuse_int4pack((mlp.gate_proj, mlp.up_proj), dtype)
            down = fuse_int4pack((mlp.down_proj,), dtype)
            return (
                layer.input_layernorm.weight, qkv.weight, qkv.scale_zero, qkv.bias, o.weight, o.scale_zero, o.bias,
                layer.post_attention_layernorm.weight, gate_up.weight, gate_up.scale_zero, down.weight,
                down.scale_zero,
            )  # fmt: skip

        def w(proj):  # a plain linear's weight, or the module itself (an int4 linear; under a delegating
            # backend, the backend's tiled forward): it applies its own bias
            return proj.weight if isinstance(proj, torch.nn.Linear) and self.backend is None else proj

        def b(proj):
            return proj.bias if isinstance(proj, torch.nn.Linear) and self.backend is None else None

        return (
            layer.input_layernorm.weight, w(attn.q_proj), b(attn.q_proj), w(attn.k_proj), b(attn.k_proj),
            w(attn.v_proj), b(attn.v_proj), w(attn.o_proj), layer.post_attention_layernorm.weight,
            w(mlp.gate_proj), w(mlp.up_proj), w(mlp.down_proj),
        )  # fmt: skip

    def _layer(self, x, cos, sin, position: int, keys, values, ln1, wq, bq, wk, bk, wv, bv, wo, ln2, wg, wu, wd):
        """One decoder layer for one token at ``position``; writes its K/V row into ``keys``/``values``
        ([kv_heads, capacity, head_dim], one layer's slice of the request's buffers)."""
        lin = self._linear
        a = self._norm(x, ln1, self.eps)
        out = self._attend(lin(a, wq, bq), lin(a, wk, bk), lin(a, wv, bv), cos, sin, position, keys, values)
        x = x + lin(out, wo, None)
        m = self._norm(x, ln2, self.eps)
        return x + lin(F.silu(lin(m, wg, None)) * lin(m, wu, None), wd, None)

    def _layer_int4(self, x, cos, sin, position: int, keys, values, ln1, wqkv, sqkv, bqkv, wo, so, bo, ln2, wgu, sgu,
                    wd, sd):  # fmt: skip
        """:meth:`_layer` with AWQ int4 projections fused per input (:class:`kvboost.models.awq.Int4Pack`): four
        int4 calls per layer instead of seven."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        a = self._norm(x, ln1, self.eps)
        qkv = self._int4(a, wqkv, sqkv, bqkv)
        # q and k are adjacent in the fused output: one RoPE over their h + kvh heads (the same elementwise
        # arithmetic as two, half the calls).
        qk = qkv[: (h + kvh) * d].view(h + kvh, d)
        qk = qk * cos + _rotate_half(qk) * sin
        out = self._attend_rotated(qk[:h], qk[h:], qkv[(h + kvh) * d :].view(kvh, d), position, keys, values)
        x = x + self._int4(out, wo, so, bo)
        m = self._norm(x, ln2, self.eps)
        gate, up = self._int4(m, wgu, sgu, None).split((self.intermediate, self.intermediate))
        return x + self._int4(F.silu(gate) * up, wd, sd, None)

    def _int4(self, x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, bias: torch.Tensor | None):
        """One token through fused int4 projections: the call ``AWQLinear`` makes, so its bits."""
        y = int4pack_mm(x, weight, self.group_size, scale_zero)
        return y if bias is None else y + bias

    def _attend(self, q, k, v, cos, sin, position: int, keys, values) -> torch.Tensor:
        """RoPE on the token's q/k, its K/V row written at ``position``, attention over rows ``[0, position]``."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k = q.view(h, d), k.view(kvh, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return self._attend_rotated(q, k, v.view(kvh, d), position, keys, values)

    def _attend_rotated(self, q, k, v, position: int, keys, values) -> torch.Tensor:
        """:meth:`_attend` after RoPE: ``q`` ``[heads, d]``, ``k``/``v`` ``[kv_heads, d]``."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        # A slice, not keys[:, position]: an integer index would specialise the graph on the position.
        keys[:, position : position + 1] = k[:, None]
        values[:, position : position + 1] = v[:, None]
        if self.backend is not None:  # the backend's call for HF's one query: no mask, [1, 1, heads, d] back
            out, _ = self.backend.attention_forward(
                None, q.view(1, h, 1, d), keys[None, :, : position + 1], values[None, :, : position + 1], None,
                scaling=self.scale,
            )  # fmt: skip
            return out.reshape(h * d)
        if not self.exact:
            ks = keys[:, : position + 1].float()  # [kvh, n, d]
            vs = values[:, : position + 1].float()
            qg = q.float().view(kvh, h // kvh, d)  # query heads grouped by the KV head they read
            probs = torch.softmax(torch.matmul(qg, ks.transpose(1, 2)) * self.scale, dim=-1)  # [kvh, g, n]
            return torch.matmul(probs, vs).reshape(h * d).to(q.dtype)
        # The call transformers' SDPA integration makes for one query without a mask, same shapes and
        # dtype: with F.linear above, the eager step's logits are HF's to the bit (bf16 included).
        return F.scaled_dot_product_attention(
            q.view(1, h, 1, d), keys[None, :, : position + 1], values[None, :, : position + 1],
            scale=self.scale, enable_gqa=self.grouped_query,
        ).reshape(h * d)  # fmt: skip

    def _prologue(self, token: torch.Tensor, position: int, embed, inv_freq):
        """The token's embedding and the RoPE cos/sin of ``position`` (as HF's rotary embedding computes them)."""
        x = embed.index_select(0, token)[0]
        freqs = float(position) * inv_freq.float()
        emb = torch.cat((freqs, freqs))
        return x, (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def _epilogue(self, x, norm, head, head_scales=None):
        """Final norm and the LM head; ``head_scales`` set: ``head`` holds int8 codes (an ``Int8Linear``),
        multiplied by its kernel (the call the module makes)."""
        x = self._norm(x, norm, self.eps)
        if head_scales is not None:
            return int8pack_mm(x, head, head_scales).float()
        return self._linear(x, head, None).float()

    def _head_args(self) -> tuple:
        head = self.model.lm_head
        if isinstance(head, Int8Linear):
            dtype = self.model.model.norm.weight.dtype
            if head.qweight.device.type != "cpu":
                return (head.dequantized_weight(dtype),)
            return head.qweight, head.kernel_scales(dtype)
        return (head.weight,)

    def _linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """One token through a projection. Compiled: a fused reduction (see the module docstring); eager: BLAS;
        an int4 linear (``weight`` is the module): its own kernel, the call HF's forward makes."""
        if isinstance(weight, torch.nn.Module):
            return weight(x)
        if self.exact:
            return F.linear(x, weight, bias)
        y = (weight.float() * x.float()).sum(-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def _forward(self, token: torch.Tensor, position: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        if self.backend is not None:
            self.backend.set_offset(position)  # what its hook records when HF's forward runs this token
        x, cos, sin = self._prologue_fn(token, position, inner.embed_tokens.weight, inner.rotary_emb.inv_freq)
        for i, weights in enumerate(self._layer_weights):
            x = self._layer_fn(x, cos, sin, position, keys[i], values[i], *weights)
        return self._epilogue_fn(x, inner.norm.weight, *self._head)

    # ------------------------------------------------------------------ per request
    def begin(self, kv: PreallocatedKV, length: int, reserve: int | None = None) -> None:
        """Start decoding into ``kv``, whose first ``length`` rows hold the prompt's K/V. ``reserve``: the rows
        the request may reach (a hint for steps that size a workspace; this one writes ``kv`` directly)."""
        self._kv, self.length = kv, length

    def finish(self, kv: PreallocatedKV) -> None:
        """Expose the rows decoded since ``begin`` to ``kv``'s cache objects (``kv.set_length``)."""
        kv.set_length(self.length)

    def can_run(self, kv: PreallocatedKV, length: int, new_tokens: int) -> bool:
        """Whether ``new_tokens`` steps fit ``kv``'s buffers and every layer still reads them (no layer grew
        past the capacity into a buffer of its own)."""
        return length + new_tokens <= kv.capacity and all(layer._owns_views() for layer in kv.layers)

    @torch.inference_mode()
    def __call__(self, token_id: int) -> torch.Tensor:
        """Feed ``token_id`` at the next position; returns its logits ``[vocab]`` (fp32)."""
        kv = self._kv
        if kv is None:
            raise RuntimeError("call begin(kv, length) before the first step")
        if self.length >= kv.capacity:
            raise ValueError(f"the KV buffer is full ({kv.capacity} rows)")
        token = torch.tensor([token_id], device=kv.keys.device)
        if not self._compiled_once:
            logits = self._first_call(token, kv)
        else:
            logits = self._fn(token, self.length, kv.keys, kv.values)
        self.length += 1
        return logits

    def _first_call(self, token: torch.Tensor, kv: PreallocatedKV) -> torch.Tensor:
        """The call that compiles (timed into ``compile_seconds``); a compiler failure falls back to eager."""
        start = time.perf_counter()
        try:
            logits = self._fn(token, self.length, kv.keys, kv.values)
        except Exception as exc:
            if not self.compiled:
                raise
            self.fallback_reason = error_line(exc)
            log.warning("kvboost: compiling the decode step failed (%s); decoding eagerly", self.fallback_reason)
            self.compiled = False
            self.exact = True
            self._prologue_fn, self._layer_fn, self._epilogue_fn = self._prologue, self._layer_impl, self._epilogue
            logits = self._fn(token, self.length, kv.keys, kv.values)  # rewrites the same rows
        self.compile_seconds += time.perf_counter() - start
        self._compiled_once = True
        return logits

    @torch.inference_mode()
    def warmup(self, capacity: int = 37) -> float:
        """Compile (or run once) on scratch buffers; returns the seconds it took (the compile time).

        The buffers are made in inference mode, like the engine's: the compiled graph is guarded on it."""
        s = self.model.config.get_text_config(decoder=True)
        param = next(self.model.parameters())
        shape = (s.num_hidden_layers, self.num_kv_heads, capacity, self.head_dim)
        kv = PreallocatedKV(torch.zeros(shape, dtype=param.dtype, device=param.device),
                            torch.zeros(shape, dtype=param.dtype, device=param.device))  # fmt: skip
        before, start = self.compile_seconds, time.perf_counter()
        # Two positions and a second buffer size: a graph specialised on the first call's sizes recompiles
        # here, not in the first timed request. Odd sizes: the compiler would tie a buffer size equal to a
        # model dimension (64) to that dimension, and recompile for every other size.
        for length in (5, 6):
            self.begin(kv, length)
            self(0)
        self.begin(PreallocatedKV(kv.keys[:, :, : capacity // 2].clone(), kv.values[:, :, : capacity // 2].clone()), 7)
        self(0)
        self._kv = None
        self.warmed = True
        elapsed = time.perf_counter() - start
        self.compile_seconds = before + elapsed  # the whole warm-up, recompilations included
        return elapsed


def error_line(exc: BaseException) -> str:
    """``"Type: first line of the message"``: what a fallback reports of the error that caused it."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _model_device(model: Any) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def make_decode_step(mode: str, model: Any, backend: Any = None) -> FusedDecodeStep | None:
    """The step object of a mode chosen by :func:`choose_decode` (``None`` for ``"hf"``)."""
    if mode == "hf":
        return None
    if mode == "graphed":
        from kvboost.models.graphed_decode import GraphedDecodeStep

        return GraphedDecodeStep(model, compile=True)
    return FusedDecodeStep(model, compile=mode == "compiled", backend=backend)


def choose_decode(requested: str, model: Any, attention: str) -> tuple[str, str]:
    """(mode, why) for the engine's ``decode`` option: ``"hf"`` (HF's forward per token), ``"eager"`` (the fused
    step without compiling), ``"compiled"`` or ``"graphed"`` (compiled and replayed as a CUDA graph; CUDA only).

    ``"auto"`` (the default) takes ``$KVBOOST_DECODE`` when set, else ``"graphed"`` on CUDA and ``"compiled"``
    elsewhere where the model is supported,
    the attention backend is one of :data:`STEP_SDPA_BACKENDS` (the fused step has its own attention; other
    backends keep theirs by decoding through HF) and inductor can build kernels; ``"eager"`` under a backend of
    :data:`DELEGATING_BACKENDS` (the eager step calls it); otherwise ``"hf"``. An explicit mode the model or the
    backend cannot take is an error.
    """
    if requested == "auto":
        forced = os.environ.get("KVBOOST_DECODE")
        if forced:
            if forced not in DECODE_MODES:
                raise ValueError(f"KVBOOST_DECODE={forced!r}: use one of {DECODE_MODES}")
            if forced == "graphed" and _model_device(model).type != "cuda":
                raise ValueError("KVBOOST_DECODE=graphed replays CUDA graphs; the model is not on a CUDA device")
            if forced == "hf" or unsupported_reason(model) is None and attention in STEP_SDPA_BACKENDS:
                return forced, "KVBOOST_DECODE"
        reason = unsupported_reason(model)
        if reason is not None:
            return "hf", f"fused decode step unsupported: {reason}"
        if attention in DELEGATING_BACKENDS and not has_int4_projections(model):
            return "eager", f"attention backend {attention!r}: the eager step calls it"
        if attention not in STEP_SDPA_BACKENDS:
            return "hf", f"attention backend {attention!r} decodes through HF's forward"
        if has_int4_projections(model):
            # Measured on the bundled AWQ model (bf16, 2-core AMX CPU): the eager step with fused int4 calls 85
            # tok/s, compiled 66: dynamo's per-call guards and wrappers cost more than inductor saves around
            # the int4 kernel, which it cannot fuse into.
            reason = fused_int4_reason(model)
            return "eager", ("AWQ int4 projections, fused" if reason is None else
                             f"AWQ int4 projections through their own modules ({reason})")  # fmt: skip
        if _model_device(model).type == "cuda":
            return "graphed", "auto: CUDA (compiled, one CUDA graph per token)"
        reason = inductor_unavailable_reason()
        if reason is not None:
            return "eager", f"not compiled: {reason}"
        return "compiled", "auto"
    if requested not in DECODE_MODES:
        raise ValueError(f"decode must be 'auto' or one of {DECODE_MODES}, got {requested!r}")
    if requested == "hf":
        return "hf", "requested"
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"decode={requested!r}: the fused decode step does not support this model: {reason}")
    if attention in DELEGATING_BACKENDS:
        if requested == "compiled" or has_int4_projections(model):
            raise ValueError(f"decode={requested!r} with attn={attention!r}: only the eager step calls the backend "
                             "(and not with AWQ int4 projections); use decode='eager', 'hf' or 'auto'")  # fmt: skip
        return requested, "requested"
    if attention not in STEP_SDPA_BACKENDS:
        raise ValueError(
            f"decode={requested!r} runs its own attention; with attn={attention!r} use decode='hf' (or 'auto')"
        )
    if requested == "graphed":
        if _model_device(model).type != "cuda":
            raise ValueError("decode='graphed' replays CUDA graphs; the model is not on a CUDA device (use "
                             "decode='compiled', 'eager' or 'auto')")  # fmt: skip
        if has_int4_projections(model):
            raise ValueError("decode='graphed' does not take AWQ int4 projections; use decode='eager' (or 'auto')")
    if requested == "compiled":
        if has_int4_projections(model) and fused_int4_reason(model) is not None:
            raise ValueError(f"decode='compiled' runs AWQ int4 projections fused through torch's int4 CPU kernel, "
                             f"which does not apply here ({fused_int4_reason(model)}); use decode='eager' (or 'auto')")
        reason = inductor_unavailable_reason()
        if reason is not None:
            raise ValueError(f"decode='compiled': {reason}; use decode='eager' or 'hf'")
    return requested, "requested"
