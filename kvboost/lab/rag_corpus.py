"""A RAG corpus with planted facts, and queries over reordered document subsets (the ``rag_reorder`` workload).

Documents are real text: long, prose-like, almost-pure-ASCII assistant messages from the ShareGPT data
(``kvboost/lab/sharegpt_data.py``), cut at a sentence end to about ``doc_tokens`` tokens. Into each one a single
*fact sentence* about a made-up subject is planted at a random interior sentence boundary (never before the first
or after the last sentence), e.g. ``Project Juniper has the access code 4817.`` Subjects are unique within
a corpus, and so are the answers (4-digit numbers that occur in no document's text), so a question has exactly
one right answer and it can only come from the one document that holds it; without the documents the answer
cannot be guessed (about 1 in 9000).

Facts share one shape, ``Project <subject> has the <relation> <answer>.``, with twelve relations ("access code",
"room number", ...; :data:`RELATIONS`). Every document of a query holds such a fact, so the model has to find the
one whose subject *and* relation match the question; with 24 documents each relation occurs twice, so about a
sixth to a quarter of the queries also hold a distractor with the target's very relation. (With a single relation
for all facts SmolLM2-135M picks the right document only ~50% of the time; with 8 relations ~85%, with 12 ~93%.)

A query takes one *target* document (the one with the answer) and ``docs_per_query - 1`` others, in a fresh
random order; the target's position is balanced over queries (each position about equally often).

Prompt layout (:func:`render_prompt`), with ``S`` the separator (default ``"\\n\\n"``)::

    <chat template: system prompt, then the user turn>
    Question: What is the access code of Project Juniper?{S}Documents:{S}<doc 1>{S}<doc 2>{S}...{S}<doc k>{S}
    Answer the question using the documents above. Question: What is the access code of Project Juniper?
    <end of user turn, assistant header>Project Juniper has the access code

i.e. the question comes before and after the documents (``layout="question_both"``, the default;
``layout="question_after"`` leaves out the first ``Question: ...{S}`` piece, so the user turn starts with
``Documents:`` and the question comes only after the documents, as the CacheBlend paper asks it), every document is exactly one ``S``-delimited piece of
the prompt text (byte-identical wherever it appears: no numbering or titles inside it; document texts never
contain the separator: paragraph breaks are normalised to single newlines), and the start of the answer is
prefilled after the generation prompt, so the model continues with `` 4817.``. The answer is scored with
:func:`is_correct` (the first number of the first output line must be the answer).

API::

    from kvboost.lab.rag_corpus import build_corpus, build_queries, render_prompt, is_correct
    docs = build_corpus(num_documents=24, seed=0, doc_tokens=280,
                        count_tokens=lambda t: len(tok(t, add_special_tokens=False)["input_ids"]))
    queries = build_queries(docs, num_queries=60, docs_per_query=5, seed=0)
    by_id = {d.doc_id: d for d in docs}
    prompt = render_prompt(tok, queries[0], by_id)      # text; tokenize it segment-wise at the separator
    is_correct(" 4817. The", queries[0].answer)          # -> True iff the answer is 4817

Determinism: everything is a pure function of the arguments (and of the ShareGPT file); ``count_tokens`` decides
where documents are cut, so pass the tokenizer of the model you measure (``None`` estimates 4.6 characters per token).
Speed: the ShareGPT index is cached by ``sharegpt_data`` (the first use in a fresh cache parses the 125 MB file
once, ~1-2 s); afterwards building a 24-document corpus decodes only the few conversations it looks at (~0.1-0.3 s
with a fast tokenizer as ``count_tokens``).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_SEPARATOR",
    "DEFAULT_SYSTEM_PROMPT",
    "LAYOUTS",
    "Document",
    "RagQuery",
    "build_corpus",
    "build_queries",
    "is_correct",
    "prompt_messages",
    "render_prompt",
]

DEFAULT_SEPARATOR = "\n\n"
#: Where the question goes: before and after the documents (default), or only after them (the CacheBlend paper's).
LAYOUTS = ("question_both", "question_after")
DEFAULT_SYSTEM_PROMPT = (
    "You answer questions using only the documents the user provides. "
    "Reply with the exact value stated in the documents."
)
#: Without a ``count_tokens`` callable, token counts are estimated as characters / this.
CHARS_PER_TOKEN = 4.6

#: The relations of the planted facts ("Project Juniper has the <relation> 4817."). Document ``i`` of a corpus
#: uses relation ``i % len(RELATIONS)``: with 24 documents every relation is held by two documents, so some
#: queries hold a distractor with the target's very relation and only the subject tells them apart.
RELATIONS: tuple[str, ...] = (
    "access code", "room number", "badge number", "locker number", "budget code", "license number",
    "serial number", "postal code", "account number", "gate number", "phone extension", "order number",
)  # fmt: skip
FACT_TEMPLATE = "Project {subject} has the {relation} {answer}."
QUESTION_TEMPLATE = "What is the {relation} of Project {subject}?"
#: The answer prefix ends where the answer (with its leading space) follows.
#: A document shorter than this leaves too little real text around its planted fact.
MIN_DOC_TOKENS = 64

ANSWER_PREFIX_TEMPLATE = "Project {subject} has the {relation}"

#: Made-up project names (one word, capitalised); a name that occurs in any chosen text is skipped.
SUBJECT_NAMES = (
    "Juniper", "Falcon", "Cobalt", "Heron", "Saffron", "Granite", "Willow", "Orchid", "Sparrow", "Topaz",
    "Cedar", "Marigold", "Osprey", "Basalt", "Lantern", "Thistle", "Magpie", "Quartz", "Hazel", "Pelican",
    "Indigo", "Bramble", "Kestrel", "Amber", "Sycamore", "Walrus", "Cinnabar", "Lotus", "Puffin", "Jasper",
    "Nutmeg", "Hemlock", "Starling", "Obsidian", "Clover", "Badger", "Vermilion", "Aspen", "Tamarind", "Otter",
    "Fennel", "Mulberry", "Gannet", "Zircon", "Tulip", "Lynx", "Sorrel", "Beacon", "Cypress", "Plover",
    "Garnet", "Larkspur", "Ibis", "Mistral", "Acorn", "Walnut", "Cormorant", "Sapphire", "Dandelion", "Marten",
    "Peregrine", "Alder", "Coriander", "Tundra", "Wren", "Onyx", "Primrose", "Bison", "Chestnut", "Finch",
    "Rosewood", "Tamarack", "Pumice", "Camellia", "Harrier", "Lichen", "Maple", "Nightjar", "Opal", "Quince",
    "Raven", "Sequoia", "Teal", "Umber", "Verbena", "Wombat", "Yarrow", "Zephyr", "Anise", "Barley",
    "Caraway", "Dunlin", "Egret", "Foxglove", "Gorse", "Hornbeam", "Iris", "Jackdaw", "Kingfisher", "Linden",
    "Mallow", "Nettle", "Oriole", "Parsnip", "Redwood", "Snowdrop", "Tansy", "Viburnum", "Wisteria", "Bluebell",
    "Curlew", "Damson", "Elderberry", "Fieldfare", "Goldcrest", "Heather", "Ironwood", "Juncus", "Kelp", "Lapwing",
)  # fmt: skip


@dataclass
class Document:
    """One corpus document: real text with one planted fact about ``subject`` whose value is ``answer``.

    ``text`` never contains a blank line (it is one separator-delimited segment of a prompt). ``fact`` is the
    planted sentence (a substring of ``text``), ``question`` / ``answer_prefix`` ask for it and start the
    answer, ``source`` names the ShareGPT message it came from (``conversation id:turn``).
    """

    doc_id: str
    text: str
    subject: str
    answer: str
    fact: str = ""
    question: str = ""
    answer_prefix: str = ""
    relation: str = ""
    source: str = ""


@dataclass
class RagQuery:
    """One query: ``doc_ids`` in prompt order, one of them (``target_doc``) holds the answer."""

    query_id: str
    doc_ids: list[str]
    target_doc: str
    question: str
    answer: str
    answer_prefix: str

    @property
    def target_position(self) -> int:
        return self.doc_ids.index(self.target_doc)


# ------------------------------------------------------------------------------------------ text handling
_BLANK_LINES = re.compile(r"\n[ \t]*(?:\n[ \t]*)+")
_TRAILING_SPACE = re.compile(r"[ \t]+\n")
# A sentence end: punctuation (plus an optional closing quote/bracket), whitespace, then a capital or quote.
_SENTENCE_END = re.compile(r"([.!?][\"')\]]?)(\s+)(?=[\"'(]?[A-Z])")
_LAST_WORD = re.compile(r"([A-Za-z0-9]+)[.!?][\"')\]]?$")
_ABBREVIATIONS = frozenset({"e", "g", "i", "eg", "ie", "mr", "mrs", "ms", "dr", "st", "vs", "etc", "no", "fig",
                            "inc", "ltd", "jr", "sr", "approx", "al"})
_CODE_CHARS = set("{}[]<>=;_#*`|\\/~^$@")
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def normalize_text(text: str) -> str:
    """Whitespace normalisation of a source message: no ``\\r``, tabs or trailing spaces, no blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    text = _TRAILING_SPACE.sub("\n", text)
    text = _BLANK_LINES.sub("\n", text)
    return text.strip()


