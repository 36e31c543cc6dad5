"""MaskBench's schemas through the grammar path with no model (SmolLM2's tokenizer): for every schema the backend
compiles, each valid instance passes the mask token by token and may end; each invalid one is ruled out. The tool
schemas (BFCL) all compile; what the others refuse is llguidance's coverage (see bench_grammar.py)."""
import pytest

from benchmarks.jsonschemabench import CATEGORIES, load_schemas, run_schema
from replica.executor.checkpoint import load_checkpoint
from replica.structured_output.backend import GuidanceBackend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    checkpoint = load_checkpoint(None)
    tokenizer = checkpoint.tokenizer
    backend = GuidanceBackend(tokenizer.backend, checkpoint.config.vocab_size, tokenizer.eos_token_id)
    return backend, lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("category", CATEGORIES)
def test_every_compiled_schema_judges_every_instance_right(smollm2, category):
    backend, encode = smollm2
    results = [run_schema(backend, schema, encode) for schema in load_schemas((category,))]
    compiled = [result for result in results if result.error is None]
    assert [wrong for result in compiled for wrong in result.wrong] == []
    if category == "BFCL":
        assert len(compiled) == len(results) == 1043
        assert sum(len(result.schema.tests) for result in compiled) == 1043
