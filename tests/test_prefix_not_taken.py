"""A first chunk planned on a cached prefix that is not there when it runs (an L3 prefetch that
did not land, no room to load): the engine core computes from where the prefix ends as many
tokens as the plan budgeted (not the whole gap, which the plan gave no device pages for), and
the scheduler does not count the part not taken as a hit.

Found by ``bench twin``: with L1 of 1.5 documents and L3 slower than compute, 6 of 16 requests
failed with "out of device KV memory" and the L3 hits were counted though recomputed.  Run on
the simulator (the engine core, scheduler and controller the engine runs), a CPU-like profile.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from strata_jax.bench.twin import trace
from strata_jax.sim.model_spec import load_model_spec
from strata_jax.sim.profile import load_profile
from strata_jax.sim.runner import SimSetup, simulate
from strata_jax.sim.systems import SYSTEMS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_prefix_that_did_not_land_neither_fails_the_request_nor_counts_as_a_hit(seed):
    # This 2-core CPU as calibrate measured it once: slow compute and memory, L3 at ~1 GB/s.
    profile = dataclasses.replace(
        load_profile("h200"),
        name="2-core CPU",
        hbm_bytes_per_s=2.24e9,
        matmul_flops_per_s=9.23e10,
        matmul_efficiency=1.0,
        attention_efficiency=0.667,
        hbm_efficiency=1.0,
        link_peak_bytes_per_s=1.46e9,
        coalesced_efficiency=1.0,
        storage_read_bytes_per_s=1.05e9,
        storage_write_bytes_per_s=0.89e9,
    )
    args = argparse.Namespace(
        num_requests=16, docs=4, doc_tokens=1024, output_tokens=16, distance="max", seed=seed, data_dir=None
    )
    requests = trace(args, 1.0)
    page = 16
    setup = SimSetup(
        model=load_model_spec("llama-3.1-8b"),
        profile=profile,
        page_size=page,
        device_tokens=1536,  # 1.5 documents: two requests' prefixes do not fit at once
        host_tokens=2560,
        max_batch_tokens=512,
    )
    system = dataclasses.replace(SYSTEMS["strata"], tiers="L1+L2+L3", layerwise=False)
    result = simulate(requests, system, setup, 1.0)
    assert result.finished == args.num_requests
    # The scheduler's hit counters (what /metrics and the simulator report) equal what the
    # requests' outputs say they took from each tier (the prefix the engine really used).
    hits, reported = result.extra["hit_tokens"], result.extra["reported_cached_tokens"]
    assert {t: hits.get(t, 0) for t in reported} == reported, (hits, reported)


def test_a_prefix_cached_beyond_the_plan_is_not_loaded():
    """The reverse case: the plan computes from 0 (the request's L3 prefetch had not landed and
    waiting did not pay), the prefetch lands before the chunk runs, so L2 now holds the prompt's
    first pages.  The chunk must neither match nor load them: the plan gave no device pages for
    that load, and taking them starved the step's other rows ("out of device KV memory", an HTTP
    429 in the soak).  The engine's own code (``RequestPages``) on a bookkeeping controller."""
    from strata_jax.api import SamplingParams
    from strata_jax.cache.config import CacheConfig
    from strata_jax.cache.controller import CacheController
    from strata_jax.engine.requests import RequestPages, TrackedRequest
    from strata_jax.engine.sinks import CollectingSink
    from strata_jax.scheduler.plan import PrefillItem
    from strata_jax.scheduler.request import ScheduledRequest

    page = 4
    ctl = CacheController.simulated(CacheConfig(page_size=page, device_pages=16, tiers="L1+L2"))
    prompt = tuple(range(100, 137))  # 9 full pages and one token
    cached = prompt[: 8 * page]
    ctl.insert(cached, "", ctl.alloc_device(8))  # write-through: L2 holds a copy
    assert ctl.evict_device(8) == 8  # now host-only: a load would need 8 device pages
    assert ctl.match_prefix(prompt).host_tokens == 8 * page

    def first_chunk(start: int, end: int) -> tuple[TrackedRequest, PrefillItem]:
        sched = ScheduledRequest(request_id=f"r{start}", prompt_token_ids=prompt, namespace="", arrival=start)
        t = TrackedRequest(f"r{start}", list(prompt), "", SamplingParams(max_tokens=1), CollectingSink(), None, 0.0)
        t.req = sched
        return t, PrefillItem(sched, start, end, load_host_tokens=start, match=ctl.match_prefix(prompt, touch=False))

    pages = RequestPages(ctl)
    free = ctl.free_device_tokens() // page
    # planned from 0: nothing may be loaded (before the fix: 8 pages taken, the load handle returned)
    t, item = first_chunk(0, 8)
    pages.pin_prefix(t, item)
    handle, taken = pages.take_prefix(t, item)
    assert handle is None and taken == 0 and t.page_table == []
    assert ctl.free_device_tokens() // page == free
    pages.release(t, keep=False)
    # planned to load 4 of the 8 cached pages: exactly those are loaded, the rest stay in L2
    t, item = first_chunk(4 * page, 4 * page + 8)
    pages.pin_prefix(t, item)
    handle, taken = pages.take_prefix(t, item)
    assert handle is not None and taken == 4 * page and len(t.page_table) == 4
    assert ctl.free_device_tokens() // page == free - 4
    after = ctl.match_prefix(prompt, touch=False)  # the other 4 stay in L2 only
    assert (after.device_tokens, after.host_tokens) == (4 * page, 4 * page)


def test_mixed_steps_run_through_the_simulator_with_the_same_hits():
    """The simulator executes a mixed plan as the engine does (one extend program carrying the
    decode rows as one-token items): every request finishes, rounds are mixed, and what the
    cache served does not change."""
    args = argparse.Namespace(
        num_requests=16, docs=4, doc_tokens=1024, output_tokens=16, distance="max", seed=0, data_dir=None
    )
    setup = SimSetup(
        model=load_model_spec("llama-3.1-8b"),
        profile=load_profile("h200"),
        page_size=16,
        device_tokens=8192,
        host_tokens=16384,
        max_batch_tokens=512,
    )
    system = dataclasses.replace(SYSTEMS["strata"], tiers="L1+L2", layerwise=False)
    runs = {
        mixed: simulate(trace(args, 2.0), system, setup, 2.0, scheduler_overrides={"enable_mixed_steps": mixed})
        for mixed in (False, True)
    }
    assert all(r.finished == args.num_requests for r in runs.values())
    assert runs[False].extra["mixed_rounds"] == 0 < runs[True].extra["mixed_rounds"]
    assert runs[True].extra["hit_tokens"] == runs[False].extra["hit_tokens"]
