"""The gateway's unit fixtures (tokenizer, tiny MoE dir, the default harness) serve its
integration tests too."""

from tests.unit.gateway.conftest import gateway, moe_dir, tokenizer

__all__ = ["gateway", "moe_dir", "tokenizer"]
