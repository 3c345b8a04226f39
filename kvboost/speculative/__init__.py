"""Speculative decoding (``DRAFT`` registry, config group ``speculative=``): none, prompt_lookup, draft_model,
layer_skip; the target verifies drafts in one forward over the request's cache (``verify``)."""

from kvboost.speculative.base import Draft, DraftLength, DraftRequest, DraftStrategy
from kvboost.speculative.draft_model import DraftModel
from kvboost.speculative.layer_skip import LayerSkip
from kvboost.speculative.none import NoDraft
from kvboost.speculative.prompt_lookup import PromptLookup

__all__ = [
    "Draft",
    "DraftLength",
    "DraftModel",
    "DraftRequest",
    "DraftStrategy",
    "LayerSkip",
    "NoDraft",
    "PromptLookup",
]
