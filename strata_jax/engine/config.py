"""``EngineConfig``: one frozen dataclass holding every concern's settings.

Most users set a handful of flat fields (``model``, ``tiers``, ``device_tokens``,
``policy``...); ``cache_config()`` / ``scheduler_config()`` derive the per-concern
configs from them.  Passing a full ``CacheConfig`` or ``SchedulerConfig`` overrides
the flat fields of that concern.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pallas_kernels.dispatch import BACKENDS as KERNEL_BACKENDS
from pallas_kernels.dispatch import KernelBackend
from strata_jax.api import InvalidRequestError
from strata_jax.cache.config import CacheConfig, KVTierFormat, PrefetchPolicy, Tiers, WritePolicy
from strata_jax.runtime.platform import LAYER_WEIGHTS
from strata_jax.scheduler.config import SchedulerConfig
from strata_jax.spec import SpeculativeConfig, parse_speculative_config


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    model: "tiny" (embedded random model) or a local Hugging Face folder.
    dtype: weights dtype; None = float32 on CPU, bfloat16 on GPU.
    kv_dtype: KV cache dtype of L1 (the device pool): "float32", "bfloat16" or "fp8"
        (float8 e4m3fn, values clipped to +-448, no scales, like vLLM's
        --kv-cache-dtype fp8; half the device bytes of bf16, close to but not
        bit-identical with full width); None = float32 on CPU (XLA:CPU rewrites bf16
        and fp8 buffers on every update), bfloat16 on GPU.
    kv_tier_format: format of L2 (host) pages and L3 objects: "full" (default: the L1
        dtype, bit-identical from every tier), "fp8" (float8 e4m3) or "int8", both with
        a float32 scale per (page, layer, K/V, KV head): about half the bytes of bf16 (a
        quarter of float32) per token held in L2 and L3 and moved per load; outputs from a
        quantized tier are close to full width, not bit-identical (docs/cache.md).
    page_size: tokens per KV page (the transfer and caching granularity).
    device_tokens: L1 (device pool) capacity in tokens; None = 64 * max_batch_tokens,
        at least 4 * max_context_tokens (enough for a few full-length requests).
    tiers: "L1", "L1+L2" (default) or "L1+L2+L3".
    hicache_ratio: L2 size as a multiple of L1 (default 2).
    write_policy: "write_through" | "write_through_selective" | "write_back".
    prefetch_policy: what a request whose L3 hit is being prefetched does: "cost" (default)
        waits while the rest is estimated to land sooner than recomputing it would take
        (the scheduler holds it back; other work runs meanwhile), "best_effort" never
        waits (what landed is used, the rest recomputed), "wait_complete" waits for every
        page (the engine thread blocks), "timeout" waits up to a deadline per page.
    prefetch_min_tokens: storage hits shorter than this are recomputed, not prefetched.
    storage_backend / storage_dir: L3 backend by name ("file", "redis") and its directory.
    storage_url: the Redis/Valkey server of storage_backend "redis"
        (default redis://127.0.0.1:6379/0); engines sharing it share L3.
    storage_secret: the fleet's L3 secret (at least 16 bytes): L3 objects carry an
        HMAC-SHA256 tag and untagged, forged or re-keyed ones are misses (docs/cache.md,
        "Authenticated L3"); None = $STRATA_STORAGE_SECRET, which is preferred (a flag
        is visible in `ps`).
    policy: scheduler policy, "strata" (default) or "fifo".
    max_batch_tokens: new tokens computed per prefill step at most (longer prompts are
        chunked); the largest extend program compiled.
    prefill_chunk: the prefill token budget per step: "max" (default: max_batch_tokens),
        an integer up to max_batch_tokens given as text (e.g. "1024"), or "auto": after
        warm-up time one step per compiled extend bucket (continuing a prompt as long as
        the largest bucket) and use the smallest bucket
        whose time per token is within 10% of the cheapest bucket's
        (strata_jax/runtime/chunk_tuning.py; needs warmup).
    max_batch_size: sequences per prefill or decode step.
    mixed_steps: a step that prefills and decodes runs both as one program (each decode row
        a one-token row of the prompt chunk's extend; the chunk leaves them a token each)
        when the scheduler's fitted step times say one costs less than the two; False runs
        an extend and then a decode (docs/scheduler.md, "Mixed steps").
    max_running_requests: requests running (prefilling or decoding) at once, each holding a
        row of per-sequence state on the device; more wait in the queue.  None = 4 *
        max_batch_size (decodes beyond max_batch_size take turns).
    max_waiting: bound of the waiting queue; beyond it requests get ``OverloadedError``.
    max_context_tokens: longest prompt + completion; None = the model's limit, capped
        at 16384 on CPU.
    warmup: compile every step shape at start-up (no compilation while serving).
    compilation_cache_dir: persistent XLA compilation cache: "auto" (default:
        $XDG_CACHE_HOME/strata-jax/xla, else ~/.cache/strata-jax/xla), a directory, or
        "none" (or None) to turn it off.  Entries are keyed by the program, device and
        jax version, so another model or config never reuses a wrong one
        (``strata_jax.runtime.compilation_cache``).
    reuse_executables: with a compilation cache, also keep each compiled step program
        whole under its ``executables`` subdirectory and read it back on the next start,
        which then skips tracing and lowering too (keyed by the code, versions, config
        and shapes; ``strata_jax.runtime.executable_cache``).  False: every start traces
        and lowers each program (the XLA cache still saves the compiles).
    show_progress: progress bars for loading and compiling.
    freeze_gc: after start-up, move every live object to the garbage collector's permanent
        generation (``gc.freeze``; ``shutdown`` undoes it), so a full collection while
        serving walks only what serving created, not the ~0.4M objects of the model and
        jax's traced programs (otherwise a 0.3 s pause of the engine loop, measured).
    kernel_backend: attention and KV-transfer kernels: "auto" (default: Pallas on
        CUDA/ROCm, "xla" on CPU; $STRATA_KERNEL_BACKEND overrides auto), "pallas",
        "xla" (block-causal XLA attention, pallas_kernels.blocked), "reference" (the
        pure-JAX references) or "interpret" (Pallas interpreted; slow, for tests).
    scan_layers: run the decoder layers under ``jax.lax.scan`` (default: compile time
        independent of depth); False unrolls them over per-layer weight arrays (faster
        decode steps on CPU, where a slice of a stacked weight is copied every step;
        compiling takes several times longer: docs/runtime.md).
    layer_weights: how the layers' weights are held: "auto" (default: "per_layer" on
        CPU, "stacked" on GPUs), "stacked" (one [num_layers, ...] array per weight, the
        layer scan slices it; XLA:CPU copies every slice before its matmul, every step)
        or "per_layer" (arrays of their own; under the scan each matmul picks its layer's
        kernel with a switch and reads it in place: decode steps about 0.6-0.7x on CPU,
        docs/runtime.md).  Unrolled layers (scan_layers=False) always hold them per layer.
    kv_layer_groups: hold the L1 pool as layer groups (``GroupedPoolLayout``: each layer
        its own rows, read through a per-layer offset), the layout in which a model's
        sliding-window layers keep fewer pages than its full-attention layers (KV older
        than a window is never read again): their KV outside the running requests'
        windows is trimmed lazily, loads move only the window a reuse needs, and matches
        end where a window is complete (docs/models.md).  Default False.
    kv_local_ratio: with ``kv_layer_groups``, the sliding-window layers' pages as a share
        of the full-attention layers' (SGLang's ``--swa-full-tokens-ratio``), in (0, 1]:
        0.25 holds their KV for a quarter of the L1 pages, which is how the layer groups
        save device memory.  Default 1.0 (every page can keep its local KV, nothing is
        trimmed for room).  Too small for the running requests' windows, a step fails its
        requests with "out of device KV memory".
    kv_host_local_ratio: with ``kv_layer_groups``, L2's share of host pages that can keep
        their sliding-window layers' KV, in (0, 1]; the rest hold their full-attention
        layers' KV only, so L2 holds more pages in the same bytes (``hicache_ratio`` x
        L1's pages at full width).  A reuse needs that KV only in the window before where it
        starts; pages without it are evicted least recently written first.  Default: the
        same as ``kv_local_ratio``.
    publish_prefill_chunks: hand each prefill chunk's full pages to the tree when the chunk is
        dispatched (backed up to L2, and L3, at once under ``write_through``), not only when
        the prompt's last chunk is: a prefill/decode disaggregation prefill replica's pages
        land in the shared L3 as its prefill goes (``serve --role prefill`` turns it on), and
        requests sharing the prompt's beginning find it ready sooner.  Default False.
    pipeline: overlap the host and the device (default): step N+1 is scheduled and
        dispatched while step N runs, and N's tokens are read after; stop rules that need
        a token's value apply one step late (a token computed past a stop is discarded).
        False: the serial loop (each step's tokens read before the next is scheduled).
    kv_events_endpoint: publish KV events (what each tier holds, in vLLM's wire format:
        ZMQ PUB, msgpack ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``) on this ZMQ endpoint, e.g. ``tcp://*:5557`` (bound; an
        address without ``*`` is connected to, as vLLM does).  None (default): off.  The
        events carry prompt token ids: bind to loopback or a trusted network only.
    kv_events_replay_endpoint: a ZMQ ROUTER endpoint (bound) that replays missed
        batches from a sequence number (None: no replay).
    kv_events_topic: the topic frame of every message (default "", vLLM's).
    kv_events_queue: batches (one per engine step) waiting for the publisher's thread;
        beyond it a batch is dropped and counted (``kv_events_dropped_*`` in /metrics),
        never waited for.
    kv_events_buffer: batches kept for replay.
    data_parallel_rank: this replica's data-parallel rank: written into every event batch
        and added to both KV event ports (as vLLM does).
    speculative_config: speculative decoding as vLLM's ``--speculative-config`` JSON, e.g.
        ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``
        (prompt lookup) or ``{"model": "<draft>", "num_speculative_tokens": 4}`` (a draft
        model with the target's tokenizer; ``draft_kv_tokens``: its KV pool, default four
        contexts): requests propose tokens and verify them in one step
        (``strata_jax.engine.speculation``; output identical to decoding without it,
        sampled rows under their seed too).  None (default): off.  An unknown field or
        method is an error naming it.
    max_loras: LoRA adapters held at once (each in its own device slot; 0, the default: no
        LoRA, and the step programs carry none of its work).  An adapter is loaded at start
        (``lora_modules``) or at run time (``Engine.load_lora_adapter``); a request names it
        (``lora_name``).  Loading more than this many is refused until one is unloaded.
    max_lora_rank: the largest adapter rank the slots hold (default 16); smaller ranks are
        zero-padded.  The step's LoRA work grows with ``max_loras * max_lora_rank``.
    lora_modules: adapters loaded at start, ``((name, path), ...)`` of PEFT folders.
    tp: tensor-parallel size (default 1): the model and the KV pool are split over the
        first ``tp`` devices (attention heads, KV heads and MLP columns; see
        ``strata_jax.runtime.sharding``).  Must divide the model's attention heads, KV
        heads and intermediate size, and not exceed its KV heads or the device count.
    """

    model: str = "tiny"
    dtype: str | None = None
    kv_dtype: str | None = None
    kv_tier_format: KVTierFormat = "full"
    page_size: int = 16
    device_tokens: int | None = None
    tiers: Tiers = "L1+L2"
    hicache_ratio: float = 2.0
    write_policy: WritePolicy = "write_through"
    prefetch_policy: PrefetchPolicy = "cost"
    prefetch_min_tokens: int = 256
    storage_backend: str = "file"
    storage_dir: str | None = None
    storage_url: str = "redis://127.0.0.1:6379/0"
    storage_secret: str | None = dataclasses.field(default=None, repr=False)
    policy: str = "strata"
    max_batch_tokens: int = 512
    prefill_chunk: str = "max"
    max_batch_size: int = 16
    mixed_steps: bool = False
    max_waiting: int = 1024
    max_running_requests: int | None = None
    max_context_tokens: int | None = None
    warmup: bool = True
    compilation_cache_dir: str | None = "auto"
    reuse_executables: bool = True
    show_progress: bool = True
    freeze_gc: bool = True
    kernel_backend: KernelBackend = "auto"
    scan_layers: bool = True
    layer_weights: str = "auto"
    kv_layer_groups: bool = False
    kv_local_ratio: float = 1.0
    kv_host_local_ratio: float | None = None
    publish_prefill_chunks: bool = False
    pipeline: bool = True
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_queue: int = 10_000
    kv_events_buffer: int = 10_000
    data_parallel_rank: int = 0
    tp: int = 1
    speculative_config: str | None = None
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    cache: CacheConfig | None = None
    scheduler: SchedulerConfig | None = None

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "max_batch_tokens",
            "max_batch_size",
            "max_waiting",
            "tp",
            "kv_events_queue",
            "kv_events_buffer",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if (
            isinstance(self.data_parallel_rank, bool)
            or not isinstance(self.data_parallel_rank, int)
            or self.data_parallel_rank < 0
        ):
            raise InvalidRequestError(
                f"EngineConfig.data_parallel_rank must be a non-negative integer, got {self.data_parallel_rank!r}"
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not str(value).startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidRequestError(
                    f"EngineConfig.{name} must be a ZMQ endpoint (tcp://, ipc:// or inproc://), got {value!r}"
                )
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_loras" else 1):
                raise InvalidRequestError(f"EngineConfig.{name} must be a non-negative integer, got {value!r}")
        if self.lora_modules and len(self.lora_modules) > self.max_loras:
            raise InvalidRequestError(
                f"{len(self.lora_modules)} LoRA modules given but max_loras={self.max_loras}: raise max_loras"
            )
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise InvalidRequestError("EngineConfig.kv_events_replay_endpoint needs kv_events_endpoint")
        if self.max_running_requests is not None:
            m = self.max_running_requests
            if isinstance(m, bool) or not isinstance(m, int) or m < self.max_batch_size:
                raise InvalidRequestError(
                    f"EngineConfig.max_running_requests must be an integer of at least max_batch_size "
                    f"({self.max_batch_size}), got {m!r}"
                )
        ratio = self.kv_local_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise InvalidRequestError(f"EngineConfig.kv_local_ratio must be in (0, 1], got {ratio!r}")
        if ratio != 1 and not self.kv_layer_groups:
            raise InvalidRequestError("EngineConfig.kv_local_ratio needs kv_layer_groups=True")
        host_ratio = self.kv_host_local_ratio
        if host_ratio is not None:
            if isinstance(host_ratio, bool) or not isinstance(host_ratio, (int, float)) or not 0 < host_ratio <= 1:
                raise InvalidRequestError(f"EngineConfig.kv_host_local_ratio must be in (0, 1], got {host_ratio!r}")
            if not self.kv_layer_groups:
                raise InvalidRequestError("EngineConfig.kv_host_local_ratio needs kv_layer_groups=True")
        if self.max_batch_tokens <= self.max_batch_size:
            raise InvalidRequestError("EngineConfig.max_batch_tokens must exceed max_batch_size")
        chunk = str(self.prefill_chunk)
        if chunk == "auto" and not self.warmup:
            raise InvalidRequestError(
                'EngineConfig.prefill_chunk "auto" measures steps at warm-up: it needs warmup=True'
            )
        if chunk not in ("max", "auto") and not (
            chunk.isdigit() and self.max_batch_size < int(chunk) <= self.max_batch_tokens
        ):
            raise InvalidRequestError(
                f'EngineConfig.prefill_chunk must be "max", "auto" or an integer above max_batch_size '
                f"({self.max_batch_size}) and at most max_batch_tokens ({self.max_batch_tokens}), "
                f"got {self.prefill_chunk!r}"
            )
        from strata_jax.runtime.platform import DTYPES, KV_DTYPE_ALIASES, KV_DTYPES

        if self.dtype not in (None, *DTYPES):
            raise InvalidRequestError(f"EngineConfig.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.kv_dtype not in (None, *KV_DTYPES, *KV_DTYPE_ALIASES):
            raise InvalidRequestError(f"EngineConfig.kv_dtype must be float32, bfloat16 or fp8, got {self.kv_dtype!r}")
        from strata_jax.cache.config import KV_TIER_FORMATS

        if self.kv_tier_format not in KV_TIER_FORMATS:
            raise InvalidRequestError(
                f"EngineConfig.kv_tier_format must be one of {', '.join(KV_TIER_FORMATS)}, got {self.kv_tier_format!r}"
            )
        if self.layer_weights not in LAYER_WEIGHTS:
            raise InvalidRequestError(
                f"EngineConfig.layer_weights must be one of {', '.join(LAYER_WEIGHTS)}, got {self.layer_weights!r}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise InvalidRequestError(
                f"EngineConfig.kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, got {self.kernel_backend!r}"
            )
        self.speculative  # noqa: B018 - parsed once here so a bad value fails at construction

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: off)."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)

    @property
    def resolved_max_running_requests(self) -> int:
        if self.scheduler is not None and self.scheduler.max_running_requests is not None:
            return self.scheduler.max_running_requests
        return self.max_running_requests if self.max_running_requests is not None else 4 * self.max_batch_size

    def resolved_device_tokens(self, max_context_tokens: int) -> int:
        if self.cache is not None:
            return self.cache.num_device_pages * self.cache.page_size
        if self.device_tokens is not None:
            return self.device_tokens
        return max(64 * self.max_batch_tokens, 4 * max_context_tokens)

    def cache_config(self, max_context_tokens: int) -> CacheConfig:
        if self.cache is not None:
            return self.cache
        return CacheConfig(
            page_size=self.page_size,
            device_tokens=self.resolved_device_tokens(max_context_tokens),
            hicache_ratio=self.hicache_ratio,
            tiers=self.tiers,
            write_policy=self.write_policy,
            prefetch_policy=self.prefetch_policy,
            prefetch_min_tokens=self.prefetch_min_tokens,
            storage_backend=self.storage_backend,
            storage_dir=self.storage_dir,
            storage_url=self.storage_url,
            storage_secret=self.storage_secret,
            kernel_backend=self.kernel_backend,
            kv_tier_format=self.kv_tier_format,
        )

    def scheduler_config(self) -> SchedulerConfig:
        if self.scheduler is not None:
            if self.scheduler.max_running_requests is None:  # the engine's device rows bound it
                return dataclasses.replace(self.scheduler, max_running_requests=self.resolved_max_running_requests)
            return self.scheduler
        chunk = str(self.prefill_chunk)
        return SchedulerConfig(
            policy=self.policy,
            max_batch_tokens=int(chunk) if chunk.isdigit() else self.max_batch_tokens,  # "auto": set after warm-up
            max_prefill_batch_size=self.max_batch_size,
            max_decode_batch_size=self.max_batch_size,
            max_waiting=self.max_waiting,
            max_running_requests=self.resolved_max_running_requests,
            wait_for_prefetch=(self.cache.prefetch_policy if self.cache is not None else self.prefetch_policy)
            == "cost",
            enable_mixed_steps=self.mixed_steps,
        )
