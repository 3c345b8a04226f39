"""Attention backends: the interface and the transformers glue.

An attention backend replaces the score/softmax/value part of every attention layer of a HuggingFace model
(projections, RoPE and the KV-cache update stay in the model's own code). ``install(model)`` registers the
backend in transformers' ``AttentionInterface`` under ``kvboost_<name>`` (plus the matching mask builder in
``AttentionMaskInterface``) and switches the model to it with ``model.set_attn_implementation``.

What a backend receives per layer call (transformers 5.x)::

    query           [B, Hq,  Lq, D]   after RoPE
    key, value      [B, Hkv, Lk, D]   already concatenated with the KV cache by the layer (Lk >= Lq)
    attention_mask  None, or a 4D mask [B, 1, Lq, Lk]: bool (True = attend) from ``sdpa_mask``, or float
                    (0 = attend, dtype-min = masked) from ``eager_mask``

and it must return ``(attn_output [B, Lq, Hq, D] contiguous, attn_weights or None)``.

Kernel backends (triton, cuda) take the shared kernel contract of ``kvboost.kernels_triton`` instead of a dense mask
(translated by ``kvboost.attention.masks``); :class:`FlashKernelBackend` falls back to transformers' SDPA for
masks the contract cannot express.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from kvboost.attention.masks import KernelMaskParams, MaskParamsCache, mask_to_kernel_params

log = logging.getLogger(__name__)

#: Attribute set on a model's attention modules by ``install`` so that the interface function registered
#: under ``kvboost_<name>`` routes each call to the backend instance installed on *that* model (two engines
#: with two instances of the same backend keep separate counters).
MODULE_BACKEND_ATTR = "_kvboost_attention_backend"

#: Attribute set on an installed model: the attention implementation it had before, for ``uninstall``.
PREVIOUS_IMPL_ATTR = "_kvboost_previous_attn_implementation"

#: Keyword argument carrying per-query absolute positions ([B, Lq] int32) from layer-wise execution to kernel
#: backends (``selected_query_inputs``); dense-mask backends never receive it.
SELECTED_Q_POSITIONS = "kvboost_q_positions"

# Latest instance installed per implementation key; serves modules that were created after install().
_LATEST_BACKEND: dict[str, AttentionBackend] = {}


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by the backend (the engine and runners read these, never lists of names).

    Attributes:
        paged: reads K/V blocks through the block tables itself (no gathered copy of a sequence's rows).
        subset_queries: attends queries at arbitrary positions (layer-wise content repair).
        observer: honours a query observer (the reader-attention probe).
        batch_invariant: a token's bits do not depend on the other rows of its forward (bit-exact bf16 reuse).
        exact: computes transformers' own attention for a layer call (HF's bits where HF would run it).
        tiled_projections: the backend also replaces the decoder's projections (``batch_invariant``): runners call
            the modules, sequence by sequence, and never substitute their own arithmetic.
        runner_decode: under this backend the runner may decode with its own attention (the compiled or graphed
            one-row forward): the backend's own decode arithmetic is plain attention with nothing to keep.
    """

    paged: bool = False
    subset_queries: bool = True
    observer: bool = True
    batch_invariant: bool = False
    exact: bool = False
    tiled_projections: bool = False
    runner_decode: bool = False


