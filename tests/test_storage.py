def test_l3_objects_are_keyed_by_the_model_dtype_and_layout(tmp_path):
    """Another model of the same shape (other weights), or the same one with another KV
    dtype, over the same L3 directory: a miss, the tokens of a cold run; the same model
    again: a hit with the same tokens."""
    import numpy as np

    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig

    prompt = np.random.default_rng(5).integers(3, 250, size=200).tolist()
    params = SamplingParams(max_tokens=6)

    def run(**overrides):
        engine = Engine(
            EngineConfig(
                model="tiny",
                warmup=False,
                show_progress=False,
                tiers="L1+L2+L3",
                storage_dir=str(tmp_path / "l3"),
                device_tokens=2048,
                max_context_tokens=512,
                prefetch_min_tokens=0,
                prefetch_policy="wait_complete",
                **overrides,
            )
        )
        try:
            out = engine.generate([prompt], params)[0]
            return out, engine.ctl.tree.kv_identity
        finally:
            engine.shutdown()

    first, identity = run()
    again, same = run()
    assert identity == same and again.cached_tokens["storage"] == 192 and again.token_ids == first.token_ids
    other_dtype, other = run(kv_dtype="bfloat16")
    assert other != identity and other_dtype.cached_tokens["storage"] == 0


def test_kv_identity_tells_apart_weights_of_the_same_shape():
    import jax.numpy as jnp

    from pallas_kernels.layout import KVLayout
    from strata_jax.models.fingerprint import kv_identity
    from strata_jax.models.loader import load_model
    from strata_jax.models.weights import random_model

    tiny = load_model("tiny", show_progress=False)
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, jnp.float32)
    a = kv_identity(random_model(cfg, seed=0), cfg, "float32", layout)
    assert a == kv_identity(random_model(cfg, seed=0), cfg, "float32", layout)  # deterministic
    assert a != kv_identity(random_model(cfg, seed=1), cfg, "float32", layout)  # a fine-tune of the same shape
    assert a != kv_identity(
        random_model(cfg, seed=0),
        cfg,
        "float32",
        KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, jnp.bfloat16),
    )
