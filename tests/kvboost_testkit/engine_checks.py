"""What the engine state machines (``tests/test_core_state_machine.py``, ``tests/test_engine_threads_state_machine.py``)
check, once: the prompt-sensitive tiny model they drive, HF references of it (greedy decode, teacher-forced score
log-probabilities, the K/V of a fresh prefill), the books (each block's references are its holders), every cached
entry of every tier against a fresh prefill, and a finished request's tokens against the same prompt decoded alone.

The model is the tiny random llama with ``initializer_range=0.2`` (the chaos test's scale): its logits span a few
units, so the greedy choice has margins well above fp32 rounding, and its output depends on the whole prompt (see
:func:`assert_prompt_sensitive`; a check that every output is the same would otherwise pass blind).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kvboost_testkit.tiny import random_ids, tiny_model

INIT_SCALE = 0.2
KV_TOL = 1e-4  # fp32: a cached entry's K/V against a fresh HF prefill of its chain
LOGPROB_TOL = 1e-4  # fp32: a score row's log-probability against HF's teacher-forced one
NEAR_TIE = 1e-3  # greedy tokens may part from HF's only where HF's own two best logits are this close

_MODELS: dict[str, Any] = {}
_KV: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
_DECODE: dict[tuple[tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}
_SCORE: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}


def model():
    """The target: 2-layer tiny llama, fp32, init scale ``INIT_SCALE`` (one per process)."""
    if "target" not in _MODELS:
        _MODELS["target"] = tiny_model("llama", seed=0, initializer_range=INIT_SCALE)
    return _MODELS["target"]


def draft_model():
    """A draft for ``speculative=draft_model``: the target's weights plus noise (same vocabulary), so its drafts are
    accepted often, not always (both paths of the verification run)."""
    if "draft" not in _MODELS:
        draft = tiny_model("llama", seed=0, initializer_range=INIT_SCALE)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in draft.parameters():
                param.add_(torch.randn(param.shape, generator=g) * 0.3 * param.std().nan_to_num(0.0))
        _MODELS["draft"] = draft
    return _MODELS["draft"]


def block_bytes(block: int) -> int:
    """Bytes of one pool block of the target: (K, V) x 2 layers x 2 KV heads x ``block`` rows x 16 dims x fp32."""
    return 2 * 2 * 2 * block * 16 * 4


def assert_prompt_sensitive() -> None:
    """Prompts that differ only before their last 9 tokens get different greedy continuations (8 prompts, at least
    6 distinct answers): the model reads the whole prompt, so a request served someone else's KV shows."""
    suffix = random_ids(9, seed=1)
    answers = {tuple(hf_greedy(tuple(random_ids(16, seed=900 + s) + suffix), 4)[0]) for s in range(8)}
    assert len(answers) >= 6, f"the tiny model is prompt-insensitive: {len(answers)} distinct answers of 8"


