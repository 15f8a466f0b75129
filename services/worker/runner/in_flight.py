"""Sampled tokens still on their way to the host: the worker's side of asynchronous scheduling.

With asynchronous scheduling the scheduler sends step N+1 before step N's result is back, and
step N+1 decodes the tokens step N samples. On a GPU the worker launches step N+1 as soon as
its plan arrives, while step N still runs: N+1's input ids for those tokens are gathered on the
device from N's sampled-token tensor (`PendingFeed`), and N's tokens reach the host through one
asynchronous copy into pinned memory, waited for only when N's result is assembled
(`InFlightTokens.wait`). The host appends them to the batch then, so between launch and finish
a request's newest token exists only on the device: `PendingFeed` says which row's token is
where.

Nothing here touches the bus; the runner drives it (model_runner.py), the service decides when
to finish (service.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.sampling import SamplerOutput
from shared.protocol import SamplingParams


@dataclass
class InFlightTokens:
    """One step's sampled tokens: the device tensors and their host copies in flight."""

    request_ids: list[str]  # sampled requests, in `rows` order
    rows: np.ndarray  # [S] batch rows at launch
    params: list[SamplingParams | None]  # each row's sampling params at launch
    device_tokens: torch.Tensor  # [S] int64 on the step's device (feeds the next step)
    host: SamplerOutput  # the same outputs on the host (pinned on CUDA: copies in flight)
    done: torch.cuda.Event | None = None  # recorded after the copies (None: already there)
    live: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # row still held
    # a chained verify step's lookahead slots per row (spec/chain.py); its `host.token_ids`
    # are then [R, 2 + W] (tokens emitted, drafts verified, draws)
    chained: np.ndarray | None = None

    @classmethod
    def start(
        cls,
        request_ids: list[str],
        rows: np.ndarray,
        params: list[SamplingParams | None],
        out: SamplerOutput,
        stream: torch.cuda.Stream | None = None,
    ) -> InFlightTokens:
        """Begin copying `out` to the host without waiting for the device. With `stream` (a
        download stream) the copies run there once the sampling is done, so the compute
        stream goes on to the next step without them."""
        device = out.token_ids.device
        done = None
        if device.type == "cuda":
            current = torch.cuda.current_stream(device)
            copier = stream if stream is not None else current
            if copier != current:
                copier.wait_stream(current)
            with torch.cuda.stream(copier):
                host = SamplerOutput(*(_to_pinned(t, copier) for t in _fields(out)))  # type: ignore[arg-type]
                done = torch.cuda.Event()
                done.record()
        else:
            host = out
        return cls(
            request_ids=request_ids,
            rows=rows,
            params=params,
            device_tokens=out.token_ids,
            host=host,
            done=done,
            live=np.ones(len(rows), dtype=bool),
        )

    def wait(self) -> None:
        """Block until the host copies are complete (releases the GIL while waiting)."""
        if self.done is not None:
            self.done.synchronize()

    def is_ready(self) -> bool:
        return self.done is None or bool(self.done.query())


def _fields(out: SamplerOutput) -> tuple[torch.Tensor | None, ...]:
    return (out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs)


def _to_pinned(tensor: torch.Tensor | None, stream: torch.cuda.Stream) -> torch.Tensor | None:
    """An asynchronous copy of `tensor` into pinned memory on `stream` (the current one); the
    device tensor is not reused by the allocator before the copy has read it."""
    if tensor is None:
        return None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    tensor.record_stream(stream)
    return host


def fed_id(rows: np.ndarray) -> np.ndarray:
    """The input ids that stand for latest[rows] in a decode graph's inputs: -(row + 1)
    (meshllm_kernels/decode_chain/token_feed.py and meshllm_kernels/decode_chain/embed_rmsnorm.py
    read them on the device)."""
    return -np.asarray(rows, dtype=np.int64) - 1


class PendingFeed:
    """Which batch rows have a newest token that is still only on the device, and where it is.

    `latest[row]` (device) holds the row's most recently sampled token: every launch's sampling
    writes its tokens there, in stream order, so a later step's gather reads the right value
    without the host ever seeing it. `count[row]` (host) is how many sampled tokens of the row
    have not reached the host batch yet. The scheduler keeps at most one step of a request
    unconfirmed when it plans, so a plan only ever needs a token with count 1; anything else
    is a PlanError, never a wrong token.
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.latest = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.count = np.zeros(max_num_reqs, dtype=np.int64)
        self.steps: list[InFlightTokens] = []  # launched, not yet finished (oldest first)

    def pending(self, rows: np.ndarray) -> np.ndarray:
        """[R] 1 where the row has a token not yet on the host, else 0."""
        return (self.count[rows] > 0).astype(np.int64)

    def launched(self, step: InFlightTokens) -> None:
        """`step` sampled its rows' tokens, and the sampler wrote them into `latest`
        (SamplingState.sample's feed)."""
        self.count[step.rows] += 1
        self.steps.append(step)

    def landed(self, step: InFlightTokens) -> np.ndarray:
        """`step`'s tokens are on the host: returns the mask of its rows still in the batch,
        whose tokens the caller appends."""
        if step in self.steps:
            self.steps.remove(step)
        live = step.live
        self.count[step.rows[live]] -= 1
        return live

    def drop(self, row: int) -> None:
        """The row left the batch: its pending tokens are appended nowhere."""
        for step in self.steps:
            step.live[step.rows == row] = False
        self.count[row] = 0

    def gather(
        self, flat_rows: np.ndarray, positions: np.ndarray, num_tokens: np.ndarray
    ) -> np.ndarray | None:
        """Flat indices of a step's tokens that must come from the device (position one past
        the host's last token of the row), or None when there are none."""
        if not self.steps:
            return None
        wanted = np.flatnonzero(positions == num_tokens[flat_rows])
        if not wanted.size:
            return None
        counts = self.count[flat_rows[wanted]]
        if (counts != 1).any():
            raise ValueError(
                f"position {int(positions[wanted[0]])} needs a token that is "
                f"{'not sampled yet' if counts[0] == 0 else 'behind another unconfirmed one'}"
            )
        return wanted

    def clear(self) -> None:
        for step in self.steps:
            step.live[:] = False
        self.steps.clear()
        self.count[:] = 0
