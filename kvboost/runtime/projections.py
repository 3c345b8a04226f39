"""How one decoder layer's projections multiply: the part of a Llama-structured layer that varies with the weights.

The layer body (:func:`kvboost.runtime.llama.decoder_layer`) is written once; it asks a ``Projections`` object for
``qkv(a) -> (q, k, v)``, ``o(x)``, ``gate_up(m) -> (gate, up)`` and ``down(x)``. The kinds:

- :class:`PlainProjections`: ``F.linear`` per projection, the calls HF's forward makes (its bits, bf16 included);
- :class:`PackedProjections`: q/k/v and gate/up each one product over prepacked copies of the weights
  (:mod:`kvboost.models.prepack`: oneDNN's layout in bf16, MKL's in fp32; faster on CPU, not HF's bits);
- :class:`Int4Projections`: int4 weights (AWQ, or GGUF's: ``weights="gguf_int4"``); q/k/v and gate/up fused for
  torch's int4 CPU kernel (the modules' bits), or dense dequantized copies for forwards of ``dense_min_rows`` rows
  and more (``model.awq_prefill: dense``), or the modules themselves where their call is not the int4 kernel (and
  for groups that are not all int4);
- :class:`ModuleProjections`: each projection through its own module (AWQ linears the step cannot fuse; the
  tiled linears of ``attn=batch_invariant``, aligned per sequence to its cache positions);
- :class:`TensorProjections`: plain weights passed as tensors into a compiled layer; on CPU with
  :func:`reduction_linear`: ``(W * x).sum(-1)`` for one-row forwards, which inductor turns into a fused reduction
  streaming the weights about twice as fast as BLAS ``gemv`` on the project's CPUs (fp32 10 -> 24 GB/s, bf16
  12 -> 20 GB/s on [1536, 576] weights); several rows use ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvboost.models.awq import (
    AWQLinear,
    fuse_dense,
    fuse_int4pack,
    fused_bias,
    fused_int4pack_unsupported,
    int4pack_mm,
)


def _projections(layer: Any) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


class PlainProjections:
    """``F.linear`` per projection on the modules' own weights (HF's calls, HF's bits)."""

    kind = "plain"

    def __init__(self, layer: Any) -> None:
        q, k, v, o, g, u, d = _projections(layer)
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.wq, self.bq, self.wk, self.bk, self.wv, self.bv = q.weight, q.bias, k.weight, k.bias, v.weight, v.bias
        self.wo, self.bo = o.weight, o.bias
        self.wg, self.wu, self.wd = g.weight, u.weight, d.weight

    def qkv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.linear(a, self.wq, self.bq), F.linear(a, self.wk, self.bk), F.linear(a, self.wv, self.bv)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.wo, self.bo)

    def gate_up(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(m, self.wg), F.linear(m, self.wu)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.wd)

    def tensors(self) -> tuple:
        """The weights as a flat tuple (what the compiled one-row layer takes as arguments)."""
        return (self.ln1, self.wq, self.bq, self.wk, self.bk, self.wv, self.bv, self.wo, self.bo, self.ln2,
                self.wg, self.wu, self.wd)  # fmt: skip


