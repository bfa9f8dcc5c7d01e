"""``strata-jax info``: what this machine offers and what the engine chose on it.

Prints the JAX stack (jax, jaxlib, GPU plugins), the devices with their memory
kinds, the defaults and kernels chosen here (``strata_jax.runtime.platform``), and
what the engine would choose on CUDA and on ROCm.  ``--check-lowering`` lowers the
Pallas kernels for both GPU platforms from this host (``pallas_kernels.aot``'s
abstract GPU targets), which proves the GPU columns are more than a table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-rocm7-plugin",
    "jax-rocm7-pjrt",
)
KERNEL_OPS = ("ragged_paged_attention_pool", "scatter_pages", "gather_pages")


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--check-lowering",
        action="store_true",
        help="also lower the Pallas kernels for cuda and rocm from this host (a few seconds)",
    )


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _device_info(device: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": device.id,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "process_index": device.process_index,
    }
    try:
        row["memory_kinds"] = [m.kind for m in device.addressable_memories()]
        row["default_memory_kind"] = device.default_memory().kind
    except Exception as exc:  # some plugins do not implement memories
        row["memory_kinds"], row["default_memory_kind"] = [], f"unavailable ({type(exc).__name__})"
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU and some plugins have none
        stats = {}
    if "bytes_limit" in stats:
        row["memory_bytes"] = int(stats["bytes_limit"])
    return row


def _kernels(backend: str) -> dict[str, str]:
    from pallas_kernels import dispatch

    return {op: _qualname(dispatch.get_implementation(op, backend)) for op in KERNEL_OPS}


def _qualname(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial (interpret mode)
    name = f"{inner.__module__}.{inner.__qualname__}"
    return name + " (interpret=True)" if inner is not fn else name


def _gpu_column(platform: str, check_lowering: bool) -> dict[str, Any]:
    from pallas_kernels.aot import DEFAULT_DEVICE_KIND
    from strata_jax.runtime.platform import defaults_for

    defaults = defaults_for(platform)
    col: dict[str, Any] = {"defaults": defaults.to_dict(), "device_kind_target": DEFAULT_DEVICE_KIND[platform]}
    col["kernels"] = _kernels(defaults.kernel_backend)
    if check_lowering:
        col["lowering"] = _check_lowering(platform)
    return col


def _check_lowering(platform: str) -> dict[str, str]:
    """Lower each Pallas kernel for ``platform`` on a small bf16 shape; "ok" or the error."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.aot import lower_for_gpu
    from pallas_kernels.attention import ragged_paged_attention_pool_pallas
    from pallas_kernels.transfer import gather_pages_pallas, scatter_pages_pallas

    dt = jnp.bfloat16
    pool = jax.ShapeDtypeStruct((2, 2, 16, 16, 2, 64), dt)
    ids = jax.ShapeDtypeStruct((4,), jnp.int32)
    staging = jax.ShapeDtypeStruct((4, 2, 2, 16, 2, 64), dt)
    attn = functools.partial(ragged_paged_attention_pool_pallas, sm_scale=0.125)
    cases = {
        "ragged_paged_attention_pool": (
            lambda q, p, pt, sl, qs: attn(q, p, 0, pt, sl, qs),
            (
                jax.ShapeDtypeStruct((8, 4, 64), dt),
                pool,
                jax.ShapeDtypeStruct((2, 4), jnp.int32),
                jax.ShapeDtypeStruct((2,), jnp.int32),
                jax.ShapeDtypeStruct((3,), jnp.int32),
            ),
            (),
        ),
        "scatter_pages": (scatter_pages_pallas, (pool, staging, ids), (0,)),
        "gather_pages": (gather_pages_pallas, (pool, ids), ()),
    }
    out: dict[str, str] = {}
    for name, (fn, args, donate) in cases.items():
        try:
            text = lower_for_gpu(fn, *args, platform=platform, donate_argnums=donate).as_text()
            out[name] = "ok" if "__gpu$xla.gpu.triton" in text else "lowered without a Triton call"
        except Exception as exc:  # reported, not raised: info must always print
            out[name] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


