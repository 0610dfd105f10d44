"""The gated delta-net layers (Qwen3.5 `linear_attention`) of the device step, on flat tensors.

In: a layer's normed hidden states `[N, hidden]`, its `GatedDeltaNet` module, the node's recurrent
state slots (`LinearStates`: per linear layer a conv window `[slots, conv_dim, K-1]` and a state
`[slots, HV, d_k, d_v]`, fp32, on the device) and the step's `LinearStep` (each row's slot, the
rows of the states it reads and writes, and for an eager step the token layout below). Out: the
layer's output `[N, hidden]` (before a tensor-parallel reduce); the rows' states are updated on the
device: in place, or, with two versions of each slot (`LinearStates.step_slots`, a runner that
launches steps ahead), into the copy the step did not read.

The arithmetic is `models/gdn.py`'s (the CPU reference): one matrix product gives [q|k|v], z, b
and a; a causal depthwise conv of width K over [the slot's K-1 stored columns | the row's tokens],
then SiLU; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) in fp32; the gated delta rule
with q and k L2-normalised (q scaled by d_k^-1/2) from and back into the slot's state; a gated
RMSNorm (plain w, times silu(z)); out_proj.

On a CUDA device with Triton (`gdn_kernels.py`): a decode-only step runs the whole layer between
its two matrix products as one kernel (`decode_step`: conv, gates, rule and gated norm, reading
each row's state and writing it back), so a layer is three launches. In an eager step the conv of
its rows is one kernel, its decode rows' rule one kernel (`recurrent_step`), the gates one kernel
and the gated norm one kernel (`eager_gates`, `eager_gated_norm`: the decode kernel's arithmetic and
rounding). Prompt rows run fla-core's `chunk_gated_delta_rule` as one varlen batch (`cu_seqlens`,
B = 1; its host copy one tensor a step, `EagerRows.prompt_cu_cpu`) from their states, its final
states written back, as a CUDA graph captured on the step's first such layer once fla has run
the call's kernel variant (`rule_graphs.py`: fla's Python is most of an eager step's host time). Elsewhere (the CPU) the
same arithmetic in torch ops, decode rows on states
gathered and scattered back. Every path reads the rows `LinearStep.read` and writes the rows
`LinearStep.write` (the same rows with one copy a slot: in place). A decode-only step
(`LinearStep.eager` None: token i is row i) reads no host memory and never synchronises, so the decode
graphs capture it. Padding rows of a captured step carry slot 0, the sink (`kv/slots.py`), so they
never touch a request's state.

An eager step with prompt rows (`linear_layout`, on the host from the packed step) carries, in one
int32 array appended to the step's packed array: the conv's gather indices `[T, K]` into
[every row's stored columns | the step's tokens], the indices of each row's new stored columns
`[R, K-1]`, the decode rows' tokens and row indices, and the prompt rows' tokens, `cu_seqlens` and
row indices.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from mstar.runtime.engine.gpu import gdn_kernels, products
from mstar.runtime.engine.gpu.kernels import RowNorm
from mstar.runtime.engine.gpu.rule_graphs import PromptRuleGraphs, RuleCall, StepRule
from mstar.runtime.engine.models.gdn import GatedDeltaNet, LinearStates

__all__ = ["EagerRows", "GdnForward", "LinearCut", "LinearLayout", "LinearStep", "fla_kernels", "linear_layout"]


def fla_kernels(device: torch.device) -> Optional[Callable]:
    """fla-core's chunked gated delta rule kernel (prompt rows) on a CUDA device, else None."""
    if device.type != "cuda":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


@dataclass
class LinearLayout:
    """An eager step's token layout for the linear layers, on the host (module docstring)."""

    host: np.ndarray  # int32: conv index [T*K] | state index [R*(K-1)] | decode tokens [D] | decode rows [D]
    #                   | prompt tokens [P] | prompt cu_seqlens [Pr+1] | prompt rows [Pr]
    sizes: list[int]
    prompt_cu: list[int]  # the prompt rows' cu_seqlens on the host (the torch fallback loops over them)
    num_covered: int  # tokens that belong to a row (T)

    def on_device(self, data: torch.Tensor, row_slot: torch.Tensor, states: LinearStates) -> "LinearStep":
        """The step from `data`, this layout's array after its copy to the device (flips the rows'
        state versions: `LinearStates.step_slots`)."""
        parts = [p.long() for p in data.split(self.sizes)]
        conv_index, state_index, decode_tokens, decode_rows, prompt_tokens, prompt_cu, prompt_rows = parts
        rows = EagerRows(conv_index.view(self.num_covered, -1), state_index.view(row_slot.shape[0], -1),
                         decode_tokens, decode_rows, prompt_tokens, prompt_cu, prompt_rows, self.prompt_cu)
        return LinearStep.of(row_slot, states, rows)


