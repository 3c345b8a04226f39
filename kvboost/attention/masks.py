"""Translating transformers' attention masks into the kernel contract of ``kvboost.kernels_triton``.

Kernel backends (triton, cuda) take ``causal``, per-query ``q_positions`` and per-row ``kv_start`` /
``kv_len`` instead of a dense mask. :func:`mask_to_kernel_params` derives those from a 4D mask and verifies
that they reproduce it exactly; a mask they cannot express yields ``None`` (the backend then falls back).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KernelMaskParams:
    """A transformers attention mask expressed in the kernel contract (see ``kvboost.kernels_triton``).

    Attributes:
        causal: whether a query attends only keys ``j <= q_positions[b, i]``.
        q_positions: ``[B, Lq]`` int32, or None for the contract's default (``Lk - Lq + i``, bottom-right).
        kv_start: ``[B]`` int32 first valid key per row (left padding), or None for 0.
        kv_len: ``[B]`` int32 one past the last valid key per row, or None for ``Lk``.
        key_len: when not None, only the first ``key_len`` keys take part (key/value are sliced to it);
            used for transformers' upper-left-aligned ``is_causal`` case.
    """

    causal: bool
    q_positions: torch.Tensor | None = None
    kv_start: torch.Tensor | None = None
    kv_len: torch.Tensor | None = None
    key_len: int | None = None


def allowed_from_mask(mask: torch.Tensor, batch: int) -> torch.Tensor | None:
    """A 4D transformers mask -> bool ``[B, Lq, Lk]`` (True = attend), or None if it is not a pure mask.

    Float masks are additive: 0 means attend and a very negative value (the dtype's minimum, or -inf) means
    masked. Any other value is a bias (ALiBi, relative positions) that no boolean kernel mask can express.
    Masks that differ across heads are not expressible either.
    """
    if mask.dim() != 4:
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        # Half the dtype minimum: exp() of it underflows to exactly 0 in every float format, so such
        # entries contribute nothing in eager attention either; anything between is a real bias.
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | masked).all()):
            return None
    else:
        return None
    if allowed.shape[1] != 1:
        if not bool((allowed == allowed[:, :1]).all()):
            return None
    allowed = allowed[:, 0]
    if allowed.shape[0] != batch:
        if allowed.shape[0] != 1:
            return None
        allowed = allowed.expand(batch, -1, -1)
    return allowed


def mask_to_kernel_params(
    attention_mask: torch.Tensor | None,
    *,
    batch: int,
    q_len: int,
    k_len: int,
    is_causal: bool = True,
    allow_q_positions: bool = True,
) -> KernelMaskParams | None:
    """Translate a transformers attention mask into kernel-contract parameters, verified exactly.

    ``attention_mask=None`` follows transformers' SDPA semantics: with ``is_causal`` and ``Lq == Lk`` (or
    ``Lq == 1``) plain causal attention; with ``1 < Lq < Lk`` SDPA's upper-left alignment, i.e. only the first
    ``Lq`` keys take part (the empty-StaticCache prefill case); without ``is_causal`` full attention.

    A 4D mask is reduced to: per row, the range of keys any query may attend (``kv_start``, ``kv_len``:
    left/right padding), and per query the last key it may attend (``q_positions``; a query that may attend
    nothing, e.g. a left-pad token, gets ``kv_start - 1``). The mask these parameters describe is then rebuilt
    and compared with the given one element by element; only an exact match is returned. The simplest form
    that matches is preferred: contract default positions, then non-causal, then explicit ``q_positions``
    (only if ``allow_q_positions``; the CUDA kernel has no ``q_positions``).

    Returns:
        the parameters, or None when the mask has a pattern the contract cannot express (sliding windows,
        packed sequences, per-head masks, additive biases): the caller must fall back to a dense-mask path.
    """
    if attention_mask is None:
        if not is_causal:
            return KernelMaskParams(causal=False)
        if q_len == 1 or q_len == k_len:
            return KernelMaskParams(causal=True)
        if q_len < k_len:
            return KernelMaskParams(causal=True, key_len=q_len)
        return None
    if attention_mask.shape[-2:] != (q_len, k_len):
        return None
    allowed = allowed_from_mask(attention_mask, batch)
    if allowed is None:
        return None

    device = allowed.device
    cols = torch.arange(k_len, device=device, dtype=torch.int32)
    rows = torch.arange(q_len, device=device, dtype=torch.int32)

    # Per row: the range of keys any query attends. A fully masked row gets the empty range [0, 0).
    any_key = allowed.any(dim=1)  # [B, Lk]
    row_nonempty = any_key.any(dim=1)  # [B]
    first = any_key.to(torch.uint8).argmax(dim=1).to(torch.int32)
    last = (k_len - 1) - any_key.flip(1).to(torch.uint8).argmax(dim=1).to(torch.int32)
    kv_start = torch.where(row_nonempty, first, 0)
    kv_len = torch.where(row_nonempty, last + 1, 0)

    # Per query: the last key it attends, or kv_start - 1 (attends nothing).
    q_nonempty = allowed.any(dim=2)  # [B, Lq]
    q_last = (k_len - 1) - allowed.flip(2).to(torch.uint8).argmax(dim=2).to(torch.int32)
    q_pos = torch.where(q_nonempty, q_last, (kv_start - 1)[:, None])

    rebuilt = (
        (cols[None, None, :] >= kv_start[:, None, None])
        & (cols[None, None, :] < kv_len[:, None, None])
        & (cols[None, None, :] <= q_pos[:, :, None])
    )
    # The one full-size comparison. It and the .tolist() below sync with the host, which the per-mask cache
    # (FlashKernelBackend) limits to once per forward rather than once per layer.
    exact = torch.equal(rebuilt, allowed)
    if not exact:
        return None

    # Simpler equivalent forms, checked on [B, Lq] only: under causal masking with positions p, query i
    # attends keys [kv_start, min(p_i, kv_len - 1)], empty when that upper end is below kv_start.
    row_empty = ~row_nonempty[:, None]
    default_pos = (k_len - q_len) + rows[None, :]
    default_end = torch.minimum(default_pos, kv_len[:, None] - 1)
    default_ok = torch.where(
        q_nonempty, default_end == q_pos, (default_end < kv_start[:, None]) | row_empty
    ).all()
    noncausal_ok = torch.where(q_nonempty, q_pos == kv_len[:, None] - 1, row_empty).all()
    start_zero = (kv_start == 0).all()
    len_full = (kv_len == k_len).all()
    default_ok, noncausal_ok, start_zero, len_full = torch.stack(
        [default_ok, noncausal_ok, start_zero, len_full]
    ).tolist()

    ks = None if start_zero else kv_start
    kl = None if len_full else kv_len
    if default_ok:
        return KernelMaskParams(causal=True, kv_start=ks, kv_len=kl)
    if noncausal_ok:
        return KernelMaskParams(causal=False, kv_start=ks, kv_len=kl)
    if allow_q_positions:
        return KernelMaskParams(causal=True, q_positions=q_pos.contiguous(), kv_start=ks, kv_len=kl)
    return None


class MaskParamsCache:
    """Translations of the last few masks, keyed by tensor identity.

    transformers builds one mask per forward and hands the same tensor to every layer, so the translation
    (and its verification, which syncs with the host) runs once per forward instead of once per layer.
    Entries hold a weak reference: a freed mask whose id() is reused cannot hit a stale entry.
    """

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._entries: OrderedDict[tuple, tuple[weakref.ref, KernelMaskParams | None]] = OrderedDict()

    def get_or_compute(self, mask: torch.Tensor, key_extra: tuple, compute: Callable[[], Any]) -> Any:
        # Inference tensors (masks built under torch.inference_mode, as in the engine) track no version;
        # the weak reference below still guards against a reused id().
        version = -1 if mask.is_inference() else mask._version
        key = (id(mask), version, *key_extra)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is mask:
            self._entries.move_to_end(key)
            return hit[1]
        value = compute()
        try:
            ref = weakref.ref(mask)
        except TypeError:  # not weak-referenceable: do not cache
            return value
        self._entries[key] = (ref, value)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return value
