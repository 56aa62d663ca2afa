"""TextStream: what may be sent while tokens arrive one by one."""

from __future__ import annotations

from rollq.workers.proxy.chat import parse_reply, trim_stop
from rollq.workers.proxy.streaming import TextStream
from tests.agents import CALL_ADD
from tests.scripted import tiny_tokenizer


def feed_one_by_one(stream: TextStream, text: str) -> list[str]:
    return [stream.feed([t]) for t in tiny_tokenizer().encode(text)]


def test_tool_call_blocks_are_never_streamed_as_content():
    text = "Let me add. " + CALL_ADD
    stream = TextStream(tiny_tokenizer(), None, parse_tools=True)
    sent = "".join(feed_one_by_one(stream, text))
    assert sent == "Let me add. "  # nothing of "<tool_call>" leaked, not even a prefix of it
    reply = parse_reply(text, "stop", parse_tools=True)
    assert stream.finish(reply) == "" and reply.tool_calls


def test_a_marker_prefix_is_held_back_until_it_turns_out_to_be_text():
    stream = TextStream(tiny_tokenizer(), None, parse_tools=True)
    sent = "".join(feed_one_by_one(stream, "a <tool is not a call"))
    reply = parse_reply("a <tool is not a call", "stop", parse_tools=True)
    assert sent + stream.finish(reply) == "a <tool is not a call"


def test_stop_strings_are_cut_and_multibyte_characters_are_never_split():
    text = "héllo wörld STOP more"
    stream = TextStream(tiny_tokenizer(), ["STOP"], parse_tools=False)
    pieces = feed_one_by_one(stream, text)
    assert all("\ufffd" not in p for p in pieces)
    reply = parse_reply(trim_stop(text, ["STOP"]), "stop", parse_tools=False)
    assert "".join(pieces) + stream.finish(reply) == "héllo wörld "
