"""The engine stage: a `Step` in, per-row results out.

In: a step (key, mixture mask, capture bucket, attention route, rows with their inputs). Out: a
`StepResult` (per-row outputs, rows that could not get memory, elapsed time). Holds the tensors:
the paged KV pool and recurrent slots, the torch models, attention backends, sampling, weights;
and a simulated engine with a cost model for what-if runs.
"""
