"""ModelRunner: the device side.  Jitted ``extend``/``decode`` steps over ragged batches.

The runner owns the layer-first KV pool (``pallas_kernels.layout``) and donates it to
every step, so it is updated in place.  It never makes policy decisions: callers hand
it the sequences to run and get next tokens back.

Per-sequence state persists on the device (``seq_state.SeqTables``: page tables, KV
lengths, last sampled tokens, sampling parameters, RNG keys), donated to every step
like the pool: a sequence's row is written once when it starts and then updated by
the steps themselves, so a step ships only slot ids, new tokens and the page-table
entries that changed (``step_inputs``).  A decode's input tokens are the previous
step's samples, read on the device: the engine can dispatch step N+1 before it reads
step N's tokens (``dispatch_decode``).  ``step``/``dispatch`` keep the plain API
(``SeqInput``: explicit tokens, positions and pages) on top, for tests and benchmarks.

Shapes are bucketed and compiled once at warm-up: one decode program per batch
bucket (``T == B``, powers of two up to ``max_batch_size``) and one extend program per
token bucket (powers of two up to ``max_batch_tokens``) with a row count fixed by the
bucket (``buckets.extend_rows``), plus the row writer per row bucket.  The page table
width is fixed by the maximum context, so no step after warm-up compiles.  Warm-up
compiles the step programs ahead of time on ``compile_workers`` threads at once (XLA
compiles with the GIL released); steps call those executables.  Nothing is run at
warm-up: a padded 512-token extend of a 32-layer model is seconds of CPU, and the
compiled program needs no first run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import pallas_kernels
from pallas_kernels import native as native_kernels
from pallas_kernels.layout import GroupedPoolLayout, KVLayout
from pallas_kernels.sharded import use_head_sharding
from strata_jax.engine.executor import ExtendChunk
from strata_jax.models.config import ModelConfig
from strata_jax.models.llama import split_layer_weights, stack_layer_weights
from strata_jax.runtime import executable_cache, sampling_step
from strata_jax.runtime import sharding as tp_sharding
from strata_jax.runtime.buckets import extend_rows, pick_bucket, power_of_two_buckets
from strata_jax.runtime.chunk_tuning import BucketTimings
from strata_jax.runtime.executable_cache import ExecutableCache
from strata_jax.runtime.lora_bank import LoraBank, step_lora
from strata_jax.runtime.platform import LAYER_WEIGHTS, resolve_layer_weights
from strata_jax.runtime.sampling_state import SamplingState
from strata_jax.runtime.seq_state import COUNT_SAMPLE, HOST_TOKEN, RowParams, SeqSlots, after_step
from strata_jax.runtime.step_inputs import (
    empty_inputs,
    model_inputs,
    pack_extend,
    pack_updates,
    update_capacity,
)

if TYPE_CHECKING:
    from strata_jax.models.weights import CausalLM


@dataclass(frozen=True)
class RunnerConfig:
    page_size: int = 16
    num_device_pages: int = 512
    max_batch_tokens: int = 512  # extend token budget per step (longer prompts are chunked)
    max_batch_size: int = 16  # sequences per step
    max_context_tokens: int = 4096
    kv_dtype: str = "float32"
    min_token_bucket: int = 16
    kernel_backend: str = "auto"  # pallas_kernels backend for the model's attention (resolved at construction)
    scan_layers: bool = True  # layers under jax.lax.scan (False: unrolled over per-layer weight arrays)
    # "stacked" ([L, ...] arrays, sliced per layer), "per_layer" (arrays of their own) or
    # "auto" (the platform's default, runtime/platform.py); unrolled layers are always per layer
    layer_weights: str = "auto"
    sampling_slots: int = 0  # sequences holding penalty/bias/min_tokens state at once (0: max_batch_size)
    max_running: int = 0  # sequences holding a row of device state at once (0: 4 * max_batch_size)
    # Speculative decoding's k + 1: extend programs of B rows x this many tokens for each
    # decode batch bucket B (0: none).  A verification of one row is 1 + k tokens; on the
    # token buckets alone it would pay for 16 (measured on CPU: 118 ms vs 73 ms at k = 4).
    verify_tokens_per_row: int = 0
    # LoRA: adapters held on the device at once and their largest rank (0 slots: no LoRA
    # in the step programs at all; runtime/lora_bank.py)
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for name in ("page_size", "num_device_pages", "max_batch_tokens", "max_batch_size", "max_context_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RunnerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.kernel_backend not in pallas_kernels.BACKENDS:
            raise ValueError(
                f"RunnerConfig.kernel_backend must be one of {pallas_kernels.BACKENDS}, got {self.kernel_backend!r}"
            )
        if self.layer_weights not in LAYER_WEIGHTS:
            raise ValueError(f"RunnerConfig.layer_weights must be one of {LAYER_WEIGHTS}, got {self.layer_weights!r}")
        if self.verify_tokens_per_row < 0 or self.verify_tokens_per_row == 1:
            raise ValueError(
                f"RunnerConfig.verify_tokens_per_row must be 0 or at least 2, got {self.verify_tokens_per_row}"
            )
        if self.verify_tokens_per_row > self.max_batch_tokens:
            raise ValueError(
                f"RunnerConfig.verify_tokens_per_row ({self.verify_tokens_per_row}) must not exceed "
                f"max_batch_tokens ({self.max_batch_tokens}): a verification runs in one step"
            )
        if self.max_running and self.max_running < self.max_batch_size:
            raise ValueError(
                f"RunnerConfig.max_running ({self.max_running}) must be at least max_batch_size ({self.max_batch_size})"
            )

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_context_tokens // self.page_size)

    @property
    def running_slots(self) -> int:
        return self.max_running or 4 * self.max_batch_size


@dataclass
class SeqInput:
    """One sequence's work in a step, all of it explicit (the plain API: ``ModelRunner.step``).

    token_ids: the new tokens to run (extend: a chunk of the prompt; decode: one token)
    start_pos: how many tokens of this sequence are already in the pool
    page_ids:  device pages holding positions 0 .. start_pos + len(token_ids) - 1, in order
    The caller owns ``page_ids`` and guarantees no other sequence writes them.
    """

    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    rng_key: tuple[int, int] = (0, 0)
    # sampling extras (runtime/sampling_step.py); the defaults ask for nothing
    sampling_slot: int | None = None  # held SamplingState slot (penalties, logit_bias, min_tokens)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens_active: bool = False  # EOS/stop ids masked this step
    keep_sample: bool = True  # the sampled token is kept (False for a chunk that is not the prompt's last)
    logprobs: bool = False  # return the sampled token's logprob and the top alternatives
    prompt_logprob_targets: list[int] | None = None  # per new token: next prompt token id, -1 for none
    adapter_slot: int = -1  # its LoRA adapter's slot in ``ModelRunner.lora`` (-1: the base model)


@dataclass
class StepResult:
    next_tokens: np.ndarray  # [len(seqs)] sampled from each sequence's last position
    logits: np.ndarray | None = None  # [num_logit_rows, V] when requested
    # (chosen [N], top ids [N, K], top logprobs [N, K]) when some sequence asked:
    sample_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # N = sequences
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # N = packed tokens
    # per packed token of a speculative verification: the target's token after it (verify_sampling)
    verify_picks: np.ndarray | None = None


@dataclass
class PendingStep:
    """A dispatched step whose results are still being computed (JAX async dispatch)."""

    next_tokens: jax.Array
    logits: jax.Array | None
    num_seqs: int
    num_tokens: int
    sample_logprobs: sampling_step.TokenLogprobs | None = None  # set only when some sequence asked
    prompt_logprobs: sampling_step.TokenLogprobs | None = None
    verify_picks: jax.Array | None = None  # with prompt_logprobs: a verification's picks [T]
    on_failure: Callable[[Exception], None] | None = None  # told when the step fails on the device

    def is_ready(self) -> bool:
        """Has the device finished this step (its sampled tokens are computed)?  Never blocks."""
        return self.next_tokens.is_ready()  # type: ignore[attr-defined]  # jax.Array's stub lacks it, arrays have it

    def result(self) -> StepResult:
        """Wait for the step and fetch its sampled tokens (and logits/logprobs if requested)."""
        try:
            return self._fetch()
        except jax.errors.JaxRuntimeError as exc:
            if self.on_failure is not None:
                self.on_failure(exc)
            raise

    def _fetch(self) -> StepResult:
        out = StepResult(next_tokens=_host_copy(self.next_tokens)[: self.num_seqs])
        if self.logits is not None:
            out.logits = _host_copy(self.logits)[: self.num_tokens]
        if self.sample_logprobs is not None:
            out.sample_logprobs = sampling_step.fetch_logprobs(self.sample_logprobs, self.num_seqs, _host_copy)
        if self.prompt_logprobs is not None:
            out.prompt_logprobs = sampling_step.fetch_logprobs(self.prompt_logprobs, self.num_tokens, _host_copy)
        if self.verify_picks is not None:
            out.verify_picks = _host_copy(self.verify_picks)[: self.num_tokens]
        return out


def _program_shape(inputs: dict) -> tuple[int, int]:
    """(tokens, rows) of packed step inputs: which warm-up program runs them."""
    return len(inputs["input_ids"]), len(inputs["slots"])


def _host_copy(x: jax.Array) -> np.ndarray:
    """A replicated step output on the host (blocks until the device computed it).  On a
    mesh spanning processes (docs/multihost.md) the array has shards this process cannot
    address and ``np.asarray`` refuses it; every local shard holds the whole value."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


