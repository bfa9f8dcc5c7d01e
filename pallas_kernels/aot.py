"""Lower the kernels for a GPU from a machine without one (ahead of time).

Up to jax 0.10 the Pallas -> Triton lowering ran on any host.  From jax 0.11 it
asks the current device for its compute capability and, on a CPU-only host, fails
with "No supported GPU devices found" unless an abstract GPU device is in scope.
``gpu_lowering_target`` supplies one (through a one-device abstract mesh), so the
same code lowers on jax 0.10.x, 0.11.x and 0.12.x:

    with gpu_lowering_target("cuda"):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import jax

# The device kinds lowered for by default: Hopper (sm_90) and MI300 (gfx942).
DEFAULT_DEVICE_KIND: Mapping[str, str] = MappingProxyType({"cuda": "NVIDIA H200", "rocm": "gfx942"})


@contextlib.contextmanager
def gpu_lowering_target(
    platform: str, device_kind: str | None = None, *, mesh_axes: Mapping[str, int] | None = None
) -> Iterator[None]:
    """Make ``platform`` ("cuda" or "rocm") kernels lowerable on this host.

    ``device_kind`` is what the device would report (``"NVIDIA H100"``, ``"gfx90a"``);
    it picks the compute capability / architecture Triton is lowered for.
    ``mesh_axes`` (e.g. ``{"tp": 2}``): lower a program sharded over a mesh of that
    shape (the abstract GPU mesh then has those axes; ``pallas_kernels.sharded`` runs
    its per-shard kernels on it).
    """
    if platform not in DEFAULT_DEVICE_KIND:
        raise ValueError(
            f"gpu_lowering_target: platform must be one of {sorted(DEFAULT_DEVICE_KIND)}, got {platform!r}"
        )
    kind = device_kind or DEFAULT_DEVICE_KIND[platform]
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    axes = dict(mesh_axes) if mesh_axes else {"aot": 1}
    mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_gpu(fn, *args, platform: str, donate_argnums: tuple[int, ...] = (), device_kind: str | None = None):
    """``jax.jit(fn).trace(*args).lower(...)`` for ``platform`` from any host (a ``jax.stages.Lowered``)."""
    with gpu_lowering_target(platform, device_kind):
        return jax.jit(fn, donate_argnums=donate_argnums).trace(*args).lower(lowering_platforms=(platform,))
