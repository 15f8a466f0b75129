"""Structured outputs in the scheduler: grammar matchers run in-process, per request.

Reading order: `reasoning` (the constraint start: where in a window of tokens the grammar
starts to apply), `request_grammar` (one request's matcher and the three uses: validate drafts,
fill bitmask rows, accept tokens), `manager` (what the scheduler core calls each step), and
`grammar_loader` (the I/O edge: compiled grammars from the grammar service's Redis cache).
Importing this package does not import xgrammar; the first constrained request does.
"""

from services.scheduler.structured_output.manager import StructuredOutputManager
from services.scheduler.structured_output.reasoning import ReasoningConfig, constraint_start
from services.scheduler.structured_output.request_grammar import Accepted, RequestGrammar

__all__ = [
    "Accepted",
    "ReasoningConfig",
    "RequestGrammar",
    "StructuredOutputManager",
    "constraint_start",
]
