"""``CostModel``: pure-Python estimates of load, extend and decode time.

* Loads: the bytes a load moves over a link bandwidth (host->device; storage->host
  for L3), each an exponential moving average of measured loads, starting from
  a documented prior.  A load of ``n`` tokens moves ``bytes_per_token`` per token,
  except on a model with sliding-window layers whose loads are window-only
  (``local_share`` of a token's bytes in those layers, ``local_window_tokens`` the
  window): their share moves for the last ``local_window_tokens`` loaded tokens only
  (``load_bytes``).  L3 objects hold every layer, so storage reads move full tokens.
* Extend (prefill) time of a batch: ``a + b*N + c*A`` with ``N`` the new tokens
  and ``A = sum(n_i * (context_i + n_i/2))`` the attended (query x key) pairs,
  so attention over a long cached context makes each new token dearer.
* Decode step time: ``d0 + d1*B + d2*C`` with ``B`` requests and ``C`` total
  context tokens read.

Both time models are fitted online by least squares over the most recent
``window`` measurements, regularised toward the prior (the prior acts as
``prior_weight`` pseudo-measurements), with coefficients kept non-negative.
Before any measurement the prior is used as is.

Every learned value stays finite and bounded, whatever is measured: a rate is
believed only between ``1/RATE_BOUND_FACTOR`` and ``RATE_BOUND_FACTOR`` times its
prior (a window of failed L3 reads measures 0 B/s, a clock glitch infinity, and the
scheduler divides by these rates every round); a step time that is negative, NaN or
above ``MAX_STEP_SECONDS`` is not a measurement; a fit that comes out non-finite is
dropped (the previous coefficients stay).  ``tests/test_cost_model_bounds.py`` drives
the model with arbitrary observation sequences and checks every estimate.

Priors are those of an 8B Llama-class model on an H200-class GPU with a PCIe 5
host link; the engine should pass ``bytes_per_token`` of its model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ExtendItem = tuple[int, int]  # (new tokens computed, context tokens already cached before them)

RATE_BOUND_FACTOR = 1e4  # a measured rate is clamped to [prior / F, prior * F]
MAX_STEP_SECONDS = 3600.0  # no real step takes an hour: a longer "measurement" is a clock fault


def bounded_rate(measured: float, prior: float) -> float | None:
    """``measured`` clamped to the band around ``prior``; ``None`` when it is no measurement at all.

    Zero, negative, NaN and infinite values carry no information about the link
    (they come from empty or failed transfers), so the caller keeps its estimate.
    """
    if not (math.isfinite(measured) and measured > 0):
        return None
    return min(max(measured, prior / RATE_BOUND_FACTOR), prior * RATE_BOUND_FACTOR)


@dataclass(frozen=True)
class CostPrior:
    """Starting point of the cost model (all seconds / bytes per second)."""

    bytes_per_token: float = 131072  # 32 layers x K,V x 8 kv heads x 128 dims x bf16
    link_bytes_per_s: float = 25e9  # host -> device, effective
    storage_bytes_per_s: float = 4e9  # storage -> host, effective
    extend_coeffs: tuple[float, float, float] = (4e-3, 3e-5, 1e-9)  # a, b, c
    decode_coeffs: tuple[float, float, float] = (8e-3, 5e-5, 3e-8)  # d0, d1, d2
    window: int = 64
    prior_weight: float = 0.01
    bandwidth_ema: float = 0.3
    transfer_overhead_s: float = 50e-6  # fixed cost of one load (issue, first byte, scatter launch)
    # window-only loads (layer groups): the windowed layers' share of a token's bytes and their window
    local_share: float = 0.0
    local_window_tokens: int = 0

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0 or self.link_bytes_per_s <= 0 or self.storage_bytes_per_s <= 0:
            raise ValueError("bytes_per_token and bandwidths must be positive")
        if any(c < 0 for c in self.extend_coeffs + self.decode_coeffs):
            raise ValueError("time model coefficients must be non-negative")
        if not self.transfer_overhead_s >= 0:
            raise ValueError("transfer_overhead_s must be non-negative")
        if self.window < 1 or self.prior_weight <= 0 or not 0 < self.bandwidth_ema <= 1:
            raise ValueError("window >= 1, prior_weight > 0 and 0 < bandwidth_ema <= 1 are required")
        if (
            not 0 <= self.local_share <= 1
            or self.local_window_tokens < 0
            or (self.local_share > 0) != (self.local_window_tokens > 0)
        ):
            raise ValueError("local_share in [0, 1] and local_window_tokens >= 0 are required, both set or neither")


class _OnlineLinearModel:
    """y ~ theta . x (3 features, theta >= 0), ridge toward a prior, sliding window."""

    def __init__(self, prior: tuple[float, float, float], window: int, prior_weight: float) -> None:
        self._prior = prior
        self._theta = prior
        self._weight = prior_weight
        self._samples: deque[tuple[tuple[float, float, float], float]] = deque(maxlen=window)
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._observed = 0
        self._maxima: list[deque[tuple[int, float]]] = [deque() for _ in range(4)]  # window max of |x_j| and y

    @property
    def coeffs(self) -> tuple[float, float, float]:
        return self._theta

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def predict(self, x: tuple[float, float, float]) -> float:
        fitted = sum(t * xi for t, xi in zip(self._theta, x))
        if self._samples and any(x[j] > self._maxima[j][0][1] for j in (1, 2)):
            # Beyond what the window saw the fit is an extrapolation, and a window of small
            # steps (a cache-warm server's prefills are a page or two) can fit a per-token
            # cost near zero: it said 2,500 tokens recompute in 0.11 s (measured 3.5 s), so an
            # L3 prefetch was given up.  There, never below the prior.
            return max(fitted, sum(p * xi for p, xi in zip(self._prior, x)))
        return fitted

    def observe(self, x: tuple[float, float, float], y: float) -> None:
        if not (0.0 <= y <= MAX_STEP_SECONDS and all(math.isfinite(v) and v >= 0 for v in x)):
            return  # a bogus timing never poisons the model
        if len(self._samples) == self._samples.maxlen:
            self._accumulate(*self._samples[0], sign=-1.0)
        self._samples.append((x, y))
        self._accumulate(x, y, sign=1.0)
        self._observed += 1
        self._track_maxima((abs(x[0]), abs(x[1]), abs(x[2]), y))
        if self._observed % (4 * (self._samples.maxlen or 1)) == 0:  # bound the drift of the running sums
            self._xx = [[0.0] * 3 for _ in range(3)]
            self._xy = [0.0] * 3
            for xs, ys in self._samples:
                self._accumulate(xs, ys, sign=1.0)
        theta = self._fit()
        if all(math.isfinite(t) for t in theta):  # an ill-conditioned window never yields an inf/NaN estimate
            self._theta = theta

    def _track_maxima(self, values: tuple[float, float, float, float]) -> None:
        """Sliding-window maxima (monotonic queues), so scaling a fit is O(1) too."""
        oldest = self._observed - (self._samples.maxlen or 1)
        for q, v in zip(self._maxima, values):
            while q and q[-1][1] <= v:
                q.pop()
            q.append((self._observed, v))
            while q[0][0] <= oldest:
                q.popleft()

    def _accumulate(self, x: tuple[float, float, float], y: float, sign: float) -> None:
        """Running sums of x x^T and x y over the window (a fit costs O(1), not O(window))."""
        for i in range(3):
            self._xy[i] += sign * x[i] * y
            row = self._xx[i]
            for j in range(3):
                row[j] += sign * x[i] * x[j]

    def _fit(self) -> tuple[float, float, float]:
        # Scale each feature so the prior regulariser is comparable across features.
        scale = [max(1e-12, self._maxima[j][0][1]) for j in range(3)]
        y_scale = max(1e-12, self._maxima[3][0][1])
        prior = [self._prior[j] * scale[j] / y_scale for j in range(3)]
        # Pseudo-observations of the prior: weight * (theta_j - prior_j)^2 per feature.
        ata = [[self._xx[i][j] / (scale[i] * scale[j]) for j in range(3)] for i in range(3)]
        aty = [self._xy[i] / (scale[i] * y_scale) for i in range(3)]
        for j in range(3):
            ata[j][j] += self._weight
            aty[j] += self._weight * prior[j]
        # Non-negative: re-solve with negative coefficients pinned to zero.
        active = [True, True, True]
        for _ in range(3):
            sol = _solve_subset(ata, aty, active)
            negative = [j for j in range(3) if active[j] and sol[j] < 0]
            if not negative:
                break
            for j in negative:
                active[j] = False
        else:
            sol = _solve_subset(ata, aty, active)
        a, b, c = (max(0.0, sol[j]) * y_scale / scale[j] for j in range(3))
        return a, b, c


def _solve_subset(a: list[list[float]], b: list[float], active: list[bool]) -> list[float]:
    """Solve the normal equations restricted to the active features (others 0)."""
    idx = [j for j in range(3) if active[j]]
    n = len(idx)
    m = [[a[i][j] for j in idx] + [b[i]] for i in idx]
    for col in range(n):  # Gaussian elimination with partial pivoting (positive definite)
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    out = [0.0, 0.0, 0.0]
    for row, j in enumerate(idx):
        out[j] = m[row][n] / m[row][row] if abs(m[row][row]) >= 1e-300 else 0.0
    return out


def _extend_features(items: Iterable[ExtendItem]) -> tuple[float, float, float]:
    new = 0.0
    attended = 0.0
    for n, ctx in items:
        new += n
        attended += n * (ctx + n / 2.0)
    return (1.0 if new > 0 else 0.0, new, attended)


class CostModel:
    """Online estimates of what a step costs; see the module doc for the models."""

    def __init__(self, prior: CostPrior | None = None) -> None:
        self.prior = prior or CostPrior()
        self.bytes_per_token = self.prior.bytes_per_token
        self._link_bytes_per_s = float(self.prior.link_bytes_per_s)
        self._storage_bytes_per_s = float(self.prior.storage_bytes_per_s)
        self.transfer_overhead_s = self.prior.transfer_overhead_s
        self._extend = _OnlineLinearModel(self.prior.extend_coeffs, self.prior.window, self.prior.prior_weight)
        self._decode = _OnlineLinearModel(self.prior.decode_coeffs, self.prior.window, self.prior.prior_weight)

    # -- learned rates (read-only: measurements go through observe_* / set_storage_rate)
    @property
    def link_bytes_per_s(self) -> float:
        """Host -> device bytes per second: the prior, then a bounded moving average of loads."""
        return self._link_bytes_per_s

    @property
    def storage_bytes_per_s(self) -> float:
        """Storage -> host bytes per second: the prior, then the bounded measured read rate."""
        return self._storage_bytes_per_s

    def set_storage_rate(self, bytes_per_s: float) -> None:
        """Adopt the controller's own average of recent L3 reads (bounded; a non-rate is ignored)."""
        rate = bounded_rate(bytes_per_s, self.prior.storage_bytes_per_s)
        if rate is not None:
            self._storage_bytes_per_s = rate

    # -- estimates ---------------------------------------------------------
    def load_bytes(self, tokens: int) -> float:
        """Bytes an L2->L1 load of ``tokens`` (the end of a prefix) moves (module doc)."""
        p = self.prior
        if not p.local_window_tokens:
            return tokens * self.bytes_per_token
        return self.bytes_per_token * (
            tokens * (1 - p.local_share) + min(tokens, p.local_window_tokens) * p.local_share
        )

    def load_seconds(self, host_tokens: int, storage_tokens: int = 0) -> float:
        """Time to bring ``host_tokens`` L2->L1 plus ``storage_tokens`` L3->L2->L1."""
        link = self.load_bytes(host_tokens + storage_tokens) / self.link_bytes_per_s
        return link + storage_tokens * self.bytes_per_token / self.storage_bytes_per_s

    def storage_seconds(self, tokens: int) -> float:
        """Time to read ``tokens`` of KV from L3 into L2 (the L3 read alone)."""
        return tokens * self.bytes_per_token / self.storage_bytes_per_s

    def extend_seconds(self, new_tokens: int, context_tokens: int = 0) -> float:
        """One request computing ``new_tokens`` on top of ``context_tokens`` cached ones."""
        return self.batch_extend_seconds(((new_tokens, context_tokens),))

    def batch_extend_seconds(self, items: Iterable[ExtendItem]) -> float:
        return self._extend.predict(_extend_features(items))

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests reading ``context_tokens`` KV tokens in all."""
        if batch <= 0:
            return 0.0
        return self._decode.predict((1.0, float(batch), float(context_tokens)))

    def would_be_loading_bound(
        self,
        load_host_tokens: int,
        load_storage_tokens: int,
        extend_items: Sequence[ExtendItem],
        ratio: float | None = None,
    ) -> bool:
        """Is a batch loading ``load_*`` tokens and computing ``extend_items`` bound by its load?

        ``ratio`` None: estimated load time > estimated compute time.  A float:
        ``loaded tokens / computed tokens > ratio`` (Strata's profiled constant).
        """
        load = load_host_tokens + load_storage_tokens
        if load <= 0:
            return False
        if ratio is not None:
            computed = sum(n for n, _ in extend_items)
            return computed <= 0 or load / computed > ratio
        return self.load_seconds(load_host_tokens, load_storage_tokens) > self.batch_extend_seconds(extend_items)

    def derived_loading_bound_ratio(self, context_tokens: int = 0) -> float:
        """The token ratio at which load time equals compute time (for reports).

        Per computed token on top of ``context_tokens``: compute seconds / load seconds per token.
        """
        a, b, c = self._extend.coeffs
        per_token_compute = b + c * context_tokens
        per_token_load = self.bytes_per_token / self.link_bytes_per_s
        return per_token_compute / per_token_load

    # -- measurements ------------------------------------------------------
    def observe_load(self, tokens: int, seconds: float, tier: str = "host") -> None:
        """Record a measured load of ``tokens`` from ``tier`` ("host": L2->L1, "storage": L3->L2)."""
        if tier not in ("host", "storage"):
            raise ValueError(f"tier must be 'host' or 'storage', got {tier!r}")
        if tokens <= 0 or not 0 < seconds <= MAX_STEP_SECONDS:
            return
        alpha = self.prior.bandwidth_ema
        if tier == "host":
            sample = bounded_rate(self.load_bytes(tokens) / seconds, self.prior.link_bytes_per_s)
            if sample is not None:
                self._link_bytes_per_s = (1 - alpha) * self._link_bytes_per_s + alpha * sample
        else:
            sample = bounded_rate(tokens * self.bytes_per_token / seconds, self.prior.storage_bytes_per_s)
            if sample is not None:
                self._storage_bytes_per_s = (1 - alpha) * self._storage_bytes_per_s + alpha * sample

    def observe_extend(self, items: Sequence[ExtendItem], seconds: float) -> None:
        """Record a measured extend step over ``items`` (new tokens, context) per request."""
        x = _extend_features(items)
        if x[1] > 0:
            self._extend.observe(x, seconds)

    def observe_decode(self, batch: int, context_tokens: int, seconds: float) -> None:
        if batch > 0:
            self._decode.observe((1.0, float(batch), float(context_tokens)), seconds)

    @property
    def extend_coeffs(self) -> tuple[float, float, float]:
        return self._extend.coeffs

    @property
    def decode_coeffs(self) -> tuple[float, float, float]:
        return self._decode.coeffs
