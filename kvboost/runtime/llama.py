"""The runner of Llama-structured models (llama, mistral, qwen2): one arithmetic for every forward of the engine.

:func:`decoder_layer` is the decoder layer, written once: RMSNorm, the q/k/v projections, RoPE, the K/V rows
written into the pool, attention, the o-projection and residual, RMSNorm, the SiLU-gated MLP. What varies is
passed in: how the projections multiply (:mod:`kvboost.runtime.projections`) and how attention runs (the
backend's paged call, or the runner's own decode attention). :class:`LlamaRunner` drives it over a
:class:`~kvboost.runtime.batch.ForwardBatch`, executed

- **eager**: the backend attends (``AttentionBackend.paged``), projections per the weights' kind; with plain
  weights and ``attn=sdpa`` a one-sequence forward computes HF's forward to the bit (fp32 and bf16; tested);
- **compiled** (decode batches, no hook): the same layer traced by ``torch.compile`` (inductor, dynamic shapes;
  one graph serves every layer, the weights being arguments), one-row projections as fused reductions and
  attention by the C++ paged kernel on a CPU where it builds (:mod:`kvboost.runtime.cpu_decode_op`), else as a
  fused gather-reduction over the block tables (:func:`gathered_decode_attention`): fewer kernels, not HF's bits
  (logits within ~1e-5 in fp32);
- **graphed** (CUDA): the compiled or eager forward captured as CUDA graphs per token-count bucket over the static
  pool (:mod:`kvboost.runtime.graphs`).

Hooks (content repair, the probe), speculative verification (several logits rows) and layer-skip drafting
(``batch.num_layers``) run eagerly through the same layer.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvboost.models.awq import AWQLinear
from kvboost.models.int8_head import Int8Linear, int8pack_mm
from kvboost.runtime.batch import ForwardBatch, hook_after_layer
from kvboost.runtime.ops import apply_rope, rms_norm, rms_norm_decomposed, rope_tables
from kvboost.runtime.projections import (
    Int4Projections,
    ModuleProjections,
    PackedProjections,
    PerSequence,
    PlainProjections,
    TensorProjections,
    reduction_linear,
)

log = logging.getLogger(__name__)

#: Model types this runner covers (one arithmetic: Llama-structured decoders).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: Recompilations allowed per compiled function (torch's default is 8; see ``LlamaRunner._compiled_fns``).
RECOMPILE_LIMIT = 64
#: RoPE types whose inverse frequencies are fixed once built (the runner reads ``rotary_emb.inv_freq`` once).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model: Any, *, hooks: bool = True) -> str | None:
    """Why :class:`LlamaRunner` cannot run ``model`` (None when it can); such models run on the HF-generic
    runner (:mod:`kvboost.runtime.hf_generic`). ``hooks=False`` skips the forward-hook check (the runner's own
    check, after an attention backend may have installed hooks of its own)."""
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
            if not isinstance(getattr(owner, name, None), (torch.nn.Linear, AWQLinear)):
                return f"{type(owner).__name__}.{name} is neither an nn.Linear nor an AWQ int4 linear (fused weights?)"
    if any(hasattr(attn, name) for name in ("q_norm", "k_norm")):
        return "query/key norms"
    if not isinstance(getattr(model, "lm_head", None), (torch.nn.Linear, Int8Linear, AWQLinear)):
        return "no plain (or int8, or int4) lm_head"
    if hooks and _foreign_hooks(model):
        return "forward hooks on the model (e.g. a layer streamer) run only in HF's forward"
    return None


def _foreign_hooks(model: Any) -> bool:
    """Whether a module of ``model`` has forward hooks other than a kvboost attention backend's own (which the
    runner honours itself: ``batch_invariant`` records each forward's first position)."""
    from kvboost.attention.base import AttentionBackend

    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if any(not isinstance(getattr(h, "__self__", None), AttentionBackend) for h in hooks.values()):
                return True
    return False


def has_int4_projections(model: Any) -> bool:
    """Whether any decoder projection (of any layer) or the LM head is an int4 linear (AWQ, or a GGUF tensor under
    ``weights="gguf_int4"``, which may leave some projections dense)."""
    if isinstance(getattr(model, "lm_head", None), AWQLinear):
        return True
    return any(isinstance(m, AWQLinear) for layer in model.model.layers for m in layer.modules())


