"""Flattening one step's scheduled requests into model inputs: token ids, positions, paged-attention metadata."""
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from replica.executor.model import AttentionGroup, AttentionMetadata
from replica.request import SamplingParams


@dataclass
class RequestState:
    """What the runner keeps about a request between steps."""
    req_id: str
    token_ids: list[int]          # prompt + every token sampled so far
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None  # set when the request has a seed
    spec_token_ids: list[int] = field(default_factory=list)  # this step's drafts to verify, after token_ids


@dataclass
class BatchInputs:
    req_ids: list[str]
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    attention: AttentionMetadata
    sample_rows: list[int]        # the requests (batch indices) whose last scheduled token ends their sequence
    # the token rows whose logits are needed: for each sample row, its drafts' positions and its last
    logits_indices: torch.Tensor  # [len(sample_rows) + their drafts]


def prepare_inputs(states: list[RequestState], num_scheduled: list[int], block_size: int,
                   device: torch.device) -> BatchInputs:
    """states must come single-token requests first (see order_decodes_first)."""
    num_tokens = np.array(num_scheduled, dtype=np.int64)
    num_computed = np.array([state.num_computed_tokens for state in states], dtype=np.int64)
    seq_lens = num_computed + num_tokens
    query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum(num_tokens, out=query_start_loc[1:])
    total = int(query_start_loc[-1])

    request_of_token = np.repeat(np.arange(len(states)), num_tokens)
    positions = np.arange(total) + np.repeat(num_computed - query_start_loc[:-1], num_tokens)
    # scheduled drafts are the last tokens scheduled, all of them: they come after all of token_ids
    input_ids = np.fromiter((token for state, start, end in zip(states, num_computed, seq_lens)
                             for token in itertools.chain(state.token_ids[start:end], state.spec_token_ids)),
                            dtype=np.int64, count=total)

    num_blocks = -(-seq_lens // block_size)
    block_tables = np.zeros((len(states), int(num_blocks.max())), dtype=np.int64)
    for row, (state, count) in enumerate(zip(states, num_blocks)):
        block_tables[row, :count] = state.block_ids[:count]
    slot_mapping = block_tables[request_of_token, positions // block_size] * block_size + positions % block_size

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    def group(first: int, end: int) -> AttentionGroup:
        token_start = int(query_start_loc[first])
        return AttentionGroup(token_start, int(query_start_loc[end]),
                              to_device(block_tables[first:end, :num_blocks[first:end].max()], torch.int32),
                              to_device(query_start_loc[first:end + 1] - token_start, torch.int32),
                              to_device(seq_lens[first:end], torch.int32))

    num_single = int(np.count_nonzero(num_tokens == 1))
    bounds = [0, num_single, len(states)] if 0 < num_single < len(states) else [0, len(states)]
    sample_rows = [row for row, state in enumerate(states)
                   if seq_lens[row] == len(state.token_ids) + len(state.spec_token_ids)]
    num_logits = np.array([len(states[row].spec_token_ids) + 1 for row in sample_rows], dtype=np.int64)
    logits_starts = query_start_loc[1:][sample_rows] - num_logits
    logits_indices = np.repeat(logits_starts - (np.cumsum(num_logits) - num_logits), num_logits) + np.arange(
        num_logits.sum())
    return BatchInputs(
        req_ids=[state.req_id for state in states],
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        attention=AttentionMetadata(slot_mapping=to_device(slot_mapping, torch.int64),
                                    groups=[group(first, end) for first, end in itertools.pairwise(bounds)]),
        sample_rows=sample_rows,
        logits_indices=to_device(logits_indices, torch.int64),
    )


def order_decodes_first(req_ids: list[str], num_scheduled: dict[str, int]) -> list[str]:
    return sorted(req_ids, key=lambda req_id: num_scheduled[req_id] > 1)
