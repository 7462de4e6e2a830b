"""Engine adapters (one per engine) and the engine environment build."""