class KVPool(Protocol):
    """What the runner needs of the pool's holder: the array, which every step replaces
    (donated), and its layer groups (None: every layer holds the same pages)."""

    kv: jax.Array
    grouped: GroupedPoolLayout | None


class _OwnPool:
    """Holds the pool array when no cache controller provides one."""

    grouped: GroupedPoolLayout | None = None  # the runner's own pool is full width

    def __init__(self, kv: jax.Array):
        self.kv = kv


class ModelRunner:
    """Runs steps over a KV pool held by ``pool`` (any object with a ``kv`` attribute,
    e.g. the cache controller's ``DevicePool``); without one the runner makes its own.

    ``mesh`` (a ``strata_jax.runtime.sharding.make_mesh`` mesh with a ``tp`` axis):
    tensor parallelism.  The parameters are placed by the sharding rules, the pool
    must be split on its KV heads (``sharding.pool_sharding``), and the step is jitted
    with those shardings explicitly (pool still donated); attention and the KV write
    run per shard (``pallas_kernels.sharded``).  ``vocab_parallel`` also splits the
    embedding and LM head on the vocabulary (default: replicated, see ``sharding``)."""

    def __init__(
        self,
        model: CausalLM,
        config: RunnerConfig,
        *,
        pool: KVPool | None = None,
        mesh: jax.sharding.Mesh | None = None,
        vocab_parallel: bool = tp_sharding.VOCAB_PARALLEL,
    ):
        self.model_config = model.config
        self.config = config
        self.layout = KVLayout(
            num_layers=model.config.num_layers,
            num_kv_heads=model.config.num_kv_heads,
            head_dim=model.config.head_dim,
            page_size=config.page_size,
            dtype=config.kv_dtype,
        )
        # Fixed now, so every program this runner traces uses the same kernels.
        self.kernel_backend = pallas_kernels.resolve_backend(config.kernel_backend)
        # Built and registered now, before any program that calls them is traced or read
        # back from the executable cache (which cannot load a custom call not registered).
        self.native_kernels = native_kernels.status_for(self.kernel_backend)
        self.graphdef, state = nnx.split(model)
        self.mesh = mesh if mesh is not None and mesh.shape[tp_sharding.TP_AXIS] > 1 else None
        # the pool's owner decides its layer groups (the cache controller's DevicePool)
        self.grouped: GroupedPoolLayout | None = pool.grouped if pool is not None else None
        pool_shape = (
            self.grouped.pool_shape() if self.grouped else self.layout.device_pool_shape(config.num_device_pages)
        )
        rep = None
        if self.mesh is not None:
            tp_sharding.check_model(model.config, self.mesh.shape[tp_sharding.TP_AXIS], vocab_parallel=vocab_parallel)
            state_sh = tp_sharding.state_shardings(state, self.mesh, vocab_parallel=vocab_parallel)
            state = jax.device_put(state, state_sh)
            pool_sh, rep = tp_sharding.pool_sharding(self.mesh), tp_sharding.replicated(self.mesh)
        # per layer: the state without the layer weights, and each layer's own (``split_layer_weights``)
        self.state: nnx.State | tuple[nnx.State, list[nnx.State]] = state
        self.layer_weights = "per_layer" if not config.scan_layers else resolve_layer_weights(config.layer_weights)
        if self.layer_weights == "per_layer":  # every layer's weights in arrays of their own (run_stacked_layers)
            self.state = split_layer_weights(state, state_sh if self.mesh is not None else None)
            if self.mesh is not None:
                state_sh = jax.tree.map(lambda a: a.sharding, self.state)
        if pool is None:
            zeros = partial(jnp.zeros, pool_shape, jnp.dtype(config.kv_dtype))
            pool = _OwnPool(jax.jit(zeros, out_shardings=pool_sh)() if self.mesh is not None else zeros())
        elif tuple(pool.kv.shape) != pool_shape:
            raise ValueError(f"pool shape {tuple(pool.kv.shape)} does not match the runner's layout")
        elif self.mesh is not None and not pool.kv.sharding.is_equivalent_to(pool_sh, len(pool_shape)):
            raise ValueError(
                f"tensor parallel runner needs a pool split on its KV heads ({pool_sh}), got {pool.kv.sharding}"
            )
        self.pool = pool
        self._replicated = rep
        self.lora: LoraBank | None = None
        if config.max_loras:
            slots, rank = config.max_loras, config.max_lora_rank
            self.lora = LoraBank(model.config, slots=slots, rank=rank, dtype=_param_dtype(state), mesh=self.mesh)
        self._local_map_version: int | None = None
        self._local_map_array: jax.Array | None = None
        self.token_buckets = power_of_two_buckets(
            min(config.min_token_bucket, config.max_batch_tokens), config.max_batch_tokens
        )
        self.batch_buckets = power_of_two_buckets(1, config.max_batch_size)
        # (tokens, rows) of every program: decodes, then one extend per token bucket.
        self.decode_shapes = tuple((b, b) for b in self.batch_buckets)
        prefill_shapes = {
            t: extend_rows(t, self.token_buckets[-1], config.max_batch_size) for t in self.token_buckets if t >= 2
        }
        per_row = config.verify_tokens_per_row
        verify_shapes = {
            b * per_row: b
            for b in self.batch_buckets
            if per_row and b * per_row <= config.max_batch_tokens and b * per_row not in prefill_shapes
        }
        # sorted by tokens: _shape_for takes the first that holds a batch, the largest is last
        self.extend_shapes = tuple(sorted({**prefill_shapes, **verify_shapes}.items()))
        # the padding slot of the step's slot mapping: out of the pool (grouped: after any layer's shift)
        self.num_slots = self.grouped.num_slots if self.grouped else config.num_device_pages * config.page_size
        self.sampling = SamplingState(
            config.sampling_slots or config.max_batch_size, model.config.vocab_size, sharding=rep
        )
        self.seqs = SeqSlots(
            config.running_slots,
            config.max_pages_per_seq,
            no_sampling_slot=self.sampling.no_slot,
            max_rows=config.max_batch_size,
            mask_words=-(-model.config.vocab_size // 32),
            sharding=rep,
        )
        shardings: dict[str, Any] = {}
        if self.mesh is not None:  # explicit: params by the rules, pool by heads, the rest replicated
            shardings = {
                # state, pool, bias, flags, seq tables, inputs, LoRA weights
                "in_shardings": (
                    state_sh,
                    pool_sh,
                    rep,
                    rep,
                    rep,
                    rep,
                    self.lora.shardings(self.mesh) if self.lora is not None else rep,
                ),
                "out_shardings": (
                    rep,
                    rep,
                    rep,
                    rep,
                    rep,
                    pool_sh,
                    rep,
                    rep,
                ),  # tokens, logits, logprobs x2, verification picks, pool, flags, tables
            }
        self._step = jax.jit(
            # all_logits positional-static: jit takes no keyword arguments once in_shardings are set
            partial(
                _forward_step,
                self.graphdef,
                self.mesh,
                scan_layers=config.scan_layers,
                page_size=config.page_size,
                num_kv_slots=self.num_slots,
                no_sampling_slot=self.sampling.no_slot,
                layer_pages=self.grouped.layer_rows() if self.grouped else None,
                verify_tokens_per_row=config.verify_tokens_per_row,
                lora_rank=config.max_lora_rank,
            ),
            donate_argnums=(1, 3, 4),  # the KV pool, the sampling flags and the sequence tables, updated in place
            static_argnums=(7,),
            **shardings,
        )
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}  # (tokens, rows) -> warm-up's program
        # (tokens, rows) -> removes its executable cache entry: for programs read back from it
        self._reused: dict[tuple[int, int], Callable[[Exception], None]] = {}

    def stacked_state(self) -> nnx.State:
        """The model state with stacked ``[L, ...]`` layer weights (copies when the runner
        holds them per layer): for code that merges the whole model (benchmarks)."""
        if isinstance(self.state, tuple):
            return stack_layer_weights(*self.state)
        return self.state

    # ---- compile accounting -------------------------------------------------------
    @property
    def compile_count(self) -> int:
        """Number of distinct step programs compiled so far (ahead of time + jit cache entries)."""
        return len(self._compiled) + self._step._cache_size()  # type: ignore[attr-defined]  # no public count

    @property
    def program_shapes(self) -> tuple[tuple[int, int], ...]:
        """(tokens, rows) of every program a step can hit; warm-up compiles exactly these."""
        return self.decode_shapes + self.extend_shapes

    def warmup(
        self,
        *,
        show_progress: bool = True,
        progress: Callable[[int, int], None] | None = None,
        compile_workers: int | None = None,
        executables: ExecutableCache | None = None,
    ) -> int:
        """Compile every program a step can hit, ``compile_workers`` at a time (default: one
        per CPU core, at most 4); returns compiles.

        ``progress(done, total)`` is called before the first and after each program compiles.
        ``executables``: read each program back from this cache when it holds it (no
        tracing, lowering or compiling) and store the ones compiled (``executable_cache``).
        """
        shapes = self.program_shapes
        workers = max(1, min(compile_workers or min(os.cpu_count() or 1, 4), len(shapes)))
        if progress is not None:
            progress(0, len(shapes))
        bar = tqdm(total=len(shapes), desc="compiling steps", disable=not show_progress)
        environment = executable_cache.environment_fingerprint() if executables is not None else None
        if environment is None:
            executables = None  # the code could not be fingerprinted: compile, reuse nothing

        def compile_one(shape: tuple[int, int]) -> jax.stages.Compiled:
            args = self._warmup_args(shape)
            key = None
            if executables is not None:
                key, in_tree = self._executable_key(args, environment)
                compiled = executables.load(key, in_tree)
                if compiled is not None:
                    self._reused[shape] = partial(executables.discard, key)
                    return compiled
            with pallas_kernels.use_backend(self.kernel_backend):  # a context variable: set it in this thread
                lowered = self._step.lower(*args, False)
            if executables is None or key is None:  # (key is None exactly without executables)
                return lowered.compile()
            compiled, fresh = executable_cache.compile_fresh(lowered)
            if fresh:
                executables.store(key, compiled)
            else:
                executables.skip_stale_copy()
            return compiled

        with bar, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="strata-compile") as pool:
            futures = {pool.submit(compile_one, shape): shape for shape in shapes}
            for done, future in enumerate(as_completed(futures), 1):
                self._compiled[futures[future]] = future.result()
                bar.update(1)
                if progress is not None:
                    progress(done, len(shapes))
        self.sampling.warmup()  # its one row-writing program, or the first penalised request compiles it
        self.seqs.warmup()  # the sequence-row writer, per row bucket
        return self.compile_count

    def executable_keys(self) -> dict[tuple[int, int], str]:
        """The executable cache's key of each warm-up program (computed without tracing)."""
        environment = executable_cache.environment_fingerprint()
        return {shape: self._executable_key(self._warmup_args(shape), environment)[0] for shape in self.program_shapes}

    def _warmup_args(self, shape: tuple[int, int]) -> tuple:
        """The step's arguments (all but ``all_logits``) for padded inputs of ``shape``."""
        sampling = self.sampling
        inputs = self._empty_inputs(*shape)
        return (self.state, self.pool.kv, sampling.bias, sampling.flags, self.seqs.tables, inputs, self._lora_weights())

    def _lora_weights(self) -> dict | None:
        return self.lora.weights() if self.lora is not None else None

    def time_extend_buckets(self, *, min_tokens: int = 64, repeats: int = 2, seed: int = 0) -> BucketTimings:
        """Seconds of one prefill step per extend bucket of at least ``min_tokens`` tokens
        (and always the largest), the best of ``repeats``, host work included
        (``chunk_tuning`` uses them).

        Each step is one sequence of exactly the bucket's tokens continuing a prompt that
        already holds as many tokens as the largest bucket (when the pool has room): the
        chunk of a long prompt, whose attention per token then differs little between
        buckets; at no context a larger bucket's tokens would see more keys on average and
        look dearer per token than they are.  It writes KV into the pool's first pages:
        call it before any page is handed out (the engine does, right after warm-up)."""
        import time

        rng = np.random.default_rng(seed)
        high = max(4, min(self.model_config.vocab_size, 32000) - 2)
        largest = self.extend_shapes[-1][0]
        page_size = self.config.page_size
        room = min(self.config.num_device_pages * page_size, self.config.max_context_tokens)
        context = largest if 2 * largest <= room else 0
        seconds: dict[int, float] = {}
        for tokens in self.token_buckets:  # (not the verification shapes: prefill chunks are these)
            pages = list(range(-(-(context + tokens) // page_size)))
            if tokens < 2 or (tokens < min_tokens and tokens != largest) or len(pages) * page_size > room:
                continue
            best = float("inf")
            for _ in range(repeats):
                seq = SeqInput(rng.integers(3, high, size=tokens).tolist(), context, pages)
                start = time.perf_counter()
                self.step([seq])
                best = min(best, time.perf_counter() - start)
            seconds[tokens] = best
        return BucketTimings(context, seconds)

    def lower_step(
        self, tokens: int, seqs: int, *, decode: bool, platforms: tuple[str, ...] | None = None
    ) -> jax.stages.Lowered:
        """The step program of ``program_arguments(tokens, seqs, decode=decode)`` lowered
        (for this platform, or for ``platforms`` from this host): its HLO, for inspection."""
        args = self.program_arguments(tokens, seqs, decode=decode)
        if platforms is None:
            return self._step.lower(*args, False)
        return self._step.trace(*args, False).lower(lowering_platforms=platforms)

    def program_arguments(self, tokens: int, seqs: int, *, decode: bool) -> tuple:
        """The step program a batch of ``tokens`` new tokens over ``seqs`` sequences runs, as
        the arguments to trace it with (all but ``all_logits``): for lowering it elsewhere."""
        return self._warmup_args(self._shape_for(tokens, seqs, decode=decode))

    @cached_property
    def _program_description(self) -> str:
        """Besides the code and the arguments, what decides the traced step: the model,
        the runner config, the kernels and the mesh (all fixed at construction)."""
        return (
            f"step all_logits=False\nmodel {type(self.model_config).__name__} {self.model_config!r}\n"
            f"graph {self.graphdef!r}\nrunner {self.config!r}\n"
            f"kernels {self.kernel_backend} native {self.native_kernels}\nmesh {self.mesh!r} "
            f"{None if self.mesh is None else self.mesh.device_ids.tolist()}"  # in mesh order
        )

    def _executable_key(self, args: tuple, environment: str | None) -> tuple[str, jax.tree_util.PyTreeDef]:
        in_tree, signature = executable_cache.arguments_signature(args)
        return executable_cache.program_key(environment, self._program_description, signature), in_tree

    # ---- sequence rows ------------------------------------------------------------
    def update_capacity(self, tokens: int, rows: int) -> int:
        """Page-table entries a step of this many tokens and rows carries (more: ``write_rows``)."""
        shape = self._shape_for(tokens, rows, decode=tokens == rows)
        return update_capacity(shape[0], shape[1], self.config.page_size)

    # ---- steps (the engine's API: rows live on the device) --------------------------
    def dispatch_decode(
        self,
        slots: Sequence[int] | np.ndarray,
        *,
        updates: np.ndarray | None = None,
        host_tokens: Sequence[int] | None = None,
        logprobs: bool = False,
    ) -> PendingStep:
        """Start a decode step of the rows ``slots`` without waiting for it.

        Each row's input is its slot's last sample (or ``host_tokens[i]``), at its KV
        length; ``updates`` (``[k, 3]``: slot, index, page) are page-table entries that
        changed since the rows were written.  ``logprobs``: some row asked for them.
        """
        n = len(slots)
        if n == 0:
            raise ValueError("empty batch")
        if n > self.config.max_batch_size:
            raise ValueError(f"batch of {n} sequences exceeds max_batch_size={self.config.max_batch_size}")
        b = pick_bucket(self.batch_buckets, n)
        x = self._empty_inputs(b, b)
        x["slots"][:n] = slots
        if host_tokens is None:
            x["row_bits"][:n] = COUNT_SAMPLE
        else:
            x["input_ids"][:n] = host_tokens
            x["row_bits"][:n] = COUNT_SAMPLE | HOST_TOKEN
        pack_updates(x, updates)
        return self._launch(x, n, n, logprobs=logprobs)

    def dispatch_extend(
        self,
        rows: Sequence[ExtendChunk[int]],
        *,
        updates: np.ndarray | None = None,
        logprobs: bool = False,
        all_logits: bool = False,
    ) -> PendingStep:
        """Start an extend step of prompt chunks (rows already written) without waiting for it."""
        if not rows:
            raise ValueError("empty batch")
        total = sum(len(r.token_ids) for r in rows)
        if total > self.config.max_batch_tokens:
            raise ValueError(f"batch of {total} tokens exceeds max_batch_tokens={self.config.max_batch_tokens}")
        if len(rows) > self.config.max_batch_size:
            raise ValueError(f"batch of {len(rows)} sequences exceeds max_batch_size={self.config.max_batch_size}")
        tokens, batch = self._shape_for(total, len(rows), decode=False)
        x = self._empty_inputs(tokens, batch)
        pack_extend(x, rows)
        pack_updates(x, updates)
        prompt_lp = any(r.prompt_logprob_targets is not None for r in rows)
        return self._launch(x, len(rows), total, logprobs=logprobs, prompt_logprobs=prompt_lp, all_logits=all_logits)

    def _launch(
        self,
        x: dict,
        num_seqs: int,
        num_tokens: int,
        *,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        all_logits: bool = False,
    ) -> PendingStep:
        # A program read back from the executable cache that fails on the device leaves the
        # cache, so the next start compiles it (the failure itself is not hidden).
        discard = None if all_logits else self._reused.get(_program_shape(x))
        try:
            next_tokens, logits, sample_lp, prompt_lp, picks = self._run_padded(x, all_logits=all_logits)
        except jax.errors.JaxRuntimeError as exc:
            if discard is not None:
                discard(exc)
            raise
        return PendingStep(
            next_tokens,
            logits if all_logits else None,
            num_seqs,
            num_tokens,
            sample_logprobs=sample_lp if logprobs else None,
            prompt_logprobs=prompt_lp if prompt_logprobs else None,
            verify_picks=picks if prompt_logprobs else None,
            on_failure=discard,
        )

    # ---- steps (the plain API: everything explicit) ---------------------------------
    def step(self, seqs: list[SeqInput], *, all_logits: bool = False) -> StepResult:
        """Run one ragged batch (any mix of extends and decodes) and sample a token per sequence."""
        return self.dispatch(seqs, all_logits=all_logits).result()

    def dispatch(self, seqs: list[SeqInput], *, all_logits: bool = False) -> PendingStep:
        """Start a step of explicit sequences without waiting for it: each gets a row of
        device state for the step (written from its ``SeqInput``, freed at once: later
        writers of the tables are ordered after this step on the device)."""
        if not seqs:
            raise ValueError("empty batch")
        if len(seqs) > self.config.max_batch_size:
            raise ValueError(f"batch of {len(seqs)} sequences exceeds max_batch_size={self.config.max_batch_size}")
        page_size = self.config.page_size
        for i, s in enumerate(seqs):
            end_pos = s.start_pos + len(s.token_ids)
            if not s.token_ids:
                raise ValueError("a sequence in the batch has no new tokens")
            if end_pos > self.config.max_context_tokens:
                raise ValueError(
                    f"sequence reaches {end_pos} tokens, beyond max_context_tokens={self.config.max_context_tokens}"
                )
            if len(s.page_ids) * page_size < end_pos:
                raise ValueError(f"sequence {i} has {len(s.page_ids)} pages for {end_pos} tokens")
        slots = []
        try:
            for _ in seqs:
                slot = self.seqs.acquire()
                if slot is None:
                    raise RuntimeError("every sequence slot is held by a running sequence")
                slots.append(slot)
            self.seqs.write_rows(
                [
                    (slot, s.page_ids, s.start_pos, 0, 0 if s.min_tokens_active else 1, _row_params(s))
                    for slot, s in zip(slots, seqs)
                ]
            )
            if (
                all(len(s.token_ids) == 1 for s in seqs)
                and not all_logits
                and not any(s.prompt_logprob_targets for s in seqs)
            ):
                x = self._decode_inputs_for(seqs, slots)
                return self._launch(x, len(seqs), len(seqs), logprobs=any(s.logprobs for s in seqs))
            rows = [
                ExtendChunk(slot, s.token_ids, s.start_pos, s.keep_sample, s.prompt_logprob_targets)
                for slot, s in zip(slots, seqs)
            ]
            return self.dispatch_extend(rows, logprobs=any(s.logprobs for s in seqs), all_logits=all_logits)
        finally:
            for slot in slots:
                self.seqs.release(slot)

    def _decode_inputs_for(self, seqs: list[SeqInput], slots: list[int]) -> dict:
        b = pick_bucket(self.batch_buckets, len(seqs))
        x = self._empty_inputs(b, b)
        n = len(seqs)
        x["slots"][:n] = slots
        x["input_ids"][:n] = [s.token_ids[0] for s in seqs]
        x["row_bits"][:n] = [HOST_TOKEN | (COUNT_SAMPLE if s.keep_sample else 0) for s in seqs]
        return x

    def _run_padded(self, inputs: dict, *, all_logits: bool):
        sampling = self.sampling
        # warm-up compiled the all_logits=False programs; an all_logits step goes through jit
        program = None if all_logits else self._compiled.get(_program_shape(inputs))
        args = (self.state, self.pool.kv, sampling.bias, sampling.flags, self.seqs.tables, inputs, self._lora_weights())
        if program is not None:
            out = program(*args)
        else:
            with pallas_kernels.use_backend(self.kernel_backend):  # in effect when a new shape is traced
                out = self._step(*args, all_logits)
        next_tokens, logits, sample_lp, prompt_lp, picks, self.pool.kv, sampling.flags, self.seqs.tables = out
        return next_tokens, logits, sample_lp, prompt_lp, picks

    @property
    def kv_pool(self) -> jax.Array:
        return self.pool.kv

    def _empty_inputs(self, tokens: int, batch: int) -> dict[str, Any]:
        x: dict[str, Any] = empty_inputs(
            tokens, batch, padding_slot=self.seqs.padding_slot, page_size=self.config.page_size
        )
        local_map = self._local_map()
        if local_map is not None:
            x["local_map"] = local_map
        return x

    def _local_map(self) -> jax.Array | None:
        """The pool's global -> local page map on the device (pools with layer groups whose
        local pages follow an allocator, ``DeviceLocalPages``), copied when it changed."""
        local = getattr(self.pool, "local", None)
        if local is None:
            return None
        if self._local_map_version != local.version:
            array = local.array.copy()  # the host array keeps changing; the device copy must not
            self._local_map_array = jax.device_put(array, self._replicated) if self._replicated else jnp.asarray(array)
            self._local_map_version = local.version
        return self._local_map_array

    def _shape_for(self, total_tokens: int, num_seqs: int, *, decode: bool) -> tuple[int, int]:
        """The (tokens, rows) program of a batch: a decode bucket, or the smallest extend
        bucket holding both its tokens and its sequences."""
        if decode:
            batch = pick_bucket(self.batch_buckets, num_seqs)
            return batch, batch
        for tokens, rows in self.extend_shapes:
            if tokens >= total_tokens and rows >= num_seqs:
                return tokens, rows
        raise ValueError(f"no extend program holds {total_tokens} tokens of {num_seqs} sequences")


def grouped_pool_layout(
    config: ModelConfig, layout: KVLayout, num_pages: int, local_ratio: float = 1.0
) -> GroupedPoolLayout:
    """The pool with layer groups for ``config``: its sliding-window layers local, the rest
    global; ``num_pages`` global pages and ``local_ratio`` of them (at least one) local."""
    return GroupedPoolLayout(layout, config.local_layers, num_pages, max(1, round(num_pages * local_ratio)))


def _row_params(s: SeqInput) -> RowParams:
    return RowParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        sampling_slot=s.sampling_slot,
        min_tokens=1,
        want_logprobs=s.logprobs,
        rng_base=s.rng_key,
        adapter_slot=s.adapter_slot,
    )


def _forward_step(
    graphdef,
    mesh,
    state,
    kv_pool,
    bias_table,
    flags_table,
    tables,
    inputs: dict,
    lora_weights: dict | None,
    all_logits: bool,
    *,
    scan_layers: bool,
    page_size: int,
    num_kv_slots: int,
    no_sampling_slot: int,
    layer_pages: tuple[tuple[int, int], ...] | None,
    verify_tokens_per_row: int,
    lora_rank: int,
):
    state, layer_states = state if isinstance(state, tuple) else (state, None)
    model = nnx.merge(graphdef, state)
    input_ids, positions, meta, sampling, new_lens, tables = model_inputs(
        tables,
        inputs,
        page_size=page_size,
        num_kv_slots=num_kv_slots,
        no_sampling_slot=no_sampling_slot,
        layer_pages=layer_pages,
    )
    with use_head_sharding(mesh):  # attention and the KV write per shard of the heads (tp)
        lora = step_lora(lora_weights, sampling["token_adapter"], lora_rank) if lora_weights is not None else None
        hidden, kv_pool = model(
            input_ids, positions, kv_pool, meta, scan_layers=scan_layers, layer_states=layer_states, lora=lora
        )
    last_logits = model.logits(hidden[sampling["last_index"]])
    num_tokens, num_rows = input_ids.shape[0], inputs["slots"].shape[0]
    next_tokens, sample_lp, prompt_lp, picks, flags_table = sampling_step.sample_with_extras(
        last_logits,
        hidden,
        model.logits,
        sampling,
        flags_table,
        bias_table,
        tables.token_mask,
        verify_picks_per_step=0 if num_tokens == num_rows else min(num_tokens, num_rows * verify_tokens_per_row),
    )
    tables = after_step(tables, inputs["slots"], sampling["kept"], next_tokens, new_lens)
    logits = model.logits(hidden) if all_logits else None
    return next_tokens, logits, sample_lp, prompt_lp, picks, kv_pool, flags_table, tables


def _param_dtype(state: nnx.State) -> jnp.dtype:
    """The dtype of the model's weights (the LoRA slots take it)."""
    leaves = [a for a in jax.tree.leaves(state) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    return max(leaves, key=lambda a: a.size).dtype if leaves else jnp.dtype(jnp.float32)
