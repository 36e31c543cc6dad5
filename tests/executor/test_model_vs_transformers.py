"""The whole default model against an independent implementation: transformers loading the same GGUF.

Both run in fp32 on CPU. Greedy continuations must be token-for-token equal; last-position logits
must agree within LOGIT_ATOL (measured max difference: about 3e-5 on logits of magnitude ~20).
"""
import pytest
import torch

from kernels import get_ops
from replica.engine import LLM
from replica.executor.checkpoint import default_model_path, load_checkpoint
from replica.executor.weights import build_model
from replica.request import SamplingParams
from tests.executor.helpers import last_position_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LOGIT_ATOL = 1e-3
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name 3 prime numbers."}],
]
TEXTS = ["The quick brown fox", "import numpy as np\n\ndef softmax(x):", "Les élèves ont 12 ans; ils aiment"]
NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_checkpoint().tokenizer
    return ([tokenizer.apply_chat_template(chat) for chat in CHATS]
            + [tokenizer.encode(text) for text in TEXTS])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_last_position_logits_match(hf_model, prompts, backend):
    model = build_model(load_checkpoint(), dtype=torch.float32, device=torch.device("cpu"), ops=get_ops(backend))
    for prompt in prompts:
        ours = last_position_logits(model, prompt)
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)


def test_greedy_continuations_match(hf_model, prompts):
    llm = LLM(dtype="float32", num_kv_blocks=64)  # the CPU (C++) kernels: the default on CPU
    ours = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0))
    for prompt, output in zip(prompts, ours):
        with torch.inference_mode():
            theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
        assert output.token_ids == theirs[0, len(prompt):].tolist()


def test_tokenizer_and_chat_template_match(hf_tokenizer):
    tokenizer = load_checkpoint().tokenizer
    for text in [*TEXTS, "  two  spaces, tabs\tand 😀 emoji 1234567", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.encode(text) == hf_tokenizer(text).input_ids
        assert tokenizer.decode(tokenizer.encode(text)) == hf_tokenizer.decode(
            hf_tokenizer(text).input_ids, skip_special_tokens=True)
    for chat in CHATS:
        assert tokenizer.apply_chat_template(chat) == hf_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False)
