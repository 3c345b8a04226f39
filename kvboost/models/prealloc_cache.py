"""A DynamicCache whose layers write into preallocated buffers, at the end or at given positions.

HF's ``DynamicLayer.update`` does ``torch.cat([keys, new])`` on every forward: assembling a cached
prefix and then prefilling a suffix copies the prefix twice, and every decode step copies the whole
cache again (O(n) per token). The engine knows the final length in advance (prompt + max new tokens),
so it allocates one buffer ``[layers, kv_heads, capacity, head_dim]`` per K and V, writes the reused
chunks straight into it, and lets each layer append in place. Layers see views of the filled part.
The numbers are the same ones HF computes; only the copies go.

Layer-wise execution (content reuse, ``kvboost.models.layerwise``) computes a *subset* of positions in a
layer whose other rows are already filled (cached, re-rotated): ``PreallocatedLayer.write_at(positions,
visible)`` makes the layer's next ``update`` write the fresh rows at those positions and return the first
``visible`` rows, instead of appending. transformers 5.x passes no ``cache_position`` to ``update``, so the
positions are set on the layer just before it runs.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` over a slice of a shared buffer ``[1, kv_heads, capacity, head_dim]``.

    It grows (doubling, one copy) if a forward goes past the capacity, and adopts a fresh buffer if
    some HF method replaced ``keys`` with a tensor of its own (``reorder_cache``, ``batch_select``...).
    """

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int = 0) -> None:
        super().__init__()
        self._kbuf, self._vbuf = key_buffer, value_buffer
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self.is_initialized = True
        self._write: tuple[torch.Tensor, int] | None = None
        self.set_length(length)

    def _owns_views(self) -> bool:
        # Identity, not data_ptr: an empty view (length 0) may report a null data pointer.
        return self.keys is self._views[0] and self.values is self._views[1]

    def write_at(self, positions: torch.Tensor, visible: int) -> None:
        """Make the next ``update`` write its rows at ``positions`` (int64, on the buffer's device) and return
        rows ``[0, visible)`` (every row below ``visible`` must be filled by then)."""
        if visible > self._kbuf.shape[-2]:
            raise ValueError(f"cannot expose {visible} rows of a {self._kbuf.shape[-2]}-row cache buffer")
        self._write = (positions, visible)

    def set_length(self, length: int) -> None:
        """Expose rows ``[0, length)`` (filled by the caller) as the layer's keys/values."""
        self.keys = self._kbuf[:, :, :length]
        self.values = self._vbuf[:, :, :length]
        self._views = (self.keys, self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._write is not None:
            positions, visible = self._write
            self._write = None
            self._kbuf.index_copy_(2, positions, key_states)
            self._vbuf.index_copy_(2, positions, value_states)
            self.set_length(visible)
            return self.keys, self.values
        length = self.keys.shape[-2]
        need = length + key_states.shape[-2]
        if not self._owns_views() or need > self._kbuf.shape[-2] or key_states.shape[0] != self._kbuf.shape[0]:
            capacity = max(need, 2 * self._kbuf.shape[-2])
            shape = (key_states.shape[0], key_states.shape[1], capacity, key_states.shape[-1])
            kbuf = key_states.new_empty(shape)
            vbuf = value_states.new_empty(shape[:-1] + (value_states.shape[-1],))
            kbuf[:, :, :length] = self.keys
            vbuf[:, :, :length] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[:, :, length:need] = key_states
        self._vbuf[:, :, length:need] = value_states
        self.set_length(need)
        return self.keys, self.values


class PreallocatedKV:
    """One request's KV: stacked buffers ``[layers, kv_heads, capacity, head_dim]`` and the cache over them.

    ``write(start, keys, values)`` fills rows with stacked KV (reused chunks); ``set_length(n)`` exposes the
    first ``n`` rows to the model; ``cache`` is what the model takes as ``past_key_values``.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.cache = DynamicCache()
        for layer_idx in range(keys.shape[0]):
            self.cache.layers.append(PreallocatedLayer(keys[layer_idx].unsqueeze(0), values[layer_idx].unsqueeze(0)))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def layers(self) -> list[PreallocatedLayer]:
        return self.cache.layers  # type: ignore[return-value]

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        t = keys.shape[2]
        if start + t > self.capacity:
            raise ValueError(f"rows {start}:{start + t} do not fit a {self.capacity}-row cache")
        self.keys[:, :, start : start + t] = keys
        self.values[:, :, start : start + t] = values

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.set_length(length)

    def length(self) -> int:
        return self.cache.get_seq_length() if self.layers else 0

    def slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows ``[start, end)`` of every layer, stacked ``[layers, kv_heads, end - start, head_dim]``.

        Reads each layer's current tensors (a layer that grew past the capacity owns a new buffer).
        """
        keys = torch.stack([layer.keys[0, :, start:end] for layer in self.layers])
        values = torch.stack([layer.values[0, :, start:end] for layer in self.layers])
        return keys, values


def allocate_kv(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    capacity: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    new_capacity: int | None = None,
) -> PreallocatedKV:
    """A :class:`PreallocatedKV` of at least ``capacity`` rows, reusing ``buffers`` when they are large enough
    (else new buffers of ``new_capacity`` rows, default ``capacity``).

    Reusing a previous request's buffers matters on CPU: a fresh allocation of this size is served by new
    pages from the OS, and faulting them in costs more than the copy itself (~86 ms for 4k tokens of
    SmolLM2, vs ~6 ms when the pages are reused).
    """
    shape = (num_layers, num_kv_heads, capacity, head_dim)
    if (
        buffers is not None
        and buffers[0].shape[:2] == shape[:2]
        and buffers[0].shape[3] == head_dim
        and buffers[0].shape[2] >= capacity
        and buffers[0].dtype == dtype
        and buffers[0].device == device
    ):
        kbuf, vbuf = buffers
    else:
        if new_capacity is not None and new_capacity < capacity:
            raise ValueError(f"new_capacity {new_capacity} is below the {capacity} rows asked for")
        kbuf = torch.empty((*shape[:2], new_capacity or capacity, shape[3]), dtype=dtype, device=device)
        vbuf = torch.empty_like(kbuf)
    return PreallocatedKV(kbuf, vbuf)
