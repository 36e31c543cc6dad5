"""A SentencePiece vocabulary in a GGUF file (Llama 2, Mistral): ids and text as SentencePiece gives them.

The reference is a tiny BPE model trained here with Llama 2's settings; its vocabulary goes into a GGUF
file the way llama.cpp's convert_hf_to_gguf.py writes it.
"""
import io

import gguf
import numpy as np
import pytest

from replica.executor import gguf_loader
from replica.executor.detokenizer import IncrementalDetokenizer
from replica.executor.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog, and the dog sleeps on.
A naïve café owner in 東京 serves crème brûlée, matcha and green tea.
def tokenize(text):
    return [piece for piece in text.split()]
Numbers like 12345 and 3.14159 appear in the text, as do dates: 2024-05-17.
Hello, world! How are you today? I'm fine, thanks for asking.
    Indented lines keep    several   spaces between the words.
Über straße, résumé, façade, coöperate, jalapeño, smörgåsbord.
東京は日本の首都です。京都も有名です。
She said that the weather would be better tomorrow than it was today.
Serving language models means tokenizing prompts and streaming the answers back.
"""
BOS, EOS, SEP = 1, 2, 3

TEXTS = [
    "Hello world", "Hello, world! How are you?", " leading space", "  two leading spaces", "trailing ",
    "several   spaces   inside", "    def tokenize(text):\n        return text", "line one\nline two\n\n",
    "\ttab", "3.14159 and 2024-05-17", "naïve café 東京", "日本語の文字化け", "emoji 😀 and 🎉!", "Ünïcödé",
    "", " ", "\n", "The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def processor():
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT.splitlines()), model_writer=model, model_type="bpe", vocab_size=500,
        hard_vocab_limit=False, character_coverage=1.0, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=BOS, eos_id=EOS, pad_id=-1, user_defined_symbols=["<sep>"], minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def gguf_path(processor, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("spm") / "vocab.gguf")
    write_gguf(path, processor)
    return path


@pytest.fixture(scope="module")
def metadata(gguf_path):
    return gguf_loader.read_metadata(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(metadata):
    return Tokenizer.from_gguf_metadata(metadata)


def write_gguf(path: str, processor) -> None:
    """The vocabulary as convert_hf_to_gguf.py's _create_vocab_sentencepiece writes it, and one dummy tensor."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    ids = range(processor.get_piece_size())
    writer.add_token_list([processor.id_to_piece(i) for i in ids])
    writer.add_token_scores([processor.get_score(i) for i in ids])
    writer.add_token_types([token_type(processor, i) for i in ids])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(processor.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_tensor("token_embd.weight", np.zeros((processor.get_piece_size(), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def token_type(processor, token_id: int) -> gguf.TokenType:
    if processor.is_unknown(token_id):
        return gguf.TokenType.UNKNOWN
    if processor.is_control(token_id):
        return gguf.TokenType.CONTROL
    if processor.is_byte(token_id):
        return gguf.TokenType.BYTE
    if processor.id_to_piece(token_id) == "<sep>":  # sentencepiece's Python API has no is_user_defined
        return gguf.TokenType.USER_DEFINED
    return gguf.TokenType.NORMAL


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_sentencepiece(tokenizer, processor, text):
    token_ids = tokenizer.encode(text)
    assert token_ids == [BOS] + processor.encode(text)
    assert tokenizer.decode(token_ids) == processor.decode(token_ids) == text


def test_the_vocabulary_is_exercised(tokenizer, processor):
    """Multi-character and multi-byte pieces, runs of "▁", and bytes with no piece of their own are all used."""
    pieces = {processor.id_to_piece(i) for text in TEXTS for i in tokenizer.encode(text)}
    assert {"▁tokeniz", "afé", "▁東京", "▁▁▁▁", "<0xF0>", "<0x0A>"} <= pieces


@pytest.mark.parametrize("prompt, completion", [
    ("Hello", "world, naïve café 東京 😀!"),
    ("A prompt ending in a newline\n", "Über 日本語 🎉"),
    ("", "Hello there"),
])
def test_streamed_text_is_the_one_shot_decode(tokenizer, processor, prompt, completion):
    prompt_ids = tokenizer.encode(prompt)
    output_ids = processor.encode(completion)  # as a model would write it: each word with its leading "▁"
    expected = processor.decode(prompt_ids + output_ids)[len(processor.decode(prompt_ids)):]
    # the completion's first "▁" is a space after a prompt, and nothing at the very start
    assert expected == (" " + completion if prompt else completion)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])
    pieces = [detokenizer.update([token_id], finished=index == len(output_ids) - 1)[0]
              for index, token_id in enumerate(output_ids)]
    assert "".join(pieces) == expected


def test_control_tokens_in_the_text_are_special(tokenizer, processor):
    """As llama.cpp (parsing special tokens) and transformers do; SentencePiece would spell "<s>" out.
    llama.cpp prefixes a space to text after a special token, as at the start."""
    assert tokenizer.encode("<s>Hello world</s>") == [BOS, BOS] + processor.encode("Hello world") + [EOS]
    assert tokenizer.decode(tokenizer.encode("<s>Hello world</s>")) == "Hello world"


def test_user_defined_tokens_stay_whole(tokenizer, processor):
    assert tokenizer.encode("Hello<sep>") == [BOS] + processor.encode("Hello<sep>")
    # llama.cpp prefixes a space to text after any added token; SentencePiece does not
    assert tokenizer.encode("<sep>Hello") == [BOS, SEP] + processor.encode("Hello")


def test_without_the_space_prefix(metadata):
    with_prefix = Tokenizer.from_gguf_metadata(metadata)
    without_prefix = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_space_prefix": False})
    assert without_prefix.encode(" Hello world") == with_prefix.encode("Hello world")
    assert without_prefix.decode(with_prefix.encode("Hello world")) == " Hello world"


def test_bos_and_eos_where_the_file_asks(metadata, processor):
    as_asked = Tokenizer.from_gguf_metadata(
        {**metadata, "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    assert as_asked.encode("Hello") == processor.encode("Hello") + [EOS]
    unsaid = {key: value for key, value in metadata.items() if key != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_gguf_metadata(unsaid).encode("Hello") == [BOS] + processor.encode("Hello")


def test_an_unknown_tokenizer_model_is_named(metadata):
    with pytest.raises(ValueError, match="GGUF tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"})


def test_a_sentencepiece_vocabulary_without_scores_is_refused(metadata):
    without_scores = {key: value for key, value in metadata.items() if key != "tokenizer.ggml.scores"}
    with pytest.raises(ValueError, match="GGUF tokenizer model 'llama' needs tokenizer.ggml.scores, which the file"):
        Tokenizer.from_gguf_metadata(without_scores)


@pytest.mark.slow
def test_ids_match_transformers_gguf_conversion(tokenizer, gguf_path):
    """transformers' own tokenizer from the same file, where it agrees with SentencePiece: its Metaspace
    prefixes no "▁" to text that starts with a space, or to text after a special token."""
    gguf_tokenizer = pytest.importorskip("transformers.integrations.gguf")
    if "llama" not in getattr(gguf_tokenizer, "GGUF_TOKENIZER_ARCHS", {"llama"}):  # transformers 5.17 had none
        pytest.skip("this transformers builds no llama tokenizer from a GGUF")
    architecture, tokenizer_dict, _ = gguf_tokenizer.get_gguf_tokenizer(gguf_path)
    reference, _ = gguf_tokenizer.convert_gguf_tokenizer(architecture, tokenizer_dict)
    for text in TEXTS:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        if not text[:1].isspace():
            assert token_ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tokenizer.decode(token_ids) == reference.decode(token_ids, skip_special_tokens=True), text
