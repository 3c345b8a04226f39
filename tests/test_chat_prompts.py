"""Plain strings to a chat model: rendered as one user message by default (``chat=None``: auto), raw on request.

Auto renders a plain string when the tokenizer has a chat template and the string holds none of the template's
markup; ``chat=False`` keeps it raw (completions; ``warm`` stores the rendering's start, see below), ``chat=True`` always renders it. Chat messages are
always rendered, token ids never. On the bundled instruct model a raw string gets an empty answer (end of sequence
at once): the integration test below is why auto is the default.
"""

from __future__ import annotations

import pytest
from kvboost_testkit.tiny import ToyTokenizer, tiny_model

from kvboost.prompts import (
    PromptError,
    chat_messages,
    open_user_turn,
    prompt_text_or_ids,
    template_markers,
    wants_chat,
)


class ChatToyTokenizer(ToyTokenizer):
    """The toy tokenizer with a chat template that writes special markup (like ChatML's ``<|im_start|>``)."""

    chat_template = "{% toy chatml %}"
    all_special_tokens = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self(text)["input_ids"] if tokenize else text


def rendered(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def test_markers_are_the_special_tokens_the_template_writes():
    assert template_markers(ChatToyTokenizer()) == ("<|im_start|>", "<|im_end|>")
    assert template_markers(ToyTokenizer()) == ()  # no chat_template: nothing rendered, nothing to detect


def test_auto_renders_a_plain_string_when_the_tokenizer_has_a_template():
    tok = ChatToyTokenizer()
    assert prompt_text_or_ids(tok, "Tell me a joke.") == rendered(tok, "Tell me a joke.")
    assert prompt_text_or_ids(tok, "Tell me a joke.", chat=None) == rendered(tok, "Tell me a joke.")
    assert chat_messages(tok, "Tell me a joke.") == [{"role": "user", "content": "Tell me a joke."}]


def test_chat_false_keeps_raw_text_and_chat_true_always_renders():
    tok = ChatToyTokenizer()
    assert prompt_text_or_ids(tok, "Tell me a joke.", chat=False) == "Tell me a joke."
    assert chat_messages(tok, "Tell me a joke.", chat=False) is None
    already = rendered(tok, "Hi")
    assert prompt_text_or_ids(tok, already, chat=True) == rendered(tok, already)


def test_auto_leaves_text_that_holds_the_templates_markup():
    tok = ChatToyTokenizer()
    already = rendered(tok, "Hi") + "The answer starts"  # a caller-rendered prompt with a prefilled answer start
    assert not wants_chat(tok, already, None)
    assert prompt_text_or_ids(tok, already) == already
    assert chat_messages(tok, already) is None


def test_auto_without_a_template_is_raw_text():
    tok = ToyTokenizer()  # has apply_chat_template, but no chat_template of its own
    assert prompt_text_or_ids(tok, "Tell me a joke.") == "Tell me a joke."
    assert chat_messages(tok, "Tell me a joke.") is None


def test_messages_always_rendered_ids_never():
    tok = ChatToyTokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    for chat in (None, False, True):
        assert prompt_text_or_ids(tok, messages, chat=chat) == rendered(tok, "Hi")
        assert prompt_text_or_ids(tok, [5, 6, 7], chat=chat) == [5, 6, 7]
        assert chat_messages(tok, [5, 6, 7], chat=chat) is None
    with pytest.raises(PromptError, match="empty prompt"):
        prompt_text_or_ids(tok, "   ")


@pytest.fixture
def chat_engine():
    from kvboost import KVBoost

    engine = KVBoost(tiny_model("llama"), ChatToyTokenizer(), model_identity="tiny-llama",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    yield engine
    engine.close()


def test_engine_default_is_auto(chat_engine):
    tok = chat_engine.tokenizer
    assert chat_engine.chat is None
    r = chat_engine.generate("Tell me a joke.", max_new_tokens=2, mode="cold")
    assert r.prompt_ids == tok(rendered(tok, "Tell me a joke."))["input_ids"]
    assert chat_engine.tokenize("Tell me a joke.") == r.prompt_ids


def test_engine_chat_false_and_per_request_raw(chat_engine):
    from kvboost import KVBoost
    from kvboost.engine import SamplingParams

    tok = chat_engine.tokenizer
    raw = tok("Tell me a joke.")["input_ids"]
    # per request (what the server's /v1/completions passes): raw text
    handle = chat_engine.add_request("Tell me a joke.", SamplingParams(max_tokens=1), chat=False)
    while chat_engine.core.has_work():
        chat_engine.step()
    assert handle.prompt_tokens == len(raw)
    chat_engine.close()
    raw_engine = KVBoost(chat_engine.model, tok, model_identity="tiny-llama", chat=False,
                         chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    try:
        assert raw_engine.generate("Tell me a joke.", max_new_tokens=1, mode="cold").prompt_ids == raw
        # a raw engine warms raw text: a document's ids are the same wherever it appears
        assert raw_engine.warm("Tell me a joke.").prompt_tokens == len(raw)
    finally:
        raw_engine.close()


def test_open_user_turn_is_the_rendering_cut_after_the_text():
    tok = ChatToyTokenizer()
    head = open_user_turn(tok, "You are terse.")
    assert head == "<|im_start|>user\nYou are terse."
    assert rendered(tok, "You are terse. Say hi.").startswith(head)
    assert open_user_turn(ToyTokenizer(), "x") is None  # no template: nothing to cut


def test_warm_stores_what_generate_starts_with_in_auto(chat_engine):
    """The original API's flow, warm(system) then generate(system + question), reuses the warmed tokens although
    generate renders the string in the chat template; chat=False warms the raw text (a mid-prompt document)."""
    tok = chat_engine.tokenizer
    system = "You are a terse assistant who answers in one word. " * 4
    warmed = chat_engine.warm(system)
    assert warmed.prompt_tokens == len(tok(open_user_turn(tok, system))["input_ids"])
    result = chat_engine.generate(system + "What is two plus two?", max_new_tokens=1)
    assert result.prompt_ids == tok(rendered(tok, system + "What is two plus two?"))["input_ids"]
    full_chunks = warmed.prompt_tokens // 16 * 16  # the fixture's chunks of 16: whole chunks are exact hits
    assert result.cached_tokens >= full_chunks > 0
    assert chat_engine.warm("A shared document.", chat=False).prompt_tokens == len(tok("A shared document.")["input_ids"])


@pytest.mark.integration
def test_plain_string_gets_an_answer_from_the_bundled_instruct_model():
    from kvboost import KVBoost

    engine = KVBoost.from_pretrained(dtype="float32")
    try:
        r = engine.generate("Tell me a joke.", max_new_tokens=12)
        assert r.output_text.strip(), "a plain string must be rendered in the chat template by default"
        assert r.prompt_ids == engine.tokenize([{"role": "user", "content": "Tell me a joke."}])
        engine.chat = False  # raw text on request: the ids of the text alone
        raw = engine.tokenizer("Tell me a joke.", add_special_tokens=False)["input_ids"]
        assert engine.generate("Tell me a joke.", max_new_tokens=2, mode="cold").prompt_ids == raw
    finally:
        engine.close()
