"""The layer streamer: non-resident decoder layers borrow their weights from staging slots for one forward.

A streamed layer owns no storage: its parameters (and persistent buffers, e.g. AWQ's ``qweight``) are
placeholders on the ``meta`` device. Each staging slot is one preallocated byte buffer sized for the largest
streamed layer; a layer's tensors are fixed views into it (64-byte aligned), built once per (slot, layer) and
reused. Slots are reused round-robin.

Per streamed layer ``i`` (hooks on the layer module):

- forward pre-hook: find the slot holding layer ``i`` (loaded by an earlier prefetch; else load it now), wait
  for its load to finish, point the module's parameters at the slot's views, and, with ``prefetch``, start
  loading the next streamed layer (wrapping around to the first: the next token needs it) into another slot, on
  a background thread (CPU) or a side CUDA stream (GPU), while layer ``i`` computes.
- forward hook (``always_call``: also when the forward raises): put the placeholders back; on GPU record an event
  so the slot is not overwritten before the kernels that read it ran.

Why the parameters are swapped by assigning into the module's ``_parameters`` / ``_buffers`` dicts (prebuilt
``nn.Parameter`` views of the slot, and the meta placeholders back afterwards) and not with ``param.data = ...``
or ``torch.utils.swap_tensors``: no tensor is mutated, so it is the same under ``torch.inference_mode``,
``no_grad`` or grad mode (``.data`` assignment and ``swap_tensors`` change tensor metadata in place, which
inference mode and weak references restrict); version counters do not move, so the model's parameter signature
(``kvboost.models.fingerprint``) is the same before and after every forward; and the loader thread only ever
writes slot buffers, never module state. A layer not being run holds only its placeholders.

The background thread is a single worker: every read of the files goes through it in order (synchronous loads
too, when prefetch is on), so two loads never race for a slot, and a later load into a slot runs after an
earlier, unused one.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvboost.streaming.source import WeightSource

_ALIGN = 64


@dataclass
class _Tensor:
    module: nn.Module
    attr: str
    is_param: bool
    name: str  # checkpoint (state_dict) name
    placeholder: torch.Tensor
    offset: int
    nbytes: int


@dataclass
class _Slot:
    index: int
    buffer: torch.Tensor
    layer: int | None = None
    future: Future | None = None
    ready: Any = None  # torch.cuda.Event: the load finished (GPU)
    free: Any = None  # torch.cuda.Event: the compute that read it finished (GPU)
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layer_tensors(layer: nn.Module) -> list[tuple[nn.Module, str, bool, str]]:
    """(module, attribute, is_parameter, local name) of every parameter and persistent buffer of ``layer``."""
    out = []
    for mod_name, mod in layer.named_modules():
        prefix = mod_name + "." if mod_name else ""
        for name, p in mod._parameters.items():
            if p is not None:
                out.append((mod, name, True, prefix + name))
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out.append((mod, name, False, prefix + name))
    return out


def layer_nbytes(layer: nn.Module) -> int:
    """Bytes of one layer's tensors laid out in a staging slot (each 64-byte aligned)."""
    total = 0
    for mod, attr, is_param, _ in layer_tensors(layer):
        t = (mod._parameters if is_param else mod._buffers)[attr]
        total += -(-_nbytes(t) // _ALIGN) * _ALIGN
    return total


class LayerStreamer:
    """Streams the weights of ``streamed`` layers of ``layers`` (an ``nn.ModuleList``) from ``source``.

    Args:
        layers: the decoder layers; ``layers_name`` is their qualified name in the model (``model.layers``).
        streamed: indices of the layers to stream; their tensors must be placeholders on ``meta``.
        source: reads checkpoint tensors by name (:mod:`kvboost.streaming.source`).
        slots: staging slots (>= 1). prefetch: load the next layer ahead (needs 2+ slots to overlap).
        device: where the slots live (the model's device).
        trace: record ``(time_ns, event, layer)`` events (``load_queued``/``load_start``/``load_end``/
            ``compute_start``/``compute_end``) in :attr:`events`, for tests and benchmarks.
    """

    def __init__(
        self,
        layers: nn.ModuleList,
        layers_name: str,
        streamed: tuple[int, ...] | list[int],
        source: WeightSource,
        *,
        slots: int = 2,
        prefetch: bool = True,
        device: torch.device | str = "cpu",
        trace: bool = False,
    ) -> None:
        if slots < 1:
            raise ValueError(f"streaming needs at least one staging slot, got {slots}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.source = source
        self.streamed = tuple(streamed)
        self.prefetch = bool(prefetch)
        self.overlap = self.prefetch and slots >= 2
        self.events: list[tuple[int, str, int]] = []
        self.trace = trace
        self.stats = {"loads": 0, "loaded_bytes": 0, "prefetched": 0, "sync_loads": 0, "wait_s": 0.0, "load_s": 0.0}
        self._lock = threading.Lock()
        self._tensors: dict[int, list[_Tensor]] = {}
        self._next: dict[int, int] = {}
        slot_bytes = 0
        for pos, i in enumerate(self.streamed):
            layer = layers[i]
            entries, offset = [], 0
            for mod, attr, is_param, local in layer_tensors(layer):
                t = (mod._parameters if is_param else mod._buffers)[attr]
                if t.device.type != "meta":
                    raise ValueError(f"streamed layer {i}: {local} holds storage; build streamed layers on 'meta'")
                entries.append(_Tensor(mod, attr, is_param, f"{layers_name}.{i}.{local}", t, offset, _nbytes(t)))
                offset += -(-_nbytes(t) // _ALIGN) * _ALIGN
            for mod in layer.modules():
                for name in mod._non_persistent_buffers_set:
                    b = mod._buffers.get(name)
                    if b is not None and b.device.type == "meta":
                        raise ValueError(
                            f"streamed layer {i}: non-persistent buffer {name!r} is on meta (cannot be streamed)"
                        )
            self._tensors[i] = entries
            self._next[i] = self.streamed[(pos + 1) % len(self.streamed)]
            slot_bytes = max(slot_bytes, offset)
        self.slot_bytes = slot_bytes
        self.slots = [_Slot(s, torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)) for s in range(slots)]
        # Every (slot, layer) view is built now, outside inference mode: a view made under inference mode would be
        # an inference tensor that the loader thread (not in inference mode) may not write into.
        with torch.inference_mode(False):
            for slot in self.slots:
                for i in self.streamed:
                    self._views(slot, i)
        self._rr = 0
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        if self.cuda:  # pragma: no cover - no GPU in CI
            self._stream = torch.cuda.Stream(device=self.device)
        elif self.prefetch:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvboost-stream")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        self._handles = []
        for i in self.streamed:
            layer = layers[i]
            layer._kvboost_stream_index = i
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook))
            self._handles.append(layer.register_forward_hook(self._post_hook, always_call=True))
        # Modules that cache a form derived from their weights (kvboost.models.awq.AWQLinear._int4pack): dropped
        # after each forward, or each streamed layer would keep a full copy of its weights.
        self._derived = {i: [m for m in layers[i].modules() if hasattr(m, "_int4pack")] for i in self.streamed}
        self._by_name = {t.name: t for entries in self._tensors.values() for t in entries}

    # ------------------------------------------------------------------ public
    def owns(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` belongs to a streamed layer."""
        return name in self._by_name

    def resolve(self, name: str, placeholder: torch.Tensor) -> torch.Tensor:
        """The real value (CPU, the placeholder's dtype) of a streamed tensor, read from the source: what the
        fingerprint digests in place of the meta placeholder."""
        t = self._by_name.get(name)
        if t is None or t.placeholder is not placeholder:
            raise ValueError(f"{name!r} is not a streamed tensor of this model")
        return self.source.read(name, placeholder.dtype)

    def info(self) -> dict[str, Any]:
        return {
            "streamed_layers": list(self.streamed), "slots": len(self.slots), "slot_bytes": self.slot_bytes,
            "prefetch": self.prefetch, "overlap": self.overlap, "source": self.source.name, **self.stats,
        }  # fmt: skip

    def close(self) -> None:
        """Remove the hooks and stop the loader thread (the streamed layers cannot run afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        i = module._kvboost_stream_index
        slot = self._acquire(i)
        views = slot.views[i]
        for t, v in zip(self._tensors[i], views):
            (t.module._parameters if t.is_param else t.module._buffers)[t.attr] = v
        if self.overlap:
            nxt = self._next[i]
            if nxt != i and self._slot_of(nxt) is None:
                self._load_into(self._victim(avoid=slot), nxt, prefetch=True)
        self._event("compute_start", i)

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        i = module._kvboost_stream_index
        self._event("compute_end", i)
        for t in self._tensors[i]:
            (t.module._parameters if t.is_param else t.module._buffers)[t.attr] = t.placeholder
        for mod in self._derived[i]:  # forms derived from the weights (AWQ's int4pack) would keep a full copy
            mod._int4pack = None
        if self.cuda:  # pragma: no cover
            slot = self._slot_of(i)
            if slot is not None:
                slot.free = torch.cuda.Event()
                slot.free.record(torch.cuda.current_stream(self.device))

    # ------------------------------------------------------------------ slots
    def _event(self, kind: str, layer: int) -> None:
        if self.trace:
            self.events.append((time.perf_counter_ns(), kind, layer))

    def _slot_of(self, layer: int) -> _Slot | None:
        for slot in self.slots:
            if slot.layer == layer:
                return slot
        return None

    def _victim(self, avoid: _Slot | None) -> _Slot:
        for _ in range(len(self.slots)):
            self._rr = (self._rr + 1) % len(self.slots)
            slot = self.slots[self._rr]
            if slot is not avoid:
                return slot
        raise RuntimeError("no free staging slot")  # only with 1 slot and avoid set; callers prevent it

    def _views(self, slot: _Slot, layer: int) -> list[torch.Tensor]:
        views = slot.views.get(layer)
        if views is None:
            views = []
            for t in self._tensors[layer]:
                v = slot.buffer[t.offset : t.offset + t.nbytes].view(t.placeholder.dtype).view(t.placeholder.shape)
                views.append(nn.Parameter(v, requires_grad=False) if t.is_param else v)
            slot.views[layer] = views
        return views

    def _acquire(self, layer: int) -> _Slot:
        slot = self._slot_of(layer)
        if slot is None:
            slot = self._victim(avoid=None)
            self._load_into(slot, layer, prefetch=False)
        t0 = time.perf_counter()
        self._wait(slot)
        self.stats["wait_s"] += time.perf_counter() - t0
        return slot

    def _load_into(self, slot: _Slot, layer: int, *, prefetch: bool) -> None:
        slot.layer = layer
        views = self._views(slot, layer)
        self.stats["prefetched" if prefetch else "sync_loads"] += 1
        self._event("load_queued", layer)
        if self.cuda:  # pragma: no cover - written for GPUs, not testable here
            stream = self._stream
            if slot.free is not None:
                stream.wait_event(slot.free)
            with torch.cuda.stream(stream):
                self._load(layer, views, non_blocking=True)
                slot.ready = torch.cuda.Event()
                slot.ready.record(stream)
        elif self._executor is not None:
            slot.future = self._executor.submit(self._load, layer, views)
        else:
            self._load(layer, views)

    def _wait(self, slot: _Slot) -> None:
        if slot.future is not None:
            slot.future.result()  # re-raises a read error in this thread
            slot.future = None
        if self.cuda and slot.ready is not None:  # pragma: no cover
            torch.cuda.current_stream(self.device).wait_event(slot.ready)

    def _load(self, layer: int, views: list[torch.Tensor], non_blocking: bool = False) -> None:
        self._event("load_start", layer)
        t0 = time.perf_counter()
        with torch.no_grad():
            for t, v in zip(self._tensors[layer], views):
                self.source.read_into(t.name, v.data if isinstance(v, nn.Parameter) else v, non_blocking=non_blocking)
        with self._lock:
            self.stats["loads"] += 1
            self.stats["loaded_bytes"] += sum(t.nbytes for t in self._tensors[layer])
            self.stats["load_s"] += time.perf_counter() - t0
        self._event("load_end", layer)
