"""Prefill/decode disaggregation, the worker side of SGLang's model gateway's PD mode.

``sglang-router --pd-disaggregation --prefill URL [PORT] --decode URL`` (0.3.2) sends every
request to one prefill and one decode worker at once, the same JSON with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added, returns the decode worker's
response to the client and drains the prefill worker's (docs/serving.md, "Prefill/decode
disaggregation").  SGLang moves the KV between the two over its own transfer engine, set
up through the bootstrap port; strata-jax moves it through the L3 both replicas share:

* ``--role prefill``: a request carrying a ``bootstrap_room`` runs its prompt and one token
  (``prefill_only``); the engine writes each chunk's pages through to L3 as the prefill goes
  (``write_through``, ``publish_prefill_chunks``), and the drained answer is that one token.
* ``--role decode``: a request carrying a ``bootstrap_room`` waits (``Frontend.stream``,
  ``strata_jax.engine.handoff``) until the prompt's pages are in L3, or a deadline from the
  cost model passes, then runs as any request: its prompt comes back from L3 and only what
  is missing is computed.  A late or dead prefill replica costs the wait, never an answer.
* ``--role both`` (default), and any request without a room: served as usual.

The room marks the request as one whose prompt the other side computes.  Given the prefill
replica's HTTP port as its bootstrap port (``--prefill http://HOST:PORT PORT``), the decode
replica also asks the prefill replica how the room stands (``GET /pd/rooms/{room}``,
answered from ``RoomBook``) while it waits: a room queued there is waited for up to
``--handoff-max-wait-s`` rather than computed twice, and a prefill replica that failed the
request or stopped answering ends the wait at once (``HandoffWait.note_peer``).  Without a
bootstrap port only L3 and the deadline decide.  As in SGLang, the decode replica trusts the
bootstrap fields it is given (it asks that host one fixed GET): keep replicas behind the
router.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from strata_jax.api import SamplingParams

ROOM_STATES_KEPT = 8192  # finished rooms a prefill replica remembers (a decode replica asks soon after)


@dataclass(frozen=True)
class Handoff:
    """This replica's part in one disaggregated prompt: ``role`` prefill or decode, the
    router's ``room`` for it and, for a decode replica, the prefill replica's room URL
    (None: the router gave no bootstrap port)."""

    role: str
    room: int
    peer_url: str | None = None


@dataclass(frozen=True)
class BootstrapFields:
    """A request's bootstrap fields where its wire form is not the HTTP body (gRPC's
    ``DisaggregatedParams``), named as the body names them for ``handoff_for``."""

    bootstrap_room: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None


def _nth(value: Any, index: int) -> Any:
    """A bootstrap field of prompt ``index``: the router sends lists for prompt lists."""
    if isinstance(value, list):
        return value[index] if index < len(value) else None
    return value


def handoff_for(role: str, request: Any, index: int = 0) -> Handoff | None:
    """Prompt ``index``'s ``Handoff`` when this replica plays a part in it, else None."""
    part = handoff_role(role, request)
    room = _nth(getattr(request, "bootstrap_room", None), index)
    if part is None or room is None:
        return None
    host = _nth(getattr(request, "bootstrap_host", None), index)
    port = _nth(getattr(request, "bootstrap_port", None), index)
    peer = None
    if part == "decode" and host and port:
        peer = f"http://{'[' + host + ']' if ':' in host else host}:{int(port)}/pd/rooms/{int(room)}"
    return Handoff(part, int(room), peer)


class RoomBook:
    """A prefill replica's rooms: ``in_flight`` from arrival until the request ends, then
    ``done`` (its prefill finished: the pages are on their way to L3) or ``failed``; the last
    ``ROOM_STATES_KEPT`` finished rooms are remembered, any other room is ``unknown``."""

    def __init__(self, kept: int = ROOM_STATES_KEPT) -> None:
        self._kept = kept
        self._live: dict[int, int] = {}  # room -> requests holding it (a retried room may come twice)
        self._ended: OrderedDict[int, str] = OrderedDict()

    def start(self, room: int) -> None:
        self._live[room] = self._live.get(room, 0) + 1
        self._ended.pop(room, None)

    def end(self, room: int, prefilled: bool) -> None:
        held = self._live.get(room, 0) - 1
        if held > 0:
            self._live[room] = held
            return
        self._live.pop(room, None)
        self._ended[room] = "done" if prefilled else "failed"
        self._ended.move_to_end(room)
        while len(self._ended) > self._kept:
            self._ended.popitem(last=False)

    def state(self, room: int) -> str:
        if room in self._live:
            return "in_flight"
        return self._ended.get(room, "unknown")


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
