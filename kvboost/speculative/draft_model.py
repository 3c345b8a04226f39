"""A separate draft model with the target's tokenizer (a smaller sibling, or a quantized copy of the target).

The draft keeps its own KV cache of the request's context. Its rows stay valid exactly as long as the context
they were computed from is unchanged: each proposal compares the context it is given with the token ids its cache
holds, keeps the common prefix (``truncate``: the rollback past a rejected token) and runs only the rest, in one
forward, before drafting token by token. The draft runs on a pool and runner of its own
(:class:`~kvboost.runtime.standalone.StandaloneRunner`): the same arithmetic as the target's. That pool holds
``sequences`` contexts (one per request drafting at once); every request's copy of the strategy has a table in it.
When it runs short, a proposal raises ``PoolExhausted`` after giving its request's draft rows back: the engine core
then decodes that request without a draft this step (it drafts again once rows are free), and the end of a request
(finish, abort, shutdown) releases its table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvboost.decoding import Sampling
from kvboost.registry import DRAFT
from kvboost.speculative.base import Draft, DraftRequest, DraftStrategy, choose_draft_token


@DRAFT.register("draft_model")
class DraftModel(DraftStrategy):
    """Another causal LM over the same vocabulary drafts the tokens.

    Args:
        model: a model folder or hub id, ``None`` for the bundled SmolLM2-135M-Instruct, or a loaded
            ``*ForCausalLM`` (tests, programmatic use). Loaded when the engine binds the strategy, not before
            (a config check builds the strategy without loading anything).
        dtype: the draft's dtype when it is loaded here (``"auto"``, ``"float32"``, ``"bfloat16"``...).
        num_draft, max_draft, adaptive: see :class:`~kvboost.speculative.base.DraftStrategy`.
        sequences: contexts the draft's own KV pool holds (requests drafting at once; more decode undrafted while it
            is full). Default 8.
        decode: the draft runner's decode path (``kvboost.runtime.config.choose_runner``); ``auto`` as the engine's
            default, ``eager`` where compiling the draft's step costs more than it saves (tests, one-off runs).
    """

    def __init__(
        self, model: Any = None, dtype: str = "float32", num_draft: int = 4, max_draft: int = 8, adaptive: bool = True,
        sequences: int = 8, decode: str = "auto",
    ) -> None:  # fmt: skip
        super().__init__(num_draft=num_draft, max_draft=max_draft, adaptive=adaptive)
        from kvboost.speculative.base import check_positive_int

        check_positive_int("draft_model", "sequences", sequences)
        self.sequences = sequences
        self.decode = decode
        if model is not None and not isinstance(model, (str, torch.nn.Module)):
            raise ValueError(
                f"speculative 'draft_model': model must be a path, a hub id, null or a loaded model, got {model!r}"
            )
        self.model_spec, self.dtype = model, dtype
        self.draft: Any = None
        self._runtime: Any = None
        self._table: Any = None
        self._cached: list[int] = []

    def bind(self, model: Any, tokenizer: Any) -> None:
        from kvboost.models.loading import load_model_and_tokenizer
        from kvboost.runtime.standalone import StandaloneRunner

        if isinstance(self.model_spec, torch.nn.Module):
            draft = self.model_spec
        else:
            draft, _, _ = load_model_and_tokenizer(
                self.model_spec, dtype=self.dtype, device=str(next(model.parameters()).device)
            )
        target_vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        draft_vocab = int(draft.config.get_text_config(decoder=True).vocab_size)
        if draft_vocab != target_vocab:
            raise ValueError(
                f"speculative 'draft_model': the draft's vocabulary ({draft_vocab} tokens) differs from the target's "
                f"({target_vocab}); a draft must share the target's tokenizer"
            )
        self.draft = draft.eval()
        # The draft has a pool and a runner of its own (the target's arithmetic, on the draft's weights).
        self._runtime = StandaloneRunner(self.draft, sequences=self.sequences, decode=self.decode)

    def begin(self, request: DraftRequest) -> None:
        if self._runtime is None:
            raise RuntimeError("draft_model: the strategy was not bound to an engine")
        self._table = self._runtime.new_table()
        self._cached = []

    def end(self) -> None:
        if self._table is not None:
            self._table.release()
        self._table, self._cached = None, []

    @torch.inference_mode()
    def propose(
        self, context: Sequence[int], k: int, sampling: Sampling, generator: torch.Generator | None = None
    ) -> Draft:
        from kvboost.runtime.batch import ForwardBatch, SeqInput

        table = self._table
        if table is None:
            raise RuntimeError("draft_model: propose() outside a request (call begin() first)")
        keep = 0
        limit = min(len(self._cached), len(context) - 1)  # the last context token is always run (its logits)
        while keep < limit and self._cached[keep] == context[keep]:
            keep += 1
        table.truncate(keep)  # rollback: rows past the common prefix were computed for rejected tokens
        self._cached = list(context[:keep])
        feed = list(context[keep:])
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        try:
            for _ in range(k):
                logits = self._runtime.runner.run(ForwardBatch.build([SeqInput(table, feed)]))[0]
                self._cached.extend(feed)
                token, q = choose_draft_token(logits, sampling, generator)
                tokens.append(token)
                if q is not None:
                    qs.append(q)
                feed = [token]
        except BaseException:  # (the draft pool is full, most likely) its rows go back to the other requests' drafts
            table.truncate(0)
            self._cached = []
            raise
        return Draft(tokens, torch.stack(qs) if qs else None)

    def fingerprint(self) -> str:
        name = (
            self.model_spec
            if isinstance(self.model_spec, str) or self.model_spec is None
            else type(self.model_spec).__name__
        )
        return f"draft_model:{name}:{self.dtype}:{super().fingerprint()}"
