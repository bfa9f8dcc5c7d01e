"""What a router's control plane asks of a worker, in SGLang's shapes.

SGLang's model gateway (``sglang-router``, the ``smg`` crate; 0.3.2 read here) registers
an HTTP worker in steps: it polls the health endpoint (``/health``) until it answers 2xx,
then reads

* ``GET /server_info`` (on 404 the older ``/get_server_info``): of its fields it keeps
  ``model_path`` and ``served_model_name`` (the worker's model id is the first of
  ``served_model_name``, ``model_path``, ``"unknown"``: what the router's ``/v1/models``
  lists and what ``cache_aware`` keys its prefix tree on), ``tp_size``, ``dp_size``,
  ``load_balance_method``, ``disaggregation_mode``; it also parses ``version``,
  ``max_batch_size``, ``max_total_tokens``, ``max_prefill_tokens``,
  ``max_running_requests``, ``max_num_reqs``, and a wrongly typed one voids the whole
  answer;
* ``GET /model_info`` (else ``/get_model_info``): ``model_type`` and ``architectures``
  become labels; ``model_path``, ``tokenizer_path`` and ``is_generation`` are parsed;
* it then loads a tokenizer for the model from the ``model_path`` label (a folder with a
  ``tokenizer.json``; a ``.gguf`` file is refused with "GGUF format not yet supported",
  logged as a warning; the HTTP router does not need one).

Later it asks ``GET /get_load`` (a list with one ``{dp_rank, num_reqs,
num_waiting_reqs, num_tokens}`` per data-parallel rank) every 30 s when a policy is
``power_of_two``, and for its own ``/get_loads``; and ``POST /flush_cache`` on every
worker when a user calls its ``/flush_cache``.

The answers here are built from the engine as loaded (``serving/routes_worker.py`` serves
them).  A value strata-jax does not have is left out (``null``), never made up.
"""

from __future__ import annotations

import os
from typing import Any

from serving.frontend import Frontend

# HF ``architectures`` of the model types the engine loads (strata_jax.models.config.SUPPORTED_MODEL_TYPES).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
BUILTIN_MODELS = frozenset({"tiny"})  # models embedded in the package: nothing on disk
LOCAL_TIERS = ("device", "host")  # what SGLang's POST /flush_cache drops here: this server's own tiers


def _version() -> str:
    from strata_jax import __version__

    return __version__


def model_path(spec: str | None) -> str | None:
    """The model as a path a router can read (absolute), or ``None`` for a built-in model."""
    if not spec or spec in BUILTIN_MODELS:
        return None
    return os.path.abspath(spec) if os.path.exists(spec) else spec


def tokenizer_path(path: str | None) -> str | None:
    """Where the tokenizer is: the model folder (its ``tokenizer.json``) or the ``.gguf`` file itself."""
    if path is None:
        return None
    if os.path.isdir(path):
        return path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    return path


def _engine_config(engine: Any) -> Any:
    return getattr(engine, "config", None)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def server_info(frontend: Frontend, instance_id: str) -> dict[str, Any]:
    """SGLang's ``/server_info`` fields that strata-jax has, plus its own (``engine``,
    ``instance_id``, ``tiers``, ...)."""
    engine = frontend.engine()
    cfg = _engine_config(engine)
    path = model_path(getattr(cfg, "model", None))
    max_total_tokens = None
    resolve = getattr(cfg, "resolved_device_tokens", None)
    if callable(resolve):
        max_total_tokens = _int_or_none(resolve(engine.max_context_tokens))
    running = getattr(cfg, "resolved_max_running_requests", None)
    return {
        "model_path": path,
        "tokenizer_path": tokenizer_path(path),
        "served_model_name": frontend.model_name,
        "is_generation": True,
        "tp_size": _int_or_none(getattr(cfg, "tp", None)),
        "dp_size": 1,
        "version": _version(),
        "max_batch_size": _int_or_none(getattr(cfg, "max_batch_size", None)),
        "max_total_tokens": max_total_tokens,
        "max_prefill_tokens": _int_or_none(getattr(engine, "prefill_chunk", getattr(cfg, "max_batch_tokens", None))),
        "max_running_requests": _int_or_none(running),
        "context_length": _int_or_none(engine.max_context_tokens),
        "page_size": _int_or_none(getattr(engine, "page_size", None)),
        "tiers": getattr(cfg, "tiers", None),
        "engine": "strata-jax",
        "instance_id": instance_id,
    }


def model_info(frontend: Frontend) -> dict[str, Any]:
    """SGLang's ``/model_info``: paths, ``is_generation``, HF ``model_type`` and ``architectures``."""
    engine = frontend.engine()
    path = model_path(getattr(_engine_config(engine), "model", None))
    model_type = getattr(getattr(engine, "model_config", None), "model_type", None)
    return {
        "model_path": path,
        "tokenizer_path": tokenizer_path(path),
        "served_model_name": frontend.model_name,
        "is_generation": True,
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]] if model_type in ARCHITECTURES else None,
        "max_context_length": _int_or_none(engine.max_context_tokens),
    }


def load_info(frontend: Frontend) -> list[dict[str, int]]:
    """SGLang's ``/get_load``: one entry (this server is one data-parallel rank)."""
    frontend.engine()  # 503 while warming up or draining, as SGLang's scheduler would not answer either
    load = frontend.load()
    return [{"dp_rank": 0, "num_reqs": load.requests, "num_waiting_reqs": load.waiting, "num_tokens": load.tokens}]
