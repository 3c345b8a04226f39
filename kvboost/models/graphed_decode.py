"""Decode steps and short prefills as CUDA graphs: a few microseconds of CPU per forward instead of ~450 launches.

On a GPU, HF's forward of a small model is bound by the CPU, not the GPU: ~15 kernels per layer, each launched
from Python (tens of microseconds of Python and launch per kernel against a few of GPU work). Measured on an H200
with the bundled 135M model (bf16): HF decodes 52 tokens/s (19 ms per token) and a 40-300-token prefill takes
20-70 ms, nearly all of it Python. This module replays the whole forward (embedding, every layer, the last
position's LM head) as one ``torch.cuda.CUDAGraph``; with ``compile=True`` the graph holds the kernels that
inductor fused per layer (``torch.compile``, dynamic shapes), else the eager ones.

A graph replays fixed shapes at fixed addresses, so:

- **static buffers.** Token ids and positions live in device tensors filled before each replay, and K/V rows
  live in the step's own workspace ``[layers, kv_heads, C, head_dim]``: ``begin`` (decode) and ``prefill`` copy
  the request's filled rows in (a device copy of ~23 KB per token for SmolLM2, microseconds), and the rows they
  compute are copied back into the request's buffers (``finish``, or at the end of ``prefill``).
- **buckets.** ``C`` is a power of two >= :data:`MIN_BUCKET` rows; a prefill of ``n`` tokens runs ``T`` rows, the
  power of two >= ``max(n, 16)``, the padding rows being computed and thrown away (their K/V land past the
  request's rows, where the next token overwrites them). One graph per ``(C, T)``; ``warmup(max_tokens)``
  captures every pair a run can meet, so no request pays a capture. Suffixes longer than
  ``max_graph_tokens`` (default 2048) go through HF's forward, where the GPU, not Python, is the cost.
- **masked attention over the bucket.** Each layer's attention reads all ``C`` rows with a boolean mask
  ``row <= position`` (one SDPA call; each KV head's query group as extra query rows, so K/V are never repeated).
- **not bit-exact.** The masked SDPA over ``C`` rows and the padded, compiled projections sum in another order
  than HF's forward: logits agree to the dtype's rounding, and greedy outputs can part after a near-tie (the
  replay reports the match rate; in fp32 the tests hold logits within 1e-4 of HF's). ``decode=eager`` and
  ``prefill=hf`` stay the exact choices.

CPU: the graph needs CUDA, but the static-shape arithmetic (:meth:`GraphedDecodeStep.static_forward`) runs
anywhere, which is how the tests check it against HF's forward on machines without a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvboost.models.awq import fused_bias
from kvboost.models.decode_step import FusedDecodeStep, _rotate_half, error_line, has_int4_projections
from kvboost.models.prealloc_cache import PreallocatedKV

log = logging.getLogger(__name__)

#: The smallest workspace bucket (rows); buckets are powers of two from here up to the model's context.
MIN_BUCKET = 256
#: The smallest prefill row bucket; prefill buckets are powers of two from here up to ``max_graph_tokens``.
MIN_PREFILL_ROWS = 16
#: Prefills of more new tokens than this run through HF's forward (the GPU's time, not Python's, dominates).
MAX_GRAPH_TOKENS = 2048
#: How a decode graph attends: ``sdpa`` (the masked SDPA call prefills use too) or ``matmul`` (two fp32 matmuls and
#: a masked softmax over the workspace). Both are tested on CPU; which is faster on a GPU is for
#: ``experiments/profile_graphed_step.py`` to say (``sdpa`` is what the H200 figures used).
DECODE_ATTENTION = ("sdpa", "matmul")


def bucket_for(rows: int, max_rows: int | None = None, minimum: int = MIN_BUCKET) -> int:
    """The bucket (a power of two >= ``minimum``) that holds ``rows`` rows, capped at ``max_rows`` but never below
    ``rows`` (a capped size is rounded up to a multiple of 16, the alignment SDPA's masked kernels want)."""
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    size = minimum
    while size < rows:
        size *= 2
    if max_rows is not None:
        size = min(size, max(-(-rows // 16) * 16, -(-max_rows // 16) * 16))
    return size


@dataclass
class _Graph:
    """One captured forward: ``T`` rows over a workspace of ``C`` rows, and the logits buffer it writes."""

    graph: Any  # torch.cuda.CUDAGraph; None where capturing failed (the forward then runs uncaptured)
    logits: torch.Tensor | None


class GraphedDecodeStep(FusedDecodeStep):
    """``step(token_id) -> logits`` replaying one CUDA graph per token, and ``prefill(ids, start, kv)`` replaying
    one per short prefill (see the module docstring).

    The decode interface is :class:`FusedDecodeStep`'s (``can_run``, ``begin``, calls, ``finish``, ``warmup``);
    its eager per-layer arithmetic stays available to the strategies that drive layers themselves (speculative
    layer skipping), unchanged.

    Args:
        model: a Llama-structured model on a CUDA device, with plain (not AWQ int4) projections.
        compile: compile the per-layer function with ``torch.compile`` before capturing it (fewer, fused
            kernels per layer); False captures the eager kernels. A compiler failure falls back to eager
            (``fallback_reason`` says why).
        max_graph_tokens: the longest prefill run as a graph.
        decode_attention: see :data:`DECODE_ATTENTION` (prefill graphs always use SDPA).
        fuse_projections: multiply q/k/v and gate/up as one matrix each, from concatenated copies of the weights
            (``packed_bytes`` more memory; fewer, larger GEMMs per layer).
    """

    def __init__(self, model: Any, *, compile: bool = True, max_graph_tokens: int = MAX_GRAPH_TOKENS,
                 decode_attention: str = "sdpa", fuse_projections: bool = False) -> None:  # fmt: skip
        super().__init__(model, compile=False)
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        self.decode_attention = decode_attention
        self.fuse_projections = fuse_projections
        if has_int4_projections(model):
            raise ValueError("the graphed decode step does not take AWQ int4 projections; use decode='eager'")
        if max_graph_tokens < MIN_PREFILL_ROWS:
            raise ValueError(f"max_graph_tokens must be >= {MIN_PREFILL_ROWS}, got {max_graph_tokens}")
        self.device = next(model.parameters()).device
        self.compile_graph = compile
        self.max_graph_tokens = max_graph_tokens
        cfg = model.config.get_text_config(decoder=True)
        self.max_rows = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        wrap = (lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)) if compile else (lambda fn: fn)
        self._g_prologue, self._g_layer, self._g_epilogue = (
            wrap(self._static_prologue),
            wrap(self._static_layer),
            wrap(self._static_epilogue),
        )
        self._workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # T -> tokens, positions, last
        self._pool: Any = None
        self._graph_weights = (
            [self._fused_weights(layer, w) for layer, w in zip(model.model.layers, self._layer_weights, strict=True)]
            if fuse_projections else self._layer_weights
        )  # fmt: skip
        # the concatenated copies (q/k/v weight and bias, gate/up weight) held beside the model's own weights
        self.packed_bytes = sum(t.numel() * t.element_size() for w in self._graph_weights for t in (w[1], w[2], w[9])
                                if t is not None) if fuse_projections else 0  # fmt: skip
        self._size = 0  # the workspace size decoding writes into
        self._start = 0
        self.capture_seconds = 0.0

    @staticmethod
    def _fused_weights(layer: Any, weights: tuple) -> tuple:
        """One layer's weights with q/k/v and gate/up concatenated (copies): one GEMM each instead of three and
        two. Same signature as the plain tuple, the fused slots left None."""
        ln1, wq, _, wk, _, wv, _, wo, ln2, wg, wu, wd = weights
        attn = layer.self_attn
        bias = fused_bias((attn.q_proj, attn.k_proj, attn.v_proj), wq.dtype)
        return (ln1, torch.cat((wq, wk, wv)), bias, None, None, None, None, wo, ln2, torch.cat((wg, wu)), None, wd)

    # ------------------------------------------------------------------ the static-shape arithmetic
    def _static_prologue(self, tokens, positions, embed, inv_freq, rows):
        """Embeddings of ``tokens`` [T], RoPE cos/sin [T, d] of ``positions`` [T], and the attention mask
        ``row <= position`` [1, 1, T * g, C] (``rows`` is ``arange(C)``; each query row repeated for the ``g``
        query heads of a KV head, the layout :meth:`_static_layer` gives the queries)."""
        x = embed.index_select(0, tokens)
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(x.dtype)
        sin = (emb.sin() * self.attention_scaling).to(x.dtype)
        group = self.num_heads // self.num_kv_heads
        allowed = rows[None, :] <= positions[:, None]  # [T, C]
        mask = allowed[:, None, :].expand(-1, group, -1).reshape(1, 1, -1, rows.shape[0])
        return x, cos, sin, mask

    def _static_layer(self, x, cos, sin, positions, mask, keys, values, ln1, wq, bq, wk, bk, wv, bv, wo, ln2, wg,
                      wu, wd):  # fmt: skip
        """One layer for ``T`` tokens at ``positions``: HF's projections, norms and RoPE; the K/V rows written with
        ``index_copy_``, attention over all rows of ``keys``/``values`` under ``mask``."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        t, g = x.shape[0], h // kvh
        a = self._norm(x, ln1, self.eps)
        if wk is None:  # fused q/k/v (fuse_projections)
            q, k, v = F.linear(a, wq, bq).split((h * d, kvh * d, kvh * d), dim=-1)
            q, k, v = q.reshape(t, h, d), k.reshape(t, kvh, d), v.reshape(t, kvh, d)
        else:
            q = F.linear(a, wq, bq).view(t, h, d)
            k = F.linear(a, wk, bk).view(t, kvh, d)
            v = F.linear(a, wv, bv).view(t, kvh, d)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        keys.index_copy_(1, positions, k.transpose(0, 1))
        values.index_copy_(1, positions, v.transpose(0, 1))
        if t == 1 and self.decode_attention == "matmul":
            # One token: scores of its g query heads per KV head as two small fp32 matmuls and a masked softmax
            # (on the H200 the masked SDPA call picked cuDNN's flash kernel, 32 us a layer for 3 query rows).
            scores = torch.matmul(q.view(kvh, g, d).float(), keys.float().transpose(1, 2)) * self.scale
            scores = scores.masked_fill(~mask.view(1, g, -1), float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(x.dtype).reshape(1, h * d)
        else:
            # Each KV head's g query heads become g query rows per token (row t * g + r): K/V are read once.
            qg = q.view(t, kvh, g, d).permute(1, 0, 2, 3).reshape(1, kvh, t * g, d)
            out = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=mask, scale=self.scale)
            out = out.view(kvh, t, g, d).permute(1, 0, 2, 3).reshape(t, h * d)
        x = x + F.linear(out, wo)
        m = self._norm(x, ln2, self.eps)
        if wu is None:  # fused gate/up
            gate, up = F.linear(m, wg).chunk(2, dim=-1)
        else:
            gate, up = F.linear(m, wg), F.linear(m, wu)
        return x + F.linear(F.silu(gate) * up, wd)

    def _static_epilogue(self, x, last, norm, *head):
        """:meth:`_epilogue` (final norm and LM head) of row ``last`` (a 1-element index tensor): logits [vocab],
        fp32."""
        return self._epilogue(x.index_select(0, last), norm, *head)[0]

    def static_forward(self, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Logits ``[vocab]`` (fp32) of row ``last`` after running ``tokens`` at ``positions`` (``[T]`` long tensors
        on the model's device), writing their K/V rows into ``keys``/``values`` ``[layers, kv_heads, C,
        head_dim]`` and attending over every row ``<=`` a token's position; what the graphs run."""
        inner = self.model.model
        rows = torch.arange(keys.shape[2], device=keys.device)
        x, cos, sin, mask = self._g_prologue(tokens, positions, inner.embed_tokens.weight, inner.rotary_emb.inv_freq,
                                             rows)  # fmt: skip
        for i, weights in enumerate(self._graph_weights):
            x = self._g_layer(x, cos, sin, positions, mask, keys[i], values[i], *weights)
        return self._g_epilogue(x, last, inner.norm.weight, *self._head)

    # ------------------------------------------------------------------ workspaces and graphs
    def _workspace(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ws = self._workspaces.get(size)
        if ws is None:
            s = self.model.config.get_text_config(decoder=True)
            shape = (s.num_hidden_layers, self.num_kv_heads, size, self.head_dim)
            dtype = next(self.model.parameters()).dtype
            ws = (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype,
                                                                                   device=self.device))  # fmt: skip
            self._workspaces[size] = ws
        return ws

    def _input_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bufs = self._inputs.get(rows)
        if bufs is None:
            bufs = tuple(torch.zeros(n, dtype=torch.long, device=self.device) for n in (rows, rows, 1))
            self._inputs[rows] = bufs
        return bufs

    def _graph(self, size: int, rows: int) -> _Graph:
        entry = self._graphs.get((size, rows))
        if entry is None:
            entry = self._capture(size, rows)
            self._graphs[(size, rows)] = entry
        return entry

    @torch.inference_mode()
    def _capture(self, size: int, rows: int) -> _Graph:
        """Warm the ``rows``-token forward up on the ``size``-row workspace (compiling on first use) and capture
        it. A capture that fails leaves the pair uncaptured (``fallback_reason`` says why): slower, same numbers.

        The warm-up runs overwrite the ``rows``-token input buffers and rows of the workspace: capture before
        a request's rows and ids go in, never between filling them and the replay."""
        if self.device.type != "cuda":
            raise RuntimeError("the graphed decode step captures CUDA graphs; the model is not on a CUDA device")
        start = time.perf_counter()
        keys, values = self._workspace(size)
        tokens, positions, last = self._input_buffers(rows)
        tokens.zero_()
        torch.arange(rows, out=positions)
        last.zero_()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # the first call compiles; the second runs what the graph will hold
                try:
                    self.static_forward(tokens, positions, last, keys, values)
                except Exception as exc:
                    if not self.compile_graph:
                        raise
                    self._fall_back_to_eager(exc)
                    self.static_forward(tokens, positions, last, keys, values)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph: Any = torch.cuda.CUDAGraph()
        try:
            # One memory pool for every graph: they never run at the same time, and each keeps its logits
            # buffer alive, so a later capture reuses only memory that no graph's output holds.
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.static_forward(tokens, positions, last, keys, values)
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves a working, uncaptured forward
            self.fallback_reason = f"CUDA graph capture failed ({error_line(exc)})"
            log.warning("kvboost: %s; the forward runs uncaptured", self.fallback_reason)
            graph, logits = None, None
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        self.compile_seconds += elapsed
        return _Graph(graph, logits)

    def _fall_back_to_eager(self, exc: Exception) -> None:
        self.fallback_reason = error_line(exc)
        log.warning("kvboost: compiling the graphed step failed (%s); capturing the eager kernels",
                    self.fallback_reason)  # fmt: skip
        self.compile_graph = False
        self._g_prologue, self._g_layer, self._g_epilogue = (
            self._static_prologue,
            self._static_layer,
            self._static_epilogue,
        )

    def _replay(self, size: int, rows: int) -> torch.Tensor:
        entry = self._graphs[(size, rows)]  # captured by begin / prefill before they filled the inputs
        if entry.graph is None:
            tokens, positions, last = self._input_buffers(rows)
            keys, values = self._workspace(size)
            return self.static_forward(tokens, positions, last, keys, values)
        entry.graph.replay()
        return entry.logits.clone()

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def begin(self, kv: PreallocatedKV, length: int, reserve: int | None = None) -> None:
        """Copy ``kv``'s first ``length`` rows into the workspace of the bucket that holds ``reserve`` rows
        (default: ``kv``'s capacity) and start decoding at ``length``."""
        rows = max(length + 1, min(reserve, kv.capacity) if reserve is not None else kv.capacity)
        size = bucket_for(rows, self.max_rows)
        self._graph(size, 1)  # before the rows go in: a capture's warm-up runs write the workspace and inputs
        self._input_buffers(1)[2].zero_()  # the one row's logits
        keys, values = self._workspace(size)
        if length:
            keys[:, :, :length].copy_(kv.keys[:, :, :length])
            values[:, :, :length].copy_(kv.values[:, :, :length])
        self._kv, self._size, self.length, self._start = kv, size, length, length

    @torch.inference_mode()
    def __call__(self, token_id: int) -> torch.Tensor:
        """Feed ``token_id`` at the next position; returns its logits ``[vocab]`` (fp32, a copy)."""
        if self._kv is None or not self._size:
            raise RuntimeError("call begin(kv, length) before the first step")
        if self.length >= min(self._size, self._kv.capacity):
            raise ValueError(f"the KV buffer is full ({min(self._size, self._kv.capacity)} rows)")
        tokens, positions, _ = self._input_buffers(1)
        tokens.fill_(token_id)
        positions.fill_(self.length)
        logits = self._replay(self._size, 1)
        self.length += 1
        return logits

    def finish(self, kv: PreallocatedKV) -> None:
        """Copy the rows decoded since ``begin`` back into ``kv`` and expose them (``kv.set_length``)."""
        if self._size and kv is self._kv and self.length > self._start:
            keys, values = self._workspace(self._size)
            kv.keys[:, :, self._start : self.length].copy_(keys[:, :, self._start : self.length])
            kv.values[:, :, self._start : self.length].copy_(values[:, :, self._start : self.length])
        self._start = self.length
        kv.set_length(self.length)

    # ------------------------------------------------------------------ prefill
    def prefill_shape(self, start: int, count: int) -> tuple[int, int] | None:
        """``(C, T)`` of the graph that runs ``count`` tokens after ``start`` rows, or None when none does (more
        than ``max_graph_tokens``). Padding rows may sit past the model's context: their positions only feed
        rotations whose results are dropped."""
        if not 0 < count <= self.max_graph_tokens:
            return None
        rows = bucket_for(count, self.max_graph_tokens, minimum=MIN_PREFILL_ROWS)
        size = bucket_for(start + rows, self.max_rows)
        return (size, rows) if start + rows <= size else None

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, start: int, kv: PreallocatedKV) -> torch.Tensor:
        """Run ``ids`` at positions ``start ..`` over ``kv``'s first ``start`` rows as one graph replay, write their
        K/V rows into ``kv``; returns the last token's logits (fp32 ``[vocab]``). The caller exposes the rows
        (``kv.set_length``). Raises ValueError where :meth:`prefill_shape` is None."""
        count = int(ids.numel())
        shape = self.prefill_shape(start, count)
        if shape is None:
            raise ValueError(f"no prefill graph for {count} tokens after {start} (max_graph_tokens="
                             f"{self.max_graph_tokens}, context {self.max_rows})")  # fmt: skip
        size, rows = shape
        self._graph(size, rows)  # before the rows and ids go in: a capture's warm-up runs write both
        keys, values = self._workspace(size)
        if start:
            keys[:, :, :start].copy_(kv.keys[:, :, :start])
            values[:, :, :start].copy_(kv.values[:, :, :start])
        tokens, positions, last = self._input_buffers(rows)
        tokens[:count].copy_(ids.reshape(-1))
        tokens[count:].zero_()  # padding rows: any token; their outputs are dropped, their K/V rows overwritten
        torch.arange(start, start + rows, out=positions)
        last.fill_(count - 1)
        logits = self._replay(size, rows)
        kv.keys[:, :, start : start + count].copy_(keys[:, :, start : start + count])
        kv.values[:, :, start : start + count].copy_(values[:, :, start : start + count])
        return logits

    # ------------------------------------------------------------------ warm-up
    @torch.inference_mode()
    def warmup(self, capacity: int = MIN_BUCKET, max_tokens: int | None = None) -> float:
        """Compile and capture the graphs a run can meet: decoding in every workspace up to the bucket of
        ``max_tokens`` rows (default ``capacity``), and prefills of every row bucket that fits each workspace.
        Returns the seconds it took (also added to ``compile_seconds``)."""
        start = time.perf_counter()
        largest = bucket_for(max(capacity, max_tokens or 0), self.max_rows)
        size = MIN_BUCKET
        while True:
            size = min(size, largest)
            self._graph(size, 1)
            rows = MIN_PREFILL_ROWS
            while rows <= min(size, self.max_graph_tokens):
                self._graph(size, rows)
                rows *= 2
            if size >= largest:
                break
            size *= 2
        self.warmed = True
        return time.perf_counter() - start

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The ``(C, T)`` pairs captured so far (T = 1: decode)."""
        return sorted(self._graphs)


class GraphedPrefill:
    """The engine's prefill hook (``prefill(ids, start, kv) -> logits``) over a :class:`GraphedDecodeStep`:
    suffixes that fit a prefill graph replay it, ``fits`` tells the engine which (the rest go through HF)."""

    def __init__(self, step: GraphedDecodeStep) -> None:
        self.step = step

    @property
    def packed_bytes(self) -> int:
        """Bytes of weight copies the graphs hold beside the model's (``fuse_projections``)."""
        return self.step.packed_bytes

    def fits(self, start: int, count: int) -> bool:
        return self.step.prefill_shape(start, count) is not None

    def __call__(self, ids: torch.Tensor, start: int, kv: PreallocatedKV) -> torch.Tensor:
        return self.step.prefill(ids, start, kv)
