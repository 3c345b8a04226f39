"""One model runner over the KV pool: ``ForwardBatch`` in, logits out, for every forward the engine makes."""

from kvboost.runtime.batch import ForwardBatch, LayerHook, SeqInput

__all__ = ["ForwardBatch", "LayerHook", "SeqInput"]