@dataclass
class EagerRows:
    """An eager step's token layout on the device (`LinearLayout.on_device`)."""

    conv_index: torch.Tensor  # [T, K]
    state_index: torch.Tensor  # [R, K-1]
    decode_tokens: torch.Tensor  # [D]
    decode_rows: torch.Tensor  # [D]: their rows in the step
    prompt_tokens: torch.Tensor  # [P]
    prompt_cu: torch.Tensor  # [Pr + 1]
    prompt_rows: torch.Tensor  # [Pr]: their rows in the step
    prompt_cu_host: list[int]
    rule: StepRule = field(default_factory=StepRule)  # the step's share of the rule graphs (rule_graphs.py)
    conv_out: Optional[torch.Tensor] = None  # the conv's output, one buffer for all the step's layers
    prompt_inputs: tuple[torch.Tensor, ...] = ()  # a mixed step's prompt tokens' q, k, v, g, beta (buffers)

    def gather_prompt_tokens(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A mixed step's prompt tokens of each of `values` (rows `prompt_tokens`), into buffers of the
        step that every layer reuses, so the rule graph reads them in place (rule_graphs.py) rather
        than finding them wherever the allocator put a new gather."""
        tokens = self.prompt_tokens
        held = self.prompt_inputs or (None,) * len(values)
        self.prompt_inputs = tuple(_step_buffer(buffer, (tokens.shape[0], *value.shape[1:]), value)
                                   for buffer, value in zip(held, values))
        return tuple(torch.index_select(value, 0, tokens, out=buffer)
                     for value, buffer in zip(values, self.prompt_inputs))

    def conv_buffer(self, num_tokens: int, channels: int, like: torch.Tensor) -> torch.Tensor:
        """The step's conv output buffer `[T, C]`: every layer's conv writes the same one, so the
        rule graph reads a layer's q, k and v where it read the previous layer's (rule_graphs.py).
        A layer's conv output is used up within the layer (stream order)."""
        self.conv_out = _step_buffer(self.conv_out, (num_tokens, channels), like)
        return self.conv_out

    @functools.cached_property
    def prompt_cu_cpu(self) -> torch.Tensor:
        """`prompt_cu_host` as one host tensor for the whole step: fla's index helpers (the chunk
        indices) cache by their arguments' identity, so a new tensor a layer recomputed them in every
        layer (0.39 ms a call under the profiler on the H200, docs/engine.md)."""
        return torch.tensor(self.prompt_cu_host, dtype=torch.long)


def _step_buffer(buffer: Optional[torch.Tensor], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """`buffer` when it has this shape and `like`'s dtype (a step's buffer, kept across its layers),
    else a new one like `like`."""
    if buffer is not None and tuple(buffer.shape) == shape and buffer.dtype == like.dtype:
        return buffer
    return like.new_empty(shape)


@dataclass
class LinearStep:
    """A step's rows for the linear layers, on the device. `eager` None: a decode-only step (token i
    is row i, one token each; what the decode graphs capture)."""

    read: torch.Tensor  # int64 [R]: the row of the states each row reads (its slot's current copy;
    #                     padding rows: slot 0, the sink)
    write: torch.Tensor  # int64 [R]: the row it writes (`read` with one version)
    eager: Optional[EagerRows] = None
    # The fused decode kernel's arrival counters (`gdn_kernels.decode_step`), `GdnForward`'s own,
    # taken on the first linear layer's call; each layer leaves them zero.
    counts: Optional[torch.Tensor] = None

    @functools.cached_property
    def decode_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(read, write) of an eager step's decode rows: gathered once a step, not once a layer."""
        assert self.eager is not None
        return self.read[self.eager.decode_rows], self.write[self.eager.decode_rows]

    @functools.cached_property
    def prompt_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(read, write) of an eager step's prompt rows: gathered once a step, not once a layer."""
        assert self.eager is not None
        return self.read[self.eager.prompt_rows], self.write[self.eager.prompt_rows]

    @classmethod
    def of(cls, row_slot: torch.Tensor, states: LinearStates, eager: Optional[EagerRows] = None) -> "LinearStep":
        """The step of rows on `row_slot`; flips their state versions (`LinearStates.step_slots`)."""
        slots = row_slot.long()
        if states.version is not None and gdn_kernels.available(slots.device):
            read, write = gdn_kernels.step_slots(slots, states.version)  # one launch, not five torch ops
        else:
            read, write = states.step_slots(slots)
        return cls(read, write, eager)


@dataclass
class LinearCut:
    """A piecewise capture's stand-in for a step's rows (`piecewise.py`): each linear layer hands
    its [q|k|v] channels and gates to `cut(index, mixed, g, beta)`, which ends the captured piece and
    returns the buffer that the layer's rule output will be in when the next piece runs
    (`GdnForward.middle` runs between the two, over the step's real tokens)."""

    cut: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def linear_layout(qo_indptr: np.ndarray, conv_kernel: int) -> Optional[LinearLayout]:
    """The layout of a step whose rows hold `diff(qo_indptr)` tokens; None when
    every row holds one token (the decode-only step needs nothing but the slots)."""
    cu = qo_indptr.astype(np.int64)
    counts = np.diff(cu)
    num_rows, num_tokens = counts.shape[0], int(cu[-1])
    if num_tokens == num_rows and (counts == 1).all():
        return None
    k1 = conv_kernel - 1
    starts = cu[:-1]
    rows = np.repeat(np.arange(num_rows), counts)
    within = np.arange(num_tokens) - starts[rows]
    # Tap i of token j of row r reads column j - (K-1) + i of [row r's stored columns | its tokens]:
    # a token of the step (after the R*(K-1) stored columns) or one of row r's stored columns.
    tap = within[:, None] - k1 + np.arange(conv_kernel)[None, :]
    conv_index = np.where(tap >= 0, num_rows * k1 + starts[rows][:, None] + tap, rows[:, None] * k1 + k1 + tap)
    last = counts[:, None] - k1 + np.arange(k1)[None, :]  # the row's new stored columns: its last K-1
    state_index = np.where(last >= 0, num_rows * k1 + starts[:, None] + last,
                           np.arange(num_rows)[:, None] * k1 + k1 + last)
    is_decode = counts == 1
    is_prompt = ~is_decode
    prompt_tokens = np.concatenate([np.arange(s, s + c) for s, c in zip(starts[is_prompt], counts[is_prompt])]
                                   or [np.zeros(0, dtype=np.int64)])
    prompt_cu = np.concatenate([[0], np.cumsum(counts[is_prompt])])
    row_index = np.arange(num_rows)
    parts = [conv_index.ravel(), state_index.ravel(), starts[is_decode], row_index[is_decode], prompt_tokens,
             prompt_cu, row_index[is_prompt]]
    return LinearLayout(np.concatenate(parts).astype(np.int32), [p.shape[0] for p in parts],
                        prompt_cu.tolist(), num_tokens)


class GdnForward:
    """The linear layers of one decoder (module docstring); holds no per-step state."""

    def __init__(self, layers: list[GatedDeltaNet], states: LinearStates, transposed: bool = False):
        """transposed: the products hold their weights as `[in, out]` (`products.py`)."""
        if len(layers) != len(states.ssm):
            raise ValueError(f"{len(layers)} gated delta-net layers but states for {len(states.ssm)}")
        self.layers, self.states = layers, states
        # [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a] as one product, and out_proj
        self.in_proj = [products.fuse([layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a],
                                      transposed) for layer in layers]
        self.out_proj = [products.fuse([layer.out_proj], transposed) for layer in layers]
        device = states.ssm[0].device if states.ssm else torch.device("cpu")
        self.kernels = fla_kernels(device)
        self.rule_graphs = PromptRuleGraphs()  # used only with fla's kernels (on a CUDA device)
        self.is_fused = gdn_kernels.available(device)  # the Triton kernels (else torch ops)
        self._counts = torch.zeros(0, dtype=torch.int32, device=device)  # `decode_counts`
        self._retired_counts: list[torch.Tensor] = []

    def takes_row_norm(self, step: "LinearStep | LinearCut") -> bool:
        """Whether a step's layers run as the fused decode kernel, which can take the layer's input
        norm folded into the in-projection as a row scale (`__call__`'s `row_norm`)."""
        return isinstance(step, LinearStep) and step.eager is None and self.is_fused

    def __call__(self, index: int, h: torch.Tensor, step: "LinearStep | LinearCut",
                 into: Optional[torch.Tensor] = None, row_norm: Optional[RowNorm] = None) -> torch.Tensor:
        """Linear layer `index` (among the linear layers) over `h` `[N, hidden]` -> `[N, hidden]`
        (added into `into` in place when given: the residual stream, `norm_folding.py`).
        step: the step's rows, or a piecewise capture's cut (`LinearCut`: the layout-bound middle
        runs eagerly between the captured pieces, `middle`). row_norm: h is the residual stream and
        the layer's input norm is folded into in_proj (only where `takes_row_norm(step)`)."""
        layer = self.layers[index]
        value_heads, value_width = layer.num_value_heads, layer.num_value_heads * layer.value_dim
        proj = self.in_proj[index](h)
        mixed, z, b, a = proj.split([layer.conv_dim, value_width, value_heads, value_heads], dim=-1)
        if self.takes_row_norm(step):
            assert isinstance(step, LinearStep)
            # one kernel from the projection to out_proj's input (gdn_kernels.py)
            if step.counts is None:
                step.counts = self.decode_counts(h.shape[0] * layer.num_heads)
            gated = gdn_kernels.decode_step(mixed, z, b, a, self.states.conv[index], layer.conv1d.weight[:, 0, :],
                                            layer.A_log, layer.dt_bias, self.states.ssm[index], step.read,
                                            layer.norm.weight, layer.eps, layer.num_heads, counts=step.counts,
                                            write_slots=step.write, row_norm=row_norm)
            return self._out(index, gated, into)
        assert row_norm is None, "only the fused decode kernel takes a folded norm's scale"
        if self.is_fused:  # one launch (gdn_kernels.eager_gates): this step's host time is its launches
            g, beta = gdn_kernels.eager_gates(a, b, layer.A_log, layer.dt_bias)
        else:
            beta = torch.sigmoid(b.float()).to(h.dtype)  # fla reads beta in the activations' dtype
            g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
        if isinstance(step, LinearCut):
            out = step.cut(index, mixed, g, beta)
        else:
            out = self.middle(index, mixed, g, beta, step)
        if self.is_fused:
            return self._out(index, gdn_kernels.eager_gated_norm(out, z, layer.norm.weight, layer.eps), into)
        out32 = out.float()
        normed = out32 * torch.rsqrt(out32.pow(2).mean(-1, keepdim=True) + layer.eps)
        gated = layer.norm.weight * normed.to(h.dtype) * F.silu(z.view_as(out).float()).to(h.dtype)
        return self._out(index, gated.reshape(h.shape[0], value_width), into)

    def decode_counts(self, num: int) -> torch.Tensor:
        """`num` arrival counters of the fused decode kernel, zero: one buffer for every step, which
        each kernel leaves zero (a (row, head)'s last part sets its counter back). Zeroed once a step
        before, a decode graph held an allocation and a memset node for them, and with a hybrid's
        piecewise graphs captured its replay took 60-75 us longer at every batch size (docs/engine.md,
        "A cost to the decode graphs"). A graph's warm-up runs before its capture, so the buffer grows
        outside every graph; a buffer outgrown stays alive for the graphs that hold it."""
        if self._counts.numel() < num:
            self._retired_counts.append(self._counts)
            self._counts = torch.zeros(num, dtype=torch.int32, device=self._counts.device)
        return self._counts[:num]

    def _out(self, index: int, gated: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
        """out_proj of linear layer `index`, added into `into` when given."""
        product = self.out_proj[index]
        return product(gated) if into is None else product.accumulate(into, gated)

    def middle(self, index: int, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               step: LinearStep, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What a step's token layout decides in linear layer `index`: the causal conv of the rows'
        [q|k|v] channels `mixed` `[N, C]` over their stored windows and the rule from the gates, from
        and back into the rows' slots -> the rule's output `[N, HV, d_v]` (before the gated norm),
        written into `out` when given (a piecewise step's handover)."""
        layer = self.layers[index]
        conv_state, ssm = self.states.conv[index], self.states.ssm[index]
        key_width, weight = layer.num_heads * layer.key_dim, layer.conv1d.weight[:, 0, :]  # [C, K]
        rows = step.eager
        if rows is None:
            conv = self._conv_decode(mixed, weight, conv_state, step.read, step.write)
        else:
            conv = self._conv_varlen(mixed, weight, conv_state, step, rows)
        conv = conv.to(mixed.dtype)
        q = conv[:, :key_width].reshape(-1, layer.num_heads, layer.key_dim)
        k = conv[:, key_width:2 * key_width].reshape(-1, layer.num_heads, layer.key_dim)
        v = conv[:, 2 * key_width:].reshape(-1, layer.num_value_heads, layer.value_dim)
        if rows is not None:
            return self._eager_rule(q, k, v, g, beta, ssm, step, rows, out)
        result = self._recurrent(q, k, v, g, beta, ssm, step.read, step.write)
        return result if out is None else out.copy_(result)

    def _eager_rule(self, q, k, v, g, beta, ssm: torch.Tensor, step: LinearStep, rows: EagerRows,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The rule over an eager step's tokens -> `[N, HV, d_v]` (into `out` when given): decode
        rows one token each (`_recurrent`), prompt rows by the chunk kernel (`_chunk`). Prompt rows
        alone hold every token of the step in order (`linear_layout`), so they need no gather of their
        tokens and no scatter of the outputs: launches are what an eager step waits on (docs/engine.md)."""
        n = q.shape[0]
        if rows.decode_tokens.shape[0] == 0 and rows.prompt_tokens.shape[0] == n:
            result = self._chunk(q, k, v, g, beta, ssm, step, rows)
            return result if out is None else out.copy_(result)
        if out is None:  # a given `out` is not zeroed: the decode and prompt rows write every token's row
            out = v.new_zeros(v.shape)
        if rows.decode_tokens.shape[0]:
            read, write = step.decode_slots
            self._recurrent(q, k, v, g, beta, ssm, read, write, rows.decode_tokens, out)
        if rows.prompt_tokens.shape[0]:
            q_p, k_p, v_p, g_p, beta_p = rows.gather_prompt_tokens(q, k, v, g, beta)
            out.index_copy_(0, rows.prompt_tokens, self._chunk(q_p, k_p, v_p, g_p, beta_p, ssm, step, rows))
        return out

    # -------------------------------------------------------------- the causal conv

    @staticmethod
    def _conv_decode(mixed: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                     read: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
        """One token a row: window = [stored K-1 columns | the token]; the last K-1 are stored back."""
        window = torch.cat([conv_state[read], mixed.to(conv_state.dtype).unsqueeze(-1)], dim=-1)  # [R, C, K]
        conv_state.index_copy_(0, write, window[:, :, 1:])
        return F.silu((window * weight.to(window.dtype)).sum(-1))

    def _conv_varlen(self, mixed: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                     step: LinearStep, rows: EagerRows) -> torch.Tensor:
        """Rows of any length, by the layout's gather indices (module docstring): column j of
        [stored | mixed] is a row's stored column (j < R*(K-1)) or token j - R*(K-1) of the step."""
        channels = mixed.shape[1]
        covered = mixed[:rows.conv_index.shape[0]]
        if self.is_fused:  # two Triton kernels: no [T, K, C] window tensor, no copy of the rows' windows
            conv = gdn_kernels.causal_conv(conv_state, step.read, covered, rows.conv_index, weight,
                                           out=rows.conv_buffer(covered.shape[0], channels, mixed))
            gdn_kernels.conv_store(conv_state, step.read, step.write, covered, rows.state_index)
        else:
            stored = conv_state[step.read].transpose(1, 2).reshape(-1, channels)  # [R*(K-1), C]
            windows = _columns(stored, covered, rows.conv_index)  # [T, K, C]
            conv = F.silu((windows * weight.T.to(windows.dtype)).sum(1))
            if rows.state_index.shape[1]:  # each row's new stored columns: its last K-1 (conv width > 1)
                conv_state.index_copy_(0, step.write, _columns(stored, covered, rows.state_index).transpose(1, 2))
        if conv.shape[0] < mixed.shape[0]:  # tokens of no row (none today): zeros
            conv = torch.cat([conv, conv.new_zeros(mixed.shape[0] - conv.shape[0], channels)])
        return conv

    # -------------------------------------------------------------- the gated delta rule

    def _recurrent(self, q, k, v, g, beta, ssm: torch.Tensor, read: torch.Tensor, write: torch.Tensor,
                   tokens: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One token a row -> `out` (new with no `tokens`): row r's token is `tokens[r]` of the step's
        (None: token r), its output that row of `out`; from the rows `read` into the rows `write` of the
        states (`gdn_kernels.recurrent_step`, which reads the tokens and writes the outputs in place),
        else the tokens and the rows' states gathered, one step, both scattered back."""
        if self.is_fused:
            return gdn_kernels.recurrent_step(q, k, v, g, beta, ssm, read, write_slots=write, tokens=tokens, out=out)
        if tokens is not None:
            q, k, v, g, beta = q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens]
        state = ssm[read]
        qn, kn = _prepare_qk(q, k, v.shape[1])
        rule_out, state = _rule_step(qn, kn, v.float(), g, beta.float(), state)
        ssm.index_copy_(0, write, state)
        if tokens is None:
            return rule_out.to(v.dtype)
        assert out is not None, "rows among the step's tokens write into the step's out"
        return out.index_copy_(0, tokens, rule_out.to(v.dtype))

    def _chunk(self, q, k, v, g, beta, ssm: torch.Tensor, step: LinearStep, rows: EagerRows) -> torch.Tensor:
        """The prompt rows' tokens (varlen by `rows.prompt_cu`) from and back into their slots."""
        read, write = step.prompt_slots
        if self.kernels is not None:
            call = RuleCall(self.kernels, q, k, v, g, beta, ssm, read, rows.prompt_cu, rows.prompt_cu_cpu)
            out, final = self.rule_graphs(call, rows.rule)
            ssm.index_copy_(0, write, final.to(ssm.dtype))
            return out[0]
        qn, kn = _prepare_qk(q, k, v.shape[1])
        v32, beta32 = v.float(), beta.float()
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        cu = rows.prompt_cu_host
        for row in range(len(cu) - 1):
            state = ssm[read[row]].unsqueeze(0)
            for t in range(cu[row], cu[row + 1]):
                o, state = _rule_step(qn[t:t + 1], kn[t:t + 1], v32[t:t + 1], g[t:t + 1], beta32[t:t + 1], state)
                out[t] = o[0]
            ssm[write[row]] = state[0]
        return out.to(v.dtype)


def _columns(stored: torch.Tensor, mixed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Columns `index` (any shape) of [stored | mixed] in `stored`'s dtype, without concatenating
    the step's tokens: `[*index.shape, C]`."""
    num_stored = stored.shape[0]
    if num_stored == 0:  # a conv of width 1 stores nothing
        return mixed[index].to(stored.dtype)
    is_stored = (index < num_stored).unsqueeze(-1)
    from_stored = stored[index.clamp(max=num_stored - 1)]
    from_mixed = mixed[(index - num_stored).clamp(min=0)].to(stored.dtype)
    return torch.where(is_stored, from_stored, from_mixed)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in fp32, L2-normalised (q scaled by d_k^-1/2), repeated to the value heads."""
    def l2norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    qn, kn = l2norm(q.float()), l2norm(k.float())
    group = num_value_heads // q.shape[1]
    if group > 1:  # value head j reads q/k head j // group (fla's and the reference's grouping)
        qn, kn = qn.repeat_interleave(group, dim=1), kn.repeat_interleave(group, dim=1)
    return qn * q.shape[-1] ** -0.5, kn


def _rule_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch: q, k `[B, HV, d_k]`, v `[B, HV, d_v]`, g and
    beta `[B, HV]`, state `[B, HV, d_k, d_v]` (fp32) -> (out `[B, HV, d_v]`, the new state)."""
    state = state * g.exp()[:, :, None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    update = (v - predicted) * beta[:, :, None]
    state = state + k[:, :, :, None] * update[:, :, None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state
