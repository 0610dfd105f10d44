"""A decoder's forward on the CPU, fp32, with the fused kernels forced on or off (on: the GPU's
Triton kernels, run under the interpreter), and one step of two rows through it: what the
interpreter tests of the fused forward compare (against the torch ops, folded norms, the skinny
products, the launch probe)."""
import torch

from mstar.runtime.engine.gpu.device_model import build_decoder
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv, torch_attend
from mstar.runtime.engine.gpu.packing import RowSpec, pack
from mstar.runtime.engine.models.gdn import LinearStates


def fused_forward(dims, is_hybrid: bool, is_fused: bool) -> tuple[DecoderForward, PagedKv, LinearStates | None]:
    """(the forward of a seeded random model of `dims`, its KV pages, its recurrent states on 4
    slots for a hybrid, else None); `is_fused` forces the fused kernels (the eager step's gated
    delta-net kernels too) on or off."""
    model = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, 16, 16, dims.num_kv_heads, dims.head_dim, torch.float32, torch.device("cpu"))
    states = LinearStates.for_dims(dims, 4) if is_hybrid else None
    forward = DecoderForward(model, dims, kv, 256, states)
    forward.is_fused = is_fused
    if forward.gdn is not None:
        forward.gdn.is_fused = is_fused
    return forward, kv, states


def two_row_step(forward: DecoderForward, kv: PagedKv, states: LinearStates | None, is_decode: bool):
    """One step of two rows -> (logits, the KV cache, the recurrent states), its inputs set afresh
    each call: prompts of 3 and 2 tokens on empty pages, or (is_decode) one token a row over seeded
    random context, the second row's read from the device token table (the fused embedding's `fed`)."""
    if is_decode:
        rows = [RowSpec([3], 5, [0], 1), RowSpec(None, 2, [1], 2)]
        kv.data.normal_(generator=torch.Generator().manual_seed(3))
        for tensor in (states.conv + states.ssm) if states is not None else []:
            tensor.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    else:
        kv.data.zero_()
        rows = [RowSpec([3, 5, 7], 0, [0], 1), RowSpec([9, 2], 0, [1], 2)]
    packed = pack(rows, 16, kv.dummy_page)
    ids, positions, slots, src, last_index, row_slot = torch.from_numpy(packed.host).split(packed.field_sizes())
    layout = forward.linear_layout(packed)
    linear = (forward.decode_step(row_slot) if layout is None
              else forward.eager_linear_step(layout, torch.from_numpy(layout.host), row_slot))
    attend = torch_attend(packed.qo_indptr.tolist(), packed.kv_indptr.tolist(), packed.kv_indices,
                          packed.last_page_len.tolist(), 16, forward.dims.head_dim ** -0.5)
    loop_tokens = torch.tensor([0, 4, 9], dtype=torch.long)  # the device token table: row slot 2 fed 9
    logits = forward(ids, positions, slots, last_index, attend, linear, fed=(src, loop_tokens))
    return logits, kv.data.clone(), [t.clone() for t in states.conv + states.ssm] if states is not None else []
