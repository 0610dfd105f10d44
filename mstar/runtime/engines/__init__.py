"""Engines that run a step: `sim` (cost model, no tensors) and `torch_engine` (real models)."""
