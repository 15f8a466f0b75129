"""The one prefill-lookahead number (CONTRACTS.md, "One prefill-lookahead number for speculative
decoding and P/D") and what follows from it.

`lookahead_of(settings)` is the only place it is computed; from it:
- the prefill role of P/D stops `max(1, lookahead)` tokens short of the prompt end
  (services.scheduler.pd.prefill_job), so a drafter fed the target's features (the backoff)
  finds those positions computed on the decode side;
- a sliding-window group retains `retained_tokens(lookahead)` tokens beyond its window, which
  widens the window coverage of offload lookups, of the "already being loaded" check and of
  the store mask (services.scheduler.offload.window_scan).
"""

from __future__ import annotations

from shared.config import SchedulerSettings

#: drafters that read the target's hidden states of the newest positions (EAGLE, EAGLE-3 and
#: MTP heads, the DFlash draft's context): the prefill side of P/D leaves those positions to
#: the decode side, where the drafter sees them computed
FEATURE_DRAFTERS = ("eagle", "eagle3", "mtp", "dflash")


def drafter_backoff(spec_method: str) -> int:
    """The drafter's prefill backoff: 1 for a head fed the target's features, else 0. The MTP
    checkpoints served here (DeepSeek-V3 / GLM naming) ship one module, reused for every draft
    and fed only the target's newest features, so MTP backs off 1 like EAGLE; an N-module
    chain that read N target positions would back off N (CONTRACTS.md)."""
    return 1 if spec_method in FEATURE_DRAFTERS else 0


def prefill_lookahead_tokens(*lookaheads: int) -> int:
    """0 without speculation, 1 for state-space or EAGLE-style backoff, N for N-module MTP;
    when several apply, the max (not the sum)."""
    return max((n for n in lookaheads if n > 0), default=0)


def lookahead_of(settings: SchedulerSettings) -> int:
    """The deployment's one prefill-lookahead number: the max of the configured backoff and
    the drafter's (an n-gram or draft-model drafter reads no target features: 0)."""
    drafter = drafter_backoff(settings.spec_method)
    return prefill_lookahead_tokens(settings.prefill_lookahead_tokens, drafter)


def retained_tokens(lookahead: int) -> int:
    """Tokens a sliding-window group keeps beyond its window: `max(0, lookahead - 1)`."""
    return max(0, lookahead - 1)
