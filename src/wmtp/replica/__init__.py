"""The GPU cost-side replica: real-shape layers, dummy weights, synthetic KV, step timings.

Modules, in import order: ``kernels`` (decode attention and fused ops), ``model`` (layers, the
step), ``timing`` (CUDA graphs and events), ``sweep`` (checks and the measurement), ``tidy`` (CSVs ->
parquet, torch-free), ``cli``. Each step's bytes/bandwidth floor is :mod:`wmtp.analyze.floor`'s.
"""
