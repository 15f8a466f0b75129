"""Per-row sampling state of the worker's persistent batch, and the sampling step.

- Rows are slots of the persistent batch (0 .. max_num_reqs-1); a request keeps its row while
  it lives in the batch.
- `add_request` / `remove_request` when the batch composition changes (not every step): all
  per-request work — parameter tensors, sparse token lists, prompt-token presence — is done
  there, so a step does no Python work per request.
- `record_sampled` after each step, vectorized (penalties and min_tokens need output counts,
  bad words the latest outputs).
- `sample(logits, rows, positions, bitmask)`: `positions[i]` is the sequence position of the
  token being sampled for row `rows[i]` — the counter of the RNG. A row with seed s at position
  p draws the same token whatever else is in the batch and in whichever batch slot it sits.

Processing order and its reasons: transforms.py. The draw: gumbel.py (CPU) and
meshllm_kernels/sampling/gumbel_kernel.py (CUDA), bit-identical. Logprobs: logprobs.py.

Optional stages (penalties, bias, truncation, ...) are skipped unless some request in the
state uses them; the host-side sets below say which, so skipping costs no device sync. When a
stage runs it runs over the whole batch with neutral parameters for the rows that do not use
it, which leaves those rows bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshllm_kernels.runtime.staged_copy import stage_to_device
from meshllm_kernels.sampling.bitmask import allowed_mask
from meshllm_kernels.sampling.gumbel import gumbel_argmax
from services.worker.sampling.bad_words import BadWords
from services.worker.sampling.logprobs import model_logprobs, pick_logprobs
from services.worker.sampling.row_params import RowParams
from services.worker.sampling.row_tokens import RowTokens
from services.worker.sampling.transforms import (
    add_entries,
    apply_penalties,
    keep_only_entries,
    mask_entries,
    truncation_mask,
)
from shared.protocol import SamplingParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1/T would overflow the scores.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's range for logit_bias values; larger values are clamped, as vLLM does.
LOGIT_BIAS_LIMIT = 100.0


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, logprob of the sampled token
    top_token_ids: torch.Tensor | None = None  # [B, k] int64
    top_logprobs: torch.Tensor | None = None  # [B, k] float32
    # Only with sample(..., return_probs=True) (speculative verification, services/worker/spec):
    # the distribution each row was drawn from, softmax of its processed logits / T (rows with
    # T > 0; a greedy row's entry is meaningless), and every token's logprob when logprobs are
    # on (the emitted token of a verification row need not be the one drawn here).
    probs: torch.Tensor | None = None  # [B, V] float32
    row_logprobs: torch.Tensor | None = None  # [B, V] float32


class _Column:
    """A per-row parameter of `SamplingState` as an attribute: its device column
    (row_params.py), the host's writes sent first."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: SamplingState, owner: type | None = None) -> torch.Tensor:
        return state.row_params.column(self.name)