def sentence_boundaries(text: str) -> list[tuple[int, int]]:
    """``(end, next_start)`` for every sentence end in ``text``: ``text[:end]`` ends a sentence, the next sentence
    starts at ``next_start`` (the whitespace between them is ``text[end:next_start]``)."""
    out = []
    for m in _SENTENCE_END.finditer(text):
        end = m.end(1)
        word = _LAST_WORD.search(text, max(0, end - 40), end)
        if word is None:
            continue
        w = word.group(1)
        # "1." (list items), "A." (initials), "e.g." and friends are not sentence ends
        if len(w) < 2 or w.isdigit() or w.lower() in _ABBREVIATIONS:
            continue
        out.append((end, m.end(2)))
    return out


def _is_prose(text: str) -> bool:
    """A crude filter for running English prose: no code, little markup, mostly long lines of words."""
    if not text or not text[0].isupper():
        return False
    if "```" in text or "<|" in text or "|>" in text or "http" in text:
        return False
    if len(text.encode("ascii", "ignore")) < 0.995 * len(text):
        return False
    if sum(c in _CODE_CHARS for c in text) > 0.005 * len(text):
        return False
    letters = sum(c.isalpha() for c in text)
    if letters < 0.75 * len(text.replace(" ", "").replace("\n", "")):
        return False
    lines = text.split("\n")
    # long lines of words (paragraphs) carry most of the characters: no lists of short items
    prose_chars = sum(len(line) for line in lines if len(line.split()) >= 12)
    return prose_chars >= 0.85 * len(text)


