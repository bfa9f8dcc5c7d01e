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
