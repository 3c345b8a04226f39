"""Needle in a haystack, RULER-style, generated in code: one planted magic number in ~4k tokens of filler passages.

Modelled on RULER's ``niah_single`` task (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv:2404.06654): a haystack of filler text, one key-value needle planted in it
at a chosen depth ("The special magic number for <key> is: <7-digit number>."), the question at the end, greedy
decoding, and the answer scored against the number. Unlike RULER's essay haystack, the filler is generated here
(no data file): seeded sentences from small word lists, digit-free, so the needle's number is the only number of
the prompt, and every passage differs from every other (identical passages would be one cache entry).

Each filler passage is its own ``separator``-delimited chunk, warmed (untimed) after the prompts' shared head as
``workload=musique`` warms its passages (CacheBlend's precomputed chunks): a query then finds its passages by
content wherever they sit and the configured recompute strategy repairs them. Prompt layout (:meth:`Needle.render`),
``S`` the separator (default ``"\\n\\n"``)::

    <chat template: system prompt (DEFAULT_SYSTEM_PROMPT), then the user turn>
    A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you
    about the number afterwards.{S}<passage 1>{S}<passage 2>{S}...{S}<passage k>{S}
    What is the special magic number for <key> mentioned in the provided text? Answer with the number only.
    <end of user turn, assistant header>The special magic number for <key> mentioned in the provided text is

(the last line, RULER's answer prefix, only with ``answer_prefix: true``, the default).

A draw is the workload's randomness under ``seed``: the filler bank (which sentences), the order of the passages
in each query's haystack, each query's key and number, and (``depths: null``) its needle depth. The bank is
generated once per run: ``context_tokens`` (default 4000) is the target length of the whole prompt as the engine
counts it (the model's tokenizer, through the configured chunker); the bank holds as many passages of about
``passage_tokens`` tokens as fit beside the instruction, the question and the needle (the last one shortened to
fill), so every prompt is within a few dozen tokens of ``context_tokens`` and never above it. Every query shows all the
bank's passages in its own seeded order, the needle sentence inserted at a sentence boundary at depth ``d`` of the
haystack (0.0: the first sentence of the first passage, 1.0: after the last sentence of the last passage): the
passage at ``d`` of the passages, the sentence at the remaining fraction of it. ``depths``: null draws ``d``
uniformly per query; a list (e.g. ``[0.0, 0.25, 0.5, 0.75, 1.0]``) gives query ``i`` depth ``depths[i % len]``.

``warm_passages``: ``per_query`` (default) warms a query's passages, the needle's included, right before it;
``all`` warms every distinct passage of the run (the bank, and each query's needle passage) before timing;
``none`` warms nothing.

Scored per record: ``correct``, whether the first number of the answer (digits, thousands separators dropped) is
the needle's number (RULER's metric is whether the number occurs in the answer; the first number is stricter: a
model that lists numbers gets no credit); ``f1``, the SQuAD token F1 (:func:`kvboost.lab.workloads.musique.token_f1`)
of the answer's first non-empty line against the number (1.0 for ``4829183.``, 0.5 for ``4829183 is it``). The
summary's ``accuracy`` gives per mode the exact-match rate and ``f1_mean``. Greedy, ``max_new_tokens`` (16).

Use it with the separator chunker (the workload's config selects it).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.base import Request, Workload, WorkloadEnv
from kvboost.lab.workloads.musique import answer_line, token_f1
from kvboost.lab.workloads.passages import PassagesAfterHead, check_passage_fields

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using only the text you are given."
INSTRUCTION = (
    "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
    "the number afterwards."
)
NEEDLE_TEMPLATE = "The special magic number for {key} is: {value}."
QUESTION_TEMPLATE = (
    "What is the special magic number for {key} mentioned in the provided text? Answer with the number only."
)
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"

# ------------------------------------------------------------------------------------------ the filler
_ADJECTIVES = (
    "quiet", "ancient", "narrow", "golden", "restless", "distant", "humble", "crowded", "silver", "hidden", "gentle",
    "stubborn", "patient", "hollow", "bright", "weathered", "curious", "modest", "sturdy", "faded", "lively",
    "careful", "rugged", "pale", "busy", "lonely", "clever", "broad", "misty", "steady", "wooden", "famous",
)  # fmt: skip
_NOUNS = (
    "village", "river", "lighthouse", "orchard", "market", "bridge", "library", "harbor", "valley", "forest",
    "workshop", "garden", "mill", "tower", "meadow", "island", "canal", "monastery", "bakery", "quarry", "school",
    "theater", "farm", "castle", "station", "square", "cathedral", "vineyard", "glacier", "courtyard", "museum",
    "cottage", "pier", "road", "chapel", "archive", "fountain", "barn", "observatory", "plaza",
)  # fmt: skip
_PEOPLE = (
    "farmer", "sailor", "weaver", "teacher", "merchant", "painter", "baker", "carpenter", "traveller", "gardener",
    "shepherd", "poet", "blacksmith", "miller", "scholar", "fisherman", "potter", "musician", "mapmaker", "nurse",
)  # fmt: skip
_VERBS = (
    "walked past", "looked at", "painted", "repaired", "visited", "described", "remembered", "cleaned", "guarded",
    "measured", "photographed", "crossed", "explored", "admired", "sketched", "studied",
)  # fmt: skip
_TIMES = (
    "in the early morning", "after the long winter", "during the harvest", "before the storm", "at dusk",
    "every spring", "on a rainy afternoon", "late in the autumn", "at the end of the summer", "once a year",
)  # fmt: skip
_TEMPLATES = (
    "The {adj} {noun} stood at the edge of the {noun2} for as long as anyone could remember.",
    "A {person} {verb} the {adj} {noun} {time}.",
    "{Time}, the {noun} near the {noun2} was {adj} and full of people.",
    "Nobody in the {noun} knew why the {person} {verb} the {noun2} so often.",
    "The path from the {noun} to the {adj} {noun2} wound through fields and low stone walls.",
    "Stories about the {adj} {person} who lived by the {noun} were told {time}.",
    "The {person} and the {person2} argued about the {noun} until the lamps were lit.",
    "Travellers said the {noun2} looked {adj} {time}, though the {noun} never changed.",
    "In the {noun}, a {adj} {person} kept a record of every visitor.",
    "The old {noun} was rebuilt {time}, and the {person} {verb} it with care.",
    "Children from the {noun2} liked to play near the {adj} {noun}.",
    "The wind carried the smell of the {noun} all the way to the {adj} {noun2}.",
)  # fmt: skip
_KEY_ADJECTIVES = (
    "plausible", "fearless", "tender", "fragrant", "abundant", "zealous", "whimsical", "obedient", "nimble", "jovial",
    "elegant", "boundless", "sincere", "vivid", "tranquil", "ambitious", "graceful", "hushed", "loyal", "radiant",
)  # fmt: skip
_KEY_NOUNS = (
    "pig", "lantern", "otter", "compass", "falcon", "teapot", "violin", "walrus", "anchor", "pumpkin", "comet",
    "badger", "kettle", "feather", "hedgehog", "saddle", "penguin", "marble", "thimble", "canoe",
)  # fmt: skip
_NUMBER = re.compile(r"\d[\d,]*")


def filler_sentence(rng: random.Random) -> str:
    """One generated filler sentence (digit-free, no newline)."""
    noun, noun2 = rng.sample(_NOUNS, 2)
    person, person2 = rng.sample(_PEOPLE, 2)
    time = rng.choice(_TIMES)
    return rng.choice(_TEMPLATES).format(adj=rng.choice(_ADJECTIVES), noun=noun, noun2=noun2, person=person,
                                         person2=person2, verb=rng.choice(_VERBS), time=time,
                                         Time=time[0].upper() + time[1:])  # fmt: skip


def first_number(text: str) -> str | None:
    """The first number of ``text`` as digits (``4,829,183`` -> ``4829183``), None without one."""
    found = _NUMBER.search(text)
    return found.group(0).replace(",", "") if found else None


# ---------------------------------------------------------------------------------------------- items
@dataclass
class NeedleItem:
    """One query: its haystack (passages in prompt order, the needle inside one), key, number and depth."""

    item_id: str
    key: str
    value: str
    depth: float
    needle_passage: int
    passages: list[str]


@dataclass
class NeedleConfig:
    context_tokens: int = 4000  # target prompt length (engine's count, model tokenizer); never exceeded
    num_queries: int = 20
    seed: int = 0
    depths: list[float] | None = None  # None: a uniform depth per query; a list: query i gets depths[i % len]
    passage_tokens: int = 250  # about this many tokens per filler passage (each its own chunk)
    separator: str = "\n\n"
    warm_passages: str = "per_query"  # per_query | all | none (WARM_PASSAGES)
    answer_prefix: bool = True  # RULER's answer prefix after the assistant header
    max_new_tokens: int = 16
    system_prompt: str | None = None  # None: DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        for name in ("context_tokens", "num_queries", "passage_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name} must be a positive integer, got {value!r}")
        if self.passage_tokens < 32:
            raise ValueError(f"workload.passage_tokens must be >= 32 (a few sentences), got {self.passage_tokens}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"workload.seed must be an integer, got {self.seed!r}")
        if self.depths is not None:
            depths = list(self.depths)
            if not depths or not all(isinstance(d, (int, float)) and not isinstance(d, bool) and 0.0 <= d <= 1.0
                                     for d in depths):  # fmt: skip
                raise ValueError(f"workload.depths must be null or a non-empty list of numbers in [0, 1], got "
                                 f"{self.depths!r}")  # fmt: skip
            self.depths = [float(d) for d in depths]
        check_passage_fields(self.warm_passages, self.separator)


@WORKLOADS.register("needle")
class Needle(PassagesAfterHead, Workload):
    """One planted magic number per query in ~``context_tokens`` of generated filler passages; exact match."""

    config_class = NeedleConfig
    head_ends_with = INSTRUCTION

    def __init__(self, *, env: WorkloadEnv, **fields: Any) -> None:
        cfg = NeedleConfig(**fields)
        self.cfg = cfg
        self.max_new_tokens = cfg.max_new_tokens
        self.tokenizer = env.tokenizer
        self.count_tokens = env.count_tokens
        self.system_prompt = cfg.system_prompt if cfg.system_prompt is not None else DEFAULT_SYSTEM_PROMPT
        for piece in (self.system_prompt, INSTRUCTION):
            if cfg.separator in piece:
                raise ValueError(f"needle: the separator {cfg.separator!r} occurs in {piece[:60]!r}")
        rng = random.Random(f"needle:{cfg.seed}:queries")
        keys = [f"{a}-{n}" for a in _KEY_ADJECTIVES for n in _KEY_NOUNS]
        picks = rng.sample(keys, cfg.num_queries) if cfg.num_queries <= len(keys) else \
            [rng.choice(keys) for _ in range(cfg.num_queries)]  # fmt: skip
        plans = []
        for i, key in enumerate(picks):
            value = str(rng.randint(1_000_000, 9_999_999))
            drawn = round(rng.random(), 4)  # drawn either way: a depths list keeps the seed's keys and numbers
            depth = cfg.depths[i % len(cfg.depths)] if cfg.depths is not None else drawn
            plans.append((f"needle{i:03d}", key, value, depth))
        self.bank = self._fill_bank(plans)
        while True:  # the needle sits inside a passage: the engine's count may differ by a token at its seams
            self.items = [self._item(*plan) for plan in plans]
            self._prompt_tokens = {item.item_id: self.count_tokens(self.prompt(item)) for item in self.items}
            if max(self._prompt_tokens.values()) <= cfg.context_tokens:
                break
            self._trim_bank()

    # ------------------------------------------------------------------------------------ building
    def _passage(self, rng: random.Random, budget: int) -> str | None:
        """Filler sentences while the passage stays within ``budget`` tokens (None: not even one fits)."""
        sentences: list[str] = []
        while True:
            sentence = filler_sentence(rng)
            if self._tokens(" ".join([*sentences, sentence])) > budget:
                return " ".join(sentences) if sentences else None
            sentences.append(sentence)

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fill_bank(self, plans: list[tuple[str, str, str, float]]) -> list[str]:
        """Filler passages of about ``passage_tokens`` until the longest query's prompt reaches ``context_tokens``."""
        cfg = self.cfg
        longest = max(plans, key=lambda p: self._tokens(NEEDLE_TEMPLATE.format(key=p[1], value=p[2])
                                                        + QUESTION_TEMPLATE.format(key=p[1])))  # fmt: skip
        _, key, value, _ = longest
        needle = NEEDLE_TEMPLATE.format(key=key, value=value)
        rng = random.Random(f"needle:{cfg.seed}:filler")
        bank: list[str] = []
        overhead = self.count_tokens(self.render(key, [needle]))
        sep_tokens = self._tokens(cfg.separator)
        budget = cfg.context_tokens - overhead
        if budget < 32:
            raise ValueError(f"workload.context_tokens={cfg.context_tokens} leaves no room for filler: the "
                             f"instruction, question and needle alone take {overhead} tokens")  # fmt: skip
        while budget > 16:
            passage = self._passage(rng, min(cfg.passage_tokens, budget - sep_tokens))
            if passage is None:
                break
            bank.append(passage)
            budget -= self._tokens(passage) + sep_tokens
        return bank

    def _trim_bank(self) -> None:
        """Drop the last sentence of the bank (the last passage when it has one sentence left)."""
        if ". " in self.bank[-1]:
            self.bank[-1] = self.bank[-1].rsplit(". ", 1)[0] + "."
        elif len(self.bank) > 1:
            self.bank.pop()
        else:
            raise ValueError(f"workload.context_tokens={self.cfg.context_tokens} leaves no room for filler")

    def _item(self, item_id: str, key: str, value: str, depth: float) -> NeedleItem:
        """A query's haystack: the bank in a seeded order, the needle sentence at ``depth``."""
        passages = list(self.bank)
        random.Random(f"needle:{self.cfg.seed}:order:{item_id}").shuffle(passages)
        k = len(passages)
        index = min(int(depth * k), k - 1)
        sentences = re.split(r"(?<=\.) ", passages[index])
        cut = round((depth * k - index) * len(sentences))
        sentences.insert(min(cut, len(sentences)), NEEDLE_TEMPLATE.format(key=key, value=value))
        passages[index] = " ".join(sentences)
        return NeedleItem(item_id=item_id, key=key, value=value, depth=depth, needle_passage=index,
                          passages=passages)  # fmt: skip

    # --------------------------------------------------------------------------------------- prompts
    def messages(self, key: str, passages: Sequence[str]) -> list[dict[str, str]]:
        """The chat messages: system prompt, then instruction, passages and question in the user turn."""
        pieces = [INSTRUCTION, *passages, QUESTION_TEMPLATE.format(key=key)]
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": self.cfg.separator.join(pieces)}]  # fmt: skip

    def render(self, key: str, passages: Sequence[str]) -> str:
        """The prompt text: the chat template with the generation prompt (and the answer prefix)."""
        text = self.tokenizer.apply_chat_template(self.messages(key, passages), tokenize=False,
                                                  add_generation_prompt=True)  # fmt: skip
        return text + ANSWER_PREFIX.format(key=key) if self.cfg.answer_prefix else text

    def prompt(self, item: NeedleItem) -> str:
        return self.render(item.key, item.passages)

    def item_prompt(self, item: NeedleItem) -> str:
        return self.prompt(item)

    # -------------------------------------------------------------------------------------- requests
    def requests(self) -> Iterator[Request]:
        for item in self.items:
            prompt = self.prompt(item)
            score = [int(t) for t in self.tokenizer(" " + item.value, add_special_tokens=False)["input_ids"]]
            yield Request(
                request_id=item.item_id, conversation_id=item.item_id, turn=1, prompt=prompt,
                expected=item.value, score_ids=score or None,
                info={"needle_key": item.key, "needle_value": item.value, "needle_depth": item.depth,
                      "needle_passage": item.needle_passage, "num_passages": len(item.passages),
                      "context_tokens": self._prompt_tokens[item.item_id]},
            )  # fmt: skip

    def is_correct(self, request: Request, output_text: str) -> bool | None:
        return first_number(output_text) == request.expected

    def score(self, request: Request, output_text: str) -> dict[str, float]:
        return {"f1": token_f1(answer_line(output_text), [request.expected or ""])}

    def stats(self) -> dict[str, Any]:
        counts = list(self._prompt_tokens.values())
        return {"queries": len(self.items), "num_passages": len(self.bank), "context_tokens": self.cfg.context_tokens,
                "prompt_tokens_min": min(counts, default=None), "prompt_tokens_max": max(counts, default=None),
                "depths": [item.depth for item in self.items]}  # fmt: skip
