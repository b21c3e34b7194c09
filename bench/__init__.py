"""braid.bench: benchmarks of braid against its peers (``python -m braid.bench <benchmark>``)."""
