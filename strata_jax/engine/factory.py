"""The engine's parts, built from an ``EngineConfig`` with every setting resolved once.

``resolve_settings`` turns the user's config and the loaded model's into ``EngineSettings``
(frozen, ``Literal``-typed where a setting is one of a few values): the platform's dtypes,
kernel backend and layer-weights layout, the context served, the cache config with its
L3 identity, the KV layout and its layer groups.  ``build_parts`` builds the cache
controller, runner, executor and cost model from those settings alone; nothing below
re-derives them (the runner takes its layer groups from the pool it is given, the pool
its kernel backend from the resolved cache config).

``Engine`` (``engine/engine.py``) adds the threads, the inbox and the API around the parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.layout import GroupedPoolLayout, KVLayout
from strata_jax.api import InvalidRequestError, RequestLimits
from strata_jax.cache.config import CacheConfig
from strata_jax.cache.controller import CacheController
from strata_jax.cache.device_transfers import DeviceTransfers
from strata_jax.engine.config import EngineConfig
from strata_jax.models.loader import LoadedModel
from strata_jax.models.loader import load_model as load_model  # a seam: bench roofline swaps in a random model
from strata_jax.runtime import sharding as tp_sharding
from strata_jax.runtime.draft_proposer import DraftModelProposer
from strata_jax.runtime.jax_executor import JaxExecutor
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, grouped_pool_layout
from strata_jax.runtime.platform import ResolvedPlatform
from strata_jax.runtime.platform import resolve as resolve_platform
from strata_jax.runtime.warmup_progress import WarmupProgress
from strata_jax.scheduler.config import SchedulerConfig
from strata_jax.scheduler.cost_model import CostModel, CostPrior
from strata_jax.spec import SpeculativeConfig


@dataclass(frozen=True)
class EngineSettings:
    """What the engine runs with: the config's choices resolved against the platform and model.

    ``layer_groups``: the L1 pool's layer groups (``kv_layer_groups``; None: full width).
    ``local_window``: the widest sliding window of the model (0: none).
    ``host_local_ratio``: L2's share of host pages that keep sliding-window layers' KV."""

    platform: ResolvedPlatform
    max_context_tokens: int
    cache: CacheConfig
    layout: KVLayout
    layer_groups: GroupedPoolLayout | None
    local_window: int
    host_local_ratio: float
    limits: RequestLimits
    runner: RunnerConfig
    scheduler: SchedulerConfig

    @property
    def page_size(self) -> int:
        return self.cache.page_size


def resolve_settings(config: EngineConfig, loaded: LoadedModel, platform: ResolvedPlatform) -> EngineSettings:
    """``config`` resolved for ``loaded`` on ``platform``; refuses what cannot be served."""
    model = loaded.config
    model_limit = model.max_context_tokens
    max_context_tokens = platform.max_context_tokens(model_limit, config.max_context_tokens)
    if max_context_tokens > model_limit:
        raise InvalidRequestError(f"max_context_tokens={max_context_tokens} exceeds the model's {model_limit}")
    cache = dataclasses.replace(config.cache_config(max_context_tokens), kernel_backend=platform.kernel_backend)
    layout = KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, cache.page_size, platform.kv_dtype)
    if not cache.kv_identity:  # L3 keys are this model's, dtype's and layout's only
        from strata_jax.models.fingerprint import kv_identity

        cache = dataclasses.replace(cache, kv_identity=kv_identity(loaded.model, model, platform.dtype, layout))
    layer_groups = None
    if config.kv_layer_groups:
        layer_groups = grouped_pool_layout(model, layout, cache.num_device_pages, config.kv_local_ratio)
        _check_local_pages(layer_groups, model.layer_windows, config, cache.page_size)
    host_local_ratio = config.kv_local_ratio if config.kv_host_local_ratio is None else config.kv_host_local_ratio
    return EngineSettings(
        platform=platform,
        max_context_tokens=max_context_tokens,
        cache=cache,
        layout=layout,
        layer_groups=layer_groups,
        local_window=max(model.layer_windows, default=0),
        host_local_ratio=host_local_ratio,
        limits=RequestLimits(
            vocab_size=model.vocab_size,
            max_context_tokens=max_context_tokens,
            kv_pages=cache.num_device_pages,
            page_size=cache.page_size,
        ),
        runner=RunnerConfig(
            page_size=cache.page_size,
            num_device_pages=cache.num_device_pages,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            max_context_tokens=max_context_tokens,
            kv_dtype=platform.kv_dtype,
            kernel_backend=platform.kernel_backend,
            scan_layers=config.scan_layers,
            layer_weights=platform.layer_weights,
            max_running=config.resolved_max_running_requests,
            verify_tokens_per_row=spec.num_speculative_tokens + 1 if (spec := config.speculative) else 0,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
        ),
        scheduler=config.scheduler_config(),
    )


@dataclass
class EngineParts:
    """The engine's parts, built once by ``build_parts``."""

    settings: EngineSettings
    loaded: LoadedModel
    mesh: jax.sharding.Mesh | None
    ctl: CacheController[DeviceTransfers]
    runner: ModelRunner
    executor: JaxExecutor
    cost: CostModel
    matmul_flops_per_s: float  # the first device's measured rate (tp: each does its share)
    draft: DraftModelProposer | None = None  # speculative decoding's draft model (method "draft_model")


