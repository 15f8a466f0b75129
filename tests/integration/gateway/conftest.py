"""The gateway's unit fixtures (tokenizer, tiny MoE dir) serve its integration tests too."""

from tests.unit.gateway.conftest import moe_dir, tokenizer

__all__ = ["moe_dir", "tokenizer"]
