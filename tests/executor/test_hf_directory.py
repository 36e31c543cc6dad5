"""Tiny random models saved by transformers, loaded from the HF directory (config.json + safetensors +
tokenizer.json) and from the GGUF file convert_hf_to_gguf would write, checked against transformers:
Llama (untied LM head; plain, llama3, linear and YaRN RoPE), Mistral, Qwen2 (q/k/v biases, tied head)
and Qwen3 (q/k norm, own head_dim)."""
import copy
import json

import pytest
import torch

from kernels import get_ops
from replica.engine import LLM, resolve_backend, resolve_device
from replica.executor.checkpoint import load_checkpoint
from replica.executor.weights import build_model
from replica.request import SamplingParams
from tests.executor.gguf_writer import write_gguf
from tests.executor.helpers import assert_tight_runs_give, byte_tokenizer_backend, last_position_logits

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
    "yarn_rope": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SHAPE, tie_word_embeddings=False, sliding_window=128)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(  # head_dim 32, not 64 / 4
        **SHAPE, head_dim=32, tie_word_embeddings=True)),
}
BF16_ERROR_RATIO = 1.5
PROMPTS = ["hello world", "The quick brown fox jumps over", "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    return save_model(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def greedy_reference(model_dir) -> dict[tuple[int, ...], list[int]]:
    """transformers' 8 greedy tokens after each prompt, EOS included (as ignore_eos generates)."""
    directory, hf_model = model_dir
    reference = {}
    with torch.inference_mode():
        for prompt in map(load_checkpoint(str(directory)).tokenizer.encode, PROMPTS):
            token_ids = list(prompt)
            for _ in range(8):
                token_ids.append(int(hf_model(torch.tensor([token_ids])).logits[0, -1].argmax()))
            reference[tuple(prompt)] = token_ids[len(prompt):]
    return reference


@pytest.fixture(scope="module", params=["hf", "gguf"])
def checkpoint(request, model_dir):
    """(path, the transformers model): the HF directory, or a GGUF file written from it."""
    directory, hf_model = model_dir
    if request.param == "hf":
        return directory, hf_model
    gguf_path = directory / "model.gguf"
    if not gguf_path.exists():
        write_gguf(hf_model, byte_tokenizer_backend(), CHAT_TEMPLATE, gguf_path)
    return gguf_path, hf_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_model("llama", tmp_path_factory)[0]


def save_model(kind: str, tmp_path_factory):
    torch.manual_seed(0)
    return save_checkpoint(MODELS[kind]().eval(), tmp_path_factory.mktemp(kind))


def save_checkpoint(hf_model, directory):
    """(directory, hf_model): the model saved as an HF directory with the byte tokenizer."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):  # transformers starts them at zero
                param.normal_(std=0.3)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # and these at one
                param.normal_(mean=1.0, std=0.3)
    hf_model.save_pretrained(directory)
    byte_tokenizer_backend().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))
    return directory, hf_model


def test_config_and_tokenizer_come_from_the_checkpoint(checkpoint):
    path, hf_model = checkpoint
    loaded = load_checkpoint(str(path))
    config = loaded.config
    model_type = hf_model.config.model_type
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2, 4, 2, 32 if model_type == "qwen3" else 16)
    assert config.attention_bias == (model_type == "qwen2")
    assert config.qk_norm == (model_type == "qwen3")
    assert config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    tokenizer = loaded.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "<s>user: hi\nassistant:"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])[0] == 256


def test_logits_match_transformers(checkpoint):
    path, hf_model = checkpoint
    model = build_model(load_checkpoint(str(path)), dtype=torch.float32, device=torch.device("cpu"),
                        ops=get_ops("torch"))
    for prompt in map(load_checkpoint(str(path)).tokenizer.encode, PROMPTS):
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(last_position_logits(model, prompt), theirs, atol=1e-4, rtol=1e-4)


def test_bf16_logits_stray_from_fp32_no_more_than_transformers_bf16(model_dir):
    """On the engine's default device and kernels, over all prompts: the mean absolute error of our
    bf16 logits against transformers' fp32 ones is at most BF16_ERROR_RATIO times that of
    transformers' own bf16 run (measured on CPU: 0.6-1.32x)."""
    directory, hf_model = model_dir
    checkpoint = load_checkpoint(str(directory))
    device = resolve_device(None)
    model = build_model(checkpoint, dtype=torch.bfloat16, device=device,
                        ops=get_ops(resolve_backend("auto", device, checkpoint.config.head_dim)))
    hf_bf16 = copy.deepcopy(hf_model).to(device=device, dtype=torch.bfloat16)
    our_error = their_error = 0.0
    for prompt in map(checkpoint.tokenizer.encode, PROMPTS):
        with torch.inference_mode():
            exact = hf_model(torch.tensor([prompt])).logits[0, -1]
            theirs = hf_bf16(torch.tensor([prompt], device=device)).logits[0, -1].float().cpu()
        our_error += (last_position_logits(model, prompt).cpu() - exact).abs().mean().item()
        their_error += (theirs - exact).abs().mean().item()
    assert our_error <= BF16_ERROR_RATIO * their_error


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_tokens_match_transformers_batched_chunked_preempted_and_cached(checkpoint, greedy_reference,
                                                                              async_scheduling):
    path, _ = checkpoint
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batched = LLM(str(path), dtype="float32", num_kv_blocks=32, async_scheduling=async_scheduling)
    prompts = [batched.tokenizer.encode(text) for text in PROMPTS]
    expected = [greedy_reference[tuple(prompt)] for prompt in prompts]
    assert [output.token_ids for output in batched.generate(prompts, params)] == expected
    # 6 usable blocks of 16 for sequences that grow to 2, 3 and 4 blocks; prefills in chunks of 8 tokens
    tight = LLM(str(path), dtype="float32", num_kv_blocks=7, max_num_batched_tokens=8, reserve_full_sequence=False,
                async_scheduling=async_scheduling)
    assert_tight_runs_give(tight, prompts, params, expected)


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

