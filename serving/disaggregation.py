"""Prefill/decode disaggregation, the worker side of SGLang's model gateway's PD mode.

``sglang-router --pd-disaggregation --prefill URL [PORT] --decode URL`` (0.3.2) sends every
request to one prefill and one decode worker at once, the same JSON with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added, returns the decode worker's
response to the client and drains the prefill worker's (docs/serving.md, "Prefill/decode
disaggregation").  SGLang moves the KV between the two over its own transfer engine, set
up through the bootstrap port; strata-jax moves it through the L3 both replicas share:

* ``--role prefill``: a request carrying a ``bootstrap_room`` runs its prompt and one token
  (``prefill_only``); the engine writes the prompt's pages through to L3 when the prefill
  ends (``write_through``), and the drained answer is that one token.
* ``--role decode``: a request carrying a ``bootstrap_room`` waits (``Frontend.stream``,
  ``strata_jax.engine.handoff``) until the prompt's pages are in L3, or a deadline from the
  cost model passes, then runs as any request: its prompt comes back from L3 and only what
  is missing is computed.  A late or dead prefill replica costs the wait, never an answer.
* ``--role both`` (default), and any request without a room: served as usual.

The bootstrap port is not used (nothing listens on it): the room only marks the request
as one whose prompt the other side computes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strata_jax.api import SamplingParams


def handoff_role(role: str, request: Any) -> str | None:
    """``"prefill"`` or ``"decode"`` when this replica plays that part for ``request`` (it
    carries a ``bootstrap_room`` and the replica is not ``both``), else None."""
    if role == "both" or getattr(request, "bootstrap_room", None) is None:
        return None
    return role


def prefill_only(params: SamplingParams) -> SamplingParams:
    """What a prefill replica runs of a disaggregated request: the prompt, then one token
    (the decode replica generates the answer the client sees)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=0)
