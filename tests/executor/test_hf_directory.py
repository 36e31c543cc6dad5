"""Loading a Hugging Face directory (config.json + safetensors + tokenizer.json): tiny random Llama
(untied LM head; plain, llama3-scaled and linearly scaled RoPE) and Qwen2 (q/k/v biases, tied head)
saved by transformers, checked against it."""
import json

import pytest
import torch

from kernels import get_ops
from replica.engine import LLM
from replica.executor.checkpoint import load_checkpoint
from replica.executor.weights import build_model
from replica.request import SamplingParams
from tests.executor.helpers import byte_tokenizer_backend, last_position_logits

transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
SHAPE = {"vocab_size": 258, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 5000.0,
         "initializer_range": 0.3, "bos_token_id": 256, "eos_token_id": 257}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # head_dim 16, theta 5000: wavelengths in all three bands
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False)),
    "llama3_rope": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE)),
    "linear_rope": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SHAPE, tie_word_embeddings=False, sliding_window=128)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(  # head_dim 32, not 64 / 4
        **SHAPE, head_dim=32, tie_word_embeddings=True)),
}
PROMPTS = ["hello world", "The quick brown fox jumps over"]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    return save_model(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_model("llama", tmp_path_factory)[0]


def save_model(kind: str, tmp_path_factory):
    torch.manual_seed(0)
    hf_model = MODELS[kind]().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):  # transformers starts them at zero
                param.normal_(std=0.3)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # and these at one
                param.normal_(mean=1.0, std=0.3)
    directory = tmp_path_factory.mktemp(kind)
    hf_model.save_pretrained(directory)
    byte_tokenizer_backend().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))
    return directory, hf_model


def test_config_and_tokenizer_come_from_the_directory(model_dir):
    directory, hf_model = model_dir
    checkpoint = load_checkpoint(str(directory))
    config = checkpoint.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2, 4, 2, 32 if directory.name.startswith("qwen3") else 16)
    assert config.attention_bias == (directory.name.startswith("qwen2"))
    assert config.qk_norm == (directory.name.startswith("qwen3"))
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    tokenizer = checkpoint.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "<s>user: hi\nassistant:"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])[0] == 256


def test_logits_and_greedy_tokens_match_transformers(model_dir):
    directory, hf_model = model_dir
    model = build_model(load_checkpoint(str(directory)), dtype=torch.float32, device=torch.device("cpu"),
                        ops=get_ops("torch"))
    llm = LLM(str(directory), dtype="float32", num_kv_blocks=32)
    prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([prompt])).logits[0, -1]
            continuation = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                             do_sample=False)
        torch.testing.assert_close(last_position_logits(model, prompt), theirs, atol=1e-4, rtol=1e-4)
        assert output.token_ids == continuation[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_kernel_backends_give_the_same_tokens(llama_dir, backend):
    """The Triton kernels (in the interpreter without a GPU) and the CPU kernels through the runner,
    chunked and batched, against the torch references."""
    if backend == "triton":
        pytest.importorskip("triton")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    for name in ("torch", backend):
        llm = LLM(str(llama_dir), dtype="float32", device=device, backend=name, num_kv_blocks=32,
                  max_num_batched_tokens=16)
        outputs[name] = [output.token_ids for output in llm.generate(PROMPTS * 2, params)]
    assert outputs[backend] == outputs["torch"]

