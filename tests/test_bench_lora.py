"""``strata-jax bench lora`` runs end to end on the tiny model and reports finite ratios."""

from __future__ import annotations

import json
import math

from strata_jax.bench import BENCHMARKS, run_benchmark


def test_bench_lora_reports_its_ratios(tmp_path, capsys):
    assert BENCHMARKS["lora"] == "strata_jax.bench.lora"
    out = tmp_path / "lora.json"
    argv = ["--slots", "2", "--rank", "4", "--batch", "4", "--decode-context", "32", "--prefill-tokens", "96"]
    argv += ["--chunk", "64", "--steps", "2", "--repeats", "1", "--json", str(out)]
    assert run_benchmark("lora", argv) == 0
    result = json.loads(out.read_text())
    for key in ("decode_ratio", "decode_base_rows_ratio", "prefill_ratio"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert set(result["seconds"]) == {
        "decode_plain",
        "decode_mixed",
        "decode_base_rows",
        "prefill_plain",
        "prefill_adapter",
    }
    assert "2 adapters" in capsys.readouterr().out


def test_random_adapter_covers_every_module_of_every_layer():
    from strata_jax.bench.lora import random_adapter
    from strata_jax.lora.peft_adapter import MODULES, module_shape
    from strata_jax.models.loader import tiny_config

    config = tiny_config()
    adapter = random_adapter(config, "x", 4, seed=0)
    assert adapter.modules == MODULES
    for m in MODULES:
        a, b = adapter.weights[m]
        d_in, d_out = module_shape(config, m)
        assert a.shape == (config.num_layers, 4, d_in) and b.shape == (config.num_layers, d_out, 4)
        assert (a != 0).all() and (b != 0).all()


def test_bench_lora_forms_agree_and_report(tmp_path):
    out = tmp_path / "forms.json"
    argv = ["--tokens", "5,12", "--d-in", "16", "--d-out", "24", "--slots", "3", "--rank", "2", "--reps", "1"]
    assert run_benchmark("lora-forms", [*argv, "--json", str(out)]) == 0  # exits non-zero if a form disagrees
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"5", "12"}
    for run in result["runs"].values():
        assert set(run["ratio_over_base"]) == {"dense", "segmented", "gathered"}


def test_lora_forms_match_a_numpy_reference():
    import jax.numpy as jnp
    import numpy as np

    from strata_jax.bench.lora_forms import forms

    rng = np.random.default_rng(1)
    x, w = rng.normal(size=(7, 6)), rng.normal(size=(6, 5))
    a, b = rng.normal(size=(3, 6, 2)), rng.normal(size=(3, 2, 5))
    slot = np.array([2, 0, 1, 1, 2, 0, 2])
    want = x @ w + np.stack([x[t] @ a[slot[t]] @ b[slot[t]] for t in range(7)])
    args = [jnp.asarray(v, jnp.float32) for v in (x, w, a, b)] + [jnp.asarray(slot, jnp.int32)]
    for name, f in forms(3, 2).items():
        if name != "base":
            assert np.allclose(np.asarray(f(*args)), want, atol=1e-4), name
