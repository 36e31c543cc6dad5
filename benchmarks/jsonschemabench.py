"""MaskBench's schemas (../shared/data/jsonschemabench) run through the grammar path with no model: each valid
instance must pass the token mask token by token and end where the grammar accepts; each invalid one must be
ruled out somewhere. Used by tests/test_jsonschemabench.py and benchmarks/bench_grammar.py."""
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from replica.structured_output import StructuredOutputsParams
from replica.structured_output.backend import Grammar, GrammarError, GuidanceBackend

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"
CATEGORIES = ("BFCL", "Glaiveai2K", "Handwritten", "MCPspec", "Synthesized")


@dataclass
class Schema:
    category: str
    name: str
    schema: dict | bool
    tests: list[dict]


@dataclass
class SchemaResult:
    """What the grammar path made of one schema and its instances."""
    schema: Schema
    error: str | None = None                  # why it was refused (did not compile)
    compile_s: float = 0.0
    mask_s: list[float] = field(default_factory=list)  # each mask fill
    wrong: list[str] = field(default_factory=list)     # instances judged against their label


def load_schemas(categories: tuple[str, ...] = CATEGORIES, data_dir: Path = DATA_DIR) -> Iterator[Schema]:
    for category in categories:
        if not (data_dir / category).is_dir():
            raise FileNotFoundError(f"no MaskBench category {category!r} in {data_dir} (../shared beside the repo)")
        for path in sorted((data_dir / category).glob("*.json")):
            data = json.loads(path.read_text())
            yield Schema(category, path.stem, data["schema"], data.get("tests", []))


def instance_text(data) -> str:
    """An instance as a model would write it: json.dumps's default separators, non-ASCII characters as they are."""
    return json.dumps(data, ensure_ascii=False)


def run_schema(backend: GuidanceBackend, schema: Schema, encode) -> SchemaResult:
    """encode: text -> token ids (the model's tokenizer, no special tokens)."""
    result = SchemaResult(schema)
    try:
        params = StructuredOutputsParams(json_schema=schema.schema)
        started = time.perf_counter()
        grammar = backend.compile(params)
        result.compile_s = time.perf_counter() - started
    except (GrammarError, ValueError) as exc:
        result.error = str(exc)
        return result
    bitmask = np.zeros((1, -(-backend.vocab_size // 32)), dtype=np.int32)
    for index, test in enumerate(schema.tests):
        token_ids = encode(instance_text(test["data"])) + [backend.tokenizer.eos_token]
        accepted = _follows_mask(backend.copy(grammar), token_ids, bitmask, result.mask_s)
        if accepted != test["valid"]:
            result.wrong.append(f"{schema.category}/{schema.name} test {index} ({test.get('description', '')}): "
                                f"{'accepted' if accepted else 'rejected'}, labelled "
                                f"{'valid' if test['valid'] else 'invalid'}")
    return result


def _follows_mask(grammar: Grammar, token_ids: list[int], bitmask: np.ndarray, mask_s: list[float]) -> bool:
    """Every token (the last one end-of-sequence) allowed by the mask filled before it."""
    for token_id in token_ids:
        started = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        mask_s.append(time.perf_counter() - started)
        if not (int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1:
            return False
        if not grammar.accept(token_id):
            raise AssertionError(f"the mask allowed token {token_id}, which the grammar then rejected")
    return True
