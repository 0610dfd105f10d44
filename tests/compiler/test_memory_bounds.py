"""The memory a node's dims imply (memory_bounds.py), which MW123 and MW323 hold against what the
runtime can allocate: each term as its docstring counts it. The golden fixtures' dims are far past
the limits, so a term counted half (the embedding and output head, fp32 recurrent state, keys and
values of the KV pages) passed them."""
from mstar.compiler import memory_bounds
from mstar.compiler.memory_bounds import MAX_NODE_BYTES


def test_kv_node_weights_count_attention_mlp_embedding_and_head_in_bf16():
    args = dict(layers=3, hidden=8, head_dim=4, qo_heads=2, kv_heads=1, intermediate=16, vocab=10)
    per_layer = 8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16  # q, k, v, o projections; gate, up, down
    assert memory_bounds.weight_bytes("kv", args) == 2 * (3 * per_layer + 2 * 10 * 8)


def test_a_recurrent_slot_is_fp32():
    state = dict(layers=6, heads=4, key_dim=32, value_dim=16)
    assert memory_bounds.recurrent_slot_bytes(state) == 6 * 4 * 32 * 16 * 4
    assert memory_bounds.weight_bytes("kv", {}, state) == memory_bounds.weight_bytes("kv", {}) + 6 * 4 * 32 * 16 * 4


def test_a_kv_page_holds_keys_and_values_of_every_layer_in_bf16():
    args = dict(layers=3, kv_heads=2, head_dim=8)
    assert memory_bounds.kv_pool_bytes(args, page_size=16, num_pages=5) == 5 * 16 * 2 * 3 * 2 * 8 * 2


def test_embedding_and_head_alone_can_put_a_node_past_the_limit():
    """1.5 TiB of embedding and as much of output head: past the 2 TiB a node may use."""
    args = dict(layers=1, hidden=2**20, head_dim=1, qo_heads=1, kv_heads=1, intermediate=1, vocab=3 * 2**18)
    assert memory_bounds.weight_bytes("kv", args) > MAX_NODE_BYTES
