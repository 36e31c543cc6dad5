"""The grammar backend: llguidance (compile p50 about 1 ms, mask p99 about 0.5 ms on MaskBench, no unbounded
compiles; ../shared/notes/structured-outputs.md). A Grammar is one request's matcher state."""
import json
import os
import threading
from collections.abc import Callable

import llguidance
import numpy as np
import tokenizers

from replica.structured_output.params import ReasoningGate, StructuredOutputsParams

# At most this many whitespace characters between two JSON tokens: enough for pretty-printed JSON several
# levels deep, too few for a model to run to max_tokens on blanks.
MAX_JSON_WHITESPACE = 20
_FLEXIBLE_WHITESPACE = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
_COMPACT_WHITESPACE = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint the backend cannot compile (or not in time): that request fails, nothing else."""


class Grammar:
    """One sequence's position in its grammar. It advances only on committed tokens."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """False: the grammar rejects the token (the matcher is then in error)."""
        return self._matcher.consume_token(token_id)

    def validate(self, token_ids: list[int]) -> int:
        """How many of token_ids, from the first, the grammar would accept; the state does not change."""
        return self._matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """bitmask [rows, words] int32, C-contiguous: row gets the tokens allowed next."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def is_terminated(self) -> bool:
        """It took its end-of-sequence token (or can take nothing more)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GuidanceBackend:
    """Compiles constraints for one tokenizer (a `tokenizers.Tokenizer`), with vocab_size the width of the
    model's logits: tokens the tokenizer lacks are never allowed (nor, in a mask wider than the logits, the
    tokens the logits lack)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_id: int | None, *,
                 num_fill_threads: int | None = None):
        self.vocab_size = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        self._tokenizer_args = (tokenizer, eos_token_id)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._fill_pool = llguidance.LLExecutor(num_fill_threads or default_fill_threads())

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about 0.4 s for a 49k vocabulary), so that an engine starts without it."""
        with self._lock:
            if self._tokenizer is None:
                tokenizer, eos_token_id = self._tokenizer_args
                self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=eos_token_id)
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh Grammar; GrammarError naming the problem if the constraint does not compile."""
        try:
            text = grammar_text(params)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {params.kind} constraint does not compile: {matcher.get_error()}")
        return Grammar(matcher)

    def fill_bitmasks(self, bitmask: np.ndarray, rows: list[tuple[Grammar, int]]) -> None:
        """Each grammar's allowed tokens into its row of bitmask [rows, words] int32, C-contiguous: the rows in
        parallel, off the interpreter lock. Inside a JSON string a row walks most of the vocabulary: about 1 ms
        at 152k tokens, against a 3.5 ms decode step on an H200 (benchmarks/results/structured-outputs.md)."""
        self._fill_pool.unsafe_compute_mask_ptr([(grammar._matcher, row) for grammar, row in rows],
                                                bitmask.ctypes.data, bitmask.strides[0], len(bitmask))

    @staticmethod
    def copy(grammar: Grammar) -> Grammar:
        """A Grammar at the same position, advancing on its own."""
        return Grammar(grammar._matcher.deep_copy())


def default_fill_threads() -> int:
    """Half the CPUs this process may run on, at most 8 (vLLM's rule for its mask fills): the rest stay with
    the engine loop and, on a CPU host, the forward pass that the fill overlaps."""
    return min(8, max(1, len(os.sched_getaffinity(0)) // 2))


def lark_json(schema: dict, whitespace_flexible: bool = True) -> str:
    """A Lark grammar's %json of schema, its whitespace bounded as grammar_text bounds it."""
    whitespace = _FLEXIBLE_WHITESPACE if whitespace_flexible else _COMPACT_WHITESPACE
    return f"%json {json.dumps({**schema, 'x-guidance': whitespace})}"


def lark_terminal(text: str, special_token_id: Callable[[str], int | None]) -> str:
    """text as a Lark grammar names it: the special token by id if it is one (text never holds one), else a string."""
    token_id = special_token_id(text)
    return json.dumps(text) if token_id is None else f"<[{token_id}]>"


def is_special_terminal(terminal: str) -> bool:
    return terminal.startswith("<[")


def grammar_text(params: StructuredOutputsParams) -> str:
    """params as an llguidance grammar; ValueError for what cannot even be converted."""
    answer = _answer_text(params)
    return answer if params.reasoning is None else _after_reasoning(answer, params.reasoning)


def _after_reasoning(answer: str, gate: ReasoningGate) -> str:
    """Any text up to the reasoning's closing tag (from its opening, if the output may start outside it, or
    without reasoning at all), a few blanks, then answer."""
    grammars = json.loads(answer)["grammars"] if answer.startswith("{") else [{"lark_grammar": answer}]
    name = grammars[0].setdefault("name", "answer")
    if is_special_terminal(gate.closing):  # text never holds a special token
        reasoning, rules = f"TEXT {gate.closing}", []
    else:  # text up to the first closing tag
        reasoning, rules = "reasoning", [f"reasoning[lazy]: TEXT {gate.closing}"]
    if gate.opening is not None and is_special_terminal(gate.opening):
        reasoning = f"({gate.opening} {reasoning})?"
    elif gate.opening is not None:  # taken as soon as it is seen, or the answer's own lexemes would go on
        reasoning, rules = f"(opening {reasoning})?", [*rules, f"opening[lazy]: {gate.opening}"]
    lark = "\n".join(["%llguidance {}", f"start: {reasoning} GAP? @{name}", *rules, r"GAP: /[ \t\n]{1,4}/",
                      r"TEXT: /(.|\n)*/"])
    return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})


def _answer_text(params: StructuredOutputsParams) -> str:
    whitespace = _FLEXIBLE_WHITESPACE if params.whitespace_flexible else _COMPACT_WHITESPACE
    match params.kind:
        case "json":
            return llguidance.LLMatcher.grammar_from_json_schema(params.json_schema, overrides=whitespace)
        case "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=whitespace)
        case "regex":  # \d and \w as ASCII, as in JSON Schema's patterns (llguidance's default is Unicode)
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(params.regex, 'dw')}/")
        case "choice":
            return llguidance.grammar_from("choice", params.choice)
        case "grammar":
            return llguidance.grammar_from("grammar", params.grammar)
