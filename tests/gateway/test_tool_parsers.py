"""Tool-call parsers without HTTP: Hermes `<tool_call>` blocks parsed whole and streamed in any chunking give
the same content and calls; a block that is not a call stays content; the forced shapes (named, required)
parse, and a required list cut short by max_tokens keeps its complete calls."""

from __future__ import annotations

import json

import pytest

from gateway.tool_parsers import HermesToolParser, NamedCallParser, RequiredCallsParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
TEXTS = {
    "content then call": ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "paris"})]),
    "two calls": (CALL + "\n" + CALL.replace("paris", "rome"), None,
                  [("get_weather", {"city": "paris"}), ("get_weather", {"city": "rome"})]),
    "no call": ("plain answer with < and <tool", "plain answer with < and <tool", []),
    "not a call": ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    "unclosed": ("a <tool_call>{\"name\": ", "a <tool_call>{\"name\": ", []),
}


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_hermes_streamed_in_any_chunking_equals_parsed_whole(name, chunk):
    text, content, calls = TEXTS[name]
    whole = HermesToolParser().parse(text)
    assert whole.content == content and _calls(whole.calls) == calls
    parser, got_content, got_calls = HermesToolParser(), "", []
    for i in range(0, len(text), chunk):
        piece = parser.feed(text[i:i + chunk])
        got_content += piece.content
        got_calls += piece.calls
    piece = parser.flush()
    got_content += piece.content
    assert (got_content or None) == content and _calls(got_calls + piece.calls) == calls


def test_calls_get_distinct_openai_ids():
    calls = HermesToolParser().parse(TEXTS["two calls"][0]).calls
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].as_dict()["type"] == "function" and calls[0].as_dict()["function"]["name"] == "get_weather"


def test_named_call_is_the_whole_text_and_streams_its_arguments():
    assert _calls(NamedCallParser("f").parse('{"a": 1}').calls) == [("f", {"a": 1})]
    parser = NamedCallParser("f")
    first, second = parser.feed('{"a"'), parser.feed(": 1}")
    assert first.call_started and not second.call_started and first.call is second.call
    assert first.arguments_delta + second.arguments_delta == '{"a": 1}'


def test_required_calls_parse_and_a_cut_list_keeps_its_complete_calls():
    text = '[{"name": "f", "arguments": {"q": "a"}}, {"name": "g", "arguments": {}}]'
    assert _calls(RequiredCallsParser().parse(text).calls) == [("f", {"q": "a"}), ("g", {})]
    cut = RequiredCallsParser().parse(text[:-20])
    assert _calls(cut.calls) == [("f", {"q": "a"})] and cut.content is None
    assert RequiredCallsParser().parse('[{"na').calls == []
