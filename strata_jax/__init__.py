"""strata-jax: a JAX/XLA serving engine with hierarchical (HBM / DRAM / storage) KV caching."""

__version__ = "0.1.0"
