"""The shape of a Llama-family decoder, read from a checkpoint (GGUF metadata or HF config.json)."""
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_SCALING_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """config.json's `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5), as rope.py applies it."""
    rope_type: str                          # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0            # llama3
    high_freq_factor: float = 4.0           # llama3
    original_max_position: int = 8192       # llama3: the context length before scaling

    @classmethod
    def from_hf(cls, scaling: dict[str, Any]) -> "RopeScaling | None":
        """None for plain RoPE; ValueError for a type the engine does not implement (never dropped)."""
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
        if rope_type == "default":
            return None
        try:
            if rope_type == "linear":
                return cls(rope_type, float(scaling["factor"]))
            return cls(rope_type, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                       float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
        except KeyError as missing:
            raise ValueError(f"RoPE scaling {rope_type!r} lacks {missing}") from None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int             # the context length the model was trained for
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False         # Qwen3: an RMSNorm over each head of q and k, before RoPE
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not split into {self.num_kv_heads} KV heads")

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = metadata["general.architecture"]

        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        if arch == "qwen3":
            raise ValueError("qwen3 GGUF files are not supported; serve the Hugging Face directory")
        if "rope_freqs.weight" in tensor_names or metadata.get(f"{arch}.rope.scaling.type", "none") != "none":
            raise ValueError("RoPE scaling in a GGUF file (rope_freqs, rope.scaling.type) is not supported")
        hidden_size = get("embedding_length")
        num_heads = get("attention.head_count")
        return cls(
            architecture=arch,
            vocab_size=get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
            hidden_size=hidden_size,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=num_heads,
            num_kv_heads=get("attention.head_count_kv", num_heads),
            head_dim=get("attention.key_length", hidden_size // num_heads),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position=get("context_length"),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
        )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelConfig":
        arch = config.get("model_type", "")
        # transformers 5 moves rope_theta and the scaling into rope_parameters
        rope_parameters = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta") or rope_parameters.get("rope_theta", 10000.0)
        num_heads = config["num_attention_heads"]
        if config.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window) is not supported")
        max_position = config.get("max_position_embeddings", 8192)
        if arch == "mistral" and config.get("sliding_window"):
            # attention past the window is not implemented: the context ends there, so longer prompts get
            # the context-length error instead of attending where the model would not
            max_position = min(max_position, config["sliding_window"])
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config["rms_norm_eps"]),
            max_position=max_position,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            rope_scaling=RopeScaling.from_hf(config.get("rope_scaling") or rope_parameters),
            qk_norm=arch == "qwen3",
        )
