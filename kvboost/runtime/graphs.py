"""CUDA graphs over the static pool: a few microseconds of CPU per forward instead of ~15 launches per layer.

On a GPU, a small model's forward is bound by Python and kernel launches, not by the GPU (measured on an H200 with
the bundled 135M model: HF decodes 52 tokens/s, 19 ms per token, nearly all of it CPU). The runner's forward is
captured once per token-count bucket and replayed:

- **static inputs.** Token ids, positions, slot mapping, block tables ``[B, max_blocks]``, KV lengths and query
  offsets live in device buffers filled before each replay; the pool itself is static (the runner writes K/V rows
  into it through the slot mapping, and attention reads blocks through the tables).
- **attention reads the block tables.** The paged Triton kernels (``kvboost.kernels_triton.paged_attention``) take the
  lengths from device tensors and their grid from the bucket's sizes, so one graph serves every context length:
  graphs are per bucket of rows only (decode: batch sizes 1, 2, 4, ..., ``max_batch``; prefill: one sequence of
  16, 32, ..., ``max_graph_tokens`` new tokens).
- **padding.** A bucket's extra rows are real computations on a scratch block the runner keeps for them (token 0
  at position 0): their K/V never touch a sequence's blocks, their logits are dropped.
- **fused** (the default). Each layer is nine kernels: residual add + RMSNorm, one GEMM for q/k/v (bias in its
  epilogue), RoPE + the K/V write into the pool, paged attention, the o GEMM, residual add + RMSNorm, one GEMM
  for gate/up, SiLU * up, the down GEMM (:mod:`kvboost.kernels_triton.decoder_ops`; the fused weights are the model's
  own, its q/k/v and gate/up parameters becoming row slices of them). The unfused layer (``fused=False``, or
  ``KVBOOST_GRAPH_FUSED=0``) launches ~35 kernels per layer and is what the measurements compare against.
- **compiled.** With ``fused=False`` and ``compile=True`` the unfused layer is compiled by inductor around the
  attention call (a graph break: the Triton kernel runs between two fused regions), then captured; a compile or
  capture failure falls back to the uncaptured forward (``fallback_reason`` says why).

Not bit-exact against HF's forward (other kernels, padded GEMMs): ``decode=eager`` stays the exact choice.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvboost.runtime.batch import ForwardBatch
from kvboost.runtime.ops import rms_norm, rope_tables
from kvboost.runtime.projections import FusedLayerWeights

log = logging.getLogger(__name__)

#: The smallest prefill row bucket; prefill buckets are powers of two from here up to ``max_graph_tokens``.
MIN_PREFILL_ROWS = 16
#: Prefills of more new tokens run uncaptured (the GPU's time, not Python's, dominates there).
MAX_GRAPH_TOKENS = 2048
#: The largest decode batch captured (bigger batches run uncaptured).
MAX_BATCH = 64


def bucket(rows: int, minimum: int = 1) -> int:
    """The power of two >= ``rows`` (and >= ``minimum``)."""
    size = minimum
    while size < rows:
        size *= 2
    return size


def paged_attention_kernel(device: torch.device) -> Any:
    """The paged attention function graphs use: the Triton kernels on CUDA (the CPU reference elsewhere: tests)."""
    if device.type == "cuda":
        from kvboost.kernels_triton.paged_attention import paged_attention

        return paged_attention
    from kvboost.attention.cpu_ext import cpu_extension_unavailable_reason

    if cpu_extension_unavailable_reason() is None:
        from kvboost.attention.cpu_ext import cpu_paged_attention_forward

        # the C++ kernel takes no launch-size hints (they matter for CUDA graphs only)
        return lambda q, k, v, max_q_len=None, max_kv_len=None, dynamic_splits=False, **kw: cpu_paged_attention_forward(q, k, v, **kw)
    from kvboost.kernels_triton.paged_attention_reference import paged_attention_reference

    return lambda q, k, v, max_q_len=None, max_kv_len=None, dynamic_splits=False, **kw: paged_attention_reference(q, k, v, **kw)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph, or None (the static forward runs uncaptured)
    logits: torch.Tensor | None


class GraphRunner:
    """Captured forwards of a :class:`~kvboost.runtime.llama.LlamaRunner` (see the module docstring).

    Args:
        runner: the runner whose arithmetic and pool the graphs use.
        max_batch: the largest decode batch captured.
        max_graph_tokens: the longest prefill captured (0: prefills run uncaptured).
        prefill: capture short prefills too.
        compile: compile the layer with inductor before capturing.
    """

    def __init__(self, runner: Any, *, max_batch: int = MAX_BATCH, max_graph_tokens: int = MAX_GRAPH_TOKENS,
                 prefill: bool = True, compile: bool = True, fused: bool | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.pool = runner.pool
        self.device = self.pool.device
        self.max_batch = max_batch
        self.max_graph_tokens = max_graph_tokens if prefill else 0
        self.fused = os.environ.get("KVBOOST_GRAPH_FUSED", "1") != "0" if fused is None else bool(fused)
        self.compile = compile and not self.fused  # the fused layer's kernels are already fused: no inductor
        cfg = runner.model.config.get_text_config(decoder=True)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        self.max_blocks = self.pool.blocks_for(self.max_positions) + 1
        self._scratch: int | None = None
        self._graphs: dict[tuple[str, int], _Graph] = {}
        self._inputs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._mempool: Any = None
        self.capture_seconds = 0.0
        self.fallback_reason: str | None = None
        self._attention = paged_attention_kernel(self.device)
        self._fused_weights = [FusedLayerWeights(layer) for layer in runner.inner.layers] if self.fused else None
        self._weights = [p.tensors() for p in runner.projections]
        self._layer = self._layer_fn()

    # ------------------------------------------------------------------ the captured arithmetic
    def _attend_paged(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: dict) -> torch.Tensor:
        """Paged attention of ``q`` ``[T, Hq, D]`` over one pool layer through the static index buffers."""
        out = q.new_empty(q.shape[0], q.shape[1], q.shape[2])
        self._attention(q, keys, values, block_tables=index["block_tables"], kv_lens=index["kv_lens"],
                        query_start=index["query_start"], q_positions=index["q_positions"],
                        block_size=self.pool.block_size, sm_scale=self.runner.scale, out=out,
                        max_q_len=index["max_q_len"], max_kv_len=self.max_positions,
                        **({"dynamic_splits": True} if index["max_q_len"] == 1 else {}))  # fmt: skip
        return out.reshape(q.shape[0], -1)

    def _layer_fn(self) -> Any:
        from kvboost.runtime.llama import decoder_layer, write_rows
        from kvboost.runtime.projections import TensorProjections

        runner = self.runner
        attend_paged = torch.compiler.disable(self._attend_paged)

        def layer(x, cos, sin, weights, keys, values, index):
            proj = TensorProjections(*weights)

            def attend(q, k, v):
                write_rows(keys, index["slots"], k)
                write_rows(values, index["slots"], v)
                return attend_paged(q, keys, values, index)

            return decoder_layer(x, cos, sin, proj, attend, rms_norm, runner.eps, runner.heads, runner.kv_heads,
                                 runner.head_dim)  # fmt: skip

        if self.compile:
            return torch.compile(layer, dynamic=False)
        return layer

    def static_forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The forward the graphs capture, over the static ``inputs`` buffers; returns the wanted rows' logits."""
        runner, inner = self.runner, self.runner.inner
        x = inner.embed_tokens.weight.index_select(0, inputs["tokens"])
        cos, sin = rope_tables(inputs["q_positions"], inner.rotary_emb.inv_freq, runner.attention_scaling, x.dtype)
        if self._fused_weights is not None:
            return self._fused_forward(x, cos, sin, inputs)
        for i in range(runner.num_layers):
            x = self._layer(x, cos, sin, self._weights[i], self.pool.keys[i], self.pool.values[i], inputs)
        return runner.head(x.index_select(0, inputs["logits_rows"]))

    def _fused_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The fused layers (see the module docstring): each layer's residual add is done by the next norm."""
        from kvboost.kernels_triton.decoder_ops import add_rms_norm, rope_write_kv, silu_mul

        runner, eps, pool = self.runner, self.runner.eps, self.pool
        delta = None  # what the last MLP adds to the residual stream x, not yet added
        for i, w in enumerate(self._fused_weights or ()):
            x, a = add_rms_norm(x, delta, w.ln1, eps)
            q = rope_write_kv(F.linear(a, w.wqkv, w.bqkv), cos, sin, pool.keys[i], pool.values[i], inputs["slots"],
                              runner.heads, runner.kv_heads, runner.head_dim)  # fmt: skip
            x, m = add_rms_norm(x, F.linear(self._attend_paged(q, pool.keys[i], pool.values[i], inputs), w.wo, w.bo),
                                w.ln2, eps)  # fmt: skip
            delta = F.linear(silu_mul(F.linear(m, w.wgu)), w.wd)
        _, normed = add_rms_norm(x, delta, runner.inner.norm.weight, eps)
        return runner.model.lm_head(normed.index_select(0, inputs["logits_rows"])).float()

    # ------------------------------------------------------------------ buckets
    def _scratch_block(self) -> int:
        if self._scratch is None:
            self._scratch = self.pool.alloc(1)[0]  # padding rows write here, never into a sequence's blocks
        return self._scratch

    def _bucket_of(self, batch: ForwardBatch) -> tuple[str, int] | None:
        if batch.is_decode and batch.num_seqs <= self.max_batch:
            return ("decode", bucket(batch.num_seqs))
        if (
            batch.num_seqs == 1 and batch.contiguous[0] and 1 < batch.num_tokens <= self.max_graph_tokens
            and batch.logits_rows.numel() == 1 and int(batch.logits_rows[0]) == batch.num_tokens - 1
        ):  # fmt: skip
            return ("prefill", bucket(batch.num_tokens, MIN_PREFILL_ROWS))
        return None

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.device.type == "cuda" and self._bucket_of(batch) is not None and (
            max(batch.kv_lens) <= self.max_positions)  # fmt: skip

    def _buffers(self, key: tuple[str, int]) -> dict[str, Any]:
        bufs = self._inputs.get(key)
        if bufs is None:
            kind, size = key
            seqs = size if kind == "decode" else 1
            rows = size
            long = {"dtype": torch.long, "device": self.device}
            i32 = {"dtype": torch.int32, "device": self.device}
            bufs = {
                "tokens": torch.zeros(rows, **long), "q_positions": torch.zeros(rows, **i32),
                "slots": torch.zeros(rows, **long), "block_tables": torch.zeros(seqs, self.max_blocks, **i32),
                "kv_lens": torch.ones(seqs, **i32),
                "query_start": torch.arange(seqs + 1, **i32) if kind == "decode" else torch.tensor([0, rows], **i32),
                "logits_rows": torch.arange(rows, **long) if kind == "decode" else torch.zeros(1, **long),
                "max_q_len": 1 if kind == "decode" else rows,
            }  # fmt: skip
            self._inputs[key] = bufs
        return bufs

    def _fill_padding(self, bufs: dict[str, Any]) -> None:
        scratch = self._scratch_block()
        bufs["tokens"].zero_()
        bufs["q_positions"].zero_()
        bufs["slots"].fill_(scratch * self.pool.block_size)
        bufs["block_tables"].fill_(scratch)
        bufs["kv_lens"].fill_(1)

    def _fill(self, key: tuple[str, int], batch: ForwardBatch) -> dict[str, Any]:
        bufs = self._buffers(key)
        self._fill_padding(bufs)
        t = batch.num_tokens
        bufs["tokens"][:t].copy_(batch.input_ids)
        bufs["q_positions"][:t].copy_(batch.positions)
        bufs["slots"][:t].copy_(batch.slot_mapping)
        tables = batch.block_tables_tensor()
        bufs["block_tables"][: batch.num_seqs, : tables.shape[1]].copy_(tables)
        bufs["kv_lens"][: batch.num_seqs].copy_(torch.tensor(batch.kv_lens, dtype=torch.int32))
        if key[0] == "prefill":
            # Padding rows sit after the real ones in the same sequence: positions past its rows (their K/V go to
            # the scratch block and no real row attends to them: real rows see keys <= their own position).
            bufs["q_positions"][t:] = torch.arange(batch.kv_lens[0], batch.kv_lens[0] + key[1] - t,
                                                   dtype=torch.int32, device=self.device)  # fmt: skip
            bufs["kv_lens"][0] = batch.kv_lens[0]
            bufs["logits_rows"].fill_(t - 1)
        return bufs

    # ------------------------------------------------------------------ capture and replay
    def _capture(self, key: tuple[str, int]) -> _Graph:
        start = time.perf_counter()
        bufs = self._buffers(key)
        self._fill_padding(bufs)
        if key[0] == "prefill":
            bufs["query_start"][1] = key[1]
            bufs["logits_rows"].zero_()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # the first call compiles; the second runs what the graph will hold
                try:
                    self.static_forward(bufs)
                except Exception as exc:
                    if self.fused:
                        self._unfuse(exc)
                    elif self.compile:
                        self._uncompile(exc)
                    else:
                        raise
                    self.static_forward(bufs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph: Any = torch.cuda.CUDAGraph()
        try:
            # One memory pool for every graph: they never run at the same time, and each keeps its logits buffer.
            with torch.cuda.graph(graph, pool=self._mempool):
                logits = self.static_forward(bufs)
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves a working, uncaptured forward
            from kvboost.runtime.llama import error_line

            self.fallback_reason = f"CUDA graph capture failed ({error_line(exc)})"
            log.warning("kvboost: %s; the forward runs uncaptured", self.fallback_reason)
            graph, logits = None, None
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - start
        return _Graph(graph, logits)

    def _unfuse(self, exc: Exception) -> None:
        from kvboost.runtime.llama import error_line

        self.fallback_reason = f"the fused layer failed ({error_line(exc)}); capturing the unfused layer"
        log.warning("kvboost: %s", self.fallback_reason)
        self.fused, self._fused_weights = False, None

    def _uncompile(self, exc: Exception) -> None:
        from kvboost.runtime.llama import error_line

        self.fallback_reason = f"compiling the graphed layer failed ({error_line(exc)}); capturing eager kernels"
        log.warning("kvboost: %s", self.fallback_reason)
        self.compile = False
        self._layer = self._layer_fn()

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        key = self._bucket_of(batch)
        assert key is not None
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(key)  # before the inputs are filled: capture writes them
        bufs = self._fill(key, batch)
        if entry.graph is None:
            logits = self.static_forward(bufs)
        else:
            entry.graph.replay()
            logits = entry.logits
        rows = batch.num_seqs if key[0] == "decode" else 1
        return logits[:rows].clone()

    @torch.inference_mode()
    def warmup(self, max_tokens: int | None = None) -> float:
        """Capture every decode bucket and the prefill buckets up to ``max_tokens`` rows."""
        start = time.perf_counter()
        size = 1
        while size <= self.max_batch:
            if ("decode", size) not in self._graphs:
                self._graphs[("decode", size)] = self._capture(("decode", size))
            size *= 2
        rows = MIN_PREFILL_ROWS
        while rows <= min(self.max_graph_tokens, max_tokens or self.max_graph_tokens):
            if ("prefill", rows) not in self._graphs:
                self._graphs[("prefill", rows)] = self._capture(("prefill", rows))
            rows *= 2
        return time.perf_counter() - start

    def describe(self) -> dict[str, Any]:
        return {"cuda_graphs": len(self._graphs), "cuda_graph_capture_s": self.capture_seconds,
                "graph_fallback_reason": self.fallback_reason, "graph_compiled": self.compile,
                "graph_layer": "fused" if self.fused else ("compiled" if self.compile else "unfused")}  # fmt: skip
