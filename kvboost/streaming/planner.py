"""The ``streaming:`` config and the memory planner.

Config fields (``KVBoost.from_pretrained(path, streaming={...})`` or ``kvboost/configs/streaming/*.yaml``):

- ``resident_layers: K``: the first K decoder layers stay resident; or
- ``resident_first: F`` / ``resident_last: L``: the first F and the last L layers stay resident; or
- ``budget: "200MiB"`` (bytes, or a string with a KiB/MiB/GiB suffix) alone: the planner keeps as many of the
  first layers resident as the budget allows. With explicit resident layers the budget is checked instead.
- ``slots`` (default 2): staging slots, each sized for the largest streamed layer, reused round-robin.
- ``prefetch`` (default ``auto``): load the next streamed layer into the next slot while the current one computes
  (a thread on CPU, a CUDA stream on GPU). Needs ``slots >= 2`` to overlap anything: with one slot the next
  layer can only be loaded once the current one is done, which is what ``prefetch: false`` does. ``auto`` is on
  for a CUDA device, and on CPU only when the machine has a core beyond torch's compute threads: otherwise the
  loader thread takes a compute core and prefetch is slower than loading in line (measured on 2 cores: AWQ
  half streamed 19.1 tok/s with prefetch, 33.9 without; `experiments/results/streaming/`).
- ``source``: where streamed weights come from: ``mmap`` (CPU default: read from the safetensors files on
  demand), ``pinned`` (GPU default: a page-locked host copy, copied asynchronously), ``resident`` (a plain host
  copy; for tests and comparisons), ``auto``.
- ``kv_tokens`` (default 1024): tokens of KV the planner reserves in the budget.
- ``prepack`` (default true): streamed AWQ layers on CPU in bf16/fp16 stream torch's int4-kernel layout from a
  sidecar written once (:mod:`kvboost.streaming.int4pack_sidecar`) instead of AutoAWQ's (repacked per forward).

What the planner counts: resident bytes (embeddings, final norm, head, resident layers; tied tensors once) +
``slots`` x the largest streamed layer + KV for ``kv_tokens``. On CPU the process's RSS adds the Python and
torch runtime (a few hundred MiB) on top: the budget is for the model's own bytes.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SOURCES = ("auto", "mmap", "pinned", "resident")


class StreamingBudgetError(ValueError):
    """The budget cannot hold what must stay resident (the message gives the numbers)."""


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class StreamingConfig:
    """A validated ``streaming:`` config (see the module docstring)."""

    resident_layers: int | None = None
    resident_first: int | None = None
    resident_last: int | None = None
    budget: int | None = None
    slots: int = 2
    prefetch: bool | str = "auto"
    source: str = "auto"
    kv_tokens: int = 1024
    prepack: bool = True

    @classmethod
    def parse(cls, spec: Any) -> StreamingConfig | None:
        """``None``, ``"none"``, ``{"name": "none"}`` or ``False`` -> ``None`` (streaming off); a dict (or a
        :class:`StreamingConfig`) -> a checked config. Unknown fields and bad values raise ``ValueError``."""
        if isinstance(spec, StreamingConfig):
            spec = asdict(spec)
        if spec is None or spec is False or spec == "none":
            return None
        if not isinstance(spec, dict):
            if type(spec).__module__.startswith("omegaconf"):
                from omegaconf import OmegaConf

                spec = OmegaConf.to_container(spec, resolve=True)
            else:
                raise ValueError(f"streaming: expected a dict of fields or 'none', got {spec!r}")
        spec = dict(spec)
        name = spec.pop("name", "on")
        if name == "none":
            return None
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise ValueError(f"streaming: unknown field(s) {unknown}; accepted: {', '.join(['name', *known])}")
        cfg = cls(**{k: v for k, v in spec.items() if v is not None or k in ("budget",)})
        cfg._check()
        return cfg

    def _check(self) -> None:
        from kvboost.kv.sizing import parse_bytes

        for name in ("resident_layers", "resident_first", "resident_last"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"streaming.{name} must be a non-negative integer, got {value!r}")
        if self.resident_layers is not None and (self.resident_first is not None or self.resident_last is not None):
            raise ValueError("streaming: give resident_layers (the first K) or resident_first/resident_last, not both")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"streaming.slots must be an integer >= 1, got {self.slots!r}")
        if not isinstance(self.prefetch, bool) and self.prefetch != "auto":
            raise ValueError(f"streaming.prefetch must be true, false or 'auto', got {self.prefetch!r}")
        if not isinstance(self.prepack, bool):
            raise ValueError(f"streaming.prepack must be true or false, got {self.prepack!r}")  # noqa: TRY004
        if self.source not in SOURCES:
            raise ValueError(f"streaming.source must be one of {SOURCES}, got {self.source!r}")
        if isinstance(self.kv_tokens, bool) or not isinstance(self.kv_tokens, int) or self.kv_tokens < 0:
            raise ValueError(f"streaming.kv_tokens must be a non-negative integer, got {self.kv_tokens!r}")
        if self.budget is not None:
            try:
                self.budget = parse_bytes(self.budget)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"streaming.budget: {exc}") from None
            if self.budget <= 0:
                raise ValueError(f"streaming.budget must be positive, got {self.budget!r}")
        if (
            self.budget is None
            and self.resident_layers is None
            and self.resident_first is None
            and self.resident_last is None
        ):
            raise ValueError(
                "streaming: say what stays resident: resident_layers, resident_first/resident_last, or a budget"
            )

    def resolve_prefetch(self, device_type: str) -> bool:
        """``prefetch`` with ``auto`` decided for ``device_type`` (see the module docstring)."""
        if self.prefetch != "auto":
            return bool(self.prefetch)
        if device_type == "cuda":
            return True
        import torch

        return (os.cpu_count() or 1) > torch.get_num_threads()

    def resolve_source(self, device_type: str) -> str:
        if self.source != "auto":
            if self.source == "pinned" and device_type != "cuda":
                raise ValueError("streaming.source='pinned' stages weights for a CUDA device; on CPU use 'mmap'")
            return self.source
        return "pinned" if device_type == "cuda" else "mmap"


@dataclass
class StreamingPlan:
    """Which layers stay resident and what the model's weights, staging slots and KV take (bytes)."""

    num_layers: int
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    base_bytes: int  # embeddings, final norm, head (everything outside the decoder layers)
    layer_bytes: tuple[int, ...]
    slots: int
    slot_bytes: int  # one staging slot: the largest streamed layer
    kv_bytes: int
    kv_tokens: int
    budget: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def resident_bytes(self) -> int:
        return self.base_bytes + sum(self.layer_bytes[i] for i in self.resident)

    @property
    def staging_bytes(self) -> int:
        return self.slots * self.slot_bytes if self.streamed else 0

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.staging_bytes + self.kv_bytes

    @property
    def full_bytes(self) -> int:
        return self.base_bytes + sum(self.layer_bytes)

    def describe(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers, "resident_layers": list(self.resident), "streamed_layers": list(self.streamed),
            "base_bytes": self.base_bytes, "resident_bytes": self.resident_bytes, "slots": self.slots,
            "slot_bytes": self.slot_bytes, "staging_bytes": self.staging_bytes, "kv_tokens": self.kv_tokens,
            "kv_bytes": self.kv_bytes, "total_bytes": self.total_bytes, "full_model_bytes": self.full_bytes,
            "budget": self.budget, "notes": list(self.notes),
        }  # fmt: skip

    def breakdown(self) -> str:
        """The numbers, in words (used in errors)."""
        layers = [self.layer_bytes[i] for i in self.resident]
        per = f" ({_mib(max(layers))} each at most)" if layers else ""
        return (
            f"embeddings/norm/head {_mib(self.base_bytes)} + {len(self.resident)} resident layer(s){per} "
            f"{_mib(sum(layers))} = resident {_mib(self.resident_bytes)}; + {self.slots} staging slot(s) x "
            f"{_mib(self.slot_bytes)} = {_mib(self.staging_bytes)}; + KV for {self.kv_tokens} tokens "
            f"{_mib(self.kv_bytes)}; total {_mib(self.total_bytes)}"
        )