def hf_greedy(ids: tuple[int, ...], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens after ``ids`` (no EOS: the machines' engines have none) and the logits that chose each."""
    key = (ids, max_tokens)
    if key not in _DECODE:
        shorter = next(((ids, n) for n in range(max_tokens + 1, 17) if (ids, n) in _DECODE), None)
        if shorter is not None:
            tokens, logits = _DECODE[shorter]
            _DECODE[key] = (tokens[:max_tokens], logits[:max_tokens])
            return _DECODE[key]
        tokens, logits = [], []
        with torch.inference_mode():
            seq = list(ids)
            for _ in range(max_tokens):
                row = model()(input_ids=torch.tensor([seq])).logits[0, -1]
                logits.append(row)
                tokens.append(int(row.argmax()))
                seq.append(tokens[-1])
        _DECODE[key] = (tokens, logits)
    return _DECODE[key]


def hf_score(ids: tuple[int, ...], score: tuple[int, ...]) -> list[float]:
    """HF's teacher-forced log-probability of each of ``score`` after ``ids`` and the score ids before it."""
    key = (ids, score)
    if key not in _SCORE:
        with torch.inference_mode():
            logits = model()(input_ids=torch.tensor([list(ids) + list(score[:-1])])).logits[0, len(ids) - 1 :]
        logp = torch.log_softmax(logits.float(), dim=-1)
        _SCORE[key] = logp.gather(-1, torch.tensor(score).unsqueeze(-1)).squeeze(-1).tolist()
    return _SCORE[key]


def hf_kv(tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, kv_heads, n, dim]`` of a fresh HF prefill of ``tokens``."""
    if tokens not in _KV:
        with torch.inference_mode():
            out = model()(input_ids=torch.tensor([tokens]), use_cache=True)
        layers = out.past_key_values.layers
        _KV[tokens] = (torch.stack([layer.keys[0] for layer in layers]),
                       torch.stack([layer.values[0] for layer in layers]))  # fmt: skip
    return _KV[tokens]


def check_greedy(ids: list[int], got: list[int], max_tokens: int, what: str) -> None:
    """``got`` are HF's greedy tokens after ``ids`` (all ``max_tokens`` of them), or part from them only at a near
    tie of HF's own logits (after which the two decodes follow different prompts)."""
    expected, logits = hf_greedy(tuple(ids), max_tokens)
    assert len(got) == len(expected), f"{what}: {len(got)} tokens, expected {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            top = torch.topk(logits[i].float(), 2).values
            assert float(top[0] - top[1]) < NEAR_TIE, f"{what}: token {i}: {got} != alone {expected}"
            return


def check_score(ids: list[int], score: list[int], got: list[float], what: str) -> None:
    """A ``score_ids`` request's per-id log-probabilities equal HF's teacher-forced ones (fp32)."""
    expected = hf_score(tuple(ids), tuple(score))
    assert len(got) == len(expected), f"{what}: {len(got)} score rows, expected {len(expected)}"
    worst = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    assert worst <= LOGPROB_TOL, f"{what}: score log-probabilities part from HF's by {worst:.2e}"


def check_holders(engine: Any, requests: Iterable[Any]) -> None:
    """Each pool block's reference count equals its holders: the block tables of ``requests`` (the ones the core
    runs) and the pins; no block both free and referenced, a cached one never free (``KVPool.verify``)."""
    pool = engine.pool
    pool.verify()
    try:
        engine.store.verify()
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {store_diff(engine.store)}") from exc
    expected = [0] * pool.num_blocks
    for request in requests:
        for block in request.table.blocks:
            expected[block] += 1
    for blocks in engine.store.tiers[0]._pins.values():
        for block in blocks:
            expected[block] += 1
    got = [pool.refcount(b) for b in range(pool.num_blocks)]
    wrong = [(b, g, e) for b, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert not wrong, f"references != holders (block, count, holders): {wrong}"


def store_diff(store: Any) -> str:
    """Where the store's index and its tiers disagree (for a failed ``KVStore.verify``)."""
    where: dict[str, set[int]] = {}
    for i, tier in enumerate(store.tiers):
        for key in tier.keys():
            where.setdefault(key, set()).add(i)
    nodes = store._nodes
    only_tiers = {k[:12]: sorted(v) for k, v in where.items() if k not in nodes}
    only_index = [k[:12] for k in nodes if k not in where]
    return f"keys in tiers only {only_tiers}, in the index only {only_index} (tiers {store.tier_names})"


def pinned_blocks(engine: Any) -> int:
    return len({b for blocks in engine.store.tiers[0]._pins.values() for b in blocks})


def check_quiet(engine: Any) -> None:
    """Nothing runs: only pins hold blocks (no leak), and a draft model's own pool holds none."""
    assert engine.pool.num_referenced == pinned_blocks(engine), (
        f"leaked blocks: {engine.pool.num_referenced} referenced, {pinned_blocks(engine)} pinned")
    runtime = getattr(engine.speculative, "_runtime", None)  # draft_model's own pool (when it has one)
    draft_pool = getattr(runtime, "pool", None)
    if draft_pool is not None:
        draft_pool.verify()
        assert draft_pool.num_referenced == 0, f"the draft pool holds {draft_pool.num_referenced} blocks at rest"


class EntryChecker:
    """Every entry of every tier holds what a fresh prefill of its tokens computes (exact entries: the K/V of a HF
    prefill of their whole chain, within ``KV_TOL``), or is a repaired one under a segment-only key (approximate:
    never served as exact; ``KVEntry`` refuses anything else). The pool tier is read in full at every check (its
    blocks are rewritten as they are reused); a lower tier's record once per key and payload size (a record does not
    change under its key unless rewritten)."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, str, int]] = set()
        self.checked = {"memory": 0, "lower": 0, "approximate": 0, "orphans": 0}

    def check(self, engine: Any) -> None:
        store = engine.store
        for index, tier in enumerate(store.tiers):
            for key in tier.keys():
                if index > 0:
                    meta = tier.peek_meta(key)
                    if meta is None:
                        continue
                    mark = (index, key, int(meta.num_tokens))
                    if mark in self.seen:
                        continue
                # a lower tier's record is read through the store, as the engine reads it: a record that vanished
                # (another process, or a delete that overtook a refresh) is then a miss the store forgets too;
                # read from the tier directly, the tier would drop it behind the store's back
                entry = tier.peek(key) if index == 0 else store.peek(key)
                if entry is None:  # a lower tier's record gone meanwhile (evicted, damaged and dropped)
                    continue
                if not entry.exact:
                    assert entry.key.startswith("seg:"), f"approximate entry under exact key {entry.key[:16]}"
                    self.checked["approximate"] += 1
                    continue
                chain, parent = list(entry.token_ids), entry.parent_key
                while parent in store:
                    up = store.peek_meta(parent)
                    chain[:0] = up.token_ids
                    parent = up.parent_key
                if len(chain) != entry.start + entry.num_tokens:  # a parent evicted from every tier
                    assert index > 0, "a pool entry whose chain does not reach the root"
                    self.checked["orphans"] += 1
                    continue
                keys, values = _materialize(engine, entry.payload)
                ref_k, ref_v = hf_kv(tuple(chain))
                rows = slice(entry.start, entry.start + entry.num_tokens)
                dk = float((keys.float() - ref_k[:, :, rows]).abs().max())
                dv = float((values.float() - ref_v[:, :, rows]).abs().max())
                assert max(dk, dv) <= KV_TOL, (
                    f"tier {index} ({type(tier).__name__}) entry at {entry.start}+{entry.num_tokens} parts from a "
                    f"fresh prefill: K {dk:.2e}, V {dv:.2e}")  # fmt: skip
                if index > 0:
                    self.seen.add(mark)
                    self.checked["lower"] += 1
                else:
                    self.checked["memory"] += 1


def _materialize(engine: Any, payload: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(payload, "materialize"):  # a run of pool blocks
        return payload.materialize()
    return engine.quantizer.dequantize(payload)
