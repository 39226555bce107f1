"""Reproducible experiments from the papers, as importable functions.

* `synthetic` -- the synthetic softmax-bottleneck experiment of Ganea et al.
  (2019, section 5.1): free context vectors fitted to Dirichlet-sampled
  next-word distributions with different output heads
  (`run_synthetic_bottleneck`, driven by `examples/synthetic_bottleneck.py`).

Submodules are imported on demand, so importing this package is cheap.
"""
