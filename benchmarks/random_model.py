"""A model directory with random weights and a given shape, for throughput benchmarks (no hub here).

"qwen3-0.6b" has Qwen3-0.6B's shapes (hidden 1024, 28 layers, 16 query / 8 KV heads of 128, FFN
3072, vocabulary 151936, tied head) in the Llama architecture: Qwen3's per-head q/k norms are not
modelled, a small cost next to the projections. The tokenizer is word-level, one "<id>" per id, so
any sampled id decodes.
"""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True},
    # steps of a few milliseconds on a CPU, as a small model's on a GPU: the host's work per step
    # (scheduling, stop checks, detokenizing) is a sizeable part of them
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096, "max_position_embeddings": 4096,
             "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}


def write_random_model(directory: Path, shape: str, *, seed: int = 0, tokenizer: Tokenizer | None = None,
                       bos_token: str = "<0>", eos_token: str = "<1>") -> Path:
    """tokenizer (holding bos_token and eos_token) replaces the word-level one; the vocabulary takes its size."""
    vocab_size = tokenizer.get_vocab_size() if tokenizer else SHAPES[shape]["vocab_size"]
    if tokenizer is None:
        tokenizer = Tokenizer(models.WordLevel({f"<{token_id}>": token_id for token_id in range(vocab_size)},
                                               unk_token="<0>"))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
              **SHAPES[shape], "vocab_size": vocab_size, "bos_token_id": tokenizer.token_to_id(bos_token),
              "eos_token_id": tokenizer.token_to_id(eos_token)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_random_weights(config, torch.Generator().manual_seed(seed)), str(directory / "model.safetensors"))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos_token, "eos_token": eos_token}))
    return directory


def _random_weights(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, ffn, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).bfloat16()

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "self_attn.q_proj.weight": normal(q_size, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_size, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_size, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_size),
            prefix + "mlp.gate_proj.weight": normal(ffn, hidden),
            prefix + "mlp.up_proj.weight": normal(ffn, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, ffn),
        }
    return weights
