"""The grammar path without a model on MaskBench's schemas (../shared/data/jsonschemabench): per category, how many
schemas llguidance refuses and why, compile time and mask-fill time p50/p99, and whether any instance was judged
against its label (there must be none).

    PYTHONPATH=. python benchmarks/bench_grammar.py [--categories BFCL Glaiveai2K ...]
    PYTHONPATH=. python benchmarks/bench_grammar.py --vocab-size 152064

By default at SmolLM2's vocabulary (49,152 tokens). With --vocab-size, a byte-level BPE of that many tokens trained
here on the Python sources of this interpreter's library (no model hub: Qwen's 151,646-token tokenizer is not on
this machine), cached under ~/.cache/prefixserve; the mask's cost grows with the vocabulary it walks.
"""
import argparse
import collections
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from benchmarks.jsonschemabench import CATEGORIES, SchemaResult, load_schemas, run_schema
from benchmarks.timing import percentile
from replica.executor.checkpoint import load_checkpoint
from replica.structured_output.backend import GuidanceBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    parser.add_argument("--vocab-size", type=int, help="a BPE of this many tokens trained here; default: SmolLM2's")
    args = parser.parse_args()
    if args.vocab_size:
        tokenizer, name = trained_tokenizer(args.vocab_size), "byte-level BPE trained on Python sources"
        backend = GuidanceBackend(tokenizer, args.vocab_size, tokenizer.token_to_id(EOS))
    else:
        checkpoint = load_checkpoint(None)
        tokenizer, name = checkpoint.tokenizer.backend, checkpoint.name
        backend = GuidanceBackend(tokenizer, checkpoint.config.vocab_size, checkpoint.tokenizer.eos_token_id)
    backend.tokenizer  # built once, outside the timings

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    print(f"vocabulary {backend.vocab_size} tokens ({name})")
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


EOS = "<|endoftext|>"
TRAINING_BYTES = 120 * 2**20


def trained_tokenizer(vocab_size: int) -> Tokenizer:
    """A GPT-2-style byte-level BPE of vocab_size tokens trained on about 120 MB of the standard library's and the
    installed packages' Python files (once; cached)."""
    path = Path.home() / ".cache" / "prefixserve" / f"bpe-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sources, num_bytes = [], 0
    for source in sorted(Path(sys.prefix, "lib").rglob("*.py")):
        if num_bytes > TRAINING_BYTES:
            break
        try:
            num_bytes += len(source.read_bytes().decode())
        except (UnicodeDecodeError, OSError):  # the trainer reads UTF-8 only
            continue
        sources.append(str(source))
    tokenizer.train(sources, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


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
