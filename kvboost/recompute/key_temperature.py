"""Key temperature: no recompute; the reused chunks' keys divided by a temperature (named ``ape`` before issue 59).

It takes one of the three parts of APE (Yang, Chen and Chen, "APE: Faster and Longer Context-Augmented Generation
via Adaptive Parallel Encoding", ICLR 2025, arXiv:2502.05431), which is why it is not called APE. APE realigns the
attention over contexts encoded in parallel with (1) a shared prefix before every context, (2) an attention
temperature ``T`` on the query's logits over the context tokens, (3) a scaling factor ``S`` on the attention mass
the contexts get as a whole, and it gives every context the same positions (they are encoded in parallel after the
prefix). What runs here:

- (2), on content hits only: every content placement's keys are divided by ``temperature`` when the content rows
  are assembled (:meth:`~kvboost.recompute.base.RecomputeStrategy.content_kv`, on a copy). Attention logits are
  ``q . k`` and RoPE re-rotation is linear, so every query that reads those rows (the new tokens: the question, the
  separators, the answer being decoded) sees ``(q . k) / T`` on them. Exact hits are not tempered: in the
  shared-prefix layout passage 1 is an exact hit (stored after the same prefix) and keeps ``T = 1``, where APE
  tempers every context. With ``temperature: 1.0`` it is ``none`` bit for bit.
- (1) is the workload's layout, not a strategy's (``workload=musique workload.layout=shared_prefix``).
- (3) is not implemented: scaling the attention mass of a set of keys adds ``log S`` to their logits, a bias no
  change of cached K/V can express (``q . k`` has no constant term), and the runner has no attention-bias hook.
- APE's shared positions are not implemented: each reused chunk is re-rotated to its place in the prompt.

An entry stored with approximate KV under this strategy (rows after the first reused one, when no exact entry of
the same text is kept) was computed with tempered keys already: it is served as stored, not tempered again.
The default temperature is untuned (a starting point to sweep, not the paper's value).
"""

from __future__ import annotations

import torch

from kvboost.cache.entry import approximate_segment_key, segment_only_key
from kvboost.plan import Placement, ReusePlan
from kvboost.recompute.base import LayerView, RecomputeStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("key_temperature")
class KeyTemperature(RecomputeStrategy):
    """No recomputation; the new tokens' attention logits over the reused chunks are divided by ``temperature``.

    Args:
        temperature: ``T`` (> 0); below 1 sharpens the attention over the reused chunks, above 1 flattens it.
    """

    ratio = 0.0

    def __init__(self, temperature: float = 0.9) -> None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not float(temperature) > 0:
            raise ValueError(
                f"recompute strategy 'key_temperature': temperature must be a number > 0, got {temperature!r}"
            )
        self.temperature = float(temperature)

    def score(self, view: LayerView) -> torch.Tensor:
        return torch.zeros(view.candidates.numel())  # recomputes nothing (ratio 0)

    def token_scores(self, plan, num_layers, check=None):  # type: ignore[no-untyped-def]
        return None  # no ranking

    def already_tempered(self, plan: ReusePlan, start: int, entry_key: str | None) -> bool:
        """Whether the content placement at ``start`` came from an entry this strategy stored (tempered keys)."""
        if entry_key is None:
            return False
        for span, key in zip(plan.spans, plan.keys):
            if span.start == start:
                return entry_key == segment_only_key(approximate_segment_key(key.segment_key, self.fingerprint()))
        return False

    def content_kv(self, plan: ReusePlan, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        """The placement's keys divided by the temperature (a copy), unless this strategy stored them so."""
        keys = placement.keys
        if self.temperature != 1.0 and not self.already_tempered(plan, placement.start, placement.entry_key):
            keys = (keys.float() / self.temperature).to(keys.dtype)
        return keys, placement.values

    def fingerprint(self) -> str:
        return f"key_temperature:{self.temperature}"