# --------------------------------------------------------------------------------------------- sources
def _candidate_messages(seed: int, path: Any = None, min_chars: int = 1400, max_chars: int = 12000):
    """Yield ``(source, text)`` of long, mostly-ASCII assistant messages, in a seeded order, one per
    conversation family (``abc_0``, ``abc_1``... count once), decoding conversations lazily by byte span."""
    from kvboost.lab import sharegpt_data as sg

    with sg._source_path(path) as src:
        index = sg._load_index(src)  # cached index: no full parse after the first use
        candidates = []
        for entry in index.entries:
            for i, (_, _, chars, ascii_chars) in enumerate(entry.turns):
                if min_chars <= chars <= max_chars and ascii_chars >= 0.99 * chars:
                    candidates.append((entry.id, i, entry))
        candidates.sort(key=lambda c: (c[0], c[1]))
        random.Random(f"rag_corpus:{seed}:order").shuffle(candidates)
        seen_families: set[str] = set()
        with src.open("rb") as f:
            for conv_id, turn, entry in candidates:
                family = entry.source_id.rsplit("_", 1)[0]
                if family in seen_families:
                    continue
                f.seek(entry.byte_start)
                raw = json.loads(f.read(entry.byte_end - entry.byte_start).decode("utf-8"))
                conv = sg.normalize_conversation(raw, fallback_id=entry.source_id)
                if conv is None or turn >= len(conv.turns):
                    continue
                text = normalize_text(conv.turns[turn].assistant)
                if _is_prose(text):
                    seen_families.add(family)
                    yield f"{conv_id}:{turn}", text


