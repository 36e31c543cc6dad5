"""What constrained decoding costs the engine: 64 concurrent requests with 0%, 50% and 100% of them under a JSON
schema, against 0% in the same run.

    python benchmarks/bench_structured.py                # SmolLM2-135M-Instruct, 64 requests x 64 tokens, 3 rounds
    python benchmarks/bench_structured.py --requests 32 --max-tokens 128 --rounds 5
    python benchmarks/bench_structured.py --slow-compile  # streams' inter-token latency while a constraint compiles
    python benchmarks/bench_structured.py --random-model qwen3-0.6b --vocab-size 152064 --requests 256  # a GPU

--random-model: random weights of a real model's shapes (no hub on a GPU machine) with bench_grammar's byte-level
BPE of --vocab-size tokens; the prompt is the question's text, as there is no chat template.

The schema asks for an object with a list of at least 60 strings, so that no constrained request ends before
max_tokens and every variant runs the same batch shape (the unconstrained requests ignore EOS). Each variant adds
all its requests at once to one in-process engine (warmed up) and steps it until they end; output tok/s is output
tokens over that wall time, TPOT a request's (last token - first token) / (tokens - 1). The variants take turns
within each round; the table has each one's median over the rounds and its ratio to 0% of the same round.

--slow-compile: 16 unconstrained streams decode while a request arrives whose constraint (a choice among 50,000
strings) takes seconds to compile; it prints the streams' step times (their inter-token latency) before, while and
after it compiles. The compile runs on its own thread: the engine loop keeps stepping the others.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.bench_grammar import EOS, trained_tokenizer  # noqa: E402
from benchmarks.random_model import SHAPES, write_random_model  # noqa: E402
from benchmarks.timing import percentile  # noqa: E402
from replica.engine import LLM  # noqa: E402
from replica.request import SamplingParams  # noqa: E402
from replica.structured_output import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "required": ["city", "facts"], "additionalProperties": False,
          "properties": {"city": {"type": "string", "maxLength": 30},
                         "facts": {"type": "array", "minItems": 60, "items": {"type": "string", "maxLength": 60}}}}
QUESTION = "List facts about city number {} as JSON."


def run(llm: LLM, num_requests: int, num_constrained: int, max_tokens: int) -> tuple[float, list[float]]:
    """(output tok/s, every request's TPOT in seconds) of one batch."""
    engine = llm.engine
    plain = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0,
                                 structured_outputs=StructuredOutputsParams(json_schema=SCHEMA))
    token_times: dict[str, list[float]] = {}
    started = time.perf_counter()
    for index in range(num_requests):
        engine.add_request(f"{time.monotonic_ns()}-{index}", question(llm, index),
                           constrained if index < num_constrained else plain)
    while engine.has_unfinished():
        for output in engine.step():
            token_times.setdefault(output.request_id, []).extend([time.perf_counter()] * len(output.new_token_ids))
    wall = time.perf_counter() - started
    num_tokens = sum(map(len, token_times.values()))
    assert num_tokens == num_requests * max_tokens, "a request ended before max_tokens: the batches differ"
    return num_tokens / wall, [(times[-1] - times[0]) / (len(times) - 1) for times in token_times.values()]


def question(llm: LLM, index: int) -> list[int]:
    text = QUESTION.format(index)
    if llm.tokenizer.chat_template is None:
        return llm.tokenizer.encode(text)
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def slow_compile(llm: LLM, num_streams: int = 16, max_tokens: int = 160) -> None:
    engine = llm.engine
    plain = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    slow = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(
        choice=[f"option number {index}" for index in range(50_000)]))
    prompt = question(llm, 0)
    for index in range(num_streams):
        engine.add_request(f"stream-{index}", prompt, plain)
    windows: dict[str, list[float]] = {"before": [], "while compiling": [], "after": []}
    compiling, slow_end = None, None
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        slow_end = next((output for output in outputs if output.request_id == "slow" and output.finished), slow_end)
        if any(output.request_id.startswith("stream-") and output.new_token_ids for output in outputs):
            window = "before" if compiling is None else "while compiling" if not compiling.future.done() else "after"
            windows[window].append(time.perf_counter() - started)
        if compiling is None and len(windows["before"]) == 20:
            engine.add_request("slow", prompt, slow)
            compiling = engine.scheduler.requests["slow"].structured_output
    print(f"{num_streams} streams; the constrained request ended with finish_reason {slow_end.finish_reason!r}"
          + (f" ({slow_end.error})" if slow_end.error else ""))
    print("| window | steps | step time p50 (ms) | p99 (ms) |")
    print("|---|---|---|---|")
    for window, times in windows.items():
        timing = f"{percentile(times, 50) * 1e3:.1f} | {percentile(times, 99) * 1e3:.1f}" if times else "- | -"
        print(f"| {window} | {len(times)} | {timing} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="default: the engine's (bf16 where the CPU has it, else fp32)")
    parser.add_argument("--slow-compile", action="store_true")
    parser.add_argument("--random-model", choices=sorted(SHAPES), help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--vocab-size", type=int, default=152064, help="the random model's BPE vocabulary")
    parser.add_argument("--async-scheduling", choices=["on", "off"], help="default: the engine's")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = None
        if args.random_model:
            model = str(write_random_model(Path(scratch, args.random_model), args.random_model,
                                           tokenizer=trained_tokenizer(args.vocab_size), bos_token=EOS, eos_token=EOS))
        async_scheduling = None if args.async_scheduling is None else args.async_scheduling == "on"
        llm = LLM(model, dtype=args.dtype, max_num_seqs=args.requests, async_scheduling=async_scheduling,
                  kv_cache_memory_gib=args.kv_cache_gib)
        measure(llm, args)


def measure(llm: LLM, args: argparse.Namespace) -> None:
    if args.slow_compile:
        return slow_compile(llm)
    fractions = (0.0, 0.5, 1.0)
    run(llm, args.requests, args.requests, 8)  # warm-up: kernels, the grammar tokenizer, the schema's compile
    results: dict[float, list[tuple[float, list[float]]]] = {fraction: [] for fraction in fractions}
    for _ in range(args.rounds):
        for fraction in fractions:
            results[fraction].append(run(llm, args.requests, round(fraction * args.requests), args.max_tokens))
    weight = llm.engine.runner.model.model.embed_tokens.weight
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds, {llm.engine.model_name}, "
          f"{str(weight.dtype).removeprefix('torch.')} on {weight.device}, "
          f"{'async' if llm.engine.scheduler.config.async_scheduling else 'sync'} scheduling")
    print("| under a schema | output tok/s | x 0% | TPOT p50 (ms) | TPOT p99 (ms) | TPOT p50 x 0% |")
    print("|---|---|---|---|---|---|")
    for fraction in fractions:
        rounds = results[fraction]
        throughput = statistics.median(tok_s for tok_s, _ in rounds)
        ratio = statistics.median(tok_s / base for (tok_s, _), (base, _) in zip(rounds, results[0.0]))
        p50 = statistics.median(percentile(tpots, 50) for _, tpots in rounds)
        p99 = statistics.median(percentile(tpots, 99) for _, tpots in rounds)
        p50_ratio = statistics.median(percentile(tpots, 50) / percentile(base, 50)
                                      for (_, tpots), (_, base) in zip(rounds, results[0.0]))
        print(f"| {fraction:.0%} | {throughput:.1f} | {ratio:.3f} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | "
              f"{p50_ratio:.3f} |")


if __name__ == "__main__":
    main()
