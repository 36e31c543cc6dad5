import torch

from replica.executor.input_batch import RequestState, order_decodes_first, prepare_inputs
from replica.request import SamplingParams


def state(req_id: str, num_tokens: int, block_ids: list[int], num_computed: int) -> RequestState:
    return RequestState(req_id, list(range(100, 100 + num_tokens)), block_ids, num_computed, SamplingParams(), None)


def test_mixed_batch_flattens_decodes_first_then_prefill_chunks():
    states = [
        state("decode", 6, [7, 3], num_computed=5),           # 1 token at position 5
        state("chunk", 10, [2, 9, 4], num_computed=0),        # prefill chunk 0..3 of 10: no sampling
        state("last_chunk", 7, [5, 8], num_computed=4),       # prefill 4..6: finishes, samples
    ]
    batch = prepare_inputs(states, [1, 4, 3], block_size=4, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [105, 100, 101, 102, 103, 104, 105, 106]
    assert batch.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 6]
    # slot = block_ids[position // 4] * 4 + position % 4
    assert batch.attention.slot_mapping.tolist() == [3 * 4 + 1, 8, 9, 10, 11, 8 * 4, 8 * 4 + 1, 8 * 4 + 2]
    decodes, prefills = batch.attention.groups
    assert (decodes.token_start, decodes.token_end) == (0, 1)
    assert decodes.block_tables.tolist() == [[7, 3]]
    assert decodes.query_start_loc.tolist() == [0, 1] and decodes.seq_lens.tolist() == [6]
    assert (prefills.token_start, prefills.token_end) == (1, 8)
    assert prefills.block_tables.tolist() == [[2, 0], [5, 8]]  # only blocks the context reaches
    assert prefills.query_start_loc.tolist() == [0, 4, 7] and prefills.seq_lens.tolist() == [4, 7]
    assert batch.sample_rows == [0, 2]
    assert batch.logits_indices.tolist() == [0, 7]


def test_all_decodes_make_one_group():
    states = [state("a", 3, [1], 2), state("b", 5, [4, 6], 4)]
    batch = prepare_inputs(states, [1, 1], block_size=4, device=torch.device("cpu"))
    [group] = batch.attention.groups
    assert group.block_tables.tolist() == [[1, 0], [4, 6]]
    assert batch.sample_rows == [0, 1]


def test_order_decodes_first_is_stable():
    assert order_decodes_first(["p1", "d1", "p2", "d2"], {"p1": 5, "d1": 1, "p2": 2, "d2": 1}) == [
        "d1", "d2", "p1", "p2"]


def test_drafts_follow_the_last_token_and_every_position_of_theirs_gives_logits():
    speculating = state("spec", 6, [7, 3], num_computed=5)
    speculating.spec_token_ids = [40, 41]
    states = [state("decode", 3, [1], 2), state("chunk", 10, [2, 9, 4], num_computed=0), speculating]
    batch = prepare_inputs(states, [1, 4, 3], block_size=4, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [102, 100, 101, 102, 103, 105, 40, 41]
    assert batch.positions.tolist() == [2, 0, 1, 2, 3, 5, 6, 7]
    assert batch.attention.slot_mapping.tolist()[5:] == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3]
    assert batch.sample_rows == [0, 2]
    assert batch.logits_indices.tolist() == [0, 5, 6, 7]
