"""vLLM's `bad_words` on the device: a word's last token is banned while its other tokens (its
prefix) are the request's latest outputs; a one-token word's token is always banned.

The rule reads the outputs, which the host does not have when it launches the next step: the
worker queues step N + 1 while step N's tokens are still on the device (in_flight.py). So each
row keeps a window of its latest outputs on the device, as long as the longest prefix in use,
which `record` shifts after every step, and the match compares every word's prefix with its
row's window on the device. A row that joins with outputs already (resumed after preemption)
starts from their tail. Only outputs count, never the prompt: vLLM matches the generated
tokens.

Words are kept per row on the host and flattened into one table (row, last token, prefix),
rebuilt after a change as row_tokens.py's lists are. A prefix is right-aligned to the window
and the slots left of a shorter one hold ANY; the window's slots before a row's first output
hold NONE, which no prefix token equals, so a word longer than the outputs so far does not
match (vLLM's rule). Entries of words that do not match point at the scratch row, like those
of rows outside the batch (row_tokens.py): nothing is compacted, so nothing waits for the
device, and a token banned by two words is written twice with the same -inf.
"""

from __future__ import annotations

import numpy as np
import torch

from meshllm_kernels.runtime.staged_copy import stage_to_device
from services.worker.sampling.row_tokens import BatchEntries

ANY = -2  # a prefix slot left of a shorter prefix: matches every window slot
NONE = -1  # a window slot before the row's first output: equals no prefix token


class BadWords:
    """Each state row's bad words (token ids) and the device window of its latest outputs."""

    @torch.inference_mode(False)  # the window is updated in place from inside and outside it
    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.device = device
        self._words: dict[int, list[list[int]]] = {}
        self._prefix_len: dict[int, int] = {}  # rows with a word of 2+ tokens: the longest prefix
        self._seeds: dict[int, list[int]] = {}  # rows whose window is still to be written
        self._width = 0
        self._flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.window = torch.full((num_rows, 0), NONE, dtype=torch.int32, device=device)

    def __bool__(self) -> bool:
        return bool(self._words)

    def __contains__(self, row: int) -> bool:
        return row in self._words

    @property
    def reads_history(self) -> bool:
        """Some row has a word of two tokens or more: its ban depends on the outputs, so
        `record` must see every sampled token."""
        return self._width > 0

    def set(self, row: int, words: list[list[int]], output_token_ids: list[int]) -> None:
        """Replace row's words (none: clear the row); its window starts as the tail of the
        outputs it already has."""
        if not words:
            self.clear(row)
            return
        if not all(words):
            raise ValueError("a bad word must have at least one token id")
        self._words[row] = [list(word) for word in words]
        longest = max(len(word) for word in words) - 1
        if longest:
            self._prefix_len[row] = longest
            self._seeds[row] = list(output_token_ids[-longest:])
        else:  # one-token words read no outputs: the window's row goes unread
            self._prefix_len.pop(row, None)
            self._seeds.pop(row, None)
        self._changed()

    def clear(self, row: int) -> None:
        if self._words.pop(row, None) is not None:
            self._prefix_len.pop(row, None)
            self._seeds.pop(row, None)
            self._changed()

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Append the tokens where `valid` (int64 rows and ids, bool valid, 1-D; a row may
        repeat, its tokens in call order) to their rows' windows. No host sync."""
        self._sync()
        width = self._width
        if not width:
            return
        counts = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)
        counts.index_add_(0, rows, valid.to(torch.int64))
        # Each token's place counted from its row's newest (0 = newest). A stable sort groups
        # each row's tokens and keeps their order, so a running count within the group is one
        # cumsum over all of them less the tokens of the rows sorted before.
        order = torch.argsort(rows, stable=True)
        rows, token_ids, valid = rows[order], token_ids[order], valid[order]
        before = counts.cumsum(0) - counts
        from_newest = counts[rows] + before[rows] - valid.to(torch.int64).cumsum(0)
        # Shift each row left by its new tokens; the slots that read past the end are the ones
        # the newest tokens overwrite next. Other tokens go to a scratch column.
        shift = counts.clamp(max=width).unsqueeze(1)
        source = (torch.arange(width, device=self.device) + shift).clamp(max=width - 1)
        shifted = torch.empty((self.num_rows, width + 1), dtype=torch.int32, device=self.device)
        shifted[:, :width] = self.window.gather(1, source)
        place = torch.where(valid & (from_newest < width), width - 1 - from_newest, width)
        shifted.index_put_((rows, place), token_ids.to(torch.int32))
        self.window.copy_(shifted[:, :width])

    def saved_window(self) -> torch.Tensor:
        """A copy of the windows, for restore_window (a verify step's provisional records)."""
        self._sync()
        return self.window.clone()

    def restore_window(self, saved: torch.Tensor) -> None:
        self.window.copy_(saved)

    def in_batch(self, batch_pos: torch.Tensor, scratch: int) -> BatchEntries:
        """The (batch row, banned token) entries of this step: every word of a row in the batch
        (`batch_pos[row]` >= 0) whose prefix ends its row's window; the others at `scratch`."""
        self._sync()
        rows, last, prefix, values = self._flatten()
        idx = batch_pos[rows]
        keep = idx >= 0
        if prefix.shape[1]:
            recent = self.window[rows]
            keep &= ((recent == prefix) | (prefix == ANY)).all(dim=1)
        return BatchEntries(torch.where(keep, idx, scratch), last, values)

    # ---- helpers -----------------------------------------------------------------------

    def _changed(self) -> None:
        self._flat = None
        self._width = max(self._prefix_len.values(), default=0)

    @torch.inference_mode(False)
    def _sync(self) -> None:
        """Bring the window to the current width and write the new rows' tails, in one staged
        upload (no sync). A row keeps its newest tokens across a resize; a row whose words are
        shorter than the width never reads the slots a resize adds on the left."""
        width, old = self._width, self.window.shape[1]
        if old != width:
            window = torch.full((self.num_rows, width), NONE, dtype=torch.int32, device=self.device)
            keep = min(old, width)
            if keep:
                window[:, width - keep :].copy_(self.window[:, old - keep :])
            self.window = window
        if not self._seeds:
            return
        tails = np.full((len(self._seeds), 1 + width), NONE, np.int64)  # column 0: the row
        for i, (row, tail) in enumerate(self._seeds.items()):
            tails[i, 0] = row
            if tail:
                tails[i, 1 + width - len(tail) :] = tail
        self._seeds.clear()
        staged = stage_to_device(tails, self.device)
        self.window.index_copy_(0, staged[:, 0], staged[:, 1:].to(torch.int32))

    def _flatten(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row [N], last token [N], prefix int32 [N, width], zero values [N]): one staged
        upload after a change."""
        if self._flat is None:
            width = self._width
            words = [(row, word) for row, row_words in self._words.items() for word in row_words]
            table = np.full((len(words), 2 + width), ANY, np.int64)
            for i, (row, word) in enumerate(words):
                table[i, 0] = row
                table[i, 1] = word[-1]
                if len(word) > 1:
                    table[i, 2 + width - (len(word) - 1) :] = word[:-1]
            staged = stage_to_device(table, self.device)
            values = torch.zeros(len(words), dtype=torch.float32, device=self.device)
            self._flat = (staged[:, 0], staged[:, 1], staged[:, 2:].to(torch.int32), values)
        return self._flat
