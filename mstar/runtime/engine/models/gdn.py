"""Gated delta-net linear attention (the Qwen3.5 `linear_attention` layer), CPU torch reference.

Per token t and value head: S <- exp(g_t) S; u = beta_t (v_t - S^T k_t); S <- S + k_t u^T;
o_t = S^T q_t, with q, k L2-normalised (q scaled by d_k^-1/2), beta = sigmoid(b),
g = -exp(A_log) softplus(a + dt_bias). Before that a causal depthwise conv (width K, then SiLU)
runs over the [q|k|v] projection; after it a gated RMSNorm (plain w, times silu(z)) and out_proj.

What crosses steps, per request and layer, lives in a slot of `LinearStates`: the last K-1 pre-conv
columns and the [HV, d_k, d_v] state (fp32). A prompt in chunks, or a prompt then decode steps,
therefore computes the same thing as one pass over the whole sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mstar.runtime.engine.kv.cache import gib
from mstar.runtime.engine.models.layers import Bounds, seg_linear

if TYPE_CHECKING:
    from mstar.plan.dims import DecoderDims

_CPU = torch.device("cpu")  # the default device (a module constant, not a call per signature)


class LinearStatesError(ValueError):
    """The recurrent state slots cannot be allocated (a start-up refusal, as a KV cache's
    KvCacheError): a plan's recurrent_state_slots or conv_kernel past what the machine holds was an
    internal error ("can't allocate memory") instead of a message naming the state."""


@dataclass
class LinearStates:
    """Slot-indexed state of every gated delta-net layer of one node (slot 0 is the padding sink).

    With two versions (`versions=2`, a runner that launches steps ahead: docs/engine.md, "Running
    ahead"), slot s keeps two copies, at rows s and s + num_slots of each tensor, and `version[s]`
    (on the device) says which one is current: a step reads the current copy, writes the other and
    flips the bit (`step_slots`). A step launched ahead that nobody claims is undone by flipping the
    bit back (`revert`): the copy it read was never written. With one version a step updates the
    slot in place."""

    conv: list[torch.Tensor]  # per linear layer: [versions * num_slots, conv_dim, K-1]
    ssm: list[torch.Tensor]  # per linear layer: [versions * num_slots, HV, d_k, d_v], fp32
    version: Optional[torch.Tensor] = None  # int32 [num_slots]: each slot's current copy (two versions)

    @classmethod
    def zeros(cls, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
              num_heads: int, key_dim: int, value_dim: int,
              device: torch.device = _CPU, versions: int = 1) -> "LinearStates":
        if versions not in (1, 2):
            raise ValueError(f"linear states keep one or two versions, not {versions}")
        rows = versions * num_slots
        try:
            return cls(
                conv=[torch.zeros(rows, conv_dim, conv_kernel - 1, device=device) for _ in range(num_layers)],
                ssm=[torch.zeros(rows, num_heads, key_dim, value_dim, device=device) for _ in range(num_layers)],
                version=torch.zeros(num_slots, dtype=torch.int32, device=device) if versions == 2 else None,
            )
        # torch reports an impossible allocation (CPU or GPU) as RuntimeError
        except (RuntimeError, MemoryError) as error:
            num_bytes = rows * num_layers * (conv_dim * (conv_kernel - 1) + num_heads * key_dim * value_dim) * 4
            raise LinearStatesError(
                f"cannot allocate the recurrent state of {num_slots} slots x {num_layers} layers "
                f"(conv kernel {conv_kernel}; {gib(num_bytes)}): {str(error).splitlines()[0]}; lower "
                "recurrent_state_slots (or max_concurrent_requests) in the deployment") from None

    @classmethod
    def for_dims(cls, dims: "DecoderDims", num_slots: int, device: torch.device = _CPU,
                 versions: int = 1) -> "LinearStates":
        """Zeroed slots for every gated delta-net layer of a decoder of `dims`."""
        conv_dim = 2 * dims.num_linear_heads * dims.linear_key_dim + dims.num_linear_value_heads * dims.linear_value_dim
        return cls.zeros(dims.num_linear_layers, num_slots, conv_dim, dims.conv_kernel, dims.num_linear_value_heads,
                         dims.linear_key_dim, dims.linear_value_dim, device=device, versions=versions)

    @property
    def num_slots(self) -> int:
        if self.version is not None:
            return self.version.shape[0]
        return self.ssm[0].shape[0] if self.ssm else 0

    def clear(self, slot: int) -> None:
        """Zero a slot on allocation: a fresh request starts from zero history (its first copy, made
        current)."""
        for conv, ssm in zip(self.conv, self.ssm):
            conv[slot].zero_()
            ssm[slot].zero_()
        if self.version is not None:
            self.version[slot] = 0

    def current(self, slot: int) -> int:
        """The row of `slot`'s current copy in each tensor (reads the device: not for a step's path)."""
        return slot + int(self.version[slot]) * self.num_slots if self.version is not None else slot

    def step_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows to read, rows to write) of a step's rows on `slots` (int64, on the device), and
        each slot's current copy flipped to the one the step writes: with one version both are
        `slots` (in place). Rows sharing a slot (padding rows on the sink) flip it in any order."""
        version = self.version
        if version is None:
            return slots, slots
        current = version[slots].long()
        read = slots + current * self.num_slots
        version[slots] = (1 - current).to(version.dtype)
        return read, slots + (1 - current) * self.num_slots

    def revert(self, slots: list[int]) -> None:
        """Undo one step's flip of these slots (a step launched ahead that nobody claimed)."""
        if self.version is not None and slots:
            index = torch.tensor(slots, dtype=torch.long).to(self.version.device, non_blocking=True)
            self.version[index] = 1 - self.version[index]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class GateNormWeight(nn.Module):
    """Holds the gated RMSNorm's plain multiplier (named `norm.weight` as in checkpoints)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class GatedDeltaNet(nn.Module):
    # The decay parameters' constructor values (what random weights keep; 1-D, never drawn).
    START_VALUES = {"A_log": 0.0, "dt_bias": 1.0}

    def __init__(self, hidden: int, num_heads: int, key_dim: int, value_dim: int, conv_kernel: int,
                 eps: float, num_value_heads: int = 0):
        super().__init__()
        self.num_heads, self.key_dim, self.value_dim = num_heads, key_dim, value_dim
        self.num_value_heads = num_value_heads or num_heads
        self.conv_kernel, self.eps = conv_kernel, eps
        self.conv_dim = 2 * num_heads * key_dim + self.num_value_heads * value_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.num_value_heads * value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.full((self.num_value_heads,), self.START_VALUES["A_log"]))
        self.dt_bias = nn.Parameter(torch.full((self.num_value_heads,), self.START_VALUES["dt_bias"]))
        self.norm = GateNormWeight(value_dim)
        self.out_proj = nn.Linear(self.num_value_heads * value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, bounds: Bounds, slots: list[int], conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        """x `[N, hidden]` packed by `bounds`; `slots[i]` is span i's state slot. Updates the states."""
        mixed = seg_linear(x, self.in_proj_qkv.weight, bounds)
        z = seg_linear(x, self.in_proj_z.weight, bounds)
        beta = torch.sigmoid(seg_linear(x, self.in_proj_b.weight, bounds).float())
        a = seg_linear(x, self.in_proj_a.weight, bounds).float()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        out = torch.empty(x.shape[0], self.num_value_heads, self.value_dim, dtype=x.dtype)
        for (start, end), slot in zip(bounds, slots):
            conv_out = self._conv(mixed[start:end], conv_state, slot)
            out[start:end] = self._recur(conv_out, g[start:end], beta[start:end], ssm_state, slot)
        normed = out.float() * torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + self.eps)
        gated = self.norm.weight * normed.to(x.dtype) * F.silu(z.view_as(out).float()).to(x.dtype)
        return seg_linear(gated.reshape(x.shape[0], -1), self.out_proj.weight, bounds)

    def _conv(self, cols: torch.Tensor, conv_state: torch.Tensor, slot: int) -> torch.Tensor:
        """Causal depthwise conv of `cols` `[T, C]` after the slot's K-1 stored columns, then SiLU."""
        window = torch.cat([conv_state[slot], cols.T], dim=1)  # [C, K-1+T]
        conv_state[slot] = window[:, window.shape[1] - (self.conv_kernel - 1):]
        conv = F.conv1d(window.unsqueeze(0), self.conv1d.weight, groups=self.conv_dim)
        return F.silu(conv[0].T)  # [T, C]

    def _recur(self, cols: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
               slot: int) -> torch.Tensor:
        """The gated delta rule over one span's tokens, from and back into the slot's state."""
        num_tokens = cols.shape[0]
        key_width = self.num_heads * self.key_dim
        q = _l2norm(cols[:, :key_width].reshape(num_tokens, self.num_heads, self.key_dim).float())
        k = _l2norm(cols[:, key_width:2 * key_width].reshape(num_tokens, self.num_heads, self.key_dim).float())
        v = cols[:, 2 * key_width:].reshape(num_tokens, self.num_value_heads, self.value_dim).float()
        group = self.num_value_heads // self.num_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        q = q * self.key_dim ** -0.5
        state = ssm_state[slot].clone()
        outs = []
        for t in range(num_tokens):
            state = state * g[t].exp()[:, None, None]
            predicted = torch.einsum("hk,hkv->hv", k[t], state)
            update = (v[t] - predicted) * beta[t][:, None]
            state = state + k[t][:, :, None] * update[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[t], state))
        ssm_state[slot] = state
        return torch.stack(outs).to(cols.dtype)