def build_parts(config: EngineConfig, progress: WarmupProgress) -> EngineParts:
    """Load the model and build the cache controller, runner, executor and cost model."""
    platform = resolve_platform(
        dtype=config.dtype,
        kv_dtype=config.kv_dtype,
        kernel_backend=config.kernel_backend,
        layer_weights=config.layer_weights,
    )
    mesh = tp_sharding.make_mesh(config.tp) if config.tp > 1 else None  # before loading: fail fast
    progress.phase("loading model")
    loaded = load_model(config.model, dtype=jnp.dtype(platform.dtype), show_progress=config.show_progress)
    tp_sharding.check_model(loaded.config, config.tp)
    progress.phase("allocating KV pools")
    settings = resolve_settings(config, loaded, platform)
    ctl = CacheController.on_device(
        settings.cache,
        settings.layout,
        # tp: the L1 pool is split on its KV heads; host pages and L3 objects stay whole pages
        device=tp_sharding.pool_sharding(mesh) if mesh is not None else None,
        grouped=settings.layer_groups,
        local_window=settings.local_window,
        host_local_ratio=settings.host_local_ratio,
    )
    runner = ModelRunner(loaded.model, settings.runner, pool=ctl.device_pool, mesh=mesh)
    from strata_jax.runtime.compute_prior import device_matmul_rate

    matmul_flops_per_s = device_matmul_rate(platform.dtype)
    draft = None
    if (spec := config.speculative) is not None and spec.model is not None:
        progress.phase("loading the draft model")
        draft = _draft_proposer(spec, config, loaded, settings)
    return EngineParts(
        settings=settings,
        loaded=loaded,
        mesh=mesh,
        ctl=ctl,
        runner=runner,
        executor=JaxExecutor(runner, eos_token_ids=loaded.eos_token_ids),
        cost=_cost_model(settings, ctl, loaded, matmul_flops_per_s, config.tp),
        matmul_flops_per_s=matmul_flops_per_s,
        draft=draft,
    )


# a draft must tokenize as the target does: this text's ids are compared (besides the sizes)
TOKENIZER_PROBE = "The draft's tokens are the target's: 12,345 words, naïve café, <tags> and\n\tindents."


def _draft_proposer(
    spec: SpeculativeConfig, config: EngineConfig, target: LoadedModel, settings: EngineSettings
) -> DraftModelProposer:
    """The draft model of ``spec`` on a runner of its own (module ``runtime.draft_proposer``);
    refused unless it shares the target's vocabulary."""
    platform = settings.platform
    assert spec.model is not None  # (method draft_model)
    draft = load_model(spec.model, dtype=jnp.dtype(platform.dtype), show_progress=config.show_progress)
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidRequestError(
            f"speculative config: the draft model {spec.model!r} has a vocabulary of {draft.config.vocab_size} "
            f"tokens, the target {target.config.vocab_size}: a draft must share the target's tokenizer"
        )
    if draft.tokenizer is not None and target.tokenizer is not None:
        ids, want = draft.tokenizer.encode(TOKENIZER_PROBE), target.tokenizer.encode(TOKENIZER_PROBE)
        if list(ids) != list(want):
            raise InvalidRequestError(
                f"speculative config: the draft model {spec.model!r} tokenizes text differently from the target "
                f"({list(ids)[:8]}... vs {list(want)[:8]}...): a draft must share the target's tokenizer"
            )
    max_context = min(settings.max_context_tokens, draft.config.max_context_tokens)
    page_size = settings.page_size
    kv_tokens = spec.draft_kv_tokens or 4 * max_context
    runner = ModelRunner(
        draft.model,
        RunnerConfig(
            page_size=page_size,
            num_device_pages=max(-(-kv_tokens // page_size), -(-max_context // page_size)),
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=1,  # one sequence per draft step (runtime.draft_proposer)
            max_context_tokens=max_context,
            kv_dtype=platform.kv_dtype,
            kernel_backend=platform.kernel_backend,
            scan_layers=config.scan_layers,
            layer_weights=platform.layer_weights,
        ),
    )
    return DraftModelProposer(runner)


def _cost_model(
    settings: EngineSettings,
    ctl: CacheController[DeviceTransfers],
    loaded: LoadedModel,
    matmul_flops_per_s: float,
    tp: int,
) -> CostModel:
    """The scheduler's cost model, before any step is measured: loads at the link's bytes of
    the tier format, extends at the device's matmul rate."""
    from strata_jax.runtime.compute_prior import extend_prior

    local_share, local_window_tokens = 0.0, 0  # (CostPrior's defaults: loads move every layer's KV)
    if ctl.local_pages is not None and settings.layer_groups is not None:
        # loads move the windowed layers' KV of the window only
        local_share = settings.layer_groups.local_share
        local_window_tokens = ctl.local_pages.window_pages * settings.page_size
    return CostModel(
        CostPrior(
            bytes_per_token=ctl.page_bytes / settings.page_size,  # what a load moves: the tier format's bytes
            link_bytes_per_s=ctl.link_bandwidth,
            extend_coeffs=extend_prior(loaded.config, matmul_flops_per_s, tp),
            local_share=local_share,
            local_window_tokens=local_window_tokens,
        )
    )


def _check_local_pages(
    layer_groups: GroupedPoolLayout, layer_windows: tuple[int, ...], config: EngineConfig, page_size: int
) -> None:
    """Refuse a local-layer pool too small for even one request's window and prefill chunk."""
    from strata_jax.cache.tree_window import window_pages_for

    windows = [w for w in layer_windows if w > 0]
    if not windows:
        return
    need = window_pages_for(max(windows), page_size) + -(-config.max_batch_tokens // page_size) + 1
    if layer_groups.local_pages < need:
        raise InvalidRequestError(
            f"kv_local_ratio={config.kv_local_ratio} leaves {layer_groups.local_pages} local-layer pages; one "
            f"request's window ({max(windows)} tokens) and prefill chunk ({config.max_batch_tokens} tokens) need {need}"
        )
