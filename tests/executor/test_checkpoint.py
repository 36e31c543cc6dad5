import numpy as np
import pytest
import torch

from replica.executor.checkpoint import load_checkpoint
from replica.executor.config import ModelConfig
from replica.executor.gguf_loader import _unpermute_rows
from tests.executor.gguf_writer import llama_cpp_permute

HF_CONFIG = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
             "rope_theta": 500000.0}


GGUF_METADATA = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
                 "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.context_length": 256,
                 "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 100}


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
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3' lacks"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "RoPE scaling 'longrope' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "short_factor": [1]}}, r"keys \['short_factor'\]"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, "partial rotary"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "sliding-window attention"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized checkpoints \\('gptq'\\)"),
])
def test_hf_config_rejects_what_the_model_cannot_run(change, error):
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_hf_config({**HF_CONFIG, **change})


@pytest.mark.parametrize("scaling, context_length", [
    ({"rope_type": "linear", "factor": 2.0}, 8192),
    ({"type": "dynamic", "factor": 4.0}, 16384),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
    ({"rope_type": "yarn", "factor": 4.0}, 16384),  # transformers' default original: max_position_embeddings
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}, 4096),
])
def test_scaled_rope_sets_the_context_length_as_vllm_does(scaling, context_length):
    config = ModelConfig.from_hf_config({**HF_CONFIG, "max_position_embeddings": 4096, "rope_scaling": scaling})
    assert config.max_position == context_length


def test_yarn_attention_factor():
    yarn = {"rope_type": "yarn", "factor": 4.0}
    assert ModelConfig.from_hf_config({**HF_CONFIG, "rope_scaling": yarn}).rope_scaling.attention_factor == (
        pytest.approx(0.1 * np.log(4.0) + 1))
    given = ModelConfig.from_hf_config({**HF_CONFIG, "rope_scaling": {**yarn, "attention_factor": 0.5}})
    assert given.rope_scaling.attention_factor == 0.5
    ratio = ModelConfig.from_hf_config({**HF_CONFIG, "rope_scaling": {**yarn, "mscale": 2, "mscale_all_dim": 1}})
    assert ratio.rope_scaling.attention_factor == pytest.approx((0.2 * np.log(4.0) + 1) / (0.1 * np.log(4.0) + 1))


def test_dynamic_ntk_frequencies_are_transformers_at_the_scaled_context():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from replica.executor import rope
    hf_config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                         rope_theta=5000.0, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, seq_len=1024)
    config = ModelConfig.from_hf_config({**HF_CONFIG, **hf_config.to_dict()})
    assert config.max_position == 1024
    torch.testing.assert_close(rope.inv_freq(16, 5000.0, config.rope_scaling), theirs)


def test_gguf_rope_scaling():
    def config(**metadata):
        return ModelConfig.from_gguf_metadata({**GGUF_METADATA, **metadata}, set())

    linear = config(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    assert (linear.rope_scaling.rope_type, linear.rope_scaling.factor, linear.max_position) == ("linear", 2.0, 512)
    yarn = config(**{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                     "llama.rope.scaling.original_context_length": 128})
    assert (yarn.rope_scaling.original_max_position, yarn.max_position) == (128, 512)
    assert yarn.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    factors = ModelConfig.from_gguf_metadata(GGUF_METADATA, {"rope_freqs.weight"}, rope_freqs=(1.0, 2.0))
    assert (factors.rope_scaling.freq_factors, factors.max_position) == ((1.0, 2.0), 256)


@pytest.mark.parametrize("metadata, rope_freqs, error", [
    ({"llama.rope.scaling.type": "longrope"}, (), "GGUF RoPE scaling 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.attn_factor": 2.0}, (), r"keys \['attn_factor'\]"),
    ({"llama.rope.scaling.type": "linear"}, (1.0,), "both rope_freqs and RoPE scaling 'linear'"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, (), "'yarn' lacks"),
    ({"llama.rope.dimension_count": 8}, (), "partial rotary"),
])
def test_gguf_what_the_engine_cannot_run_is_refused(metadata, rope_freqs, error):
    with pytest.raises(ValueError, match=error):
        ModelConfig.from_gguf_metadata({**GGUF_METADATA, **metadata}, set(), rope_freqs)


def test_a_gguf_tensor_type_without_dequantization_is_named(tmp_path):
    import gguf
    from replica.executor import gguf_loader
    writer = gguf.GGUFWriter(str(tmp_path / "f64.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = ModelConfig.from_gguf_metadata(GGUF_METADATA, set())
    with pytest.raises(ValueError, match="'token_embd.weight' has type F64, which the engine cannot dequantize"):
        list(gguf_loader.iter_arrays(str(tmp_path / "f64.gguf"), config))


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