def _cut(text: str, budget: int, count_tokens: Callable[[str], int]) -> tuple[str, list[tuple[int, int]]] | None:
    """The longest prefix of ``text`` ending at a sentence end with at most ``budget`` tokens (``None`` when it
    would be shorter than 3/4 of the budget or hold fewer than 4 sentences), and its inner boundaries."""
    bounds = sentence_boundaries(text)
    ends = [b[0] for b in bounds] + ([len(text)] if text[-1] in ".!?" else [])
    if not ends:
        return None
    # binary search on the (monotone) token count of prefixes
    lo, hi, best = 0, len(ends) - 1, -1
    while lo <= hi:
        mid = (lo + hi) // 2
        if count_tokens(text[: ends[mid]]) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best < 3:  # fewer than 4 sentences
        return None
    prefix = text[: ends[best]]
    if count_tokens(prefix) < 0.75 * budget:
        return None
    return prefix, [b for b in bounds if b[0] < ends[best]]


def _default_count_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def build_corpus(
    num_documents: int = 24,
    seed: int = 0,
    doc_tokens: int = 280,
    count_tokens: Callable[[str], int] | None = None,
    *,
    path: Any = None,
) -> list[Document]:
    """Build ``num_documents`` documents of about ``doc_tokens`` tokens each (fact included), deterministically.

    Args:
        num_documents: corpus size (at most ``len(SUBJECT_NAMES)``).
        seed: picks the source messages, subjects, answers and where facts are planted.
        doc_tokens: target length; a document has between ~3/4 of it and it (measured with ``count_tokens``).
        count_tokens: ``text -> number of tokens`` (the tokenizer of the model measured); ``None``: ~4
            characters per token.
        path: a ShareGPT JSON file instead of the packaged one.

    Returns:
        Documents ``doc00``, ``doc01``, ... Subjects are unique and occur in no other document's text; answers
        are unique 4-digit numbers that occur in no document's text.
    """
    if isinstance(num_documents, bool) or not isinstance(num_documents, int) or num_documents < 1:
        raise ValueError(f"num_documents must be a positive integer, got {num_documents!r}")
    if num_documents > len(SUBJECT_NAMES):
        raise ValueError(f"num_documents={num_documents} exceeds the {len(SUBJECT_NAMES)} subject names available")
    if isinstance(doc_tokens, bool) or not isinstance(doc_tokens, int) or doc_tokens < MIN_DOC_TOKENS:
        raise ValueError(f"doc_tokens must be an integer >= {MIN_DOC_TOKENS}, got {doc_tokens!r}")
    count = count_tokens or _default_count_tokens
    rng = random.Random(f"rag_corpus:{seed}:plant")
    subjects = list(SUBJECT_NAMES)
    random.Random(f"rag_corpus:{seed}:subjects").shuffle(subjects)

    # the longest fact sentence, so every document fits its budget whatever subject it gets
    longest = max(subjects, key=len)
    fact_tokens = max(count(FACT_TEMPLATE.format(subject=longest, relation=r, answer="8888")) for r in RELATIONS) + 1
    budget = doc_tokens - fact_tokens

    chosen: list[tuple[str, str, list[tuple[int, int]]]] = []
    with contextlib.closing(_candidate_messages(seed, path)) as candidates:  # closes the source file early
        for source, text in candidates:
            cut = _cut(text, budget, count)
            if cut is None:
                continue
            chosen.append((source, *cut))
            if len(chosen) == num_documents:
                break
    if len(chosen) < num_documents:
        raise ValueError(f"only {len(chosen)} ShareGPT messages pass the document filters; ask for fewer documents")

    all_text = "\n".join(t for _, t, _ in chosen)
    lowered_words = set(re.findall(r"[a-z]+", all_text.lower()))
    numbers_in_text = set(re.findall(r"\d+", all_text))
    usable = [s for s in subjects if s.lower() not in lowered_words]
    if len(usable) < num_documents:
        raise ValueError("not enough subject names absent from the chosen texts")

    answer_rng = random.Random(f"rag_corpus:{seed}:answers")
    answers: list[str] = []
    while len(answers) < num_documents:
        a = str(answer_rng.randint(1000, 9999))
        # unique, absent from every text (also as part of a longer number), no digit three times in a row
        if a in answers or any(a in n for n in numbers_in_text) or re.search(r"(\d)\1\1", a):
            continue
        answers.append(a)

    docs = []
    for i, ((source, text, bounds), subject, answer) in enumerate(zip(chosen, usable, answers, strict=False)):
        relation = RELATIONS[i % len(RELATIONS)]
        fact = FACT_TEMPLATE.format(subject=subject, relation=relation, answer=answer)
        end, next_start = bounds[rng.randrange(len(bounds))]  # an inner boundary: never first or last
        ws = text[end:next_start]
        ws = ws if "\n" in ws else " "  # at a line break the fact becomes a line of its own
        planted = f"{text[:end]}{ws}{fact}{ws}{text[next_start:]}"
        docs.append(Document(
            doc_id=f"doc{i:02d}", text=planted, subject=subject, answer=answer, fact=fact,
            question=QUESTION_TEMPLATE.format(subject=subject, relation=relation),
            answer_prefix=ANSWER_PREFIX_TEMPLATE.format(subject=subject, relation=relation), relation=relation,
            source=source,
        ))  # fmt: skip
    return docs


