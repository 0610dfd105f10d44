"""Which attention heads the Triton decode kernel (`decode_attention.py`) serves: a rule of the heads
alone, importing neither torch nor Triton, so the sim's cost model (`sim_cost.py`) reads the same
rule the GPU engine picks its decode graphs' kernel by."""
from __future__ import annotations

MAX_GROUP = 16  # query heads a KV head: tl.dot's smallest M, to which the kernel pads a group


def serves_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """A group of at most MAX_GROUP query heads a KV head and a power-of-two head dim of 16 to 256
    (a block of the kernel's products)."""
    return (num_kv_heads > 0 and num_qo_heads % num_kv_heads == 0 and num_qo_heads // num_kv_heads <= MAX_GROUP
            and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0)
