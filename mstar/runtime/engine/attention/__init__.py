"""Paged attention backends: the torch reference (CPU) and FlashInfer (GPU)."""