# --------------------------------------------------------------------------------------------- queries
def build_queries(
    corpus: Sequence[Document], num_queries: int = 60, docs_per_query: int = 5, seed: int = 0
) -> list[RagQuery]:
    """``num_queries`` queries of ``docs_per_query`` documents each, deterministically from ``seed``.

    Targets cycle through the corpus in a shuffled order (each document is a target about equally often); the
    other documents are a fresh random sample; the target's position cycles through a shuffled schedule (each
    position about equally often); the others are in a random order. The first ``n`` queries are the same for
    any ``num_queries >= n``.
    """
    if isinstance(docs_per_query, bool) or not isinstance(docs_per_query, int) or docs_per_query < 1:
        raise ValueError(f"docs_per_query must be a positive integer, got {docs_per_query!r}")
    if docs_per_query > len(corpus):
        raise ValueError(f"docs_per_query={docs_per_query} exceeds the corpus size {len(corpus)}")
    if isinstance(num_queries, bool) or not isinstance(num_queries, int) or num_queries < 0:
        raise ValueError(f"num_queries must be a non-negative integer, got {num_queries!r}")
    ids = [d.doc_id for d in corpus]
    by_id = {d.doc_id: d for d in corpus}
    # Every draw comes from its own seeded stream (per block of targets / positions, per query), so a longer
    # request extends a shorter one: the first n queries do not depend on num_queries.
    targets: list[str] = []
    positions: list[int] = []
    while len(targets) < num_queries:
        block = list(ids)
        random.Random(f"rag_queries:{seed}:targets:{len(targets) // len(ids)}").shuffle(block)
        targets.extend(block)
    while len(positions) < num_queries:
        block = list(range(docs_per_query))
        random.Random(f"rag_queries:{seed}:positions:{len(positions) // docs_per_query}").shuffle(block)
        positions.extend(block)
    queries = []
    for i in range(num_queries):
        target = by_id[targets[i]]
        rng = random.Random(f"rag_queries:{seed}:query:{i}")
        order = rng.sample([d for d in ids if d != target.doc_id], docs_per_query - 1)
        order.insert(positions[i], target.doc_id)
        queries.append(RagQuery(
            query_id=f"q{i:03d}", doc_ids=order, target_doc=target.doc_id, question=target.question,
            answer=target.answer, answer_prefix=target.answer_prefix,
        ))  # fmt: skip
    return queries