class SamplingState:
    # Persistent tensors are created outside inference mode even when the caller is inside it
    # (the model runner is): they are updated in place from both sides, which PyTorch refuses
    # for inference tensors.
    @torch.inference_mode(False)
    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: list[int] | None = None,
    ) -> None:
        if max_num_reqs <= 0 or vocab_size <= 0:
            raise ValueError("max_num_reqs and vocab_size must be positive")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = [t for t in (eos_token_ids or []) if 0 <= t < vocab_size]
        rows, dev = max_num_reqs, self.device
        # Per-row parameters, written on the host and sent without a sync (row_params.py).
        # inv_temperature: float32(1/T), 0 for greedy rows (the draw multiplies by it, see
        # gumbel.py); seed: the uint64 bit pattern; restricted: has allowed ids.
        self.row_params = RowParams(
            rows,
            dev,
            floats={
                "temperature": 0.0,
                "inv_temperature": 0.0,
                "top_p": 1.0,
                "min_p": 0.0,
                "repetition": 1.0,
                "frequency": 0.0,
                "presence": 0.0,
            },
            ints={
                "seed": 0,
                "top_k": vocab_size,
                "min_tokens": 0,
                "num_output": 0,
                "restricted": 0,
            },
        )
        # Dense [rows, V] history for penalties, allocated when a request first needs it.
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        self.logit_bias = RowTokens(dev)
        self.allowed = RowTokens(dev)
        self.banned = RowTokens(dev)
        self.bad_words = BadWords(rows, dev)
        self.min_tokens_stops = RowTokens(dev)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self._random_rows: set[int] = set()
        self._top_k_rows: dict[int, int] = {}
        self._top_p_rows: set[int] = set()
        self._min_p_rows: set[int] = set()
        self._penalty_rows: set[int] = set()
        self._logprob_rows: dict[int, int] = {}

    # Device views of the per-row parameters (each flushes the host writes first).
    temperature = _Column()
    inv_temperature = _Column()
    seed = _Column()
    top_k = _Column()
    top_p = _Column()
    min_p = _Column()
    repetition = _Column()
    frequency = _Column()
    presence = _Column()
    min_tokens = _Column()
    num_output = _Column()

    @property
    def restricted(self) -> torch.Tensor:
        """bool [rows]: the row has allowed_token_ids."""
        return self.row_params.column("restricted") != 0

    # ---- batch composition -------------------------------------------------------------

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
    ) -> None:
        """Put a request in `row` (replacing whatever was there). Bad token ids: ValueError."""
        self._check_row(row)
        bias_ids = [int(t) for t in params.logit_bias]
        self._check_ids("logit_bias", bias_ids)
        self._check_ids("bad_token_ids", params.bad_token_ids)
        words = [list(word) for word in params.bad_words_token_ids]
        if not all(words):
            raise ValueError("bad_words_token_ids must not hold an empty word")
        self._check_ids("bad_words_token_ids", [t for word in words for t in word])
        if params.allowed_token_ids is not None:
            if not params.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            self._check_ids("allowed_token_ids", params.allowed_token_ids)
        self._check_ids("prompt_token_ids", prompt_token_ids)
        self._check_ids("output_token_ids", output_token_ids)
        self.remove_request(row)
        self.params[row] = params

        greedy = params.temperature < GREEDY_TEMPERATURE
        seed = params.seed
        values: dict[str, float] = {
            "temperature": 0.0 if greedy else params.temperature,
            "inv_temperature": 0.0 if greedy else 1.0 / params.temperature,
            "seed": seed - 2**64 if seed >= 2**63 else seed,
            "num_output": len(output_token_ids),
            "min_tokens": params.min_tokens,
        }
        if not greedy:
            self._random_rows.add(row)
        if 0 < params.top_k < self.vocab_size:
            values["top_k"] = params.top_k
            self._top_k_rows[row] = params.top_k
        if params.top_p < 1.0:
            values["top_p"] = params.top_p
            self._top_p_rows.add(row)
        if params.min_p > 0.0:
            values["min_p"] = params.min_p
            self._min_p_rows.add(row)

        if bias_ids:
            bias = [
                max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v)))
                for v in params.logit_bias.values()
            ]
            self.logit_bias.set(row, bias_ids, bias)
        if params.allowed_token_ids is not None:
            self.allowed.set(row, list(params.allowed_token_ids))
            values["restricted"] = 1
        self.banned.set(row, list(params.bad_token_ids))
        self.bad_words.set(row, words, output_token_ids)

        stops = {t for t in params.stop_token_ids if 0 <= t < self.vocab_size}
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        if params.min_tokens > len(output_token_ids) and stops:
            self.min_tokens_stops.set(row, sorted(stops))
        if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
            values["repetition"] = params.repetition_penalty
            values["frequency"] = params.frequency_penalty
            values["presence"] = params.presence_penalty
            self._set_history(row, prompt_token_ids, output_token_ids)
        self.row_params.set(row, **values)
        if params.logprobs is not None:
            self._logprob_rows[row] = params.logprobs

    def remove_request(self, row: int) -> None:
        """Free `row`; every per-row parameter returns to its neutral value."""
        self._check_row(row)
        self.params[row] = None
        self.row_params.reset(row)
        for table in (self.logit_bias, self.allowed, self.banned, self.min_tokens_stops):
            table.clear(row)
        self.bad_words.clear(row)
        for rows in (self._random_rows, self._top_p_rows, self._min_p_rows, self._penalty_rows):
            rows.discard(row)
        self._top_k_rows.pop(row, None)
        self._logprob_rows.pop(row, None)

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Rows `rows` just produced `token_ids` (1-D, same length; a row may repeat).

        Ids outside the vocabulary (placeholders) count for nothing. No host sync.
        """
        rows = rows.to(self.device, torch.int64)
        token_ids = token_ids.to(self.device, torch.int64)
        if rows.shape != token_ids.shape or rows.dim() != 1:
            raise ValueError(
                f"rows {tuple(rows.shape)} and token_ids {tuple(token_ids.shape)} must be "
                "1-D of the same length"
            )
        if not self.counts_outputs:
            return
        valid = (token_ids >= 0) & (token_ids < self.vocab_size)
        if self.bad_words.reads_history:
            self.bad_words.record(rows, token_ids, valid)
        self.num_output.index_add_(0, rows, valid.to(torch.int64))
        if self.output_counts is not None:
            self.output_counts.index_put_(
                (rows, token_ids.clamp(0, self.vocab_size - 1)),
                valid.to(torch.int32),
                accumulate=True,
            )

    def provisional(self) -> ProvisionalRecords:
        """Records to take back: a verify step records each position's drafts before it draws
        the next position (its penalties, min_tokens and bad words see the drafts before it,
        as plain decoding would have seen them as outputs), then takes them all back and
        records the tokens it accepted. No host sync."""
        return ProvisionalRecords(self)

    # ---- the step ----------------------------------------------------------------------

    @property
    def counts_outputs(self) -> bool:
        """Whether `record_sampled` records anything: only min_tokens stops, the penalties'
        output counts and bad words of two tokens or more (the windows of latest outputs)
        read what it records (num_output gates min_tokens, and a row that gets a min_tokens
        stop has it set by add_request, a bad-words row its window). Otherwise it is skipped:
        five launches a step saved, and a verify step's upload of its tokens."""
        return (
            bool(self.min_tokens_stops)
            or self.output_counts is not None
            or self.bad_words.reads_history
        )

    @property
    def rows_repeatable(self) -> bool:
        """Whether one `sample` call may list a state row several times (at different
        positions: a verify step's rows): no stage that scatters per-entry tables by batch
        position (allowed/banned tokens, bad words, min_tokens stops, logit bias) is active.
        The other stages only read their rows' parameters."""
        return not (
            self.allowed
            or self.banned
            or self.bad_words
            or self.min_tokens_stops
            or self.logit_bias
        )

    @property
    def draws_read_no_history(self) -> bool:
        """Whether every row's draw reads only its logits, parameters, seed and position: no
        per-entry stage, nothing recorded from earlier draws (min_tokens, penalties, bad
        words), no logprobs. Then a verify step may run before the host has seen the previous
        step's tokens (services/worker/spec/chain.py)."""
        return (
            self.rows_repeatable
            and not self.counts_outputs
            and not self._logprob_rows
            and not self._penalty_rows
        )

    @property
    def truncates(self) -> bool:
        """Some row keeps only part of the vocabulary (top-k, top-p, min-p)."""
        return bool(self._top_k_rows or self._top_p_rows or self._min_p_rows)

    def sample(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        bitmask: torch.Tensor | None = None,
        *,
        bitmask_index: torch.Tensor | None = None,
        position_salt: int = 0,
        feed: torch.Tensor | None = None,
        return_probs: bool = False,
    ) -> SamplerOutput:
        """One token per batch row: logits [B, V], rows [B] (state rows), positions [B].

        bitmask: packed int32 [G, ceil(V/32)] (bit j of word w allows token 32w + j); batch
        row i uses bitmask row `bitmask_index[i]` (-1: unconstrained), or row i when no index
        is given and G == B. `position_salt` is added to every position (draft sampling uses
        2^30 so its noise differs from the target's). `feed` int64 [max_num_reqs] (the
        worker's newest token per row, in_flight.PendingFeed) receives feed[rows[i]] = token i;
        on CUDA the draw writes it itself when nothing edits its tokens afterwards.
        `return_probs`: also return the processed distribution (SamplerOutput.probs).
        """
        batch, vocab = self._check_batch(logits, rows, positions)
        rows = rows.to(self.device, torch.int64)
        positions = positions.to(self.device, torch.int64)
        if position_salt:
            positions = positions + position_salt
        if bitmask is not None and bitmask_index is None:
            bitmask_index = torch.arange(batch, device=self.device)
        truncating = bool(self._top_k_rows or self._top_p_rows or self._min_p_rows)
        want_logprobs = bool(self._logprob_rows)
        by_entry = not self.rows_repeatable
        staged = logits  # with a scratch row after the batch's rows for the by-entry stages
        if truncating or want_logprobs or by_entry or self._penalty_rows:
            # The stages below write into their own fp32 copy.
            staged = torch.empty(
                batch + int(by_entry), vocab, dtype=torch.float32, device=logits.device
            )
            work = staged[:batch]
            work.copy_(logits)
        else:  # the draw alone reads the logits as they are (fp32 inside; exact for bf16/fp16)
            work = logits
        fused_bitmask = bitmask
        if bitmask is not None and (truncating or want_logprobs):
            # Truncation and logprobs must see the grammar's distribution: mask up front.
            assert bitmask_index is not None
            work.masked_fill_(~allowed_mask(bitmask, bitmask_index, vocab), float("-inf"))
            fused_bitmask = None
        logprobs = model_logprobs(work) if want_logprobs else None

        if by_entry:
            batch_pos = torch.full((self.max_num_reqs,), -1, dtype=torch.int64, device=self.device)
            batch_pos[rows] = torch.arange(batch, device=self.device)
        if self.allowed:
            allowed = self.allowed.in_batch(batch_pos, batch)
            keep_only_entries(staged, self.restricted[rows], allowed)
        if self.banned:
            mask_entries(staged, self.banned.in_batch(batch_pos, batch))
        if self.bad_words:
            mask_entries(staged, self.bad_words.in_batch(batch_pos, batch))
        if self.min_tokens_stops:
            below_min = self.num_output < self.min_tokens
            mask_entries(staged, self.min_tokens_stops.in_batch(batch_pos, batch, below_min))
        if self.logit_bias:
            add_entries(staged, self.logit_bias.in_batch(batch_pos, batch))
        if self._penalty_rows:
            assert self.prompt_mask is not None and self.output_counts is not None
            work = apply_penalties(
                work,
                self.prompt_mask[rows],
                self.output_counts[rows],
                self.repetition[rows],
                self.frequency[rows],
                self.presence[rows],
            )

        if truncating:
            inv_temperature = self.inv_temperature[rows]
            # Greedy rows are scaled by 1: no truncation ever removes the argmax.
            scale = torch.where(inv_temperature == 0, 1.0, inv_temperature)
            removed = truncation_mask(
                work * scale.unsqueeze(1),
                self.min_p[rows] if self._min_p_rows else None,
                self.top_k[rows] if self._top_k_rows else None,
                self.top_p[rows] if self._top_p_rows else None,
                max_top_k=max(self._top_k_rows.values(), default=None),
            )
            work.masked_fill_(removed, float("-inf"))

        probs = self._probs(work, rows, fused_bitmask, bitmask_index) if return_probs else None
        draw_index = bitmask_index if fused_bitmask is not None else None
        fed = False
        if work.is_cuda:  # one launch: the kernel reads the rows' temperature and seed itself
            from meshllm_kernels.sampling.gumbel_kernel import gumbel_argmax_triton

            fed = feed is not None and bitmask is None
            token_ids = gumbel_argmax_triton(
                work,
                self.inv_temperature,
                self.seed,
                positions,
                fused_bitmask,
                draw_index,
                rows=rows,
                feed=feed if fed else None,
            )
        else:
            token_ids = gumbel_argmax(
                work,
                self.inv_temperature[rows],
                self.seed[rows],
                positions,
                fused_bitmask,
                draw_index,
            )
        if bitmask is not None:
            assert bitmask_index is not None
            token_ids = grammar_first(token_ids, bitmask, bitmask_index, vocab)
        if feed is not None and not fed:
            feed[rows] = token_ids
        if logprobs is None:
            return SamplerOutput(token_ids=token_ids, probs=probs)
        k = max(self._logprob_rows.values())
        chosen, top_ids, top_values = pick_logprobs(logprobs, token_ids, k)
        row_logprobs = logprobs if return_probs else None
        return SamplerOutput(token_ids, chosen, top_ids, top_values, probs, row_logprobs)

    def _probs(
        self,
        work: torch.Tensor,
        rows: torch.Tensor,
        bitmask: torch.Tensor | None,
        bitmask_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """softmax(work / T) with the grammar applied: exactly the distribution the Gumbel draw
        of `work` samples (the draw scales by the same float32 1/T). Greedy rows are scaled by 1
        (their draw is an argmax; nothing reads their entry)."""
        scores = work.float()
        if bitmask is not None:
            assert bitmask_index is not None
            allowed = allowed_mask(bitmask, bitmask_index, work.shape[1])
            scores = scores.masked_fill(~allowed, float("-inf"))
        inv_temperature = self.inv_temperature[rows]
        scale = torch.where(inv_temperature == 0, 1.0, inv_temperature)
        return torch.softmax(scores * scale.unsqueeze(1), dim=-1)

    # ---- helpers -----------------------------------------------------------------------

    @torch.inference_mode(False)
    def _set_history(
        self, row: int, prompt_token_ids: list[int], output_token_ids: list[int]
    ) -> None:
        """The penalties' history of `row`: which tokens the prompt has, and how often each
        output token occurred; built on the host and sent in one staged copy (no sync)."""
        shape = (self.max_num_reqs, self.vocab_size)
        if self.prompt_mask is None or self.output_counts is None:
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        history = np.zeros((2, self.vocab_size), np.int32)
        history[0, np.asarray(prompt_token_ids, np.int64)] = 1
        np.add.at(history[1], np.asarray(output_token_ids, np.int64), 1)
        staged = stage_to_device(history, self.device)
        self.prompt_mask[row].copy_(staged[0] != 0)
        self.output_counts[row].copy_(staged[1])
        self._penalty_rows.add(row)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row {row} outside the batch [0, {self.max_num_reqs})")

    def _check_ids(self, name: str, ids: list[int]) -> None:
        if not len(ids):
            return
        t = torch.as_tensor(ids, dtype=torch.int64)
        bad = t[(t < 0) | (t >= self.vocab_size)]
        if bad.numel():
            raise ValueError(
                f"{name} has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5].tolist()}"
            )

    def _check_batch(
        self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
    ) -> tuple[int, int]:
        here = self.device
        if logits.device.type != here.type or (
            here.index is not None and logits.device.index != here.index
        ):  # "cuda" names the current GPU, which logits report as "cuda:N"
            raise ValueError(f"logits are on {logits.device}, the sampling state on {here}")
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits must be [batch, {self.vocab_size}], got {tuple(logits.shape)}"
            )
        batch = logits.shape[0]
        for name, t in (("rows", rows), ("positions", positions)):
            if t.shape != (batch,):
                raise ValueError(f"{name} must be [{batch}], got {tuple(t.shape)}")
        return batch, logits.shape[1]


