"""``HardwareProfile``: the target machine of a simulation, read from JSON.

Shipped profiles (package data, ``strata_jax/sim/profiles/``): ``h200`` (H200 SXM
with a PCIe 5.0 x16 host link) and ``gh200`` (NVLink-C2C).  ``--profile`` takes a
name or a path; every field is required and named in errors, unknown fields are
rejected (a typo must not silently fall back to a default).  ``notes`` says where
the numbers come from.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A hardware profile is missing, malformed or out of range (the message names the file and field)."""


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU (per tensor-parallel rank) and its links; seconds, bytes, bytes/s, FLOP/s.

    hbm_bytes / hbm_bytes_per_s / hbm_efficiency: device memory, its peak bandwidth and
        the share decode steps reach.
    matmul_flops_per_s / matmul_efficiency / attention_efficiency: dense peak and the
        shares reached by the linear layers and by attention.
    kv_memory_fraction: share of HBM left to weights + KV (the rest: activations, runtime).
    link_peak_bytes_per_s: host<->device link, per direction (PCIe is full duplex).
    naive_copy_overhead_s: fixed cost of one small copy on the naive per-page per-layer path.
    coalesced_efficiency / transfer_overhead_s: share of link peak a coalesced transfer
        reaches, and its fixed cost (issue, first byte, scatter launch).
    transfer_kernel_slowdown: compute slowdown while a layout-conversion kernel runs beside it.
    host_kv_bytes: host DRAM given to the L2 KV pool.
    storage_read_bytes_per_s / storage_write_bytes_per_s: L3 bandwidth.
    step_overhead_s: fixed device-side cost of one step program (launch, synchronization); the
        engine's host path is the measured host model (``sim/host_model.py``), not this.
    tp_allreduce_s_per_layer: tensor-parallel all-reduce cost per layer per step.
    extend_overhead_s: a prefill step's fixed cost beyond ``step_overhead_s`` (its program's
        token bucket, the LM head and sampling); 0 in the GPU profiles, measured by ``bench twin``.
    decode_row_s: a decode step's cost per row beyond the roofline (sampling, the row's own
        gathers); 0 in the GPU profiles, measured by ``bench twin`` (a CPU pays milliseconds).
    """

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    hbm_efficiency: float
    matmul_flops_per_s: float
    matmul_efficiency: float
    attention_efficiency: float
    kv_memory_fraction: float
    link_peak_bytes_per_s: float
    naive_copy_overhead_s: float
    coalesced_efficiency: float
    transfer_overhead_s: float
    transfer_kernel_slowdown: float
    host_kv_bytes: float
    storage_read_bytes_per_s: float
    storage_write_bytes_per_s: float
    step_overhead_s: float
    tp_allreduce_s_per_layer: float
    extend_overhead_s: float = 0.0
    decode_row_s: float = 0.0
    notes: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "notes"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                raise ProfileError(f"profile {self.name!r}: {f.name} must be a finite non-negative number, got {v!r}")
        for name in (
            "hbm_efficiency",
            "matmul_efficiency",
            "attention_efficiency",
            "kv_memory_fraction",
            "coalesced_efficiency",
        ):
            if not 0 < getattr(self, name) <= 1:
                raise ProfileError(f"profile {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in (
            "hbm_bytes",
            "hbm_bytes_per_s",
            "matmul_flops_per_s",
            "link_peak_bytes_per_s",
            "storage_read_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be > 0")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def available_profiles() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (``h200``, ``gh200``) or a JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ProfileError(
                f"unknown hardware profile {name_or_path!r}; shipped: {', '.join(available_profiles())}, "
                "or give a JSON path"
            )
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"hardware profile {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"hardware profile {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"hardware profile {path} must hold a JSON object")
    names = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ProfileError(f"hardware profile {path}: unknown field(s) {', '.join(unknown)}")
    optional = {f.name for f in fields(HardwareProfile) if f.default is not MISSING}
    missing = sorted(names - set(raw) - optional)
    if missing:
        raise ProfileError(f"hardware profile {path}: missing field(s) {', '.join(missing)}")
    return HardwareProfile(**raw)
