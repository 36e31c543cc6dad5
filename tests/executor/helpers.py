"""Running a bare model (no scheduler) over one prompt: the logits at its last position."""
import torch

from replica.executor.model import AttentionGroup, AttentionMetadata, LlamaForCausalLM
from replica.executor.paged_cache import allocate_kv_caches
from replica.request import SamplingParams


def last_position_logits(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Prefill token_ids into a fresh paged cache (blocks 1, 2, ... in order) -> fp32 logits [vocab]."""
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    weight = model.model.embed_tokens.weight
    kv_caches = allocate_kv_caches(model.config, num_blocks + 1, block_size, weight.dtype, weight.device)
    with torch.device(weight.device):
        block_table = torch.arange(1, num_blocks + 1, dtype=torch.int32).unsqueeze(0)
        positions = torch.arange(num_tokens)
        group = AttentionGroup(0, num_tokens, block_table, torch.tensor([0, num_tokens], dtype=torch.int32),
                               torch.tensor([num_tokens], dtype=torch.int32))
        metadata = AttentionMetadata(slot_mapping=positions + block_size, groups=[group])
        with torch.inference_mode():
            hidden = model(torch.tensor(token_ids), positions, kv_caches, metadata)
            return model.compute_logits(hidden[-1:])[0].float()


def byte_tokenizer_backend():
    """A byte-level BPE with no merges: every UTF-8 byte is one token, plus <s> and </s> (256, 257)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return backend


def assert_tight_runs_give(llm, prompts: list[list[int]], params: SamplingParams, expected: list[list[int]]) -> None:
    """llm, whose KV cache is too small for the three prompts of 1-3 blocks at once, gives the expected
    tokens with preemptions, and again from the prefix cache (0, 1 and 2 blocks cached)."""
    assert [output.token_ids for output in llm.generate(prompts, params)] == expected
    assert llm.engine.stats().num_preemptions > 0
    again = llm.generate(prompts, params)
    assert [output.token_ids for output in again] == expected
    assert [output.num_cached_tokens for output in again] == [0, 16, 32]
