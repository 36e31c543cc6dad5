"""The shape of a Llama-family decoder, read from a checkpoint (GGUF metadata or HF config.json)."""
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_SCALING_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# every key of config.json's rope_scaling / rope_parameters that RopeScaling reads; others are refused
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
              "high_freq_factor", "beta_fast", "beta_slow", "truncate", "attention_factor", "mscale",
              "mscale_all_dim", "partial_rotary_factor"}


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are scaled, as rope.py applies it: from config.json's `rope_scaling`
    (transformers 4) or `rope_parameters` (transformers 5), or from a GGUF's rope metadata."""
    rope_type: str                     # linear, dynamic, yarn, llama3, or freq_factors (a GGUF's rope_freqs)
    factor: float = 1.0
    original_max_position: int = 0     # yarn, llama3: the context length before scaling
    low_freq_factor: float = 1.0       # llama3
    high_freq_factor: float = 4.0      # llama3
    beta_fast: float = 32.0            # yarn: rotations bounding the ramp from extrapolated to interpolated
    beta_slow: float = 1.0             # yarn
    truncate: bool = True              # yarn: round the ramp's bounds to whole dimensions
    attention_factor: float = 1.0      # yarn: scales cos and sin
    freq_factors: tuple[float, ...] = ()  # freq_factors: each frequency divided by its own factor

    def context_length(self, max_position: int) -> int:
        """The context the scaled model serves, derived as vLLM derives it."""
        if self.rope_type in ("linear", "dynamic"):
            return int(max_position * self.factor)
        if self.rope_type == "yarn":
            return int(self.original_max_position * self.factor)
        return max_position

    @classmethod
    def from_hf(cls, scaling: dict[str, Any], max_position: int) -> "RopeScaling | None":
        """None for plain RoPE; ValueError for a type or key the engine does not implement (never dropped)."""
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
        if unknown := sorted(set(scaling) - _ROPE_KEYS):
            raise ValueError(f"RoPE scaling keys {unknown} are not supported")
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor) are not supported")
        if rope_type == "default":
            return None
        try:
            factor = float(scaling["factor"])
            if rope_type in ("linear", "dynamic"):
                return cls(rope_type, factor)
            if rope_type == "llama3":
                return cls(rope_type, factor, int(scaling["original_max_position_embeddings"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]))
        except KeyError as missing:
            raise ValueError(f"RoPE scaling {rope_type!r} lacks {missing}") from None
        return cls("yarn", factor, int(scaling.get("original_max_position_embeddings") or max_position),
                   beta_fast=float(scaling.get("beta_fast") or 32.0), beta_slow=float(scaling.get("beta_slow") or 1.0),
                   truncate=bool(scaling.get("truncate", True)),
                   attention_factor=_yarn_attention_factor(scaling, factor))


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale: given, or 0.1 ln(factor) + 1, as a ratio when mscale and mscale_all_dim are set."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


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
    def from_gguf_metadata(cls, metadata: dict[str, Any], tensor_names: set[str],
                           rope_freqs: tuple[float, ...] = ()) -> "ModelConfig":
        """rope_freqs: the values of the file's rope_freqs tensor (llama.cpp's Llama 3.1 frequency factors)."""
        arch = metadata["general.architecture"]

        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden_size = get("embedding_length")
        num_heads = get("attention.head_count")
        head_dim = get("attention.key_length", hidden_size // num_heads)
        if get("rope.dimension_count", head_dim) != head_dim:
            raise ValueError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
        rope_scaling = _gguf_rope_scaling(metadata, arch, rope_freqs)
        max_position = get("context_length")
        return cls(
            architecture=arch,
            vocab_size=get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
            hidden_size=hidden_size,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=num_heads,
            num_kv_heads=get("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position=rope_scaling.context_length(max_position) if rope_scaling else max_position,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_scaling=rope_scaling,
        )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelConfig":
        arch = config.get("model_type", "")
        # transformers 5 moves rope_theta and the scaling into rope_parameters
        rope_parameters = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta") or rope_parameters.get("rope_theta", 10000.0)
        num_heads = config["num_attention_heads"]
        if quantization := config.get("quantization_config"):
            raise ValueError(f"quantized checkpoints ({quantization.get('quant_method', 'unknown method')!r}) "
                             "are not supported; serve the unquantized model or a GGUF file")
        if config.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window) is not supported")
        max_position = config.get("max_position_embeddings", 8192)
        rope_scaling = RopeScaling.from_hf(config.get("rope_scaling") or rope_parameters, max_position)
        if rope_scaling:
            max_position = rope_scaling.context_length(max_position)
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
            rope_scaling=rope_scaling,
            qk_norm=arch == "qwen3",
        )


# the rope.scaling.* keys a GGUF may carry (after "{arch}.rope.scaling."); others are refused
_GGUF_ROPE_KEYS = {"type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow", "finetuned"}


def _gguf_rope_scaling(metadata: dict[str, Any], arch: str, rope_freqs: tuple[float, ...]) -> RopeScaling | None:
    """llama.cpp writes linear and YaRN scaling as rope.scaling.* metadata, Llama 3.1's as a rope_freqs tensor."""
    prefix = f"{arch}.rope.scaling."
    scaling = {key.removeprefix(prefix): value for key, value in metadata.items() if key.startswith(prefix)}
    if unknown := sorted(set(scaling) - _GGUF_ROPE_KEYS):
        raise ValueError(f"GGUF RoPE scaling keys {unknown} are not supported")
    rope_type = scaling.get("type", "none")
    if rope_freqs:
        if rope_type != "none":
            raise ValueError(f"GGUF has both rope_freqs and RoPE scaling {rope_type!r}")
        return RopeScaling("freq_factors", freq_factors=rope_freqs)
    if rope_type == "none":
        return None
    if rope_type not in ("linear", "yarn"):
        raise ValueError(f"GGUF RoPE scaling {rope_type!r} is not supported; supported: linear, yarn, rope_freqs")
    if "factor" not in scaling or (rope_type == "yarn" and "original_context_length" not in scaling):
        raise ValueError(f"GGUF RoPE scaling {rope_type!r} lacks {prefix}factor or original_context_length")
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    return RopeScaling("yarn", factor, int(scaling["original_context_length"]),
                       beta_fast=float(scaling.get("yarn_beta_fast", 32.0)),
                       beta_slow=float(scaling.get("yarn_beta_slow", 1.0)),
                       attention_factor=_yarn_attention_factor({}, factor))
