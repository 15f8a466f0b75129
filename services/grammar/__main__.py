"""`python -m services.grammar`: wiring only."""

from __future__ import annotations

from services.grammar.service import GrammarService
from shared.config import GrammarSettings
from shared.service import run_service

if __name__ == "__main__":
    run_service(GrammarService(GrammarSettings()))
