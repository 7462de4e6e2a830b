"""wmtp: reruns the studies of speculative decoding at long context, end to end."""

__version__ = "0.1.0"
