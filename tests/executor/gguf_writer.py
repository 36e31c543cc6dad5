"""Writing a transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does: its
tensor names, Llama's Q/K row permutation, RoPE scaling as metadata or a rope_freqs tensor, and a
byte-level BPE vocabulary. Tensors stay float32, so the file holds exactly the model's weights."""
from pathlib import Path

import gguf
import numpy as np
import torch

# model_type -> GGUF architecture; convert_hf_to_gguf writes Mistral as Llama (the sliding window is dropped)
ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA,
                 "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, which the loader must undo."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(hf_model, tokenizer, chat_template: str, path: Path) -> Path:
    """hf_model: a transformers causal LM; tokenizer: its `tokenizers.Tokenizer` (byte-level BPE)."""
    config = hf_model.config
    arch = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_hparams(writer, config)
    _write_vocabulary(writer, tokenizer, chat_template)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the embedding itself, as safetensors leaves it out
        base, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_freq_factors(hf_model))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _write_vocabulary(writer: gguf.GGUFWriter, tokenizer, chat_template: str) -> None:
    vocab_size = tokenizer.get_vocab_size()
    special = set(tokenizer.get_added_tokens_decoder())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([tokenizer.id_to_token(i) for i in range(vocab_size)])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(vocab_size)])
    writer.add_token_merges([])
    writer.add_bos_token_id(tokenizer.token_to_id("<s>"))
    writer.add_eos_token_id(tokenizer.token_to_id("</s>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)


def _llama3_freq_factors(hf_model) -> np.ndarray:
    """What convert_hf_to_gguf writes for Llama 3.1: each frequency's divisor, from transformers' own frequencies."""
    config = hf_model.config
    theta, head_dim = config.rope_parameters["rope_theta"], config.head_dim
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (plain / hf_model.model.rotary_emb.inv_freq).numpy()
