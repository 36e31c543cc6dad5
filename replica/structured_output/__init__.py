"""Structured outputs: constrained decoding with a token bitmask (JSON schema, regex, choice, grammar)."""
from replica.structured_output.params import Kind, ReasoningGate, StructuredOutputsParams

__all__ = ["Kind", "ReasoningGate", "StructuredOutputsParams"]
