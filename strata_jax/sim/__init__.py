"""Simulation at scale with the real scheduler, tree, controller and engine step (docs/study.md).

Files (one job each): ``profile.py`` (hardware profiles; ``profiles/*.json``),
``model_spec.py`` (model shapes, TP), ``cost.py`` (step and transfer times),
``executor.py`` (``SimExecutor`` on a virtual clock, links, ``SimTimer``),
``systems.py`` (hicache / strata / ablations by name), ``workloads.py`` (LooGLE-like,
multi-turn, Mooncake, ShareGPT-like), ``runner.py`` (one run), ``report.py``
(tables, plot), ``cli.py`` (``strata-jax simulate``), ``calibrate.py`` (``--calibrate``).
Nothing here imports jax except ``calibrate.py``.
"""
