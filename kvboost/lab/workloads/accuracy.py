"""Accuracy evals: does serving the history from the cache cost quality? Warm (``kvboost``) vs cold prefill.

Two parts, each a set of multi-turn chats replayed turn by turn (turn t's prompt is the chat history of turns
1..t-1 plus the new user message, in the model's chat template with the generation prompt). The history's
assistant messages are the dataset's own (or fixed text), never the engine's output, so every mode gets the
very same prompt; the earlier turns' prompts were served before, so in ``kvboost`` mode a turn's history
comes from the cache (its reuse grows with the turn), while ``baseline`` / ``kvboost_cold`` prefill it cold.
Whatever the run configures (chunker, recompute strategy, KV quantizer...) is what serves the history.

(a) Perplexity (``perplexity_conversations`` x up to ``perplexity_turns``): real ShareGPT conversations. Each
    turn's request scores the dataset's held-out assistant reply to that turn: ``score_ids`` = the reply text
    tokenized without special tokens, cut to its first ``score_tokens`` tokens. That is how the reply is
    tokenized inside the next turn's prompt (it follows the template's ``<|im_start|>assistant\\n``; a
    byte-level BPE does not merge across that newline, and the reply is stripped), so the scored tokens are
    exactly the ones the model would have to produce; ``tests/test_accuracy_workload.py`` checks it on the
    bundled tokenizer. (With a segmenting chunker the prompt is tokenized per segment; the reply's ids are
    still the same text's ids.) The runner records ``answer_logprob`` = the summed natural-log probability of
    those tokens; the number of tokens is in the record as ``score_tokens``, so a request's perplexity is
    ``exp(-answer_logprob / score_tokens)`` (``kvboost/lab/accuracy_table.py``).

(b) Known-answer recall (``recall_tasks`` chats): a fact is planted in the first user turn ("Please remember
    this: the PIN for my bike lock is 4821."; several templates, values drawn from a seeded RNG: 4-digit
    numbers, or uncommon words, unique within the run and absent from the rest of the chat, so the model
    cannot guess them), answered by a fixed acknowledgement; then ``filler_turns`` real ShareGPT turns (scored
    for perplexity like part (a)); then a last turn asks for the fact. ``expected`` is the value,
    :meth:`AccuracyWorkload.is_correct` a normalized whole-word match in the generated text, and
    ``score_ids`` the value's tokens, so its log-probability is recorded too. With ``answer_prefix`` (default)
    the last prompt ends with the start of the answer after the generation prompt ("The PIN for your bike
    lock is"), so the model continues with the value: a 135M model then answers in the expected form
    (without it, it mostly restates the question within ``max_new_tokens``). With ``bridge_turn`` (default) a
    short unscored exchange ("Thanks, that helps." / "You're welcome!") comes between the last filler and the
    question: its request stores the last filler's reply, so in ``kvboost`` mode the question's long history
    is all cached but those few tokens (reuse 0.8-0.95 on the defaults); without it the last filler's reply is new
    to the cache (reuse ~0.5).

Records carry ``task`` (``perplexity``, ``recall``, and the unscored ``plant`` and ``bridge`` turns),
``score_tokens``, and for recall ``template``, ``expected`` and ``filler_turns``. A turn whose prompt would
exceed ``max_prompt_tokens`` ends a perplexity conversation there; a recall chat drops fillers from the end
until its question fits.

The question's prompt (with ``answer_prefix``) is text, like rag_reorder's: run it with ``engine.chat=false``
(the default), which leaves text prompts as they are.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from kvboost.lab.sharegpt_data import Conversation, load_conversations
from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.base import Request, Workload, WorkloadEnv

ACK = "Got it, I will remember that."
PLANT_PREFIX = "Please remember this for later: "
#: The bridge turn before the question (``bridge_turn``): a short exchange whose request stores the last filler's
#: reply, so the question finds all of its history but these few tokens in the cache.
BRIDGE = ("Thanks, that helps.", "You're welcome!")


@dataclass(frozen=True)
class FactTemplate:
    """One kind of fact: ``{v}`` is the value to recall, ``{k}`` a distinguishing number (a locker...)."""

    name: str
    statement: str  # planted: PLANT_PREFIX + statement
    question: str
    answer_start: str  # prefilled after the generation prompt (answer_prefix=true)
    kind: str = "number"  # number: a 4-digit value; word: one of WORDS


#: Fact templates, used in turn (task i gets template i % len): each value type and wording equally often.
TEMPLATES: tuple[FactTemplate, ...] = (
    FactTemplate("locker_code", "the access code for locker {k} is {v}.", "What is the access code for locker {k}?",
                 "The access code for locker {k} is"),
    FactTemplate("bike_pin", "the PIN for my bike lock is {v}.", "What is the PIN for my bike lock?",
                 "The PIN for your bike lock is"),
    FactTemplate("hotel_room", "my hotel room number is {v}.", "What is my hotel room number?",
                 "Your hotel room number is"),
    FactTemplate("order_number", "my order number is {v}.", "What is my order number?", "Your order number is"),
    FactTemplate("code_word", "the code word for the meeting is {v}.", "What is the code word for the meeting?",
                 "The code word for the meeting is", kind="word"),
    FactTemplate("dog_name", "my neighbour's dog is called {v}.", "What is my neighbour's dog called?",
                 "Your neighbour's dog is called", kind="word"),
)  # fmt: skip

#: Uncommon words for word-valued facts (capitalised; one token sequence each, never a common answer).
WORDS = (
    "Quillon", "Marzipan", "Tamarind", "Bramble", "Saffron", "Pumice", "Juniper", "Kestrel", "Obsidian",
    "Periwinkle", "Cobalt", "Thistle", "Wombat", "Zephyr", "Nutmeg", "Gadwall", "Brisket", "Halibut",
    "Lichen", "Mandolin", "Ocelot", "Parsnip", "Quokka", "Rhubarb", "Sorrel", "Tapioca", "Vetiver", "Walrus",
)  # fmt: skip


@dataclass
class Fact:
    """A planted fact: what the user says, what is asked later, the answer and the prefilled answer start."""

    template: str
    value: str
    statement: str
    question: str
    answer_start: str


def make_facts(num: int, seed: int, *, avoid: list[str] | None = None) -> list[Fact]:
    """``num`` facts, a pure function of ``(num, seed)`` (and of ``avoid``): template ``i % len(TEMPLATES)``,
    values unique within the list and never occurring (as a whole word) in any text of ``avoid`` (pass the
    chats' filler texts, so a value can only come from its planted fact)."""
    rng = random.Random(f"kvboost-accuracy-facts/{seed}")
    used: set[str] = set()
    blocked = " ".join(f" {normalize_answer(text)} " for text in avoid or [])
    facts = []
    for i in range(num):
        template = TEMPLATES[i % len(TEMPLATES)]
        k = rng.randint(10, 99)
        for attempt in range(2000):  # a value repeats only once the words run out (more word tasks than WORDS)
            value = str(rng.randint(1000, 9999)) if template.kind == "number" else rng.choice(WORDS)
            if f" {normalize_answer(value)} " not in blocked and (value not in used or attempt >= 1000):
                break
        used.add(value)
        facts.append(Fact(template.name, value, PLANT_PREFIX + template.statement.format(k=k, v=value),
                          template.question.format(k=k), template.answer_start.format(k=k)))  # fmt: skip
    return facts


def normalize_answer(text: str) -> str:
    """Lowercase words and numbers separated by single spaces: NFKC, digit-grouping commas dropped
    (``4,821`` -> ``4821``), every other non-alphanumeric character a separator."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return " ".join(re.findall(r"[^\W_]+", text))


def _contains_word(text: str, answer: str) -> bool:
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {normalize_answer(text)} "


@dataclass
class AccuracyConfig:
    perplexity_conversations: int = 2  # part (a); 0 disables it
    perplexity_turns: int = 3
    recall_tasks: int = 12  # part (b); 0 disables it
    filler_turns: int = 2  # ShareGPT turns between the planted fact and the question
    score_tokens: int = 64  # held-out reply tokens scored per turn (its first ones)
    answer_prefix: bool = True  # prefill the answer start of the recall question
    bridge_turn: bool = True  # a short unscored exchange before the question (its history is then ~all cached)
    max_new_tokens: int = 8
    seed: int = 0
    max_user_chars: int | None = 1000
    max_assistant_chars: int | None = 1000
    max_prompt_tokens: int | None = 2048
    system_prompt: str | None = None  # None: the chat template's default

    def __post_init__(self) -> None:
        for name in ("perplexity_turns", "score_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name} must be a positive integer, got {value!r}")
        for name in ("perplexity_conversations", "recall_tasks", "filler_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"workload.{name} must be a non-negative integer, got {value!r}")
        if self.perplexity_conversations == 0 and self.recall_tasks == 0:
            raise ValueError(
                "workload.perplexity_conversations and workload.recall_tasks are both 0: nothing to measure"
            )
        for name in ("answer_prefix", "bridge_turn"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"workload.{name} must be true or false, got {getattr(self, name)!r}")


@WORKLOADS.register("accuracy")
class AccuracyWorkload(Workload):
    """Perplexity of held-out ShareGPT replies and recall of planted facts, turn by turn (module docstring)."""

    config_class = AccuracyConfig

    def __init__(self, *, env: WorkloadEnv, **fields) -> None:
        cfg = AccuracyConfig(**fields)
        self.cfg = cfg
        self.max_new_tokens = cfg.max_new_tokens
        self.tokenizer = env.tokenizer
        self.count_tokens = env.count_tokens
        self.skipped: Counter[str] = Counter()
        ppl_convs, filler_convs = self._load(cfg)
        self.facts = make_facts(
            cfg.recall_tasks, cfg.seed,
            avoid=[" ".join(f"{t.user} {t.assistant}" for t in c.turns) for c in filler_convs],
        )  # fmt: skip
        # Every prompt is fixed in advance (no history depends on generated text): build them all now, so a
        # chat that has to lose fillers to fit max_prompt_tokens does so before anything is measured.
        self._requests: list[Request] = []
        for conv in ppl_convs:
            self._requests += self._perplexity_chat(conv)
        for i, (fact, conv) in enumerate(zip(self.facts, filler_convs)):
            self._requests += self._recall_chat(i, fact, conv)

    # ------------------------------------------------------------------ building
    def _load(self, cfg: AccuracyConfig) -> tuple[list[Conversation], list[Conversation]]:
        """Perplexity conversations, then one filler conversation per recall task (distinct conversations)."""
        ppl = cfg.perplexity_conversations
        need = ppl + (cfg.recall_tasks if cfg.filler_turns else 0)
        if need == 0:
            return [], [Conversation(f"nofiller{i}", []) for i in range(cfg.recall_tasks)]
        turns = max(cfg.perplexity_turns if ppl else 1, cfg.filler_turns)
        convs = load_conversations(
            min_turns=turns, max_turns=turns, num_conversations=need, seed=cfg.seed,
            max_user_chars=cfg.max_user_chars, max_assistant_chars=cfg.max_assistant_chars,
            max_prompt_chars=cfg.max_prompt_tokens * 4 if cfg.max_prompt_tokens else None,
        )  # fmt: skip
        perplexity = [Conversation(c.id, c.turns[: cfg.perplexity_turns], c.system) for c in convs[:ppl]]
        fillers = [Conversation(c.id, c.turns[: cfg.filler_turns], c.system) for c in convs[ppl:]]
        if not cfg.filler_turns:
            fillers = [Conversation(f"nofiller{i}", []) for i in range(cfg.recall_tasks)]
        return perplexity, fillers

    def _system(self) -> list[dict[str, str]]:
        # The conversations' own system prompts are ignored: one system prompt for every chat keeps the parts
        # comparable (and ShareGPT's are mostly absent).
        return [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []

    def _fits(self, prompt) -> bool:
        return not self.cfg.max_prompt_tokens or self.count_tokens(prompt) <= self.cfg.max_prompt_tokens

    def _reply_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(t) for t in ids[: self.cfg.score_tokens]]

    def _sharegpt_turns(self, conv_id: str, history: list[dict[str, str]], turns: list, first_turn: int, *,
                        check_fit: bool = True) -> tuple[list[Request], list[dict[str, str]]]:  # fmt: skip
        """Requests for ``turns`` after ``history`` (each scoring its dataset reply); with ``check_fit`` it stops
        at the first turn over max_prompt_tokens. Returns the requests and the history after the last one."""
        requests = []
        for t, turn in enumerate(turns, start=first_turn):
            messages = history + [{"role": "user", "content": turn.user}]
            if check_fit and not self._fits(messages):
                self.skipped["turns_over_max_prompt_tokens"] += len(turns) - (t - first_turn)
                break
            score = self._reply_ids(turn.assistant)
            requests.append(Request(f"{conv_id}/{t}", conv_id, t, messages, score_ids=score,
                                    info={"task": "perplexity", "score_tokens": len(score)}))  # fmt: skip
            history = messages + [{"role": "assistant", "content": turn.assistant}]
        return requests, history

    def _perplexity_chat(self, conv: Conversation) -> list[Request]:
        return self._sharegpt_turns(f"ppl/{conv.id}", self._system(), conv.turns, 1)[0]

    def _recall_chat(self, index: int, fact: Fact, conv: Conversation) -> list[Request]:
        conv_id = f"recall{index}/{conv.id}"
        plant = self._system() + [{"role": "user", "content": fact.statement}]
        history = plant + [{"role": "assistant", "content": ACK}]
        # Drop fillers from the end until the question fits (then every earlier, shorter prompt fits too).
        for keep in range(len(conv.turns), -1, -1):
            fillers, before = self._sharegpt_turns(conv_id, history, conv.turns[:keep], 2, check_fit=False)
            bridge = None
            if self.cfg.bridge_turn:
                bridge = before + [{"role": "user", "content": BRIDGE[0]}]
                before = bridge + [{"role": "assistant", "content": BRIDGE[1]}]
            question = self._question_prompt(before, fact)
            if self._fits(question):
                break
            self.skipped["fillers_dropped_over_max_prompt_tokens"] += 1
        else:
            self.skipped["recall_tasks_over_max_prompt_tokens"] += 1
            return []
        answer = self.tokenizer((" " if self.cfg.answer_prefix else "") + fact.value, add_special_tokens=False)
        info = {"task": "recall", "template": fact.template, "expected": fact.value,
                "score_tokens": len(answer["input_ids"]), "filler_turns": keep}  # fmt: skip
        turn = len(fillers) + 2
        bridges = []
        if bridge:
            bridges = [Request(f"{conv_id}/{turn}", conv_id, turn, bridge, info={"task": "bridge"})]
            turn += 1
        return [
            Request(f"{conv_id}/1", conv_id, 1, plant, info={"task": "plant", "template": fact.template}),
            *fillers,
            *bridges,
            Request(f"{conv_id}/{turn}", conv_id, turn, question, expected=fact.value,
                    score_ids=[int(t) for t in answer["input_ids"]], info=info),
        ]  # fmt: skip

    def _question_prompt(self, history: list[dict[str, str]], fact: Fact):
        messages = history + [{"role": "user", "content": fact.question}]
        if not self.cfg.answer_prefix:
            return messages
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + fact.answer_start

    # ------------------------------------------------------------------ Workload
    def requests(self) -> Iterator[Request]:
        yield from self._requests

    def num_requests_upper_bound(self) -> int:
        return len(self._requests)

    def is_correct(self, request: Request, output_text: str) -> bool | None:
        if request.expected is None:
            return None
        return is_correct(output_text, request.expected)

    def stats(self) -> dict[str, object]:
        tasks = Counter(r.info.get("task") for r in self._requests)
        return {
            "requests": len(self._requests),
            "perplexity_requests": tasks["perplexity"],
            "recall_tasks": tasks["recall"],
            "unscored_requests": tasks["plant"] + tasks["bridge"],
            "scored_reply_tokens": sum(r.info.get("score_tokens", 0) for r in self._requests
                                       if r.info.get("task") == "perplexity"),
            "templates": dict(Counter(r.info["template"] for r in self._requests if r.info.get("task") == "recall")),
            **{k: v for k, v in self.skipped.items() if v},
        }  # fmt: skip


def is_correct(output_text: str, expected: str) -> bool:
    """Whether the generated text holds the expected answer as whole words, after :func:`normalize_answer`
    (case, punctuation and digit grouping ignored: ``" 4,821."`` holds ``4821``; ``48213`` does not)."""
    return _contains_word(output_text, expected)
