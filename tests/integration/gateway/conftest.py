"""The gateway's unit fixtures (tokenizer, tiny MoE dir, the harness) serve its integration
tests too, and the `openai` client of a harness that serves HTTP (`harness(serve=True)`)."""

import openai
import pytest

from tests.unit.gateway.conftest import gateway, moe_dir, tokenizer
from tests.unit.gateway.harness import GatewayHarness

__all__ = ["client", "gateway", "moe_dir", "tokenizer"]


@pytest.fixture
def client(gateway: GatewayHarness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
