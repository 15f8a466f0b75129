"""Per-row sampling parameters on the device, written from the host without waiting for it.

Assigning a Python number to an element of a CUDA tensor (`t[row] = x`) synchronizes: PyTorch
uploads the number with a blocking copy, which first waits for everything queued on the stream.
The worker launches step N+1 while step N still runs (in_flight.py), so every request joining
or leaving the batch stalled the host until step N had finished, and step N+1's inputs were
then prepared on an idle GPU (tests/gpu/test_no_host_sync_cuda.py found a dozen such writes per
add and remove). Here writes land in host columns and mark their row; `flush()` sends the
marked rows in one staged asynchronous upload and scatters them into the device columns with
one `index_copy_` per dtype. Stream order does the rest: the scatter runs after every step
queued before it and before the sampling that reads it.

A column the device also updates itself (the output count, `record_sampled`) keeps its device
values for unmarked rows: only marked rows are written, from the host values set with them.
"""

from __future__ import annotations

import numpy as np
import torch

from meshllm_kernels.runtime.staged_copy import stage_to_device


class RowParams:
    """float32 and int64 columns of `num_rows` rows; `column(name)` is the device view."""

    @torch.inference_mode(False)  # updated in place from inside and outside inference mode
    def __init__(
        self,
        num_rows: int,
        device: torch.device,
        floats: dict[str, float],
        ints: dict[str, int],
    ) -> None:
        self.device = device
        self._neutral = {**floats, **ints}
        self._float_col = {name: j for j, name in enumerate(floats)}
        self._int_col = {name: j for j, name in enumerate(ints)}
        self._host_floats = np.tile(np.array(list(floats.values()), np.float32), (num_rows, 1))
        self._host_ints = np.tile(np.array(list(ints.values()), np.int64), (num_rows, 1))
        self._floats = torch.from_numpy(self._host_floats.copy()).to(device)
        self._ints = torch.from_numpy(self._host_ints.copy()).to(device)
        self._marked: set[int] = set()

    def set(self, row: int, **values: float) -> None:
        """Host values for `row` (named columns), sent at the next flush."""
        for name, value in values.items():
            if name in self._float_col:
                self._host_floats[row, self._float_col[name]] = value
            else:
                self._host_ints[row, self._int_col[name]] = value
        self._marked.add(row)

    def reset(self, row: int) -> None:
        """Every column of `row` back to its neutral value."""
        self.set(row, **self._neutral)

    def column(self, name: str) -> torch.Tensor:
        """The device column [num_rows] (a strided view), with every marked row sent."""
        self.flush()
        if name in self._float_col:
            return self._floats[:, self._float_col[name]]
        return self._ints[:, self._int_col[name]]

    def flush(self) -> None:
        """Send the marked rows: one upload, one scatter per dtype, nothing waited for."""
        if not self._marked:
            return
        rows = np.fromiter(sorted(self._marked), np.int64, len(self._marked))
        self._marked.clear()
        n_int, n_float = self._host_ints.shape[1], self._host_floats.shape[1]
        words = (n_float + 1) // 2  # float32 pairs per int64 word
        floats = np.zeros((len(rows), 2 * words), np.float32)
        floats[:, :n_float] = self._host_floats[rows]
        packed = np.empty((len(rows), 1 + n_int + words), np.int64)
        packed[:, 0] = rows
        packed[:, 1 : 1 + n_int] = self._host_ints[rows]
        packed[:, 1 + n_int :] = floats.view(np.int64)
        staged = stage_to_device(packed, self.device)
        index = staged[:, 0]
        self._ints.index_copy_(0, index, staged[:, 1 : 1 + n_int])
        as_floats = staged[:, 1 + n_int :].contiguous().view(torch.float32)
        self._floats.index_copy_(0, index, as_floats[:, :n_float])
