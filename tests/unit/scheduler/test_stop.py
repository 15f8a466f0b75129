"""Stop conditions, through the scheduler: the WorkerDouble is told which token to return at
a given position (`overrides`), everything else is its pure function of the position."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble, token_at

EOS = 2
PROMPT = [100, 101, 102]


def make(max_model_len: int = 256) -> Driver:
    config = SchedulerConfig(
        block_size=16, num_gpu_blocks=32, max_model_len=max_model_len, eos_token_ids=[EOS]
    )
    return Driver(Scheduler(config, "s0"), WorkerDouble(block_size=16))


def expected(rid: str, n: int) -> list[int]:
    return [token_at(rid, p) for p in range(len(PROMPT), len(PROMPT) + n)]


def test_max_tokens_finishes_with_length() -> None:
    d = make()
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=5))
    d.run()
    assert d.client.outputs["r"] == expected("r", 5)
    assert d.client.finish["r"] == "length" and d.client.stop_token["r"] is None


def test_eos_finishes_with_stop_and_names_the_token() -> None:
    d = make()
    d.worker.overrides[("r", 5)] = [EOS]  # third output token
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=10))
    d.run()
    assert d.client.outputs["r"] == [*expected("r", 2), EOS]
    assert d.client.finish["r"] == "stop" and d.client.stop_token["r"] == EOS


def test_ignore_eos_keeps_going() -> None:
    d = make()
    d.worker.overrides[("r", 5)] = [EOS]
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=6, ignore_eos=True))
    d.run()
    assert d.client.outputs["r"][2] == EOS and len(d.client.outputs["r"]) == 6
    assert d.client.finish["r"] == "length"


def test_stop_token_ids_finish_with_stop() -> None:
    d = make()
    d.worker.overrides[("r", 4)] = [7]
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=10, stop_token_ids=[7, 8]))
    d.run()
    assert d.client.outputs["r"] == [token_at("r", 3), 7]
    assert d.client.finish["r"] == "stop" and d.client.stop_token["r"] == 7


def test_min_tokens_suppresses_stops_but_not_length() -> None:
    d = make()
    d.worker.overrides[("r", 3)] = [EOS]  # first output: too early
    d.worker.overrides[("r", 4)] = [8]  # second output: still too early (min 3)
    d.worker.overrides[("r", 6)] = [8]  # fourth output: counts
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=10, min_tokens=3, stop_token_ids=[8]))
    d.run()
    assert d.client.outputs["r"] == [EOS, 8, token_at("r", 5), 8]
    assert d.client.finish["r"] == "stop"
    d.worker.overrides[("s", 3)] = [EOS]
    d.scheduler.add_request(submit("s", PROMPT, max_tokens=2, min_tokens=5))
    d.run()
    assert d.client.outputs["s"] == [EOS, token_at("s", 4)]
    assert d.client.finish["s"] == "length"


def test_max_model_len_finishes_with_length() -> None:
    d = make(max_model_len=8)
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=100))
    d.run()
    assert d.client.outputs["r"] == expected("r", 5)  # 3 prompt + 5 = 8 tokens
    assert d.client.finish["r"] == "length"


def test_prompt_one_short_of_max_model_len_gets_exactly_one_token() -> None:
    d = make(max_model_len=4)
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=100))
    d.run()
    assert d.client.outputs["r"] == expected("r", 1)
    assert d.client.finish["r"] == "length"


def test_tokens_after_a_stop_in_one_step_are_dropped() -> None:
    d = make()
    d.worker.overrides[("r", 3)] = [40, EOS, 41, 42]  # several tokens in one step
    d.scheduler.add_request(submit("r", PROMPT, max_tokens=10))
    d.run()
    assert d.client.outputs["r"] == [40, EOS]
    assert d.client.finish["r"] == "stop"
