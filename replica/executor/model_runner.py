"""ModelRunner: executes one SchedulerOutput on the model and samples the next tokens.

It mirrors the scheduler's two-tier diff: new requests arrive with their prompt and block ids,
cached ones with only what changed. It keeps every request's token ids itself (the prompt plus
the tokens it sampled); a resumed request starts over from the scheduler's token ids and blocks.
"""
import torch

from replica.executor.input_batch import BatchInputs, RequestState, order_decodes_first, prepare_inputs
from replica.executor.model import KVCache, LlamaForCausalLM
from replica.executor.sampler import SamplingMetadata, sample
from replica.scheduler import ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0][0].device
        self.requests: dict[str, RequestState] = {}

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        num_scheduled = scheduler_output.num_scheduled_tokens
        req_ids = order_decodes_first(list(num_scheduled), num_scheduled)
        states = [self.requests[req_id] for req_id in req_ids]
        batch = prepare_inputs(states, [num_scheduled[req_id] for req_id in req_ids], self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attention)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampling = [states[row] for row in batch.sample_rows]
        metadata = SamplingMetadata.from_params(
            [state.sampling_params for state in sampling],
            {row: state.generator for row, state in enumerate(sampling) if state.generator is not None},
            logits.shape[1], self.device)
        token_ids, logprobs, top = sample(logits, metadata)
        output = self._make_output(batch, sampling, token_ids.tolist(), None if logprobs is None else logprobs.tolist())
        if top is not None:
            output.top_logprobs = self._top_logprobs(batch, *top)
        return output

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        # preempted requests keep their state (and their generator's position) until resumed
        for new in scheduler_output.scheduled_new_reqs:
            seed = new.sampling_params.seed
            generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
            self.requests[new.req_id] = RequestState(new.req_id, new.prompt_token_ids + new.output_token_ids,
                                                     list(new.block_ids), new.num_computed_tokens,
                                                     new.sampling_params, generator)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                   cached.num_computed_tokens, strict=True):
            state = self.requests[req_id]
            if req_id in cached.resumed_req_ids:
                state.token_ids = list(cached.all_token_ids[req_id])
                state.block_ids = list(block_ids)
            else:
                state.block_ids.extend(block_ids)
            state.num_computed_tokens = num_computed

    def _make_output(self, batch: BatchInputs, sampling: list[RequestState], token_ids: list[int],
                     logprobs: list[float] | None) -> ModelRunnerOutput:
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        sampled_logprobs: list[list[float]] = [[] for _ in batch.req_ids]
        for index, (row, state) in enumerate(zip(batch.sample_rows, sampling)):
            state.token_ids.append(token_ids[index])
            sampled[row] = [token_ids[index]]
            if logprobs is not None:
                sampled_logprobs[row] = [logprobs[index]]
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled,
                                 logprobs=None if logprobs is None else sampled_logprobs)

    @staticmethod
    def _top_logprobs(batch: BatchInputs, values: torch.Tensor,
                      token_ids: torch.Tensor) -> list[list[list[tuple[int, float]]]]:
        """Per request: [the k most likely (token id, logprob) of its sampled token's position], or []."""
        top: list[list[list[tuple[int, float]]]] = [[] for _ in batch.req_ids]
        for index, row in enumerate(batch.sample_rows):
            top[row] = [list(zip(token_ids[index].tolist(), values[index].tolist()))]
        return top
