"""The GPU cost-side replica: real-shape layers, dummy weights, synthetic KV, step timings."""
