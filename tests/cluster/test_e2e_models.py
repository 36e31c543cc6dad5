"""The real app serving a model that is not Llama from an HF directory (`prefixserve serve --model DIR`):
a tiny random Qwen3 saved by transformers, with speculative decoding, read through the openai client,
greedy tokens as transformers'."""
import time

import openai
import pytest
import torch

from cluster.config import ClusterConfig
from replica.executor.checkpoint import load_checkpoint
from tests.executor.test_hf_directory import PROMPTS, save_model

from .test_e2e import metric_values, served

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
transformers = pytest.importorskip("transformers")

METRICS_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory, hf_model = save_model("qwen3", tmp_path_factory)
    config = ClusterConfig(engine={"model": str(directory), "dtype": "float32", "num_kv_blocks": 32,
                                   "num_speculative_tokens": 3}, num_replicas=1)
    with served(config) as base_url:
        yield base_url, directory, hf_model


def test_a_qwen3_directory_served_to_the_openai_client(qwen3):
    base_url, directory, hf_model = qwen3
    tokenizer = load_checkpoint(str(directory)).tokenizer
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert [model.id for model in client.models.list().data] == [directory.name]
        for prompt in PROMPTS:
            completion = client.completions.create(model=directory.name, prompt=prompt, max_tokens=8, temperature=0,
                                                   logprobs=0, extra_body={"ignore_eos": True})
            prompt_ids = tokenizer.encode(prompt)
            with torch.inference_mode():
                theirs = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, min_new_tokens=8,
                                           do_sample=False)[0, len(prompt_ids):].tolist()
            choice = completion.choices[0]
            assert choice.logprobs.tokens == [tokenizer.decode([token], skip_special_tokens=False) for token in theirs]
            # random bytes: the text holds back a UTF-8 sequence the last tokens leave unfinished
            assert choice.text and tokenizer.decode(theirs).startswith(choice.text)
            assert completion.usage.completion_tokens == 8
    # The ingress's view gets the engine's counters through the router feed, moments after the step.
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while not (drafts := metric_values(base_url, "spec_decode_num_draft_tokens_total")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(drafts) == 1 and next(iter(drafts.values())) > 0  # byte-level prompts repeat their bytes
