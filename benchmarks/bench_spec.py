"""Speculative decoding (n-gram prompt lookup) on a copy-heavy workload, against speculation off in the same run.

    python benchmarks/bench_spec.py                      # SmolLM2-135M-Instruct, k = 0 (off), 2, 4
    python benchmarks/bench_spec.py --ks 0 3 --ngram-min 2 --max-tokens 96

Chat prompts that ask the model to repeat or lightly edit a text or code snippet given in the
prompt, greedy, EOS honoured. Each k gets an engine of its own (warmed up on another prompt); the
prompts run one at a time (batch 1, where a step's cost hardly grows with its tokens) and all at
once, --repeats times, the engines taking turns within each round so that a noisy neighbour hits
them alike; the table has the median time. Throughput = output tokens / wall time of the chat
calls. Greedy outputs must be the same for every k and round: the table says whether they are.
From the second round on, the prompts' blocks are in each engine's prefix cache.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.timing import timed  # noqa: E402
from replica.engine import LLM  # noqa: E402
from replica.request import SamplingParams  # noqa: E402
from replica.scheduler import SpecDecodingStats  # noqa: E402

CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged'''
PARAGRAPH = ("The river runs through the old town, past the market square and under the stone bridge. "
             "Every morning the fishermen bring their boats to the harbour, and every evening the children "
             "gather on the bridge to watch the sun go down behind the hills.")
LIST = "apples, bread, milk, eggs, cheese, tomatoes, onions, rice, coffee, butter"
PROMPTS = [
    f"Repeat this Python function exactly:\n\n{CODE}",
    f"Rename the function to merge_ranges and return the whole code:\n\n{CODE}",
    f"Add a docstring to this function and return the full code:\n\n{CODE}",
    f"Copy this paragraph word for word:\n\n{PARAGRAPH}",
    f"Rewrite this paragraph, replacing 'river' with 'canal':\n\n{PARAGRAPH}",
    f"Write this shopping list as a numbered list, one item per line: {LIST}",
    f"Repeat the text below twice.\n\n{PARAGRAPH}",
    f"Fix the indentation of this code and return it:\n\n{CODE.replace('        ', '      ')}",
]


def spec_delta(after: SpecDecodingStats, before: SpecDecodingStats) -> SpecDecodingStats:
    return SpecDecodingStats(
        after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        [a - b for a, b in zip(after.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)])


def run(llm: LLM, conversations: list[list[dict]], params: SamplingParams, batched: bool):
    """(seconds, token ids per prompt, the speculative decoding stats of these requests)."""
    before = llm.engine.stats().spec_decoding
    if batched:
        elapsed, outputs = timed(llm.chat, conversations, params)
    else:
        elapsed, outputs = 0.0, []
        for conversation in conversations:
            seconds, [output] = timed(llm.chat, conversation, params)
            elapsed, outputs = elapsed + seconds, outputs + [output]
    return elapsed, [output.token_ids for output in outputs], spec_delta(llm.engine.stats().spec_decoding, before)


def row(mode: str, k: int, elapsed: float, num_tokens: int, baseline: float, stats: SpecDecodingStats,
        same: bool) -> str:
    """stats: of one round."""
    rate = f"{stats.num_accepted_tokens / stats.num_draft_tokens:.2f}" if stats.num_draft_tokens else "–"
    per_step = f"{stats.num_accepted_tokens / stats.num_drafts:.2f}" if stats.num_drafts else "–"
    per_pos = " / ".join(f"{count / stats.num_drafts:.2f}" for count in stats.num_accepted_tokens_per_pos) \
        if stats.num_drafts else "–"
    tok_s = num_tokens / elapsed
    return (f"| {mode} | {k} | {elapsed:.2f} | {num_tokens} | {tok_s:.1f} | {tok_s / baseline:.2f}x | {rate} | "
            f"{per_step} | {per_pos} | {'yes' if same else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 2, 4], help="num_speculative_tokens; 0 = off")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.ks[0] != 0:
        parser.error("the first k must be 0: the baseline")
    conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    engines = {k: LLM(args.model, num_speculative_tokens=k, ngram_min=args.ngram_min, ngram_max=args.ngram_max)
               for k in args.ks}
    for llm in engines.values():
        llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8, temperature=0))
    modes = {"one at a time": False, f"batch of {len(PROMPTS)}": True}
    times = {(mode, k): [] for mode in modes for k in args.ks}
    results = {}  # (mode, k) -> (token ids, stats) of the first round
    same = True
    for round_index in range(args.repeats):
        for mode, batched in modes.items():
            for k, llm in engines.items():
                elapsed, token_ids, stats = run(llm, conversations, params, batched)
                times[mode, k].append(elapsed)
                results.setdefault((mode, k), (token_ids, stats))
                same &= token_ids == results[mode, 0][0]
                print(f"round {round_index}, {mode}, k={k}: {elapsed:.2f} s", flush=True)
    print(f"\nngram_min {args.ngram_min}, ngram_max {args.ngram_max}, max_tokens {args.max_tokens}, "
          f"median of {args.repeats} rounds; greedy tokens identical for every k and round: {same}\n")
    print("| mode | k | s | output tokens | tok/s | vs off | acceptance rate | accepted per draft step | "
          "acceptance by position | same tokens as off |\n|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        baseline = sum(map(len, results[mode, 0][0])) / statistics.median(times[mode, 0])
        for k in args.ks:
            token_ids, stats = results[mode, k]
            print(row(mode, k, statistics.median(times[mode, k]), sum(map(len, token_ids)), baseline, stats,
                      token_ids == results[mode, 0][0]))


if __name__ == "__main__":
    main()
