"""Reasoning models (Qwen3, DeepSeek-R1 and their kind): what they think between <think> and </think> comes back
as the message's reasoning_content, apart from its content, and a constraint (response_format, a forced tool call,
strict tools) holds from the end of the thinking on, which stays free."""
from collections.abc import Callable
from dataclasses import dataclass

from cluster.tool_calls import partial_suffix
from replica.structured_output import ReasoningGate
from replica.structured_output.backend import lark_terminal

OPENING, CLOSING = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    """How an answer's output begins: inside the thinking (the prompt opened it), or perhaps with it."""
    starts_inside: bool

    def gate(self, special_token_id: Callable[[str], int | None]) -> ReasoningGate:
        return ReasoningGate(closing=lark_terminal(CLOSING, special_token_id),
                             opening=None if self.starts_inside else lark_terminal(OPENING, special_token_id))

    def split(self, text: str) -> tuple[str | None, str]:
        """(the thinking, None if there is none; the answer after it, from its first non-blank character)."""
        if not self.starts_inside:
            if not text.lstrip().startswith(OPENING):
                return None, text
            text = text.lstrip()[len(OPENING):]
        thinking, closed, answer = text.partition(CLOSING)
        return thinking, answer.lstrip() if closed else ""

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class ReasoningStream:
    """split() as the text streams: each piece's new thinking and new answer; the concatenations equal split()'s.
    Text that may still be the opening, a part of the closing or the blanks after it is held back."""

    def __init__(self, reasoning: Reasoning):
        self._state = "thinking" if reasoning.starts_inside else "opening"
        self._held = ""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self._held += text
        if self._state == "opening":
            stripped = self._held.lstrip()
            if stripped.startswith(OPENING):
                self._state, self._held = "thinking", stripped[len(OPENING):]
            elif OPENING.startswith(stripped) and not finished:
                return "", ""
            else:
                self._state = "answer"
        thinking = ""
        if self._state == "thinking":
            thinking, closed, rest = self._held.partition(CLOSING)
            if not closed:
                kept = 0 if finished else partial_suffix(thinking, CLOSING)
                self._held = thinking[len(thinking) - kept:]
                return thinking[:len(thinking) - kept], ""
            self._state, self._held = "after_thinking", rest
        if self._state == "after_thinking":
            self._held = self._held.lstrip()
            if not self._held and not finished:
                return thinking, ""
            self._state = "answer"
        answer, self._held = self._held, ""
        return thinking, answer


def reasoning_for(chat_template: str | None, prompt_tail: str) -> Reasoning | None:
    """The reasoning of a model with this template after a prompt ending in prompt_tail; None for a model that
    does not reason, or a prompt that already closed the thinking (Qwen3's enable_thinking false)."""
    if chat_template is None or CLOSING not in chat_template:
        return None
    if prompt_tail.rfind(OPENING) > prompt_tail.rfind(CLOSING):
        return Reasoning(starts_inside=True)
    return None if prompt_tail.rstrip().endswith(CLOSING) else Reasoning(starts_inside=False)
