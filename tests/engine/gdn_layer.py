"""A small random gated delta-net layer and its recurrent states, for the kernels' interpreter tests."""
import torch

from mstar.runtime.engine.models.gdn import GatedDeltaNet, LinearStates


def small_gdn_layer(dtype: torch.dtype, num_value_heads: int = 4, value_dim: int = 32, key_dim: int = 16):
    """A small random gated delta-net layer (2 q/k heads, grouped value heads) and its states on 6
    slots, in `dtype` with the decay parameters in fp32 (as `device_model` builds them)."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden=48, num_heads=2, key_dim=key_dim, value_dim=value_dim, conv_kernel=4, eps=1e-6,
                          num_value_heads=num_value_heads)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.5 if param.dim() < 2 else param[0].numel() ** -0.5)
    layer.to(dtype)
    layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float() * 3
    states = LinearStates.zeros(1, 6, layer.conv_dim, layer.conv_kernel, layer.num_value_heads, layer.key_dim,
                                layer.value_dim)
    states.conv[0].normal_(0, 0.5)
    states.ssm[0].normal_(0, 0.1)
    return layer, states