# ---------------------------------------------------------------------------------------------- prompts
def prompt_messages(
    query: RagQuery,
    docs_by_id: dict[str, Document],
    separator: str = DEFAULT_SEPARATOR,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    include_documents: bool = True,
    layout: str = "question_both",
) -> list[dict[str, str]]:
    """The chat messages of a query (system, user); ``include_documents=False`` leaves the documents out (a
    control: the answer must then be unguessable). ``layout``: one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    before = [f"Question: {query.question}"] if layout == "question_both" else []
    after = f"Answer the question using the documents above. Question: {query.question}"
    if include_documents:
        pieces = [*before, "Documents:", *(docs_by_id[d].text for d in query.doc_ids), after]
    else:
        pieces = [*before, f"Answer the question. Question: {query.question}"]
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": separator.join(pieces)}]


def render_prompt(
    tokenizer: Any,
    query: RagQuery,
    docs_by_id: dict[str, Document],
    separator: str = DEFAULT_SEPARATOR,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    include_documents: bool = True,
    layout: str = "question_both",
) -> str:
    """The whole prompt as text: the chat template (with the generation prompt) plus the prefilled answer start.

    Every document of the query is exactly one ``separator``-delimited piece of the result (checked: a document
    or a template piece holding the separator raises ``ValueError``).
    """
    if not separator:
        raise ValueError("separator must be a non-empty string")
    for piece in (system_prompt, query.question, query.answer_prefix):
        if separator in piece:
            raise ValueError(f"the separator {separator!r} occurs in {piece[:60]!r}")
    if include_documents:
        for d in query.doc_ids:
            if separator in docs_by_id[d].text:
                raise ValueError(f"document {d} contains the separator {separator!r}; it would not be one segment")
    messages = prompt_messages(query, docs_by_id, separator, system_prompt, include_documents, layout)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text += query.answer_prefix
    if include_documents:
        pieces = text.split(separator)
        for d in query.doc_ids:
            if pieces.count(docs_by_id[d].text) != 1:
                raise ValueError(f"document {d} is not exactly one {separator!r}-delimited piece of the prompt")
    return text


# ---------------------------------------------------------------------------------------------- scoring
def is_correct(output_text: str, answer: str) -> bool:
    """Whether a generated continuation gives ``answer``.

    Looks at the first non-empty line only. A numeric answer must be the *first number* of that line (digit
    grouping commas are ignored, so ``4,817`` counts; ``48170``, ``14817`` or ``4817.5`` do not); any other
    answer must occur in that line as a whole word (case-insensitive).
    """
    if not answer:
        return False
    line = next((ln.strip() for ln in output_text.splitlines() if ln.strip()), "")
    if answer.isdigit():
        m = _NUMBER.search(line)
        return m is not None and m.group(0).replace(",", "") == answer
    pattern = r"(?<![A-Za-z0-9])" + re.escape(answer) + r"(?![A-Za-z0-9])"
    return re.search(pattern, line, flags=re.IGNORECASE) is not None
