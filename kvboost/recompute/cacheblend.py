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

The deviation measure (``deviation``): ``value``, the reference code's (github.com/YaoJiayi/CacheBlend's
``vllm_blend`` check layer ranks tokens by the squared difference of the fresh and cached values, as issue 59 reads
it); ``key``, LMCache's CacheBlend (its blender ranks by the squared difference of the keys at the check layer);
``kv``, the sum of both (kvboost's first choice, and the default). The default has not been chosen by measured fidelity yet: issue 59 asks for it to be set
on the MuSiQue tuning split (the dev file's first 50 questions), which has not been run.

Where it departs from the paper: the check layer's ranking and the per-layer budget are the paper's; the paper's
pipelining of KV loading with recompute and its numbers are not reproduced; the fraction is of the prompt's
content-hit tokens (exact hits are never candidates).
"""

from __future__ import annotations

import torch

from kvboost.recompute.base import DEVIATION_PARTS, LayerView, RecomputeStrategy, check_flag, check_fraction
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("cacheblend")
class CacheBlend(RecomputeStrategy):
    """Selective recomputation of high-KV-deviation tokens (scored: the deviation at each check layer).

    Args:
        ratio: fraction of content-hit tokens recomputed after the (last) check layer.
        check_layers: layers after which tokens are ranked (0-based; default ``[1]``).
        ratios: optional per-check-layer fractions (non-increasing, the last equal to ``ratio``) for gradual
            filtering; default: ``ratio`` at every check layer.
        deviation: what is compared: ``value`` (the reference code's), ``key`` (LMCache's) or ``kv`` (both, summed).
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
        if deviation not in DEVIATION_PARTS:
            raise ValueError(
                f"recompute strategy 'cacheblend': deviation must be one of {DEVIATION_PARTS}, got {deviation!r}"
            )
        self.check_layers, self.check_ratios, self.deviation = layers, dict(zip(layers, ratios)), deviation

    def score(self, view: LayerView) -> torch.Tensor:
        """The candidates' K/V deviation at the check layer (the part ``deviation`` names)."""
        return view.deviation(self.deviation)

    def fingerprint(self) -> str:
        return f"cacheblend:{self.ratio}:{list(self.check_layers)}:{self.deviation}"
