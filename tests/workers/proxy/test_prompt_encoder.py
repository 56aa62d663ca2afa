"""PromptEncoder: the piecewise, cached encoding is exactly the tokenizer's encoding of the whole prompt."""

from __future__ import annotations

from rollq.workers.chat_template import encode, render
from rollq.workers.proxy.prompt_encoder import PromptEncoder
from tests.agents import ADD_TOOL
from tests.scripted import tiny_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief.  "}, {"role": "user", "content": "  lead and trail  \n\n"}],
    [
        {"role": "user", "content": "héllo <tool_call> not a call"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "<|im_end|> inside"},
    ],
]


def test_cached_pieces_give_the_exact_ids_of_a_whole_encode():
    tok = tiny_tokenizer()
    encoder = PromptEncoder(tok, cache_size=4)
    assert encoder.piecewise
    for _ in range(2):  # second round: from the cache
        for messages in CONVERSATIONS:
            for tools in (None, [ADD_TOOL]):
                text = render(tok, messages, tools=tools, add_generation_prompt=True)
                assert encoder.chat(messages, tools) == encode(tok, text)
    assert len(encoder._pieces) <= 4  # bounded


def test_encode_matches_the_tokenizers_own_call():
    tok = tiny_tokenizer()
    for messages in CONVERSATIONS:
        text = render(tok, messages, tools=[ADD_TOOL], add_generation_prompt=True)
        assert encode(tok, text) == tok(text, add_special_tokens=False)["input_ids"]