class AttentionBackend(ABC):
    """Interface of an attention backend plugin (registered in ``kvboost.registry.ATTENTION``).

    Attributes:
        name: the registry key (``"sdpa"``, ``"triton"``, ...); the transformers implementation name is
            ``f"kvboost_{name}"``.
        kernel_calls: number of attention-layer calls that really ran this backend's own kernel (a forward of
            an N-layer model adds N). Calls served by a fallback are not counted here.
    """

    name: ClassVar[str] = "base"

    #: Name of the transformers mask builder registered for this backend's implementation key:
    #: ``"sdpa"`` gives bool masks (or None where SDPA's ``is_causal`` suffices), ``"eager"`` additive floats.
    mask_kind: ClassVar[str] = "sdpa"

    #: Non-empty for a backend whose K/V has other bits than the others' (``batch_invariant``, whose tag also
    #: names its settings): it goes into the engine's fingerprint, so cache entries computed under one
    #: arithmetic are never served to another.
    fingerprint_tag: str = ""

    #: What this backend can do (see :class:`Capabilities`).
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self) -> None:
        self.kernel_calls = 0
        #: Called as ``observer(module, query, key, scaling)`` before every attention call while set (the
        #: HF-generic runner's layer hooks use it); None in normal operation.
        self.query_observer: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, float | None], None] | None = None

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def check_available(self) -> None:
        """Raise RuntimeError with a clear, actionable message if this backend cannot run here."""

    @abstractmethod
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
        """One attention-layer call, in transformers' attention-interface convention.

        Args:
            module: the calling attention layer (``num_key_value_groups``, ``is_causal``, ``training``...).
            query: ``[B, Hq, Lq, D]``.
            key, value: ``[B, Hkv, Lk, D]``, cached prefix included.
            attention_mask: None or a 4D mask ``[B, 1, Lq, Lk]`` (bool or additive float, see ``mask_kind``).
            scaling: softmax scale; None means ``1/sqrt(D)``.
            dropout: attention dropout probability (transformers passes 0.0 outside training).
            **kwargs: everything else transformers forwards (``is_causal``, ``sliding_window``, ...).

        Returns:
            ``(attn_output [B, Lq, Hq, D] contiguous, attn_weights or None)``.
        """

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ValueError/RuntimeError with a clear message if this backend cannot serve ``model``.

        Called by ``install`` after ``check_available``, before the model is changed, so a model the backend
        cannot run (dtype, head dim, soft-capping...) is refused when the engine is built, not at the first call.
        """

    def warmup(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
    ) -> None:
        """Run whatever one-off work (autotuning, compilation) the shapes up to ``max_len`` will need, so that
        no measured request pays for it. Default: nothing to do."""

    def selected_query_inputs(
        self, q_positions: torch.Tensor, k_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Attention inputs for queries at arbitrary absolute ``q_positions`` over keys ``[0, k_len)``.

        Layer-wise execution runs a *subset* of a prompt's positions through a layer; query i must see key j
        iff ``j <= q_positions[i]`` (exactly causal by its own position; a bottom-right aligned causal mask
        would let it see later keys). Returns ``(attention_mask, extra kwargs for attention_forward)``; the
        default builds the dense mask this backend's ``mask_kind`` expects.
        """
        return self.causal_mask(q_positions, k_len, dtype), {}

    # ------------------------------------------------------------------ the runners' call
    def paged(
        self, q: torch.Tensor, layer: int, batch: Any, scale: float, module: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """Attention of a :class:`~kvboost.runtime.batch.ForwardBatch`'s queries ``q`` ``[T, Hq, D]`` (after RoPE)
        over the KV pool's ``layer``, whose rows the runner has written; returns ``[T, Hq * D]`` (the
        o-projection's input). Query ``t`` of sequence ``b`` sees its keys ``j <= batch.positions[t]``.

        Default (gathering backends): sequence by sequence, its rows as one ``[1, Hkv, kv_len, D]`` tensor (a view
        when its blocks are consecutive, else a gathered copy) and the mask transformers would build for that
        call (None for a decode step or a cold prefill, a causal-by-position mask for a suffix), through
        :meth:`attention_forward`, the call HF's forward makes: the same bits as HF's forward. Rows at arbitrary
        positions (content repair) take :meth:`selected_query_inputs`. Backends that read blocks themselves
        (``capabilities.paged``) override this."""
        total, heads, dim = q.shape
        out = q.new_empty(total, heads * dim)
        for b in range(batch.num_seqs):
            rows = batch.rows_of(b)
            if rows.start == rows.stop:
                continue
            keys, values = batch.layer_kv(b, layer)
            mask, extra = batch.cached((self.impl_name, "inputs", b), lambda b=b: self.paged_inputs(batch, b, q.dtype))
            qb = q[rows].transpose(0, 1)[None]
            result, _ = self.attention_forward(module, qb, keys, values, mask, scaling=scale, **extra)
            out[rows] = result[0].reshape(rows.stop - rows.start, heads * dim)
        return out

    def paged_inputs(self, batch: Any, b: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """``(attention_mask, extra kwargs)`` for sequence ``b`` of ``batch`` in the form this backend's
        ``attention_forward`` takes: what transformers' mask builder gives for a plain suffix (None where SDPA's
        ``is_causal`` suffices: one query, or a cold prefill; else the causal-by-position mask), and
        :meth:`selected_query_inputs` for rows at arbitrary positions."""
        rows = batch.rows_of(b)
        t, n = rows.stop - rows.start, batch.kv_lens[b]
        positions = batch.positions[rows]
        if not batch.contiguous[b]:
            return self.selected_query_inputs(positions, n, dtype)
        if self.mask_kind == "sdpa" and (t == 1 or t == n):
            return None, {}
        return self.causal_mask(positions, n, dtype), {}

    def causal_mask(self, positions: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, t, n]``: query ``i`` (at ``positions[i]``) sees key ``j`` iff ``j <= positions[i]``, in this
        backend's ``mask_kind`` (bool for ``sdpa``, 0 / dtype-min for ``eager``), as transformers builds it."""
        allowed = torch.arange(n, device=positions.device)[None, :] <= positions[:, None]
        if self.mask_kind == "eager":
            mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
            return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
        return allowed[None, None]

    # ------------------------------------------------------------------ transformers glue
    @property
    def impl_name(self) -> str:
        """The key this backend is registered under in transformers' attention interfaces."""
        return f"kvboost_{self.name}"

    def mask_function(self) -> Callable[..., Any]:
        """The transformers mask builder whose output this backend's ``attention_forward`` expects."""
        from transformers.masking_utils import eager_mask, sdpa_mask

        return {"sdpa": sdpa_mask, "eager": eager_mask}[self.mask_kind]

    def register(self) -> str:
        """Register this backend in transformers' attention and mask interfaces; returns the key.

        Registration is global in transformers; the registered function routes each call to the backend
        instance installed on the calling module's model, so registering is idempotent.
        """
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        key = self.impl_name
        AttentionInterface.register(key, _make_dispatcher(key))
        # Without a mask builder under our key, transformers' mask preprocessing treats the implementation as
        # "needs no mask" and hands the layers None, which would silently drop padding.
        AttentionMaskInterface.register(key, self.mask_function())
        _LATEST_BACKEND[key] = self
        return key

    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model`` run its attention through this backend; returns the model.

        Checks availability and the model first (a backend that cannot run here fails now, with its clear
        message, not in the middle of a generate call), registers the backend, tags the model's modules so calls are
        counted on this instance, and switches the model with ``model.set_attn_implementation``.
        """
        self.check_available()
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise TypeError(
                f"attention backend {self.name!r}: install() needs a transformers PreTrainedModel, "
                f"got {type(model).__name__}"
            )
        self.check_model(model)
        key = self.register()
        previous = getattr(config, "_attn_implementation", None)
        if previous != key and not hasattr(model, PREVIOUS_IMPL_ATTR):
            setattr(model, PREVIOUS_IMPL_ATTR, previous)
        for sub in model.modules():
            setattr(sub, MODULE_BACKEND_ATTR, self)
        model.set_attn_implementation(key)
        # set_attn_implementation only *warns* for model classes that do not use the attention interface;
        # running such a model would silently bypass the backend (and its counters), so fail instead.
        if getattr(config, "_attn_implementation", None) != key:
            raise RuntimeError(
                f"attention backend {self.name!r}: {type(model).__name__} did not switch to {key!r} (its "
                "attention layers do not dispatch through transformers' AttentionInterface)"
            )
        return model

    def uninstall(self, model: torch.nn.Module) -> torch.nn.Module:
        """Switch ``model`` back to the attention implementation it had before ``install``."""
        previous = getattr(model, PREVIOUS_IMPL_ATTR, None) or "sdpa"
        model.set_attn_implementation(previous)
        for sub in model.modules():
            if getattr(sub, MODULE_BACKEND_ATTR, None) is self:
                delattr(sub, MODULE_BACKEND_ATTR)
        if hasattr(model, PREVIOUS_IMPL_ATTR):
            delattr(model, PREVIOUS_IMPL_ATTR)
        return model

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Counters for results: ``{"backend": name, "kernel_calls": n, ...}``."""
        return {"backend": self.name, "kernel_calls": self.kernel_calls}

    def reset_stats(self) -> None:
        """Zero the counters."""
        self.kernel_calls = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _make_dispatcher(key: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The function registered in transformers' AttentionInterface for ``key``."""

    def kvboost_attention(module, query, key_states, value_states, attention_mask, **kwargs):
        backend = getattr(module, MODULE_BACKEND_ATTR, None)
        if backend is None or backend.impl_name != key:
            backend = _LATEST_BACKEND[key]
        observer = getattr(backend, "query_observer", None)
        if observer is not None:
            observer(module, query, key_states, kwargs.get("scaling"))
        return backend.attention_forward(module, query, key_states, value_states, attention_mask, **kwargs)

    kvboost_attention.__name__ = f"{key}_attention_forward"
    kvboost_attention.__qualname__ = kvboost_attention.__name__
    return kvboost_attention


class FlashKernelBackend(AttentionBackend):
    """Shared driver for backends that run a kernel with the ``kvboost.kernels_triton`` attention contract.

    Subclasses implement :meth:`_run_kernel`. This class validates the call, translates the mask (cached per
    mask tensor), falls back to transformers' SDPA for masks the contract cannot express (counted in
    ``fallback_calls``, warned once), and returns the output in transformers' layout.
    """

    #: Whether the kernel accepts per-query ``q_positions`` (the CUDA extension does not).
    supports_q_positions: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.fallback_calls = 0
        self._warned_fallback = False
        self._warned_grad = False
        self._mask_cache = MaskParamsCache()

    @abstractmethod
    def _run_kernel(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: KernelMaskParams,
        scaling: float | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the kernel; returns ``[B, Hq, Lq, D]``, written into ``out`` (any strides) when given."""

    def kernel_params(
        self, attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, is_causal: bool
    ) -> KernelMaskParams | None:
        """The (cached) translation of ``attention_mask`` for this call, or None if not expressible."""
        batch, _, q_len, _ = query.shape
        k_len = key.shape[2]

        def compute() -> KernelMaskParams | None:
            return mask_to_kernel_params(
                attention_mask,
                batch=batch,
                q_len=q_len,
                k_len=k_len,
                is_causal=is_causal,
                allow_q_positions=self.supports_q_positions,
            )

        if attention_mask is None:
            return compute()
        return self._mask_cache.get_or_compute(attention_mask, (batch, q_len, k_len, is_causal), compute)

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
        if dropout and dropout > 0.0:
            raise RuntimeError(
                f"attention backend {self.name!r} is forward-only and has no attention dropout "
                f"(got dropout={dropout}); train with attn=sdpa or attn=eager"
            )
        if getattr(module, "training", False) and torch.is_grad_enabled() and query.requires_grad:
            raise RuntimeError(
                f"attention backend {self.name!r} is forward-only (no backward kernel); the model is in "
                "training mode with gradients enabled: use attn=sdpa for training, or model.eval()/no_grad"
            )
        for unsupported in ("softcap", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(
                    f"attention backend {self.name!r} does not support {unsupported!r} "
                    "(logit soft-capping / attention sinks); use attn=eager"
                )
        if torch.is_grad_enabled() and query.requires_grad and not self._warned_grad:
            self._warned_grad = True
            log.warning(
                "kvboost attention %r: gradients do not flow through the kernel; run inference under "
                "torch.no_grad()",
                self.name,
            )

        q_positions = kwargs.pop(SELECTED_Q_POSITIONS, None)
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        params = None
        if q_positions is not None:
            # Layer-wise execution: queries at given absolute positions over the whole key range.
            params = KernelMaskParams(causal=True, q_positions=q_positions)
        elif kwargs.get("position_bias") is None:
            params = self.kernel_params(attention_mask, query, key, bool(is_causal))
        if params is None:
            return self._fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

        if params.key_len is not None:
            key = key[:, :, : params.key_len]
            value = value[:, :, : params.key_len]
        # transformers wants [B, Lq, Hq, D]: let the kernel write through a transposed view of that layout
        # instead of transposing a [B, Hq, Lq, D] result with an extra copy.
        batch, heads, q_len, head_dim = query.shape
        out = query.new_empty(batch, q_len, heads, head_dim)
        self._run_kernel(query, key, value, params, scaling, out=out.transpose(1, 2))
        self.kernel_calls += 1
        return out, None

    def selected_query_inputs(
        self, q_positions: torch.Tensor, k_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """The kernel takes the positions themselves (no dense mask); backends without per-query positions
        get the dense mask, which their mask translation serves or sends to the SDPA fallback."""
        if not self.supports_q_positions:
            return super().selected_query_inputs(q_positions, k_len, dtype)
        return None, {SELECTED_Q_POSITIONS: q_positions.to(torch.int32)[None]}

    def _fallback(self, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
        """Dense-mask path for masks the kernel contract cannot express: transformers' own SDPA."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if not self._warned_fallback:
            self._warned_fallback = True
            shape = None if attention_mask is None else tuple(attention_mask.shape)
            log.warning(
                "kvboost attention %r: attention mask %s has a pattern the kernel contract cannot express "
                "(e.g. sliding window, packed sequences, bias); those calls run transformers' SDPA "
                "(counted in fallback_calls; warned once)",
                self.name,
                shape,
            )
        self.fallback_calls += 1
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "fallback_calls": self.fallback_calls}

    def reset_stats(self) -> None:
        super().reset_stats()
        self.fallback_calls = 0
