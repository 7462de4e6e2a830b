"""Cells: prompts, one server per cell, its counters, power and energy, raw files."""
