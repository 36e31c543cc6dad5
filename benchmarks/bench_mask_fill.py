"""One step's token bitmask for a batch of constrained requests, every one inside a JSON string (where a row
walks most of the vocabulary): the rows one after the other against the backend's parallel fill at 1, 2, 4 and
8 threads (up to this machine's CPUs), in the same run.

    PYTHONPATH=. python benchmarks/bench_mask_fill.py                       # SmolLM2's 49,152 tokens, 64 rows
    PYTHONPATH=. python benchmarks/bench_mask_fill.py --vocab-size 152064 --rows 256

Each row is a grammar of its own (bench_structured's schema) fed its own text, and every step advances each one by
a token of a different word, so that no row finds its mask in another's cache, as in a batch of real answers.
"""
import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.bench_grammar import EOS, trained_tokenizer
from benchmarks.bench_structured import SCHEMA
from replica.executor.checkpoint import load_checkpoint
from replica.structured_output import StructuredOutputsParams
from replica.structured_output.backend import Grammar, GuidanceBackend

WORDS = ["river", "museum", "bridge", "market", "harbour", "garden", "castle", "station", "tower", "square"]


def grammars_in_strings(backend: GuidanceBackend, encode, rows: int) -> list[Grammar]:
    grammars = []
    for row in range(rows):
        grammar = backend.compile(StructuredOutputsParams(json_schema=SCHEMA))
        for token_id in encode(f'{{"city": "City {row}", "facts": ["Fact {row}:'):
            assert grammar.accept(token_id)
        grammars.append(grammar)
    return grammars


def step_times(backend: GuidanceBackend, grammars: list[Grammar], word_tokens: list[list[int]], steps: int,
               parallel: bool) -> list[float]:
    bitmask = np.full((len(grammars), -(-backend.vocab_size // 32)), -1, dtype=np.int32)
    times = []
    for step in range(steps):
        for row, grammar in enumerate(grammars):
            tokens = word_tokens[(row + step) % len(word_tokens)]
            assert all(grammar.accept(token_id) for token_id in tokens)
        started = time.perf_counter()
        if parallel:
            backend.fill_bitmasks(bitmask, [(grammar, row) for row, grammar in enumerate(grammars)])
        else:
            for row, grammar in enumerate(grammars):
                grammar.fill_bitmask(bitmask, row)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, help="bench_grammar's trained BPE; default: SmolLM2's tokenizer")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6,
                        help="each step adds a word to every row's string (the schema allows 60 characters)")
    args = parser.parse_args()
    if args.vocab_size:
        tokenizer = trained_tokenizer(args.vocab_size)
        vocab_size, eos = args.vocab_size, tokenizer.token_to_id(EOS)
    else:
        checkpoint = load_checkpoint(None)
        tokenizer, vocab_size, eos = (checkpoint.tokenizer.backend, checkpoint.config.vocab_size,
                                      checkpoint.tokenizer.eos_token_id)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    word_tokens = [encode(f" {word}") for word in WORDS]
    cpus = len(os.sched_getaffinity(0))
    print(f"{args.rows} rows inside JSON strings, {args.steps} steps, vocabulary {vocab_size}, {cpus} CPUs")
    print("| fill | threads | step p50 (ms) | per row (us) | x one at a time |")
    print("|---|---|---|---|---|")
    baseline = None
    for threads in [0] + [count for count in (1, 2, 4, 8) if count <= cpus]:
        backend = GuidanceBackend(tokenizer, vocab_size, eos, num_fill_threads=threads or 1)
        grammars = grammars_in_strings(backend, encode, args.rows)
        p50 = statistics.median(step_times(backend, grammars, word_tokens, args.steps, parallel=threads > 0))
        baseline = baseline or p50
        print(f"| {'parallel' if threads else 'one row at a time'} | {threads or 1} | {p50 * 1e3:.2f} | "
              f"{p50 / args.rows * 1e6:.0f} | {baseline / p50:.2f} |")


if __name__ == "__main__":
    main()
