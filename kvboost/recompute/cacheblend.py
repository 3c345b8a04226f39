"""CacheBlend (Yao et al., EuroSys 2025): recompute the tokens whose K/V deviate most, found at an early layer.

All non-exact tokens are computed through the check layer(s) (default layer 1: layer 0's K/V depend only on
the token and its position, so after re-rotation they never deviate). There the engine compares each content
token's fresh K/V with its cached one; the top ``ratio`` of them by deviation (high-KV-deviation tokens) are
kept, and every later layer computes only those plus the new tokens, reusing the cached K/V of the rest. The
cost therefore scales with ``ratio`` (measured as ``recompute_ratio``; the check layers are reported apart).
The paper reports ~15% recomputed tokens keeping quality within ~0.02 F1 / Rouge-L of a full prefill at
2.2-3.3x lower TTFT.

Gradual filtering (optional): several check layers with non-increasing ``ratios`` narrow the set step by step
(e.g. ``check_layers: [1, 2]``, ``ratios: [0.3, 0.15]``).
"""

from __future__ import annotations

import torch

from kvboost.plan import ReusePlan
from kvboost.recompute.base import ScoredStrategy, check_flag, check_fraction
from kvboost.registry import RECOMPUTE

DEVIATIONS = ("kv", "key", "value")


@RECOMPUTE.register("cacheblend")
class CacheBlend(ScoredStrategy):
    """Selective recomputation of high-KV-deviation tokens (scored: the deviation at each check layer).

    Args:
        ratio: fraction of content-hit tokens recomputed after the (last) check layer.
        check_layers: layers after which tokens are ranked (0-based; default ``[1]``).
        ratios: optional per-check-layer fractions (non-increasing, the last equal to ``ratio``) for gradual
            filtering; default: ``ratio`` at every check layer.
        deviation: what is compared: ``kv`` (squared error of keys plus values), ``key`` or ``value``.
        oracle_agreement: also judge each selection against the oracle's (``oracle_recall``,
            ``oracle_rank_corr`` of the deviation at the last check layer; costs a full prefill, kept out of TTFT).
    """

    def __init__(
        self,
        ratio: float = 0.15,
        check_layers: list[int] | tuple[int, ...] = (1,),
        ratios: list[float] | None = None,
        deviation: str = "kv",
        oracle_agreement: bool = False,
    ) -> None:
        self.oracle_agreement = check_flag("cacheblend", "oracle_agreement", oracle_agreement)
        self.ratio = check_fraction("cacheblend", "ratio", ratio)
        layers = tuple(int(x) for x in check_layers)
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(f"recompute strategy 'cacheblend': check_layers must be sorted unique layers >= 0, got {check_layers!r}")
        if ratios is None:
            ratios = [self.ratio] * len(layers)
        ratios = [check_fraction("cacheblend", "ratios", r) for r in ratios]
        if len(ratios) != len(layers) or any(b > a for a, b in zip(ratios, ratios[1:])) or abs(ratios[-1] - self.ratio) > 1e-9:
            raise ValueError(
                "recompute strategy 'cacheblend': ratios needs one non-increasing fraction per check layer, the last "
                f"equal to ratio ({self.ratio}); got {ratios!r} for check_layers {list(layers)}"
            )
        if deviation not in DEVIATIONS:
            raise ValueError(f"recompute strategy 'cacheblend': deviation must be one of {DEVIATIONS}, got {deviation!r}")
        self.check_layers, self.ratios, self.deviation = layers, dict(zip(layers, ratios)), deviation

    def check_model(self, num_layers: int) -> None:
        if self.check_layers[-1] >= num_layers - 1:
            raise ValueError(
                f"recompute strategy 'cacheblend': check layer {self.check_layers[-1]} leaves no later layer to save "
                f"(the model has {num_layers} layers); set recompute.check_layers to layers below {num_layers - 1}"
            )

    def fraction(self, plan: ReusePlan, candidates: torch.Tensor, layer: int | None = None) -> float:
        # Fractions are of the prompt's content tokens, not of the candidate set (which shrinks when filtering).
        return min(1.0, self.ratios[layer] * plan.content_tokens / max(1, candidates.numel()))

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        if deviation is None:
            raise ValueError("recompute strategy 'cacheblend' scores at its check layers only (needs the deviation)")
        return deviation["key"] + deviation["value"] if self.deviation == "kv" else deviation[self.deviation]

    def fingerprint(self) -> str:
        return f"cacheblend:{self.ratio}:{list(self.check_layers)}:{self.deviation}"
