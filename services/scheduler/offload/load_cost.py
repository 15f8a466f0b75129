"""Whether loading a prefix from the tier beats recomputing it, on this machine (pure).

A remote KV tier that costs more than it saves is the known way to fail (LMCache's Redis backend
measured 14.9 s to first token against 1.03 s recomputed). So a load is chosen only when it is
expected to be faster than the compute it replaces:

    load_s(bytes)      = answer_s + bytes / load_bytes_per_s
    recompute_s(tokens) = tokens / prefill_tokens_per_s

`answer_s` is what a load costs besides its bytes: the loaded blocks are copied in at a step
boundary and the request rejoins the batch at the next plan, so it is the time of a step of the
running batch: the recent decode step (steps computing fewer than `min_prefill_tokens` tokens).
None while no batch runs (`batch_running`, set by the scheduler before each decision): an idle
worker applies a load at once. (Counting a decode step there made a small model's hits
recompute whenever its decode step was about as slow as prefilling the hit.)
Each rate is learned online as an exponential moving average, from the worker's own figures:
its KVTransferDone (bytes and seconds of every successful load) and its StepResults (tokens
computed per second of execute time, from steps that compute at least `min_prefill_tokens`,
so decode steps, whose cost is the weights rather than the tokens, do not count). Until a rate
was observed its prior (settings) stands; with no prior for the prefill rate, loads are chosen
(the tier's reason to exist: a fresh worker recomputing everything is the cost it saves).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoadCostStats:
    loads: int = 0  # decisions to load
    computes: int = 0  # hits left to recompute because a load would be slower


class LoadCostModel:
    def __init__(
        self,
        *,
        load_bytes_per_s: float = 200e6,
        prefill_tokens_per_s: float = 0.0,
        step_s: float = 0.0,
        smoothing: float = 0.2,
        min_prefill_tokens: int = 64,
    ) -> None:
        if load_bytes_per_s <= 0:
            raise ValueError(f"load_bytes_per_s must be > 0, got {load_bytes_per_s}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.load_bytes_per_s = load_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s  # 0 = not known yet
        self.step_s = step_s
        self.smoothing = smoothing
        self.min_prefill_tokens = min_prefill_tokens
        self.batch_running = True  # whether a load would wait for a step of a running batch
        self.stats = LoadCostStats()

    def _ewma(self, old: float, new: float) -> float:
        return new if old <= 0 else old + self.smoothing * (new - old)

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        """A successful load moved `num_bytes` in `seconds` (submitted to answered, worker)."""
        if num_bytes > 0 and seconds > 0:
            self.load_bytes_per_s = self._ewma(self.load_bytes_per_s, num_bytes / seconds)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` tokens in `seconds` of execute time."""
        if seconds <= 0 or num_tokens <= 0:
            return
        if num_tokens >= self.min_prefill_tokens:
            rate = num_tokens / seconds
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, rate)
        else:
            self.step_s = self._ewma(self.step_s, seconds)

    def load_seconds(self, num_bytes: int) -> float:
        answer_s = self.step_s if self.batch_running else 0.0
        return answer_s + num_bytes / self.load_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float | None:
        """None while the prefill rate is unknown."""
        if self.prefill_tokens_per_s <= 0:
            return None
        return num_tokens / self.prefill_tokens_per_s

    def load_wins(self, num_tokens: int, num_bytes: int) -> bool:
        """Whether loading `num_tokens` tokens (`num_bytes` of payload) beats recomputing them."""
        recompute = self.recompute_seconds(num_tokens)
        return recompute is None or self.load_seconds(num_bytes) < recompute

    def decide(self, num_tokens: int, num_bytes: int) -> bool:
        """`load_wins`, counted as a decision."""
        wins = self.load_wins(num_tokens, num_bytes)
        if wins:
            self.stats.loads += 1
        else:
            self.stats.computes += 1
        return wins

    def state(self) -> dict[str, float]:
        return {
            "load_bytes_per_s": self.load_bytes_per_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "step_s": self.step_s,
        }
