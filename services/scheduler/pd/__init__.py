"""Prefill/decode disaggregation over the KV offload tier (pure core; CONTRACTS.md, "One
prefill-lookahead number").

A scheduler has a role (SchedulerSettings.role): "both" serves requests whole; "prefill" reads
the `requests` stream, computes each prompt but its last `max(1, lookahead)` tokens, stores
their KV through the offload tier and hands the request (the unchanged SubmitRequest) to the
`handoff` stream; "decode" reads the `handoff` stream, loads the stored prefix like any offload
hit, computes the rest of the prompt and decodes, streaming to the gateway as usual.

Hybrid models (a recurrent-state group beside attention, shared/kv/groups.py): "transferable is
not storable". Under a prefill or decode role the offload connector (`transfer_state`) also
stores the state block at the end of each store offer (the state after exactly the offer's full
blocks) and the decode side loads the one state block ending at its hit; a hit whose end has no
stored state falls back to the largest block boundary that has one (or to no hit), never
resuming from a missing state. Role "both" keeps the tier attention-only.

Reads top-down:
- `prefill_job`: what a prefill scheduler computes for a request (a truncated copy that samples
  nothing), and which step finished it;
- `handoff_book`: prefilled requests waiting for their stores to be answered.

The I/O edge (handoff publishing, acks) is `services.scheduler.pd.edge`.
"""

from services.scheduler.pd.handoff_book import HandoffBook
from services.scheduler.pd.prefill_job import PrefillPolicy, prefilled_in_step

__all__ = ["HandoffBook", "PrefillPolicy", "prefilled_in_step"]