def grammar_first(
    token_ids: torch.Tensor, bitmask: torch.Tensor, bitmask_index: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The grammar's mask is hard, every other mask gives way to it: a row whose grammar-allowed
    tokens all scored -inf (min_tokens masking the stop tokens of a finished JSON object, a
    banned or penalised-to-overflow token the grammar requires) gets its smallest allowed token
    id, the argmax's tie rule applied to the allowed tokens alone, instead of token 0 of the
    whole vocabulary, which the grammar would reject. So structured output stays parseable and
    min_tokens is best-effort under a grammar.

    Each drawn token's bit is read from the packed mask (bit j of word w allows 32w + j); the
    full [B, V] unpack runs only when some row drew a token its grammar does not allow. The
    check reads one value back: grammar steps wait for their tokens anyway (the scheduler
    advances the matcher before the next plan)."""
    index = bitmask_index.to(torch.int64)
    words = bitmask[index.clamp(min=0), token_ids // 32].to(torch.int64)
    drawn = ((words >> (token_ids % 32)) & 1).bool() | (index < 0)
    if bool(drawn.all()):
        return token_ids
    allowed = allowed_mask(bitmask, bitmask_index, vocab_size)
    return torch.where(drawn, token_ids, allowed.to(torch.uint8).argmax(dim=1))


class ProvisionalRecords:
    """SamplingState.provisional: record_sampled calls that `undo` takes back. What a record
    changes: num_output and the bad-words windows (restored from copies taken here: [rows]
    and [rows, width], small) and the penalties' output counts (the recorded tokens counted
    off again: a [rows, V] copy would cost more than the step)."""

    def __init__(self, state: SamplingState) -> None:
        self.state = state
        self._num_output = state.num_output.clone()
        words = state.bad_words
        self._window = words.saved_window() if words.reads_history else None
        self._recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        state = self.state
        if not state.counts_outputs:
            return
        state.record_sampled(rows, token_ids)
        self._recorded.append((rows, token_ids))

    def undo(self) -> None:
        state = self.state
        if not self._recorded:
            return
        state.num_output.copy_(self._num_output)
        if self._window is not None:
            state.bad_words.restore_window(self._window)
        if state.output_counts is not None:
            rows = torch.cat([r for r, _ in self._recorded]).to(state.device, torch.int64)
            tokens = torch.cat([t for _, t in self._recorded]).to(state.device, torch.int64)
            valid = (tokens >= 0) & (tokens < state.vocab_size)
            state.output_counts.index_put_(
                (rows, tokens.clamp(0, state.vocab_size - 1)),
                -valid.to(torch.int32),
                accumulate=True,
            )
        self._recorded.clear()
