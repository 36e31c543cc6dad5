"""What one request's output must match: a JSON schema, any JSON object, a regex, one of some strings, or a
grammar (Lark, or llama.cpp's GBNF). Plain values only: no grammar library is imported here."""
import json
from typing import Any, Literal

import pydantic

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]


class ReasoningGate(pydantic.BaseModel):
    """The model reasons before it answers, and the constraint holds only from the end of its reasoning on. Each
    tag is a Lark terminal: a string ('"</think>"') or a special token by id ('<[151668]>'). opening None: the
    output starts inside the reasoning (the prompt opened it); else the output may start with it."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    closing: str
    opening: str | None = None


class StructuredOutputsParams(pydantic.BaseModel):
    """Exactly one kind of constraint. json_schema is a JSON Schema; json_object asks for any JSON object;
    choice for exactly one of its strings. whitespace_flexible: JSON may put (bounded) whitespace between
    its tokens; False means the compact form."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = True
    reasoning: ReasoningGate | None = None

    @pydantic.model_validator(mode="after")
    def _one_kind(self) -> "StructuredOutputsParams":
        kinds = self._kinds_set()
        if len(kinds) != 1:
            raise ValueError("exactly one kind of constraint (json, json_object, regex, choice or grammar) per "
                             f"request, got {len(kinds)}" + (f": {', '.join(kinds)}" if kinds else ""))
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one string")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar must not be empty")
        if self.regex is not None and "\x00" in self.regex:
            raise ValueError("regex must not contain a NUL character")
        return self

    def _kinds_set(self) -> list[str]:
        values = {"json": self.json_schema, "json_object": self.json_object or None, "regex": self.regex,
                  "choice": self.choice, "grammar": self.grammar}
        return [kind for kind, value in values.items() if value is not None]

    @property
    def kind(self) -> Kind:
        return self._kinds_set()[0]

    def key(self) -> tuple[str, str, bool, ReasoningGate | None]:
        """The compiled grammar's identity: kind, the canonical text of its spec, the whitespace rule and the
        reasoning before it."""
        spec = {"json": self.json_schema, "json_object": True, "regex": self.regex, "choice": self.choice,
                "grammar": self.grammar}[self.kind]
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, separators=(",", ":"))
        return self.kind, text, self.whitespace_flexible, self.reasoning