def collect(*, check_lowering: bool = False) -> dict[str, Any]:
    """Everything ``strata-jax info`` reports, as a JSON-ready dict."""
    import jax

    from pallas_kernels import native
    from pallas_kernels.dispatch import ENV_VAR
    from strata_jax.runtime.platform import current_platform, resolve

    resolved = resolve()
    devices = jax.devices()
    return {
        "versions": _versions(),
        "kernel_env_var": ENV_VAR,
        "python": sys.version.split()[0],
        "platform": {
            "name": current_platform(),
            "jax_backend": jax.default_backend(),
            "platform_version": str(getattr(devices[0].client, "platform_version", "")),
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
        },
        "devices": [_device_info(d) for d in devices],
        "chosen": {
            "defaults": resolved.defaults.to_dict(),
            "kernel_backend": resolved.kernel_backend,
            "kernel_backend_env": os.environ.get(ENV_VAR) or None,
            "kernels": _kernels(resolved.kernel_backend),
            "native_kernels": native.status_for(resolved.kernel_backend),
        },
        "would_choose": {p: _gpu_column(p, check_lowering) for p in ("cuda", "rocm")},
    }


def format_text(info: dict[str, Any]) -> str:
    lines: list[str] = []
    v = info["versions"]
    lines.append("versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + f", python {info['python']}")
    if not any(val for k, val in v.items() if k.startswith(("jax-cuda", "jax-rocm"))):
        lines.append("GPU plugins: none installed (pip install -e '.[cuda]'; ROCm: see the README)")
    p = info["platform"]
    lines.append(
        f"platform: {p['name']} (jax backend {p['jax_backend']}, {p['platform_version']}); "
        f"process {p['process_index']} of {p['process_count']}, {p['local_device_count']} local / {p['device_count']} "
        "devices"
    )
    lines.append("devices:")
    for d in info["devices"]:
        mem = f", {d['memory_bytes'] / 2**30:.1f} GiB" if "memory_bytes" in d else ""
        kinds = ", ".join(k + ("*" if k == d["default_memory_kind"] else "") for k in d["memory_kinds"])
        lines.append(
            f"  {d['id']}: {d['platform']} {d['device_kind']} (process {d['process_index']}{mem}); memory kinds: "
            f"{kinds}"
        )
    lines.append("  (* = default memory kind)")

    def defaults_lines(title: str, defaults: dict, backend: str, kernels: dict[str, str]) -> None:
        cap = defaults["max_context_cap"]
        lines.append(title)
        lines.append(
            f"  dtype {defaults['dtype']}, kv_dtype {defaults['kv_dtype']}, kernel backend {backend}, "
            f"host memory kind {defaults['host_memory_kind']}, context cap {cap if cap else 'the model limit'}, "
            f"layer weights {defaults['layer_weights']}"
        )
        for op, fn in kernels.items():
            lines.append(f"  {op}: {fn}")
        if backend == "pallas":
            lines.append("  (attention falls back to the xla backend for a head_dim that is not a power of two >= 16)")

    c = info["chosen"]
    env = f" (${info['kernel_env_var']}={c['kernel_backend_env']})" if c["kernel_backend_env"] else ""
    defaults_lines(f"chosen here ({c['defaults']['platform']}){env}:", c["defaults"], c["kernel_backend"], c["kernels"])
    lines.append(f"  native decode and extend attention: {c['native_kernels']}")
    for name, col in info["would_choose"].items():
        d = col["defaults"]
        defaults_lines(
            f"would choose on {name} (lowering target {col['device_kind_target']}):",
            d,
            d["kernel_backend"],
            col["kernels"],
        )
        for op, status in col.get("lowering", {}).items():
            lines.append(f"  lowers {op} for {name}: {status}")
    return "\n".join(lines)


def run_info(args: argparse.Namespace) -> int:
    info = collect(check_lowering=args.check_lowering)
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    lowering = [s for col in info["would_choose"].values() for s in col.get("lowering", {}).values()]
    return 0 if all(s == "ok" for s in lowering) else 1