def inductor_unavailable_reason() -> str | None:
    """Why ``torch.compile`` cannot build CPU kernels here (None when it can): inductor needs a C++ compiler."""
    if torch.cuda.is_available():
        return None
    if not any(shutil.which(cc) for cc in (os.environ.get("CXX") or "g++", "g++", "c++", "clang++")):
        return "no C++ compiler on PATH (inductor builds its CPU kernels with one)"
    return None


def error_line(exc: BaseException) -> str:
    """``"Type: first line of the message"``: what a fallback reports of the error that caused it."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ---------------------------------------------------------------------------------------------- the arithmetic
def decoder_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    proj: Any,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """One Llama-structured decoder layer over ``x`` ``[T, hidden]`` (HF's ``LlamaDecoderLayer``, term by term).

    ``proj`` multiplies (``qkv``, ``o``, ``gate_up``, ``down``; its ``ln1``/``ln2`` are the norms' weights),
    ``attend(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq * D]`` writes the rows' K/V and attends,
    ``norm`` is RMSNorm. Every path of the engine runs this function."""
    t = x.shape[0]
    a = norm(x, proj.ln1, eps)
    q, k, v = proj.qkv(a)
    q = apply_rope(q.reshape(t, heads, head_dim), cos, sin)
    k = apply_rope(k.reshape(t, kv_heads, head_dim), cos, sin)
    x = x + proj.o(attend(q, k, v.reshape(t, kv_heads, head_dim)))
    m = norm(x, proj.ln2, eps)
    gate, up = proj.gate_up(m)
    return x + proj.down(F.silu(gate) * up)


def write_rows(pool_layer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows`` ``[T, Hkv, D]`` into one layer of the pool ``[Hkv, S, D]`` at ``slots`` ``[T]``."""
    pool_layer.index_copy_(1, slots, rows.transpose(0, 1))


def gathered_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its blocks: ``q`` ``[B, Hq, D]``, one pool layer ``keys``/``values``
    ``[Hkv, S, D]``, ``block_tables`` ``[B, M]``, ``kv_lens`` ``[B]``; returns ``[B, Hq * D]``.

    Written for inductor: the gather by slot is an indirect load inside the score and value reductions (no
    gathered copy is made), each KV head's group of query heads reads its rows once, scores and softmax in fp32."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables.long()[:, :, None] * block_size + offsets).reshape(batch, -1)  # [B, M * bs]
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < kv_lens[:, None]
    k = keys[:, slots].float()  # [Hkv, B, N, D]
    # Rows past a sequence's length hold whatever the pool held (NaN bits included): 0 * NaN is NaN, so they are
    # zeroed, not only masked out of the scores.
    v = torch.where(valid[None, :, :, None], values[:, slots].float(), 0.0)
    qg = q.view(batch, kv_heads, group, dim).permute(1, 0, 2, 3).float()  # [Hkv, B, g, D]
    scores = (qg[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * scale  # [Hkv, B, g, N]
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * v[:, :, None, :, :]).sum(-2)  # [Hkv, B, g, D]
    return out.permute(1, 0, 2, 3).reshape(batch, heads * dim).to(q.dtype)


# ---------------------------------------------------------------------------------------------- the runner
class LlamaRunner:
    """``run(batch) -> logits [R, vocab]`` (fp32) for a Llama-structured model over a KV pool.

    Args:
        model: a loaded ``*ForCausalLM`` (:func:`unsupported_reason` is None).
        pool: the engine's :class:`~kvboost.kv.pool.KVPool` (this model's KV shape, dtype and device).
        attention: the installed attention backend (its ``paged`` call attends in eager forwards).
        decode: ``"eager"``, ``"compiled"`` (decode batches through ``torch.compile``), ``"graphed"`` (CUDA
            graphs, :mod:`kvboost.runtime.graphs`) or ``"quantized"`` (decode batches from the GGUF file's 4-bit
            blocks, :mod:`kvboost.runtime.quant_step`).
        weights: ``"plain"`` (``F.linear``, HF's bits), ``"prepacked"`` (CPU packed copies for forwards of
            several rows; one-row forwards keep plain weights) or ``"int4"`` (AWQ projections fused).
        graph_options: passed to the graph runner (``max_graph_tokens``, ...).
        decode_activations: ``decode="quantized"``: ``"int16"``, ``"int8"`` or ``"fp32"`` activations.
        quantized_prefill_rows: ``decode="quantized"`` only: forwards without hooks of fewer rows than this
            through the quantized step too, longer ones eagerly on the dense weights: 0 none (the default),
            ``SHORT_PREFILL_ROWS`` (``engine.prefill=quantized_short``), ``ALL_ROWS`` every one
            (``engine.prefill=quantized``; both in :mod:`kvboost.runtime.config`).
    """

    def __init__(
        self,
        model: Any,
        pool: Any,
        attention: Any,
        *,
        decode: str = "eager",
        weights: str = "plain",
        graph_options: dict[str, Any] | None = None,
        decode_activations: str = "int16",
        quantized_prefill_rows: int = 0,
    ) -> None:
        reason = unsupported_reason(model, hooks=False)
        if reason is not None:
            raise ValueError(f"the Llama-family runner does not support this model: {reason}")
        if decode not in ("eager", "compiled", "graphed", "quantized"):
            raise ValueError(f"decode must be 'eager', 'compiled', 'graphed' or 'quantized', got {decode!r}")
        self.model, self.pool, self.attention = model, pool, attention
        cfg = model.config.get_text_config(decoder=True)
        inner = model.model
        self.inner = inner
        self.eps = float(cfg.rms_norm_eps)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.intermediate = int(cfg.intermediate_size)
        self.num_layers = len(inner.layers)
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.attention_scaling = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.dtype = inner.norm.weight.dtype
        if (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (self.num_layers, self.kv_heads, self.head_dim):
            raise ValueError("the KV pool's shape does not match the model's")
        self.attn_modules = [layer.self_attn for layer in inner.layers]
        splits = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.weights = weights
        tiled = bool(getattr(attention, "capabilities", None) and attention.capabilities.tiled_projections)
        if tiled:
            self.projections: list[Any] = [ModuleProjections(layer) for layer in inner.layers]
        elif weights == "int4":
            self.projections = [Int4Projections(layer, splits, self.intermediate, self.dtype) for layer in inner.layers]
        elif has_int4_projections(model):
            self.projections = [ModuleProjections(layer) for layer in inner.layers]
        else:
            self.projections = [PlainProjections(layer) for layer in inner.layers]
        self.tiled = tiled
        self.packed: list[PackedProjections] | None = None
        if weights == "prepacked":
            self.packed = [PackedProjections(layer, splits, self.intermediate) for layer in inner.layers]
        self.decode = decode
        self.compile_seconds = 0.0
        self.fallback_reason: str | None = None
        self.forwards = {"eager": 0, "compiled": 0, "graphed": 0, "quantized": 0}
        self._compiled: tuple | None = None
        # Compiled CPU decode: attention by the C++ paged kernel ("cpu_kernel") when it builds here, else inductor's
        # own; set when the compiled functions are built.
        self.decode_attention = "inductor" if decode in ("compiled", "graphed") else "backend"
        self._compiled_ok = decode in ("compiled", "graphed") and not tiled and all(
            isinstance(p, PlainProjections) for p in self.projections
        )
        if decode in ("compiled", "graphed") and not self._compiled_ok:
            raise ValueError(f"decode={decode!r} needs plain nn.Linear projections and a backend whose projections "
                             "are the model's own (not AWQ int4, not attn=batch_invariant); use decode='eager'")  # fmt: skip
        self.graphs: Any = None
        self.quantized: Any = None
        if quantized_prefill_rows and decode != "quantized":
            raise ValueError("quantized_prefill_rows needs decode='quantized' (its step runs the prompt rows)")
        self.quantized_prefill_rows = quantized_prefill_rows
        if decode == "quantized":  # decode steps from the GGUF's own 4-bit blocks (kvboost.runtime.quant_step)
            from kvboost.runtime.quant_step import QuantDecodeStep

            self.quantized = QuantDecodeStep(self, decode_activations)
            self.decode_attention = "cpu_kernel"
        self._graph_options = dict(graph_options or {})
        if decode == "graphed":
            from kvboost.runtime.graphs import GraphRunner

            self.graphs = GraphRunner(self, **self._graph_options)

    def bind_pool(self, pool: Any) -> None:
        """Run over ``pool`` from now on (the engine sizes a GPU pool once the runner exists); graphs are captured
        again over it."""
        if (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (self.num_layers, self.kv_heads, self.head_dim):
            raise ValueError("the KV pool's shape does not match the model's")
        self.pool = pool
        if self.graphs is not None:
            from kvboost.runtime.graphs import GraphRunner

            self.graphs = GraphRunner(self, **self._graph_options)

    # ------------------------------------------------------------------ public
    @property
    def exact(self) -> bool:
        """Whether every forward computes HF's bits (eager, plain weights, a backend that computes HF's
        attention): what ``decode_info`` reports."""
        return self.decode == "eager" and self.weights == "plain" and not self.tiled

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits of ``batch.logits_rows`` (fp32 ``[R, vocab]``), or None when a hook stopped the forward early.
        Writes every row's K/V into the pool."""
        if batch.num_tokens == 0:
            raise ValueError("an empty forward batch")
        if batch.hook is None and batch.num_layers is None and self.quantized is not None:
            if batch.is_decode or batch.num_tokens < self.quantized_prefill_rows:
                self.forwards["quantized"] += 1
                return self.quantized.run(batch)
            decoding = [b for b in range(batch.num_seqs)
                        if batch.contiguous[b] and batch.query_start[b + 1] - batch.query_start[b] == 1]  # fmt: skip
            if 0 < len(decoding) < batch.num_seqs:
                return self._run_split(batch, decoding)
        if batch.hook is None and batch.num_layers is None and batch.is_decode:
            if self.graphs is not None and self.graphs.can_run(batch):
                self.forwards["graphed"] += 1
                return self.graphs.run(batch)
            if self._compiled_ok and self.decode == "compiled":
                logits = self._run_compiled(batch)
                if logits is not None:
                    self.forwards["compiled"] += 1
                    return logits
        if (
            self.graphs is not None and batch.hook is None and batch.num_layers is None
            and self.graphs.can_run(batch)
        ):  # fmt: skip
            self.forwards["graphed"] += 1
            return self.graphs.run(batch)
        self.forwards["eager"] += 1
        return self._run_eager(batch)

    def _run_split(self, batch: ForwardBatch, decoding: list[int]) -> torch.Tensor:
        """A step that mixes decode rows and prompt chunks (the serving loop's, under a step budget): the decode
        rows through the quantized step, the rest eagerly on the dense weights, logits back in the batch's order.
        One eager forward of every row costs more than the two: measured on 2 AVX2 cores, 8 decode rows 47-66 ms
        quantized, a 32-token chunk 179-289 ms eagerly, both in one eager forward 307-408 ms."""
        chosen = set(decoding)
        rest = [b for b in range(batch.num_seqs) if b not in chosen]
        decode_part, decode_at = batch.subset(decoding)
        rest_part, rest_at = batch.subset(rest)
        decoded = self.quantized.run(decode_part)
        self.forwards["quantized"] += 1
        self.forwards["eager"] += 1
        others = self._run_eager(rest_part)
        logits = decoded.new_empty((batch.logits_rows.numel(), decoded.shape[-1]))
        logits[decode_at] = decoded
        if rest_at:
            logits[rest_at] = others.to(logits.dtype)
        return logits

    # ------------------------------------------------------------------ eager
    def _layer_projections(self, i: int, batch: ForwardBatch) -> Any:
        proj = self.projections[i]
        if self.packed is not None and batch.num_tokens > 1:
            proj = self.packed[i]
        if self.tiled:
            spans = [(batch.query_start[b], batch.query_start[b + 1],
                      min(batch.positions_list[b]) if batch.positions_list[b] else 0)
                     for b in range(batch.num_seqs)]  # fmt: skip
            proj = PerSequence(proj, self.attention.set_offset, spans)
        return proj

    def _attend_fn(self, i: int, batch: ForwardBatch) -> Callable:
        pool, attention, hook, module = self.pool, self.attention, batch.hook, self.attn_modules[i]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            write_rows(pool.keys[i], batch.slot_mapping, k)
            write_rows(pool.values[i], batch.slot_mapping, v)
            if hook is not None:
                hook.on_query(i, q, batch)
            return attention.paged(q, i, batch, self.scale, module)

        return attend

    def _run_eager(self, batch: ForwardBatch) -> torch.Tensor | None:
        inner = self.inner
        x = inner.embed_tokens.weight.index_select(0, batch.input_ids)
        cos, sin = rope_tables(batch.positions, inner.rotary_emb.inv_freq, self.attention_scaling, x.dtype)
        for proj in self.projections:
            if isinstance(proj, Int4Projections):
                proj.route(batch.num_tokens, x.dtype)
        hook = batch.hook
        layers = self.num_layers if batch.num_layers is None else batch.num_layers
        for i in range(layers):
            if hook is not None:
                hook.before_layer(i, batch)
            x = decoder_layer(x, cos, sin, self._layer_projections(i, batch), self._attend_fn(i, batch), rms_norm,
                              self.eps, self.heads, self.kv_heads, self.head_dim)  # fmt: skip
            if hook is not None:
                stop, keep, batch = hook_after_layer(hook, i, batch, x)
                if stop:
                    return None
                if keep is not None:
                    x, cos, sin = x[keep], cos[keep], sin[keep]
        return self.head(x.index_select(0, batch.logits_rows))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of rows ``x`` ``[R, hidden]`` -> fp32 logits (the head module's own call, as HF's
        ``logits_to_keep``)."""
        return self.model.lm_head(rms_norm(x, self.inner.norm.weight, self.eps)).float()

    # ------------------------------------------------------------------ compiled decode
    def _compiled_fns(self) -> tuple:
        if self._compiled is None:
            # One code object serves every runner of the process: runners of models of other shapes (head counts,
            # eps) recompile it; the default limit of 8 is too few for a process that builds a few engines.
            dynamo_config = torch._dynamo.config
            dynamo_config.recompile_limit = max(getattr(dynamo_config, "recompile_limit", 8), RECOMPILE_LIMIT)
            wrap = (lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)) if self.decode in (
                "compiled", "graphed") else (lambda fn: fn)  # fmt: skip
            if self.pool.device.type == "cpu" and self.decode == "compiled":
                from kvboost.runtime.cpu_decode_op import cpu_paged_decode_unavailable_reason

                reason = cpu_paged_decode_unavailable_reason()
                self.decode_attention = "cpu_kernel" if reason is None else f"inductor ({reason})"
            self._compiled = (wrap(self._static_prologue), wrap(self._static_layer), wrap(self._static_epilogue))
            self._layer_tensors = [p.tensors() for p in self.projections]
            self._head_args = self._head_tensors()
        return self._compiled

    def _static_prologue(self, tokens, positions, embed, inv_freq):
        x = embed.index_select(0, tokens)
        cos, sin = rope_tables(positions, inv_freq, self.attention_scaling, x.dtype)
        return x, cos, sin

    def _static_layer(self, x, cos, sin, keys, values, slots, block_tables, kv_lens, *weights):
        proj = TensorProjections(*weights, linear=reduction_linear)
        bs, scale = self.pool.block_size, self.scale

        def attend(q, k, v):
            write_rows(keys, slots, k)
            write_rows(values, slots, v)
            if self.decode_attention == "cpu_kernel":  # the C++ kernel reads the blocks in place (kvboost/runtime/cpu_decode_op.py)
                out = torch.ops.kvboost.cpu_paged_decode(q, keys, values, block_tables, kv_lens, bs, scale)
                return out.reshape(q.shape[0], -1)
            return gathered_decode_attention(q, keys, values, block_tables, kv_lens, bs, scale)

        return decoder_layer(x, cos, sin, proj, attend, rms_norm_decomposed, self.eps, self.heads, self.kv_heads,
                             self.head_dim)  # fmt: skip

    def _static_epilogue(self, x, norm, head, head_scales=None):
        x = rms_norm_decomposed(x, norm, self.eps)
        if head_scales is not None:
            return int8pack_mm(x, head, head_scales).float()
        return reduction_linear(x, head, None).float()

    def _head_tensors(self) -> tuple:
        head = self.model.lm_head
        if isinstance(head, Int8Linear):
            if head.qweight.device.type != "cpu":
                return (head.dequantized_weight(self.dtype),)
            return head.qweight, head.kernel_scales(self.dtype)
        return (head.weight,)

    def static_forward(self, tokens, positions, slots, block_tables, kv_lens) -> torch.Tensor:
        """The compiled decode forward over index tensors (what the graphs capture): one row per sequence."""
        prologue, layer, epilogue = self._compiled_fns()
        inner, pool = self.inner, self.pool
        x, cos, sin = prologue(tokens, positions, inner.embed_tokens.weight, inner.rotary_emb.inv_freq)
        for i in range(self.num_layers):
            x = layer(x, cos, sin, pool.keys[i], pool.values[i], slots, block_tables, kv_lens, *self._layer_tensors[i])
        return epilogue(x, inner.norm.weight, *self._head_args)

    def _run_compiled(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The compiled decode forward; a compiler failure (now or at a later recompilation) switches this runner
        to eager decoding for good, with the reason in ``fallback_reason`` (None is returned: the caller runs the
        batch eagerly; the rows the failed call may have written are written again)."""
        args = batch.kernel_args()
        start = time.perf_counter()
        try:
            logits = self.static_forward(batch.input_ids, batch.positions, batch.slot_mapping, args["block_tables"],
                                         args["kv_lens"])  # fmt: skip
        except Exception as exc:  # a compiler failure leaves the eager path
            self.fallback_reason = error_line(exc)
            log.warning("kvboost: compiling the decode forward failed (%s); decoding eagerly", self.fallback_reason)
            self._compiled_ok = False
            self.decode = "eager"
            return None
        if not getattr(self, "_compiled_once", False):
            self._compiled_once = True
            self.compile_seconds += time.perf_counter() - start
        return logits

    # ------------------------------------------------------------------ warm-up
    @torch.inference_mode()
    def warmup(self, max_tokens: int | None = None) -> float:
        """Compile the decode forward (two lengths and two batch sizes, so that no measured request recompiles)
        and, on CUDA, capture the graphs up to ``max_tokens`` rows. Uses scratch blocks of the pool."""
        from kvboost.kv.block_table import BlockTable

        start = time.perf_counter()
        if self._compiled_ok and self.decode in ("compiled", "graphed"):
            # Block tables of one block and of three (torch.compile specialises a size of 1), batches of 1 and 2,
            # two lengths each: the shapes a run meets, compiled here rather than in a measured request.
            for rows, lengths, count in ((16, (3, 5), 1), (16, (4, 6), 2), (48, (21, 37), 1), (48, (6, 21), 2)):
                tables = [BlockTable(self.pool) for _ in range(count)]
                try:
                    for table in tables:
                        table.reserve(rows)
                    for length in lengths:
                        for table in tables:
                            table.length = length
                        batch = ForwardBatch.build([_scratch_input(t) for t in tables])
                        if self.decode == "compiled":
                            self._run_compiled(batch)
                        else:
                            args = batch.kernel_args()
                            self.static_forward(batch.input_ids, batch.positions, batch.slot_mapping,
                                                args["block_tables"], args["kv_lens"])  # fmt: skip
                finally:
                    for table in tables:
                        table.release()
        if self.graphs is not None:
            self.graphs.warmup(max_tokens=max_tokens)
        elapsed = time.perf_counter() - start
        self.compile_seconds += elapsed
        return elapsed

    def describe(self) -> dict[str, Any]:
        return {
            "runner": "llama",
            "decode": self.decode,
            "weights": self.weights,
            "exact": self.exact,
            "compile_s": self.compile_seconds,
            "forwards": dict(self.forwards),
            "fallback_reason": self.fallback_reason,
            "decode_attention": self.decode_attention,
            "packed_weight_bytes": sum(p.nbytes for p in self.packed) if self.packed else 0,
            **(self.graphs.describe() if self.graphs is not None else {}),
            **({"quantized": self.quantized.describe()} if self.quantized is not None else {}),
        }


def _scratch_input(table: Any) -> Any:
    from kvboost.runtime.batch import SeqInput

    return SeqInput(table, [0])
