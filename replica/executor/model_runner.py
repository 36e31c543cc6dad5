"""ModelRunner: executes one SchedulerOutput on the model and samples the next tokens.

It mirrors the scheduler's two-tier diff: new requests arrive with their prompt and block ids,
cached ones with only what changed. It keeps every request's token ids itself (the prompt plus
the tokens it emitted); a resumed request starts over from the scheduler's token ids and blocks.
A request's speculative drafts are verified in the same forward pass as the rest of the batch: its
last token and the drafts are scheduled together, and the logits at each of their positions go to
the rejection sampler. Under tensor parallelism every rank runs one, on its shard: the driver rank
samples, and the others take its tokens so that their requests' token ids stay the same.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from replica.executor.cuda_graphs import DecodeGraphs
from replica.executor.host_copies import HostCopies
from replica.executor.input_batch import BatchInputs, RequestState, order_decodes_first, prepare_inputs
from replica.executor.model import KVCache, LlamaForCausalLM
from replica.kv_cache.host_pool import KVLoad
from replica.executor.rejection_sampler import num_emitted, rejection_sample
from replica.executor.sampler import Sampled, SamplingMetadata, sample
from replica.scheduler import ModelRunnerOutput, SchedulerOutput
from replica.structured_output.manager import GrammarBitmask


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int,
                 decode_graphs: DecodeGraphs | None = None, host_copies: HostCopies | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.decode_graphs = decode_graphs
        self.device = kv_caches[0][0].device
        self.tp = model.tp
        self.requests: dict[str, RequestState] = {}
        self.host_copies = host_copies
        # loads from the node's pool run beside the forward pass (into blocks the step does not read)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load") if host_copies is not None else None

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        loading = self._loader.submit(self.load_from_host, scheduler_output.kv_loads) \
            if scheduler_output.kv_loads else None
        output = self._execute(scheduler_output)
        if loading is not None:
            output.kv_loaded, output.kv_load_s = loading.result()
        if scheduler_output.kv_save is not None:
            self.host_copies.save(scheduler_output.kv_save)
        return output

    def load_from_host(self, loads: list[KVLoad]) -> tuple[dict[str, int], float]:
        """Copy the loads in from the node's pool: per load, its leading blocks that arrived whole; the seconds."""
        started = time.perf_counter()
        return self.host_copies.load(loads), time.perf_counter() - started

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not scheduler_output.total_num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        num_scheduled = scheduler_output.num_scheduled_tokens
        req_ids = order_decodes_first(list(num_scheduled), num_scheduled)
        states = [self.requests[req_id] for req_id in req_ids]
        batch = prepare_inputs(states, [num_scheduled[req_id] for req_id in req_ids], self.block_size, self.device)
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampling = [states[row] for row in batch.sample_rows]
        num_drafts = [len(state.spec_token_ids) for state in sampling]
        sampled, counts = None, None
        if logits is not None:
            if scheduler_output.grammar_bitmask is not None:
                self._apply_grammar_bitmask(logits, scheduler_output.grammar_bitmask, sampling, num_drafts)
            sampled, counts = self._sample(logits, sampling, num_drafts)
        if self.tp.size > 1:
            sampled, counts = self._broadcast_tokens(sampled, counts, len(batch.logits_indices), len(sampling))
        return self._make_output(batch, sampling, sampled, num_drafts, counts)

    def _sample(self, logits: torch.Tensor, sampling: list[RequestState],
                num_drafts: list[int]) -> tuple[Sampled, list[int]]:
        """The tokens of every logits row, and how many of each request's rows it emits."""
        # one logits row per draft position and one more per request, each sampled with its request's params
        row_states = [state for state, count in zip(sampling, num_drafts) for _ in range(count + 1)]
        metadata = SamplingMetadata.from_params(
            [state.sampling_params for state in row_states],
            {row: state.generator for row, state in enumerate(row_states) if state.generator is not None},
            logits.shape[1], self.device)
        if any(num_drafts):
            draft_token_ids = [token for state in sampling for token in (*state.spec_token_ids, -1)]
            sampled, accepted = rejection_sample(logits, torch.tensor(draft_token_ids, device=self.device), metadata)
            return sampled, num_emitted(accepted.tolist(), num_drafts)
        return sample(logits, metadata), [1] * len(sampling)

    def _apply_grammar_bitmask(self, logits: torch.Tensor, grammar_bitmask: GrammarBitmask,
                               sampling: list[RequestState], num_drafts: list[int]) -> None:
        """Rule out what the constrained requests' grammars do not allow, in each of their logits rows (waiting
        for the bitmask, filled while the forward pass ran). Unconstrained rows are not touched."""
        first_rows = grammar_bitmask.rows
        logit_rows, mask_rows = [], []
        logits_row = 0
        for state, count in zip(sampling, num_drafts):
            if (mask_row := first_rows.get(state.req_id)) is not None:
                logit_rows.extend(range(logits_row, logits_row + count + 1))
                mask_rows.extend(range(mask_row, mask_row + count + 1))
            logits_row += count + 1
        bitmask = torch.from_numpy(grammar_bitmask.result()[mask_rows]).to(self.device, non_blocking=True)
        self.model.ops.apply_token_bitmask(logits, bitmask, torch.tensor(logit_rows, device=self.device))

    def _broadcast_tokens(self, sampled: Sampled | None, counts: list[int] | None, num_rows: int,
                          num_requests: int) -> tuple[Sampled, list[int]]:
        """The driver's tokens and counts, on every rank; the driver keeps its logprobs."""
        if self.tp.is_driver:
            packed = torch.cat([sampled.token_ids, torch.tensor(counts, device=self.device)])
        else:
            packed = torch.empty(num_rows + num_requests, dtype=torch.int64, device=self.device)
        self.tp.broadcast(packed)
        if self.tp.is_driver:
            return sampled, counts
        return Sampled(packed[:num_rows], None, None), packed[num_rows:].tolist()

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.attention)
            if hidden is not None:
                return hidden
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attention)

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
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            self.requests[req_id].spec_token_ids = spec_tokens.get(req_id, [])

    def _make_output(self, batch: BatchInputs, sampling: list[RequestState], sampled: Sampled,
                     num_drafts: list[int], counts: list[int]) -> ModelRunnerOutput:
        """Per request, the tokens of its first counts[i] logits rows (and their logprobs); [] for the
        requests that sample nothing this step."""
        token_ids = sampled.token_ids.tolist()
        logprobs = None if sampled.logprobs is None else sampled.logprobs.tolist()
        top = None if sampled.top_logprobs is None else [tensor.tolist() for tensor in sampled.top_logprobs]
        output = ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=[[] for _ in batch.req_ids],
                                   logprobs=None if logprobs is None else [[] for _ in batch.req_ids],
                                   top_logprobs=None if top is None else [[] for _ in batch.req_ids])
        start = 0
        for row, state, num_rows, count in zip(batch.sample_rows, sampling, num_drafts, counts):
            emitted = slice(start, start + count)
            state.token_ids.extend(token_ids[emitted])
            output.sampled_token_ids[row] = token_ids[emitted]
            if logprobs is not None:
                output.logprobs[row] = logprobs[emitted]
            if top is not None:
                values, top_ids = top
                output.top_logprobs[row] = [list(zip(ids, lps)) for ids, lps in zip(top_ids[emitted], values[emitted])]
            start += num_rows + 1
        return output
