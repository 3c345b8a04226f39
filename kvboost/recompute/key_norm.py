"""Key-norm selection: recompute the content tokens whose fresh keys have the lowest L2 norm at a check layer.

After Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024,
arXiv:2406.11430; kvpress's ``KnormPress``), who found that keys of low norm draw high attention. Here that signal
ranks content tokens for recomputation instead of eviction: the tokens later queries will read most. Written from
scratch as the contract's example (README "Adding a strategy"); its fidelity has not been measured.
"""

import torch

from kvboost.recompute.base import LayerView, RecomputeStrategy, check_count, check_fraction
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("key_norm")
class KeyNorm(RecomputeStrategy):
    """The top ``ratio`` of content tokens by negated key norm (mean over KV heads) at check layer ``layer``."""

    def __init__(self, ratio: float = 0.15, layer: int = 1) -> None:
        self.ratio = check_fraction("key_norm", "ratio", ratio)
        self.check_layers = (check_count("key_norm", "layer", layer),)

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1).mean(dim=0)  # [kv_heads, C, D] -> [C]: lowest norm first

    def fingerprint(self) -> str:
        return f"key_norm:{self.ratio}:{self.check_layers[0]}"
