"""The grammar path without a model on MaskBench's schemas (../shared/data/jsonschemabench): per category, how many
schemas llguidance refuses and why, compile time and mask-fill time p50/p99 at SmolLM2's vocabulary (49,152
tokens), and whether any instance was judged against its label (there must be none).

    PYTHONPATH=. python benchmarks/bench_grammar.py [--categories BFCL Glaiveai2K ...]
"""
import argparse
import collections

from benchmarks.jsonschemabench import CATEGORIES, SchemaResult, load_schemas, run_schema
from benchmarks.timing import percentile
from replica.executor.checkpoint import load_checkpoint
from replica.structured_output.backend import GuidanceBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    args = parser.parse_args()
    checkpoint = load_checkpoint(None)
    tokenizer = checkpoint.tokenizer
    backend = GuidanceBackend(tokenizer.backend, checkpoint.config.vocab_size, tokenizer.eos_token_id)
    backend.tokenizer  # built once, outside the timings

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    print(f"vocabulary {backend.vocab_size} tokens ({checkpoint.name})")
    print("| category | schemas | refused | instances judged | wrong | compile p50 / p99 (ms) | "
          "mask p50 / p99 (us) |")
    print("|---|---|---|---|---|---|---|")
    reasons = collections.Counter()
    for category in args.categories:
        results = [run_schema(backend, schema, encode) for schema in load_schemas((category,))]
        reasons.update(f"{category}: {_reason(result)}" for result in results if result.error)
        print(_row(category, results))
    print("\nwhy schemas were refused (category: reason, count):")
    for reason, count in reasons.most_common():
        print(f"  {count:4d}  {reason}")


def _row(category: str, results: list[SchemaResult]) -> str:
    compiled = [result for result in results if result.error is None]
    compile_ms = [result.compile_s * 1e3 for result in compiled]
    mask_us = [seconds * 1e6 for result in compiled for seconds in result.mask_s]
    judged = sum(len(result.schema.tests) for result in compiled)
    wrong = sum(len(result.wrong) for result in compiled)

    def p50_p99(values: list[float], digits: int) -> str:
        return f"{percentile(values, 50):.{digits}f} / {percentile(values, 99):.{digits}f}" if values else "-"

    return (f"| {category} | {len(results)} | {len(results) - len(compiled)} | {judged} | {wrong} | "
            f"{p50_p99(compile_ms, 2)} | {p50_p99(mask_us, 0)} |")


def _reason(result: SchemaResult) -> str:
    return result.error.removeprefix("the json constraint does not compile: ").split("\n")[0][:90]


if __name__ == "__main__":
    main()
