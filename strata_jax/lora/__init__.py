"""LoRA adapters over the base model (pure Python + numpy; no jax).

* ``peft_adapter.py``  a PEFT adapter folder read into per-module, per-layer A/B arrays, its
                       scaling and its content identity (the digest that namespaces its KV)
* ``registry.py``      the adapters a server holds: names, device slots, requests using each

The device side (the slots' weights and the low-rank product inside the step) is
``strata_jax/runtime/lora_bank.py``.
"""
