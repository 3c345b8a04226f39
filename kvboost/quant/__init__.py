"""KV quantizers. ``KV_QUANT.build("none")``."""

from kvboost.quant.base import KVPayload, KVQuantizer
from kvboost.quant.none import NoQuantizer, RawKV

__all__ = ["KVPayload", "KVQuantizer", "NoQuantizer", "RawKV"]
