"""``strata-jax bench prefill``: where the time of one cold prefill goes.

For each chunk size (``--chunk``, or every size of ``--chunks``) one engine serves the
prefill of a fresh random ``--tokens``-token prompt (``generate`` with ``max_tokens=1``,
``tiers="L1"``, a new prompt every run so nothing is cached; one warm run first, then
``--repeats`` timed runs, the median kept).  Its time to first token (TTFT) is the
whole: the engine's executor stamps when each step finished on the device
(``JaxExecutor.collect``'s ``seconds``), so TTFT = device time + host time.

The device time is then taken apart by running the step's pieces alone, each a jitted
program of its own on the model's real weights and the step's real shapes (the bucket
each chunk pads to, the metadata ``step_inputs.model_inputs`` builds for it, the page
table width of the engine), warm, median of ``--repeats``:

* **matmuls**: the QKV, O and gate/up/down projections of every layer (a scan over the
  stacked weights, as the model runs them) over the bucket's tokens;
* **norms, RoPE, SiLU**: the elementwise rest of the layers;
* **attention**: ``pallas_kernels.ragged_paged_attention_pool``, with the backend the
  engine resolved (on CPU: ``"xla"``, the block-causal ``pallas_kernels.blocked``), over
  the chunk's pages, every layer;
* **KV writes**: ``pallas_kernels.write_kv`` of the chunk's K/V, every layer;
* **LM head**: the logits of the rows that sample (one per real sequence);
* **sampling**: ``sampling_step.sample_with_extras`` on the bucket's rows;
* **step inputs, embedding, final norm**: ``model_inputs`` (page tables, positions,
  slot mapping), the embedding gather, the final norm and the tables' update;
* **padding**: what the bucket computes beyond the chunk: its padding tokens' share of
  the per-token pieces (matmuls, elementwise and KV writes are linear in the bucket's
  tokens; so is attention on the ``"reference"`` backend, which scores every token of
  the bucket against each KV block, while the others skip padding tokens) plus the LM
  head's padding rows (measured: all rows minus one row).
* **host**: TTFT minus the device time (admission, scheduling, page bookkeeping,
  dispatch gaps, reading the token);
* **other / overlap**: device time minus the sum of the pieces: what the pieces do not
  explain (fusion across pieces, or a piece costing more alone; negative when the pieces
  overlap in the real step).  It is reported, never folded into another row.

The shares of TTFT sum to 1.  The matmuls are also set against the machine: their FLOPs
(``projection_flops``) over their time, next to the rate of a square float32 matmul of
a comparable size (the cube root of tokens x hidden x intermediate) timed with jax, and
attention's causal work (``attention_flops``) against the same rate.  The whole and the
parts are measured minutes apart, so a 1024^3 matmul is timed when the process's first
engine starts (this one, from the CLI) and again after the pieces: a machine whose speed
changed meanwhile is warned about.  With several chunk sizes a per-chunk table shows each chunk's device time per token,
whether work grows faster than linearly with the chunk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from strata_jax.runtime.compute_prior import attention_flops, lm_head_flops, projection_flops

if TYPE_CHECKING:
    from strata_jax.engine import Engine

DESCRIPTION = "one cold prefill split into matmuls, attention, KV writes, LM head, sampling, padding and host time"

# Rows of the breakdown, in print order: (key, label).
PART_LABELS: tuple[tuple[str, str], ...] = (
    ("matmuls", "matmuls (QKV/O + MLP projections)"),
    ("elementwise", "norms, RoPE, SiLU, residuals"),
    ("attention", "attention"),
    ("kv_write", "KV writes into the paged pool"),
    ("lm_head", "LM head (sampled rows)"),
    ("sampling", "sampling"),
    ("inputs", "step inputs, embedding, final norm"),
    ("padding", "padding (bucket tokens + LM-head rows)"),
)
PARTS = tuple(key for key, _ in PART_LABELS)
DRIFT_WARNING = 1.2  # the machine's matmul rate at the start and the end of a breakdown differ more: warn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model (tiny, a HF folder or a GGUF; default tiny)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens prefilled cold (default 2048)")
    parser.add_argument(
        "--chunk",
        type=int,
        default=512,
        help="prefill chunk: the engine's max_batch_tokens (default 512, the engine's default)",
    )
    parser.add_argument(
        "--chunks",
        default="",
        help="comma-separated chunk sizes to break down one after the other, e.g. 512,2048 "
        "(default: --chunk alone); adds a per-chunk time-per-token comparison",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of the engine and of each piece (median; default 3)"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=16, help="the engine's max_batch_size (default 16, the engine's)"
    )
    parser.add_argument(
        "--device-tokens",
        type=int,
        default=None,
        help="L1 pool of the engine in tokens (default: max(8192, 4 x (tokens + chunk)); "
        "step time does not depend on it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and inputs")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


# ---------------------------------------------------------------------------- pure helpers
@dataclass(frozen=True)
class ChunkPlan:
    """One prefill step of the prompt: ``tokens`` new tokens from ``start``, padded to the
    extend program ``bucket`` tokens x ``rows`` sequences."""

    start: int
    tokens: int
    bucket: int
    rows: int

    @property
    def padding(self) -> int:
        return self.bucket - self.tokens


def plan_chunks(total: int, chunk: int, extend_shapes: Sequence[tuple[int, int]]) -> list[ChunkPlan]:
    """The steps the engine runs for one ``total``-token prompt in chunks of ``chunk``: each
    takes the smallest extend program (``(tokens, rows)``, as ``ModelRunner.extend_shapes``)
    holding its tokens and one sequence."""
    if total <= 0 or chunk <= 0:
        raise ValueError("tokens and chunk must be positive")
    plans = []
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        bucket, rows = next((t, r) for t, r in sorted(extend_shapes) if t >= n and r >= 1)
        plans.append(ChunkPlan(start, n, bucket, rows))
    return plans


def split_shares(parts: dict[str, float], device_s: float, ttft_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """``(seconds, shares)`` of every row: the parts, ``host`` = TTFT - device, and
    ``other`` = device - sum(parts) (negative when the pieces overlap).  Shares are of
    TTFT and sum to 1."""
    seconds = dict(parts)
    seconds["host"] = ttft_s - device_s
    seconds["other"] = device_s - sum(parts.values())
    return seconds, {k: v / ttft_s for k, v in seconds.items()}


def _median_time(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call`` (blocked until its outputs are ready) after a warm call
    (compile + first run)."""
    import jax

    jax.block_until_ready(call())
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------- the engine
def _measure_engine(args: argparse.Namespace, chunk: int) -> tuple[dict, Engine]:
    """Cold prefills of fresh prompts through one engine; returns (numbers, the engine)."""
    import numpy as np

    from strata_jax.api import InvalidRequestError, SamplingParams
    from strata_jax.engine import Engine, EngineConfig

    device_tokens = args.device_tokens or max(8192, 4 * (args.tokens + chunk))
    config = EngineConfig(
        model=args.model,
        show_progress=False,
        tiers="L1",
        max_batch_tokens=chunk,
        max_batch_size=args.max_batch_size,
        device_tokens=device_tokens,
        # the prompt and its one sampled token, past the CPU's default cap of 16K
        max_context_tokens=args.tokens + 1,
    )
    try:
        engine = Engine(config)
    except InvalidRequestError as exc:  # past the model's limit: one line, not a traceback
        raise SystemExit(
            f"--tokens {args.tokens}: the prompt and its first token need {args.tokens + 1} tokens of context ({exc})"
        ) from None
    if args.tokens + 1 > engine.max_context_tokens:
        engine.shutdown()
        raise SystemExit(f"--tokens {args.tokens} exceeds the engine's context ({engine.max_context_tokens})")
    steps: list[tuple[int, float]] = []  # (tokens, device seconds) of each extend step, in order
    executor = engine.executor
    collect = executor.collect

    def timed_collect(pending):
        out = collect(pending)
        if pending.extend:
            steps.append((sum(part.step.num_tokens for part in pending.parts), float(out.seconds or 0.0)))
        return out

    # this instance only: the core calls self.executor.collect
    executor.collect = timed_collect  # type: ignore[method-assign]  # timing wrapper, restored below
    rng = np.random.default_rng(args.seed + 7919 * chunk)
    low, high = 3, max(4, min(engine.vocab_size, 32000) - 2)  # clear of the byte model's BOS/EOS
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    runs = []
    for i in range(1 + args.repeats):  # the first run is a warm-up: its numbers are not kept
        prompt = rng.integers(low, high, size=args.tokens).tolist()
        steps.clear()
        t0 = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        wall = time.perf_counter() - t0
        if i:
            runs.append(
                {"ttft_s": out.ttft_s, "wall_s": wall, "device_s": sum(s for _, s in steps), "steps": list(steps)}
            )
    executor.collect = collect  # type: ignore[method-assign]  # the original bound method back
    median = sorted(runs, key=lambda r: r["ttft_s"])[(len(runs) - 1) // 2]
    return {"runs": runs, "median": median, "device_tokens": device_tokens}, engine


# ---------------------------------------------------------------------------- the pieces
class _Pieces:
    """The step's pieces as separate jitted programs on one model's weights (shared with
    the engine's runner: no copy), over a pool and sequence tables of their own."""

    def __init__(self, runner: SimpleNamespace, total_tokens: int, seed: int):
        """``runner``: the engine runner's ``graphdef``, ``state``, ``config`` and
        ``kernel_backend``."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from flax import nnx

        from pallas_kernels.layout import KVLayout
        from strata_jax.runtime.sampling_state import SamplingState
        from strata_jax.runtime.seq_state import SeqSlots

        self.graphdef, self.state = runner.graphdef, runner.state
        model = nnx.merge(self.graphdef, self.state)
        self.config = c = model.config
        self.page_size = runner.config.page_size
        self.kernel_backend = runner.kernel_backend
        layers = model.model.layers
        attn, mlp = layers.self_attn, layers.mlp
        linears = {
            "q": attn.q_proj,
            "k": attn.k_proj,
            "v": attn.v_proj,
            "o": attn.o_proj,
            "gate": mlp.gate_proj,
            "up": mlp.up_proj,
            "down": mlp.down_proj,
        }
        self.weights = {name: lin.kernel[...] for name, lin in linears.items()}
        self.biases = {name: lin.bias[...] for name, lin in linears.items() if lin.bias is not None}
        self.norms = {"in": layers.input_layernorm.weight[...], "post": layers.post_attention_layernorm.weight[...]}
        if attn.q_norm is not None:
            self.norms.update(qn=attn.q_norm.weight[...], kn=attn.k_norm.weight[...])
        self.dtype = self.weights["q"].dtype
        self.num_pages = -(-total_tokens // self.page_size) + 1
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, self.page_size, runner.config.kv_dtype)
        shape = layout.device_pool_shape(self.num_pages)
        self.key = jax.random.key(seed)
        self.pool = (jax.random.normal(self._next_key(), shape, jnp.float32) * 0.5).astype(runner.config.kv_dtype)
        self.num_kv_slots = self.num_pages * self.page_size
        self.sampling_state = SamplingState(runner.config.max_batch_size, c.vocab_size)
        self.seqs = SeqSlots(
            2,
            runner.config.max_pages_per_seq,
            no_sampling_slot=self.sampling_state.no_slot,
            max_rows=runner.config.max_batch_size,
            mask_words=-(-c.vocab_size // 32),
        )
        slot = self.seqs.acquire()
        assert slot is not None  # a new SeqState: every slot is free
        self.slot = slot
        self.prompt = np.random.default_rng(seed).integers(3, max(4, min(c.vocab_size, 32000) - 2), size=total_tokens)
        self._inputs: dict[int, dict] = {}
        self._jit()

    def _next_key(self):
        import jax

        self.key, key = jax.random.split(self.key)
        return key

    def _random(self, *shape: int):
        import jax

        return jax.random.normal(self._next_key(), shape, self.dtype)

    def random_inputs(self, tokens: int) -> dict:
        """Activations of ``tokens`` tokens (values do not change the work)."""
        import jax.numpy as jnp

        if tokens not in self._inputs:
            c = self.config
            self._inputs[tokens] = {
                "x": self._random(tokens, c.hidden_size),
                "q": self._random(tokens, c.num_heads, c.head_dim),
                "k": self._random(tokens, c.num_kv_heads, c.head_dim),
                "v": self._random(tokens, c.num_kv_heads, c.head_dim),
                "gate": self._random(tokens, c.intermediate_size),
                "ones": jnp.ones((tokens, c.intermediate_size), self.dtype),
            }
        return self._inputs[tokens]

    def _jit(self) -> None:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import pallas_kernels
        from strata_jax.models.rope import apply_rope, inverse_frequencies
        from strata_jax.runtime import sampling_step
        from strata_jax.runtime.seq_state import after_step
        from strata_jax.runtime.step_inputs import model_inputs

        c, graphdef = self.config, self.graphdef
        num_layers, eps = c.num_layers, c.rms_norm_eps
        layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
        inv_freq = jnp.asarray(inverse_frequencies(c))
        page_size, num_kv_slots, no_slot = self.page_size, self.num_kv_slots, self.sampling_state.no_slot

        def rms(x, w):
            xf = x.astype(jnp.float32)
            xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
            return w * xf.astype(x.dtype)

        def matmuls(weights, biases, x):
            # Every layer's 7 projections; each output is consumed (summed into the carry) so
            # nothing is dead code, and layers read distinct weights, so nothing is hoisted.
            def lin(name, w, b, a):
                y = a @ w[name]
                return y + b[name] if name in b else y

            def body(carry, wb):
                acc, s = carry
                w, b = wb
                q, k, v = lin("q", w, b, x), lin("k", w, b, x), lin("v", w, b, x)
                g, u = lin("gate", w, b, x), lin("up", w, b, x)
                out = lin("o", w, b, q) + lin("down", w, b, g)
                return (acc + out, s + jnp.sum(k) + jnp.sum(v) + jnp.sum(u)), None

            init = (jnp.zeros_like(x), jnp.zeros((), x.dtype))
            return jax.lax.scan(body, init, (weights, biases))[0]

        def elementwise(norms, x, q, k, gate, ones, positions):
            def body(carry, w):
                x, q, k, g = carry
                xn = rms(x, w["in"])
                if "qn" in w:
                    q, k = rms(q, w["qn"]), rms(k, w["kn"])
                q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
                x = x + xn  # residual after attention (the attention output's stand-in: xn)
                x = x + rms(x, w["post"])  # post-attention norm, residual after the MLP
                g = jax.nn.silu(g) * ones  # SiLU(gate) * up
                return (x, q, k, g), None

            return jax.lax.scan(body, (x, q, k, gate), norms)[0]

        def attention(pool, q, page_table, seq_lens, query_start):
            decode_only = q.shape[0] == page_table.shape[0]  # as the model decides

            def body(carry, layer):
                acc, pool = carry
                out, pool = pallas_kernels.ragged_paged_attention_pool(
                    q,
                    pool,
                    layer,
                    page_table,
                    seq_lens,
                    query_start,
                    sm_scale=c.head_dim**-0.5,
                    max_q_len=1 if decode_only else None,
                )
                return (acc + out, pool), None

            return jax.lax.scan(body, (jnp.zeros_like(q), pool), layer_ids)[0]

        def kv_write(pool, k, v, slot_mapping):
            def body(pool, layer):
                return pallas_kernels.write_kv(pool, layer, k, v, slot_mapping), None

            return jax.lax.scan(body, pool, layer_ids)[0]

        def lm_head(state, hidden, last_index):
            return nnx.merge(graphdef, state).logits(hidden[last_index])

        def sample(state, last_logits, hidden, sampling, flags, bias, token_mask):
            head = nnx.merge(graphdef, state).logits
            return sampling_step.sample_with_extras(last_logits, hidden, head, sampling, flags, bias, token_mask)

        def inputs(state, tables, x, hidden):
            model = nnx.merge(graphdef, state)
            input_ids, positions, meta, sampling, new_lens, tables = model_inputs(
                tables, x, page_size=page_size, num_kv_slots=num_kv_slots, no_sampling_slot=no_slot
            )
            embedded = model.model.embed_tokens(input_ids)
            normed = model.model.norm(hidden)
            tables = after_step(tables, x["slots"], sampling["kept"], jnp.zeros_like(sampling["last_index"]), new_lens)
            return embedded, normed, tables, positions, meta, sampling

        self._matmuls = jax.jit(matmuls)
        self._elementwise = jax.jit(elementwise)
        self._attention = jax.jit(attention, donate_argnums=(0,))
        self._kv_write = jax.jit(kv_write, donate_argnums=(0,))
        self._lm_head = jax.jit(lm_head)
        self._sample = jax.jit(sample, donate_argnums=(4,))
        self._inputs_fn = jax.jit(inputs)

    def measure(self, plan: ChunkPlan, repeats: int, shape_cache: dict) -> dict[str, float]:
        """Seconds of each piece of the step that runs ``plan`` (shape-only pieces are timed
        once per program shape and reused)."""
        import jax.numpy as jnp
        import numpy as np

        import pallas_kernels
        from strata_jax.engine.executor import ExtendChunk
        from strata_jax.runtime.seq_state import RowParams
        from strata_jax.runtime.step_inputs import empty_inputs, pack_extend

        T, B, n = plan.bucket, plan.rows, plan.tokens
        last = plan.start + n == len(self.prompt)
        pages = list(range(-(-(plan.start + n) // self.page_size)))
        self.seqs.write_rows([(self.slot, pages, plan.start, 0, 0, RowParams(min_tokens=0))])
        packed = empty_inputs(T, B, padding_slot=self.seqs.padding_slot, page_size=self.page_size)
        pack_extend(
            packed, [ExtendChunk(self.slot, self.prompt[plan.start : plan.start + n].tolist(), plan.start, last)]
        )
        x = {k: jnp.asarray(v) for k, v in packed.items()}
        act = self.random_inputs(T)
        hidden = act["x"]
        tables = self.seqs.tables
        out: dict[str, float] = {}
        with pallas_kernels.use_backend(self.kernel_backend):  # traced on first call: the engine's kernels
            _, _, _, positions, meta, sampling = self._inputs_fn(self.state, tables, x, hidden)
            key = (T, B)
            if key not in shape_cache:
                rows, one_row = sampling["last_index"], sampling["last_index"][:1]
                shape_cache[key] = {
                    "matmuls": _median_time(lambda: self._matmuls(self.weights, self.biases, hidden), repeats),
                    "elementwise": _median_time(
                        lambda: self._elementwise(
                            self.norms, hidden, act["q"], act["k"], act["gate"], act["ones"], positions
                        ),
                        repeats,
                    ),
                    "inputs": _median_time(lambda: self._inputs_fn(self.state, tables, x, hidden), repeats),
                    "lm_head_rows": _median_time(lambda: self._lm_head(self.state, hidden, rows), repeats),
                    "lm_head_one": _median_time(lambda: self._lm_head(self.state, hidden, one_row), repeats),
                }
                logits = self._lm_head(self.state, hidden, rows)
                holder = {"flags": self.sampling_state.flags}

                def sample():
                    tokens, _, _, _, holder["flags"] = self._sample(
                        self.state,
                        logits,
                        hidden,
                        sampling,
                        holder["flags"],
                        self.sampling_state.bias,
                        tables.token_mask,
                    )
                    return tokens

                shape_cache[key]["sampling"] = _median_time(sample, repeats)
                self.sampling_state.flags = holder["flags"]
            out.update(shape_cache[key])

            def attention():
                attn_out, self.pool = self._attention(
                    self.pool, act["q"], meta.page_table, meta.seq_lens, meta.query_start
                )
                return attn_out

            def kv_write():
                self.pool = self._kv_write(self.pool, act["k"], act["v"], meta.slot_mapping)
                return self.pool

            out["attention"] = _median_time(attention, repeats)
            out["kv_write"] = _median_time(kv_write, repeats)
        out["seq_len"] = float(np.asarray(meta.seq_lens)[0])
        return out


# Backends whose extend attention costs per bucket token (padding tokens included): the
# reference scores every token of the bucket against each KV block of each sequence.  The
# others walk only the sequences' real tokens.
ATTENTION_PER_BUCKET_TOKEN = ("reference",)


def _split_padding(plan: ChunkPlan, piece: dict[str, float], kernel_backend: str) -> dict[str, float]:
    """One chunk's parts: per-token pieces split between its real tokens and its bucket's
    padding (linear in tokens), the LM head's padding rows measured."""
    real = plan.tokens / plan.bucket
    parts = {}
    padding = 0.0
    per_bucket_token = ["matmuls", "elementwise", "kv_write"]
    if kernel_backend in ATTENTION_PER_BUCKET_TOKEN:
        per_bucket_token.append("attention")
    else:
        parts["attention"] = piece["attention"]
    for name in per_bucket_token:
        parts[name] = piece[name] * real
        padding += piece[name] * (1.0 - real)
    parts["lm_head"] = min(piece["lm_head_one"], piece["lm_head_rows"])
    padding += piece["lm_head_rows"] - parts["lm_head"]
    parts["sampling"] = piece["sampling"]
    parts["inputs"] = piece["inputs"]
    parts["padding"] = padding
    return parts


def _projection_rate(tokens: int, d_in: int, d_out: int, dtype, repeats: int) -> float:
    """FLOP/s of one ``[tokens, d_in] x [d_in, d_out]`` product alone (the MLP's up
    projection of a chunk): the shape the layers multiply, without anything around it."""
    import jax
    import jax.numpy as jnp

    a, b = jnp.ones((tokens, d_in), dtype), jnp.ones((d_in, d_out), dtype)
    product = jax.jit(lambda a, b: a @ b)
    return 2.0 * tokens * d_in * d_out / _median_time(lambda: product(a, b), max(3, repeats))


# ---------------------------------------------------------------------------- one chunk size
def _breakdown(args: argparse.Namespace, chunk: int) -> dict:
    import gc

    import jax.numpy as jnp

    from strata_jax.runtime.compute_prior import matmul_flops_per_s

    engine_numbers, engine = _measure_engine(args, chunk)
    # timed (1024^3) when the first engine of the process starts: this one, run from the CLI
    rate_at_start = engine.matmul_flops_per_s
    engine.shutdown()
    r = engine.runner
    runner = SimpleNamespace(
        graphdef=r.graphdef, state=r.stacked_state(), config=r.config, kernel_backend=r.kernel_backend
    )
    plans = plan_chunks(args.tokens, chunk, r.extend_shapes)
    del engine, r  # the engine's pool and tables go; the weights stay (the pieces use them)
    gc.collect()
    pieces = _Pieces(runner, args.tokens, args.seed)
    config = pieces.config
    shape_cache: dict = {}
    per_chunk: list[dict[str, Any]] = []
    for plan in plans:
        measured = pieces.measure(plan, args.repeats, shape_cache)
        per_chunk.append(
            {"plan": asdict(plan), "pieces": measured, "parts": _split_padding(plan, measured, runner.kernel_backend)}
        )
    parts = {name: sum(c["parts"][name] for c in per_chunk) for name in PARTS}
    median = engine_numbers["median"]
    seconds, shares = split_shares(parts, median["device_s"], median["ttft_s"])
    steps = median["steps"]
    for i, c in enumerate(per_chunk):
        c["engine_device_s"] = steps[i][1] if i < len(steps) and steps[i][0] == c["plan"]["tokens"] else None

    # The matmuls against the machine.
    real_tokens = sum(p.tokens for p in plans)
    flops = projection_flops(config, real_tokens)
    dtype = pieces.dtype
    square = max(64, round((chunk * config.hidden_size * config.intermediate_size) ** (1 / 3) / 64) * 64)
    machine = matmul_flops_per_s(jnp.dtype(dtype), square)
    achieved = flops / parts["matmuls"]
    one_projection = _projection_rate(
        plans[0].bucket, config.hidden_size, config.intermediate_size, dtype, args.repeats
    )
    causal = sum(attention_flops(config, p.start, p.tokens) for p in plans)
    rate_at_end = matmul_flops_per_s(jnp.dtype(dtype), 1024)
    del pieces
    gc.collect()
    return {
        "chunk": chunk,
        "plans": [asdict(p) for p in plans],
        "engine": engine_numbers,
        "kernel_backend": runner.kernel_backend,
        "dtype": str(jnp.dtype(dtype)),
        "ttft_s": median["ttft_s"],
        "device_s": median["device_s"],
        "parts": parts,
        "seconds": seconds,
        "shares": shares,
        "chunks": per_chunk,
        "matmul": {
            "projection_flops": flops,
            "achieved_flops_per_s": achieved,
            "machine_square_n": square,
            "machine_flops_per_s": machine,
            "efficiency": achieved / machine,
            "one_projection_shape": [plans[0].bucket, config.hidden_size, config.intermediate_size],
            "one_projection_flops_per_s": one_projection,
            "seconds_at_machine_rate": flops / machine,
            "lm_head_flops": lm_head_flops(config, len(plans)),
        },
        "attention": {"causal_flops": causal, "causal_flops_per_s": causal / parts["attention"]},
        # The same 1024^3 matmul when the engine started and after the pieces: the parts and
        # the whole are measured minutes apart, so a machine whose speed changed meanwhile
        # (other load, a shared host) shows here rather than as a silent remainder.
        "drift": {
            "flops_per_s_at_start": rate_at_start,
            "flops_per_s_at_end": rate_at_end,
            "ratio": max(rate_at_start, rate_at_end) / min(rate_at_start, rate_at_end),
        },
    }


def _print_breakdown(model: str, tokens: int, r: dict) -> None:
    plans = [ChunkPlan(**p) for p in r["plans"]]
    buckets = ", ".join(f"{p.tokens}->{p.bucket}x{p.rows}" for p in plans)
    runs = ", ".join(f"{x['ttft_s']:.2f}" for x in r["engine"]["runs"])
    print(
        f"\n{model}: cold prefill of {tokens} tokens in chunks of {r['chunk']} ({len(plans)} steps: tokens->bucket "
        "tokens x rows "
        f"{buckets}); {r['dtype']}, attention backend {r['kernel_backend']}"
    )
    print(
        f"engine TTFT median {r['ttft_s']:.3f} s (runs: {runs} s); device (executor step spans) {r['device_s']:.3f} s"
    )
    print("| part | seconds | share of TTFT |")
    print("|---|---:|---:|")
    labels = dict(PART_LABELS) | {"host": "host (TTFT - device time)", "other": "other / overlap (device - parts)"}
    for key in (*PARTS, "host", "other"):
        print(f"| {labels[key]} | {r['seconds'][key]:.3f} | {100 * r['shares'][key]:.1f}% |")
    print(f"| **TTFT** | **{r['ttft_s']:.3f}** | **{100 * sum(r['shares'].values()):.1f}%** |")
    m = r["matmul"]
    print(
        f"matmuls: {m['projection_flops'] / 1e9:.1f} GFLOP in {r['parts']['matmuls']:.3f} s = "
        f"{m['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s; machine ({m['machine_square_n']}^3 {r['dtype']} matmul, jax): "
        f"{m['machine_flops_per_s'] / 1e9:.1f} GFLOP/s ({100 * m['efficiency']:.0f}%); at the machine rate the "
        "projections "
        f"take {m['seconds_at_machine_rate']:.3f} s, {100 * m['seconds_at_machine_rate'] / r['ttft_s']:.0f}% of TTFT; "
        f"one {'x'.join(map(str, m['one_projection_shape']))} projection alone: "
        f"{m['one_projection_flops_per_s'] / 1e9:.1f} GFLOP/s"
    )
    a = r["attention"]
    print(
        f"attention: {a['causal_flops'] / 1e9:.1f} GFLOP of causal work (QK^T and PV of the keys each token sees) in "
        f"{r['parts']['attention']:.3f} s = {a['causal_flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"({100 * a['causal_flops_per_s'] / m['machine_flops_per_s']:.0f}% of the machine's matmul rate)"
    )
    d = r["drift"]
    print(
        f"machine check: 1024^3 matmul {d['flops_per_s_at_start'] / 1e9:.1f} GFLOP/s when the engine started, "
        f"{d['flops_per_s_at_end'] / 1e9:.1f} after the pieces"
        + (
            f"; WARNING: the machine's speed changed {d['ratio']:.2f}x during the run, the split is unreliable "
            "(rerun on an idle machine)"
            if d["ratio"] > DRIFT_WARNING
            else ""
        )
    )
    print(
        "per step: | step | start | tokens | bucket | engine device s | ms/token | pieces s (matmuls / attention / "
        "rest) |"
    )
    for i, c in enumerate(r["chunks"]):
        p, parts = c["plan"], c["parts"]
        dev = c["engine_device_s"]
        rest = sum(parts.values()) - parts["matmuls"] - parts["attention"]
        dev_s = "-" if dev is None else f"{dev:.3f}"
        per_token = "-" if dev is None else f"{1e3 * dev / p['tokens']:.2f}"
        print(
            f"  | {i} | {p['start']} | {p['tokens']} | {p['bucket']}x{p['rows']} | {dev_s} | {per_token} | "
            f"{parts['matmuls']:.3f} / {parts['attention']:.3f} / {rest:.3f} |"
        )


def _print_comparison(tokens: int, results: list[dict]) -> None:
    print(f"\nchunk sizes, one {tokens}-token prompt (ms per prompt token; device = the engine's step spans):")
    print(
        "| chunk | steps | TTFT s | device s | device ms/token | matmuls ms/token | attention ms/token | attention s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        n = tokens
        print(
            f"| {r['chunk']} | {len(r['plans'])} | {r['ttft_s']:.2f} | {r['device_s']:.2f} | "
            f"{1e3 * r['device_s'] / n:.2f} | "
            f"{1e3 * r['parts']['matmuls'] / n:.2f} | {1e3 * r['parts']['attention'] / n:.2f} | "
            f"{r['parts']['attention']:.2f} |"
        )
    base = results[0]
    for r in results[1:]:
        print(
            f"chunk {r['chunk']} vs {base['chunk']}: TTFT {r['ttft_s'] / base['ttft_s']:.2f}x, "
            f"attention {r['parts']['attention'] / base['parts']['attention']:.2f}x, "
            f"matmuls {r['parts']['matmuls'] / base['parts']['matmuls']:.2f}x"
        )


def run(args: argparse.Namespace) -> int:
    import jax

    chunks = [int(c) for c in args.chunks.split(",") if c.strip()] if args.chunks else [args.chunk]
    if args.tokens <= 0 or args.repeats <= 0 or any(c <= args.max_batch_size for c in chunks):
        raise SystemExit("--tokens and --repeats must be positive and every chunk must exceed --max-batch-size")
    results = []
    for chunk in chunks:
        r = _breakdown(args, chunk)
        _print_breakdown(args.model, args.tokens, r)
        results.append(r)
    if len(results) > 1:
        _print_comparison(args.tokens, results)
    if args.json:
        report = {
            "model": args.model,
            "tokens": args.tokens,
            "platform": jax.default_backend(),
            "devices": len(jax.devices()),
            "results": results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
