import numpy as np
import pytest

from replica.executor.checkpoint import load_checkpoint
from replica.executor.config import ModelConfig
from replica.executor.gguf_loader import _unpermute_rows

HF_CONFIG = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
             "rope_theta": 500000.0}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, which the loader must undo."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("shape", [(4 * 8, 5), (4 * 8,)])
def test_unpermute_undoes_llama_cpp_permutation(shape):
    weights = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(_unpermute_rows(llama_cpp_permute(weights, 4), 4), weights)


def test_a_mistral_sliding_window_ends_the_context():
    mistral = {**HF_CONFIG, "model_type": "mistral", "max_position_embeddings": 4096}
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": 1024}).max_position == 1024
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": None}).max_position == 4096


def test_hf_config_fields():
    config = ModelConfig.from_hf_config({**HF_CONFIG, "max_position_embeddings": 4096})
    assert (config.head_dim, config.num_kv_heads, config.rope_theta, config.max_position) == (16, 2, 5e5, 4096)
    assert not config.attention_bias and not config.tie_word_embeddings
    assert ModelConfig.from_hf_config({**HF_CONFIG, "model_type": "qwen2"}).attention_bias
    # transformers 5 writes rope_theta under rope_parameters
    moved = {**HF_CONFIG, "rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert ModelConfig.from_hf_config(moved).rope_theta == 1e6


@pytest.mark.parametrize("change, error", [
    ({"model_type": "gpt2"}, "unsupported architecture"),
    ({"num_key_value_heads": 3}, "do not split"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3' lacks 'low_freq_factor'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic' is not supported"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "sliding-window attention"),
])
def test_hf_config_rejects_what_the_model_cannot_run(change, error):
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_hf_config({**HF_CONFIG, **change})


@pytest.mark.parametrize("metadata, tensor_names, error", [
    ({"llama.rope.scaling.type": "linear"}, set(), "RoPE scaling in a GGUF file"),
    ({}, {"rope_freqs.weight"}, "RoPE scaling in a GGUF file"),  # llama.cpp's Llama 3.1 frequency factors
    ({"general.architecture": "qwen3"}, set(), "qwen3 GGUF files are not supported"),
])
def test_gguf_what_the_engine_cannot_run_is_refused(metadata, tensor_names, error):
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_gguf_metadata({"general.architecture": "llama", **metadata}, tensor_names)


def test_bad_model_path_raises(tmp_path):
    with pytest.raises(ValueError, match="neither a .gguf file nor"):
        load_checkpoint(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(str(tmp_path))


@pytest.mark.slow
def test_default_gguf_metadata():
    checkpoint = load_checkpoint()
    config = checkpoint.config
    assert checkpoint.name == "SmolLM2-135M-Instruct"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.rope_theta, config.vocab_size, config.max_position) == (100000.0, 49152, 8192)
    assert config.tie_word_embeddings and not config.attention_bias
    tokenizer = checkpoint.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("Hi 42") == [26843, 216, 36, 34]  # digits one by one, no BOS added