class _Fused:
    """Shared shape of the fused kinds: ``qkv`` and ``gate_up`` as one product each, split after."""

    def __init__(self, layer: Any, splits_qkv: tuple[int, int, int], intermediate: int) -> None:
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.splits_qkv = splits_qkv
        self.intermediate = intermediate

    def _qkv(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _gate_up(self, m: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def qkv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._qkv(a).split(self.splits_qkv, dim=-1)  # type: ignore[return-value]

    def gate_up(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gate_up(m).split((self.intermediate, self.intermediate), dim=-1)  # type: ignore[return-value]


class PackedProjections(_Fused):
    """Prepacked copies (:func:`kvboost.models.prepack.pack_layer`): q/k/v and gate/up one product each."""

    kind = "prepacked"

    def __init__(self, layer: Any, splits_qkv: tuple[int, int, int], intermediate: int) -> None:
        from kvboost.models.prepack import pack_layer

        super().__init__(layer, splits_qkv, intermediate)
        _, self._qkv_fn, self._o_fn, _, self._gate_up_fn, self._down_fn = pack_layer(layer)

    def _qkv(self, a: torch.Tensor) -> torch.Tensor:
        return self._qkv_fn(a)

    def _gate_up(self, m: torch.Tensor) -> torch.Tensor:
        return self._gate_up_fn(m)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._o_fn(x)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self._down_fn(x)

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(f, "nbytes", 0)) for f in (self._qkv_fn, self._o_fn, self._gate_up_fn, self._down_fn))


def _int4_pack(modules: tuple, dtype: torch.dtype) -> Any:
    """The fused :class:`~kvboost.models.awq.Int4Pack` of ``modules``, or None where they do not all fuse (a group
    mixing int4 and dense linears, as a GGUF file with some tensors in other types gives): run member by member."""
    return fuse_int4pack(modules, dtype) if fused_int4pack_unsupported(modules, dtype) is None else None


class Int4Projections(_Fused):
    """int4 projections on CPU (AWQ, or GGUF's under ``weights="gguf_int4"``): q/k/v and gate/up fused for torch's
    int4 kernel (the modules' call, so their bits); forwards of ``dense_min_rows`` rows or more multiply fused
    dequantized copies instead (dense prefill); row counts whose module call is not the int4 kernel (fp32 beyond a
    few rows) run the modules themselves. A group that is not all int4 (a GGUF layer whose v or down tensor is
    Q6_K, say) has no pack and always runs through its modules (each int4 member still takes the int4 kernel)."""

    kind = "int4"

    def __init__(self, layer: Any, splits_qkv: tuple[int, int, int], intermediate: int, dtype: torch.dtype) -> None:
        super().__init__(layer, splits_qkv, intermediate)
        attn, mlp = layer.self_attn, layer.mlp
        self.modules = ModuleProjections(layer)
        qkv_modules, gate_up_modules = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
        self.qkv_pack = _int4_pack(qkv_modules, dtype)
        self.o_pack = _int4_pack((attn.o_proj,), dtype)
        self.gate_up_pack = _int4_pack(gate_up_modules, dtype)
        self.down_pack = _int4_pack((mlp.down_proj,), dtype)
        int4 = [m for m in _projections(layer) if isinstance(m, AWQLinear)]
        self._probe = int4[0] if int4 else None  # None: no int4 linear in this layer, every call is the module's
        rows = {m.dense_min_rows for m in int4}
        if len(rows) > 1:
            raise ValueError(f"dense prefill: the AWQ linears disagree on dense_min_rows ({sorted(rows, key=str)})")
        self.dense_min_rows = rows.pop() if rows else None
        self.dense: tuple | None = None
        if self.dense_min_rows is not None:
            def dense(pack: Any, modules: tuple) -> torch.Tensor | None:
                return None if pack is None else fuse_dense(modules, dtype)

            self.dense = (dense(self.qkv_pack, qkv_modules), fused_bias(qkv_modules, dtype),
                          dense(self.o_pack, (attn.o_proj,)), fused_bias((attn.o_proj,), dtype),
                          dense(self.gate_up_pack, gate_up_modules),
                          dense(self.down_pack, (mlp.down_proj,)))  # fmt: skip
        self._path = "int4"

    @property
    def packs(self) -> dict[str, Any]:
        """The fused packs by group (None: that group runs through its modules)."""
        return {"qkv": self.qkv_pack, "o": self.o_pack, "gate_up": self.gate_up_pack, "down": self.down_pack}

    def route(self, rows: int, dtype: torch.dtype) -> None:
        """Choose the path for a forward of ``rows`` rows (called once per forward by the runner)."""
        probe = self._probe
        if self.dense is not None and rows >= self.dense_min_rows:
            self._path = "dense"
        elif probe is None or not probe._use_int4pack(
            torch.empty(rows, 1, dtype=dtype).expand(rows, probe.in_features)
        ):
            self._path = "modules"
        else:
            self._path = "int4"

    @staticmethod
    def _mm(x: torch.Tensor, pack: Any) -> torch.Tensor:
        y = int4pack_mm(x, pack.weight, pack.group_size, pack.scale_zero)
        return y if pack.bias is None else y + pack.bias

    def qkv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._path == "modules" or self.qkv_pack is None:
            return self.modules.qkv(a)
        return super().qkv(a)

    def gate_up(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._path == "modules" or self.gate_up_pack is None:
            return self.modules.gate_up(m)
        return super().gate_up(m)

    def _qkv(self, a: torch.Tensor) -> torch.Tensor:
        if self._path == "dense":
            return F.linear(a, self.dense[0], self.dense[1])
        return self._mm(a, self.qkv_pack)

    def _gate_up(self, m: torch.Tensor) -> torch.Tensor:
        if self._path == "dense":
            return F.linear(m, self.dense[4])
        return self._mm(m, self.gate_up_pack)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        if self._path == "modules" or self.o_pack is None:
            return self.modules.o(x)
        if self._path == "dense":
            return F.linear(x, self.dense[2], self.dense[3])
        return self._mm(x, self.o_pack)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        if self._path == "modules" or self.down_pack is None:
            return self.modules.down(x)
        if self._path == "dense":
            return F.linear(x, self.dense[5])
        return self._mm(x, self.down_pack)


class ModuleProjections:
    """Each projection through its own module (``module(x)``): whatever forward the module has."""

    kind = "modules"

    def __init__(self, layer: Any) -> None:
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.q, self.k, self.v, self.o_proj, self.g, self.u, self.d = _projections(layer)

    def qkv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q(a), self.k(a), self.v(a)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(x)

    def gate_up(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.g(m), self.u(m)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(x)


class PerSequence:
    """Projections run sequence by sequence, each call told its first cache position first (``set_offset``):
    the tiled linears of ``attn=batch_invariant`` align their tiles to a sequence's positions, so a batch of
    several sequences must not share a call."""

    def __init__(self, inner: Any, set_offset: Callable[[int], None], spans: Sequence[tuple[int, int, int]]) -> None:
        self.inner, self.set_offset, self.spans = inner, set_offset, spans  # spans: (first row, end row, offset)
        self.ln1, self.ln2 = inner.ln1, inner.ln2

    def _each(self, fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
        if len(self.spans) == 1:
            self.set_offset(self.spans[0][2])
            return fn(x)
        parts = []
        for a, b, offset in self.spans:
            self.set_offset(offset)
            parts.append(fn(x[a:b]))
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(p) for p in zip(*parts, strict=True))
        return torch.cat(parts)

    def qkv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._each(self.inner.qkv, a)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._each(self.inner.o, x)

    def gate_up(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._each(self.inner.gate_up, m)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self._each(self.inner.down, x)


def reduction_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for the compiled path: one row as ``(W * x).sum(-1)`` in fp32 (a fused, vectorised reduction
    under inductor); several rows through ``F.linear`` (a GEMM reads the weight once for all of them)."""
    if x.shape[0] != 1:
        return F.linear(x, weight, bias)
    y = (weight.float() * x.float()[:, None, :]).sum(-1)  # [1, out]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class TensorProjections:
    """Plain weights given as tensors (one layer's :meth:`PlainProjections.tensors`), multiplied by ``linear``:
    built inside a compiled layer from its tensor arguments, so one compiled graph serves every layer."""

    kind = "tensors"

    def __init__(self, ln1, wq, bq, wk, bk, wv, bv, wo, bo, ln2, wg, wu, wd, *, linear=F.linear) -> None:
        self.ln1, self.ln2, self.linear = ln1, ln2, linear
        self.w = (wq, bq, wk, bk, wv, bv, wo, bo, wg, wu, wd)

    def qkv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wq, bq, wk, bk, wv, bv = self.w[:6]
        return self.linear(a, wq, bq), self.linear(a, wk, bk), self.linear(a, wv, bv)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.w[6], self.w[7])

    def gate_up(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(m, self.w[8], None), self.linear(m, self.w[9], None)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.w[10], None)


def _rows_in_place(tensors: Sequence[torch.Tensor], owners: Sequence[tuple[Any, str]]) -> torch.Tensor:
    """One tensor whose consecutive row ranges are ``tensors``: when they already are adjacent slices of one
    storage (a runner built earlier on the same model fused them) that tensor, else their concatenation, which
    the owners' parameters then become views of (``owner.<name>.data``), so the fused copy is the only copy."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset, adjacent = first.storage_offset(), True
    for t in tensors:
        adjacent = adjacent and t.is_contiguous() and t.untyped_storage().data_ptr() == storage
        adjacent = adjacent and t.storage_offset() == offset and t.dtype == first.dtype
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    if adjacent:
        return first.detach().as_strided((rows, *first.shape[1:]), first.stride())
    fused = torch.cat([t.detach() for t in tensors])
    start = 0
    for t, (owner, name) in zip(tensors, owners, strict=True):
        getattr(owner, name).data = fused[start : start + t.shape[0]]
        start += t.shape[0]
    return fused


class FusedLayerWeights:
    """One layer's weights for the fused graph forward: q/k/v as one ``[Hq*D + 2*Hkv*D, hidden]`` weight (and
    bias, when every one of the three has one), gate/up as one ``[2*I, hidden]`` weight.

    Built in place: the modules' parameters become row slices of the fused tensors (same values, no second copy
    of the model; HF's forward and the other runners read the same bits through the slices)."""

    def __init__(self, layer: Any) -> None:
        q, k, v, o, g, u, d = _projections(layer)
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        with torch.no_grad():
            self.wqkv = _rows_in_place([q.weight, k.weight, v.weight], [(q, "weight"), (k, "weight"), (v, "weight")])
            biases = [m.bias for m in (q, k, v)]
            if all(b is not None for b in biases):
                self.bqkv: torch.Tensor | None = _rows_in_place(biases, [(q, "bias"), (k, "bias"), (v, "bias")])
            elif any(b is not None for b in biases):  # some of the three have a bias: zeros for the others (small)
                self.bqkv = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0])
                                       for b, m in zip(biases, (q, k, v), strict=True)])  # fmt: skip
            else:
                self.bqkv = None
            self.wgu = _rows_in_place([g.weight, u.weight], [(g, "weight"), (u, "weight")])
        self.wo, self.bo, self.wd = o.weight, o.bias, d.weight
