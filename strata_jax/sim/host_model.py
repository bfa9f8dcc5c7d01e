"""``HostModel``: how long the engine's host path takes per step, measured, not assumed.

Everything the engine thread does for one step besides waiting for the device:
schedule, tree and controller bookkeeping, packing and dispatching the step, and
reading the previous step's tokens and applying the stop rules.  Modelled as linear
in the step's size::

    seconds = step_s + decode_row_s * decode_rows + prefill_row_s * prefill_rows
              + prefill_token_s * prefill_tokens

and fitted by ``strata-jax bench host --fit FILE`` from the real engine's own steps
(``bench/host.py``).  The bundled model (``host_model.json`` beside this module) was measured on
the 2-core CPU development machine; a server CPU runs the same Python faster, so the
simulator's host times are conservative for an H200 host.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parent / "host_model.json"


class HostModelError(ValueError):
    """A host model file is missing, malformed or out of range."""


@dataclass(frozen=True)
class HostModel:
    step_s: float
    decode_row_s: float
    prefill_row_s: float
    prefill_token_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "source":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                raise HostModelError(f"host model: {f.name} must be a finite non-negative number, got {v!r}")

    def seconds(self, decode_rows: int, prefill_rows: int, prefill_tokens: int) -> float:
        return (
            self.step_s
            + self.decode_row_s * decode_rows
            + self.prefill_row_s * prefill_rows
            + self.prefill_token_s * prefill_tokens
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def load_host_model(spec: str | Path | None = "measured") -> HostModel | None:
    """``"measured"``: the bundled model; ``"none"``/None: no host time; else a JSON file."""
    if spec is None or spec == "none":
        return None
    path = DEFAULT_PATH if spec == "measured" else Path(spec)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HostModelError(f"host model {path}: {exc}") from exc
    known = {f.name for f in fields(HostModel)}
    unknown = set(data) - known
    if unknown:
        raise HostModelError(f"host model {path}: unknown fields {sorted(unknown)}")
    try:
        return HostModel(**data)
    except TypeError as exc:
        raise HostModelError(f"host model {path}: {exc}") from exc
