import pytest

from replica.executor.detokenizer import IncrementalDetokenizer
from replica.executor.tokenizer import Tokenizer
from tests.executor.helpers import byte_tokenizer_backend

TOKENIZER = Tokenizer(byte_tokenizer_backend(), bos_token_id=256, eos_token_id=257, chat_template=None)


def stream(text: str, stop: list[str], extra_tokens: list[int] = ()) -> list[tuple[str, bool]]:
    """Feed text's tokens one at a time until a stop (the last one finishing) -> [(released text, stopped)]."""
    detokenizer = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("prompt"), stop)
    token_ids = TOKENIZER.encode(text) + list(extra_tokens)
    steps = []
    for index, token_id in enumerate(token_ids):
        steps.append(detokenizer.update([token_id], finished=index == len(token_ids) - 1))
        if steps[-1][1]:
            break
    return steps


def test_multibyte_characters_are_released_whole():
    steps = stream("é😀!", stop=[])
    # é is 2 bytes, 😀 is 4: nothing comes out until a character is complete
    assert [text for text, _ in steps] == ["", "é", "", "", "", "😀", "!"]


def test_special_tokens_are_not_in_the_text():
    assert "".join(text for text, _ in stream("ok", stop=[], extra_tokens=[257])) == "ok"


def test_stop_string_cuts_the_text_and_holds_back_a_possible_prefix():
    steps = stream("ab, cd, ef", stop=["d,", "zzz"])
    # up to 2 characters (longest stop - 1) stay back while they could start a stop string
    assert steps == [("", False), ("", False), ("a", False), ("b", False), (",", False), (" ", False),
                     ("c", True)]


def test_stop_string_across_a_multibyte_character():
    steps = stream("x😀y", stop=["😀"])
    assert "".join(text for text, _ in steps) == "x"
    assert steps[-1][1] is True
    assert len(steps) == 5  # stopped on the emoji's last byte; "y" never decoded


def test_without_a_stop_everything_is_released_at_the_end():
    steps = stream("hello", stop=["lo!"])
    assert [text for text, _ in steps] == ["", "", "h", "e", "llo"]
    assert not any(stopped for _, stopped in steps)


@pytest.mark.parametrize("text, stop", [("aé😀 b, cd, ef", ["d,"]), ("x😀y z", ["😀y"]), ("plain text", [])])
def test_given_the_tokens_so_far_it_releases_exactly_what_was_not_released(text, stop):
    """A migrated request: a fresh detokenizer given the output so far continues the lost one's text."""
    whole = stream(text, stop)
    token_ids = TOKENIZER.encode(text)[:len(whole)]
    for split in range(len(whole)):
        resumed = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("prompt"), stop, token_ids[:split])
        rest = [resumed.update([token_id], finished=index == len(whole) - 1)
                for index, token_id in enumerate(token_ids[split:], split)]
        assert rest == whole[split:], split
