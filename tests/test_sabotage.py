"""The narrowing sabotage checks of issue 59, as tests: each breaks the narrowed (subset-query) prefill in one way,
and the equivalence test of ``tests/test_recompute_narrowing.py`` must fail on it; unsabotaged it passes.

The equivalence test (``check_equivalence``) runs a strategy that narrows at check layer 0 to a scattered set S and
compares, per layer and row, its K/V and first-token logits with the fixed schedule that recomputes S, and both with
references that share no subset-query code (a cold prefill's rows at layers 0-1 and the re-rotated cached rows of
``none``), to 1e-5. A sabotage is active only in the prefill of a strategy that narrows (the batch's hook has check
layers), so the fixed schedule and the references stay right and the comparison has to tell. Sabotages:

- ``positions_plus_one`` / ``positions_minus_one``: the narrowed rows are rotated as if one position later / earlier;
- ``next_slot``: every computed row's K/V is written into the slot after its own;
- ``wrong_rows_kept``: after the check layer the hook keeps each selected content row's neighbour instead;
- ``rope_of_wrong_row``: each row gets the RoPE table of the row before it in the batch;
- ``rerotation_off_by_one``: the cached content keys are re-rotated by one position more than they moved.
"""

from __future__ import annotations

import pytest
import torch
import test_recompute_narrowing as narrowing

import kvboost.reuse.prefill as prefill_module
import kvboost.runtime.llama as llama
from kvboost.reuse.repair import CheckLayerHook
from kvboost.runtime.batch import ForwardBatch

ARCH, NAME, RATIO = "llama", "forced_scattered", 0.15
SABOTAGES = ("positions_plus_one", "positions_minus_one", "next_slot", "wrong_rows_kept", "rope_of_wrong_row",
             "rerotation_off_by_one")  # fmt: skip


def narrows(batch: ForwardBatch) -> bool:
    """Whether ``batch`` is the narrowed path's forward (a check-layer hook with check layers)."""
    return isinstance(batch.hook, CheckLayerHook) and bool(batch.hook.check_layers)


def sabotage(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Break the narrowed path in the way ``kind`` names (see the module docstring)."""
    if kind in ("positions_plus_one", "positions_minus_one", "rope_of_wrong_row"):
        rope, run_eager, active = llama.rope_tables, llama.LlamaRunner._run_eager, []

        def wrong_rope(positions, *args):
            if not active or not active[-1]:
                return rope(positions, *args)
            if kind == "rope_of_wrong_row":
                cos, sin = rope(positions, *args)
                return cos.roll(1, 0), sin.roll(1, 0)
            return rope(positions + (1 if kind == "positions_plus_one" else -1), *args)

        def run(self, batch):
            active.append(narrows(batch))
            try:
                return run_eager(self, batch)
            finally:
                active.pop()

        monkeypatch.setattr(llama, "rope_tables", wrong_rope)
        monkeypatch.setattr(llama.LlamaRunner, "_run_eager", run)
    elif kind == "next_slot":

        class NextSlot:
            @staticmethod
            def build(seqs, **options):
                batch = ForwardBatch.build(seqs, **options)
                if narrows(batch):
                    batch.slot_mapping = batch.slot_mapping + 1
                return batch

        monkeypatch.setattr(prefill_module, "ForwardBatch", NextSlot)
    elif kind == "wrong_rows_kept":
        after_layer = CheckLayerHook.after_layer

        def neighbours(self, layer, batch):
            is_content = self._content_rows(batch)
            kept = after_layer(self, layer, batch)
            if kept is None:
                return None
            chosen = kept[is_content[kept]]
            wrong = torch.clamp(chosen + 1, max=batch.num_tokens - 1)
            kept = torch.unique(torch.cat([kept[~is_content[kept]], wrong]))
            self.final_positions = batch.positions[kept].cpu()
            return kept

        monkeypatch.setattr(CheckLayerHook, "after_layer", neighbours)
    elif kind == "rerotation_off_by_one":
        assemble = prefill_module.assemble_content

        class OffByOne:
            def __init__(self, rotator):
                self.rotator = rotator

            def rotate(self, keys, shift):
                return self.rotator.rotate(keys, shift + 1)

        def wrong_assembly(plan, table, rotator, strategy=None):
            narrowing_strategy = strategy is not None and bool(strategy.check_layers)
            return assemble(plan, table, OffByOne(rotator) if narrowing_strategy else rotator, strategy)

        monkeypatch.setattr(prefill_module, "assemble_content", wrong_assembly)
    else:
        raise ValueError(kind)


@pytest.fixture(scope="module", autouse=True)
def clean_references():
    """The warmed engine and the references, computed before any sabotage (``functools.cache``)."""
    narrowing.references(ARCH)


def test_the_equivalence_test_passes_unsabotaged():
    narrowing.check_equivalence(ARCH, NAME, RATIO)


@pytest.mark.parametrize("kind", SABOTAGES)
def test_the_equivalence_test_fails_on_each_sabotage(monkeypatch, kind):
    sabotage(monkeypatch, kind)
    with pytest.raises(AssertionError, match="over 1e-05") as failed:
        narrowing.check_equivalence(ARCH, NAME, RATIO)
    # the narrowed run itself is what differs from the fixed schedule or the cold prefill
    assert "narrowed" in str(failed.value) or "'keys'" in str(failed.value) or "'logits'" in str(failed.value)
