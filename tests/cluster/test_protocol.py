"""cluster/protocol.py's stream chunks: a chunk of text alone comes from a template, equal to the event dumped whole."""
import json

import pytest

from cluster.protocol import TEXT_MARKER, ChatFormat, CompletionFormat


def dumped_whole(chunk_format, text: str) -> str:
    choice = chunk_format.chunk_choice(text, None, None)
    return f"data: {json.dumps(chunk_format._envelope(chunk_format.chunk_object, [choice]))}\n\n"


@pytest.mark.parametrize("chunk_format", [CompletionFormat("cmpl-1", "model-a"), ChatFormat("chatcmpl-1", "model-a")])
@pytest.mark.parametrize("text", [" word", 'a "quote", a \\ and a line\n', "é 😀 \x00", TEXT_MARKER])
def test_a_text_chunk_is_the_event_dumped_whole_for_every_choice(chunk_format, text):
    first, second = chunk_format.for_choices(2)
    for choice_format in (chunk_format, first, second):
        assert choice_format.chunk(text, None) == dumped_whole(choice_format, text)
    assert json.loads(second.chunk(text, None).removeprefix("data: "))["choices"][0]["index"] == 1


def test_a_chunk_that_finishes_or_has_no_text_is_dumped_whole():
    chunk_format = CompletionFormat("cmpl-2", "model-b")
    chunk = json.loads(chunk_format.chunk(" end", "stop").removeprefix("data: "))
    assert chunk["choices"] == [{"index": 0, "text": " end", "logprobs": None, "finish_reason": "stop"}]
    chat = json.loads(ChatFormat("chatcmpl-2", "model-b").chunk("", None).removeprefix("data: "))
    assert chat["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
