"""Tensor parallelism of kv nodes (Llama-style decoders and the Qwen3.5 hybrid) over a process group.

`comm.py` the collectives (`TpComm`), `layout.py` which part of every weight a rank holds and the
rank's local dims, `sharded.py` the rank's `Decoder`, `load.py` its weights (seeded random shards of
the one-process model, or slices of a safetensors checkpoint), `build.py` the entry points:
`tp_comms(plan, rank)` and `build_sharded_decoder(dims, comm, ...)`; `TorchEngine(plan,
tp_comms=...)` builds such nodes as the rank's shard. docs/engine.md, "Tensor parallelism".
"""