def plan_streaming(
    cfg: StreamingConfig, *, base_bytes: int, layer_bytes: list[int] | tuple[int, ...], kv_bytes_per_token: int
) -> StreamingPlan:
    """Choose the resident layers and check the budget; :class:`StreamingBudgetError` (with the numbers) when the
    budget cannot hold the resident part, ``ValueError`` for resident counts over the number of layers."""
    n = len(layer_bytes)
    kv_bytes = cfg.kv_tokens * kv_bytes_per_token

    def make(resident: list[int]) -> StreamingPlan:
        resident_set = set(resident)
        streamed = tuple(i for i in range(n) if i not in resident_set)
        slot = max((layer_bytes[i] for i in streamed), default=0)
        return StreamingPlan(
            num_layers=n, resident=tuple(sorted(resident_set)), streamed=streamed, base_bytes=base_bytes,
            layer_bytes=tuple(layer_bytes), slots=cfg.slots, slot_bytes=slot, kv_bytes=kv_bytes,
            kv_tokens=cfg.kv_tokens, budget=cfg.budget,
        )  # fmt: skip

    if cfg.resident_layers is not None:
        if cfg.resident_layers > n:
            raise ValueError(f"streaming.resident_layers={cfg.resident_layers} but the model has {n} decoder layers")
        plan = make(list(range(cfg.resident_layers)))
    elif cfg.resident_first is not None or cfg.resident_last is not None:
        first, last = cfg.resident_first or 0, cfg.resident_last or 0
        if first + last > n:
            raise ValueError(
                f"streaming: resident_first={first} + resident_last={last} is more than the model's {n} decoder layers"
            )
        plan = make(list(range(first)) + list(range(n - last, n)))
    else:  # budget alone: as many of the first layers as fit
        assert cfg.budget is not None
        plan = make([])
        if plan.total_bytes > cfg.budget:
            raise StreamingBudgetError(
                f"streaming budget {_mib(cfg.budget)} cannot hold even the smallest streamed setup: {plan.breakdown()}"
            )
        for k in range(1, n + 1):
            candidate = make(list(range(k)))
            if candidate.total_bytes > cfg.budget:
                break
            plan = candidate
    if cfg.budget is not None and plan.total_bytes > cfg.budget:
        raise StreamingBudgetError(
            f"streaming budget {_mib(cfg.budget)} cannot hold the resident part: {plan.breakdown()} "
            f"(over by {_mib(plan.total_bytes - cfg.budget)}); lower resident layers, slots or kv_tokens, or raise the budget"
        )
    if not plan.streamed:
        plan.notes.append("every layer is resident: nothing is streamed")
    if cfg.prefetch is True and cfg.slots < 2 and plan.streamed:
        plan.notes.append("prefetch needs 2 or more slots to overlap loads with compute; with 1 slot it has no effect")
    return plan
