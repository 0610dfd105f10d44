"""The engine's per-request memory: paged KV pages (`pages.py` bookkeeping, `cache.py` tensors),
recurrent slots (`slots.py`) and the one admission policy over a page pool (`admission.py`, shared
with the simulated engine, which imports no torch: this package's modules are imported by name)."""
