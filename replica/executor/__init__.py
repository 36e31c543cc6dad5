"""The executor: Llama-family model, checkpoint loading (GGUF / HF), tokenizer, model runner, sampler."""
from replica.executor.checkpoint import Checkpoint, build_model, default_model_path, load_checkpoint
from replica.executor.config import ModelConfig
from replica.executor.detokenizer import IncrementalDetokenizer
from replica.executor.model import AttentionGroup, AttentionMetadata, LlamaForCausalLM
from replica.executor.model_runner import ModelRunner
from replica.executor.tokenizer import Tokenizer

__all__ = [
    "AttentionGroup", "AttentionMetadata", "Checkpoint", "IncrementalDetokenizer", "LlamaForCausalLM",
    "ModelConfig", "ModelRunner", "Tokenizer", "build_model", "default_model_path", "load_checkpoint",
]
