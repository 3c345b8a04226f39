"""APE-style reuse: no recompute; an attention temperature on the reused (parallel-encoded) chunks.

Yang, Chen and Chen, "APE: Faster and Longer Context-Augmented Generation via Adaptive Parallel Encoding"
(ICLR 2025, arXiv:2502.05431). Contexts encoded in parallel (each on its own, KV cached) and then read together
give the query an attention distribution unlike the sequential one; APE realigns it without any recomputation by
(1) a shared prefix before every context, so no context carries sinks of its own, (2) an attention temperature
``T`` on the query's attention logits over the context tokens, and (3) a scaling factor ``S`` on the attention mass
the contexts get as a whole.

What runs here, and what cannot:

- (2) is implemented exactly: the reused chunks' keys are divided by ``temperature`` before assembly. Attention
  logits are ``q . k`` and RoPE re-rotation is linear, so every query that reads those rows (the new tokens: the
  question, the separators, the answer being decoded) sees ``(q . k) / T`` on the reused chunks' keys and the
  unchanged logits on the exact prefix and on the new tokens. Nothing is recomputed (as ``none``); with
  ``temperature: 1.0`` it is ``none`` bit for bit.
- (1) is the workload's layout, not a strategy's: kvboost stores a document after the shared prefix when the
  workload warms it so (``workload=musique``); with a document stored on its own, its first tokens keep their sink
  role (compose ``epic`` there).
- (3) is not implemented: scaling the attention mass of a set of keys adds ``log S`` to their logits, a bias no
  change of cached K/V can express (``q . k`` has no constant term), and kvboost's runner has no attention-bias hook
  (its subset-query attention is each backend's own kernel). ``S`` is 1 here.
- APE also gives every context the same position ids (they are encoded in parallel after the prefix). kvboost
  re-rotates each reused chunk to its place in the prompt (positions are the plan's), so positions stay sequential.

The temperature is applied to a copy of each content placement's keys (the cache's tensors are never written).
An entry stored with approximate KV under this strategy (rows after the first reused one, when no exact entry of
the same text is kept) was computed with tempered keys already: it is served as stored, not tempered again.
The default temperature is a starting point to sweep, not the paper's value.
"""

from __future__ import annotations

import weakref

from kvboost.cache.entry import approximate_segment_key, segment_only_key
from kvboost.plan import ComputeSchedule, ReusePlan
from kvboost.recompute.base import RecomputeStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("ape")
class AdaptiveParallelEncoding(RecomputeStrategy):
    """No recomputation; the new tokens' attention logits over the reused chunks are divided by ``temperature``.

    Args:
        temperature: ``T`` (> 0); below 1 sharpens the attention over the reused chunks, above 1 flattens it.
    """

    def __init__(self, temperature: float = 0.9) -> None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not float(temperature) > 0:
            raise ValueError(f"recompute strategy 'ape': temperature must be a number > 0, got {temperature!r}")
        self.temperature = float(temperature)
        self._tempered: weakref.WeakSet[ReusePlan] = weakref.WeakSet()

    def already_tempered(self, plan: ReusePlan, start: int, entry_key: str | None) -> bool:
        """Whether the content placement at ``start`` came from an entry this strategy stored (tempered keys)."""
        if entry_key is None:
            return False
        for span, key in zip(plan.spans, plan.keys):
            if span.start == start:
                return entry_key == segment_only_key(approximate_segment_key(key.segment_key, self.fingerprint()))
        return False

    def temper(self, plan: ReusePlan) -> None:
        """Divide each content placement's keys by the temperature (once per plan; a copy, never in place)."""
        if self.temperature == 1.0 or plan in self._tempered:
            return
        self._tempered.add(plan)
        for p in plan.placements:
            if p.kind == "content" and p.keys is not None and not self.already_tempered(plan, p.start, p.entry_key):
                p.keys = (p.keys.float() / self.temperature).to(p.keys.dtype)

    def schedule(self, plan: ReusePlan, num_layers: int) -> ComputeSchedule:
        if plan.content_tokens:
            self.temper(plan)
        return ComputeSchedule(plan.positions("new"))

    def fingerprint(self) -> str:
        return f"ape:{self.temperature}"
