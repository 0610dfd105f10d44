"""The SNAC decoder against the `snac` package (the reference implementation): a tiny random
snac.SNAC in the 24 kHz model's structure (depthwise convs, noise blocks, no local attention,
3 codebooks at strides 4, 2, 1), saved as its published files are (config.json and
pytorch_model.bin, in either of torch's weight-norm layouts, or model.safetensors), loads into
mstar's `SnacDecoder`, whose output equals `SNAC.decode` within 1e-4."""
import json

import pytest
import torch

from mstar.runtime.engine.models.snac import SnacDecoder
from mstar.runtime.engine.snac_checkpoint import WeightsError, load_snac_weights, read_snac_config

snac = pytest.importorskip("snac")

CONFIG = {"sampling_rate": 24000, "encoder_dim": 4, "encoder_rates": [2, 2], "latent_dim": None, "decoder_dim": 32,
          "decoder_rates": [4, 2, 3], "attn_window_size": None, "codebook_size": 64, "codebook_dim": 4,
          "vq_strides": [4, 2, 1], "noise": True, "depthwise": True}


def random_snac(config):
    torch.manual_seed(0)
    model = snac.SNAC(**config).eval()
    with torch.no_grad():  # off the initial values, so a wrong fold or a skipped alpha shows
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if param.dim() > 1 else 0.5) + (1.0 if "alpha" in name else 0))
    return model


def old_weight_norm_names(state):
    """The layout of the published pytorch_model.bin (torch.nn.utils.weight_norm: weight_g / weight_v)."""
    renamed = {}
    for name, tensor in state.items():
        name = name.replace(".parametrizations.weight.original0", ".weight_g")
        renamed[name.replace(".parametrizations.weight.original1", ".weight_v")] = tensor
    return renamed


def save(model, config, path, layout):
    (path / "config.json").write_text(json.dumps(config))
    state = model.state_dict()
    if layout == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    else:
        torch.save(old_weight_norm_names(state) if layout == "weight_g" else state, path / "pytorch_model.bin")
    return path


def random_codes(num_frames, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG["codebook_size"], (1, num_frames * n), generator=generator) for n in (1, 2, 4)]


@pytest.mark.parametrize("layout", ["parametrizations", "weight_g", "safetensors"])
def test_decode_matches_snac(layout, tmp_path):
    reference = random_snac(CONFIG)
    save(reference, CONFIG, tmp_path, layout)
    dims = read_snac_config(str(tmp_path))
    model = SnacDecoder(dims).eval()
    load_snac_weights(model, str(tmp_path))
    codes = random_codes(5)
    torch.manual_seed(7)  # SNAC's noise blocks draw from the global generator
    with torch.no_grad():
        expected = reference.decode(codes)
        got = model(codes, torch.Generator().manual_seed(7))
    assert got.shape == expected.shape == (1, 1, 5 * dims.samples_per_frame)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_plain_convs_without_noise_match_snac(tmp_path):
    config = dict(CONFIG, noise=False, depthwise=False, latent_dim=12, decoder_rates=[2, 2])
    reference = random_snac(config)
    model = SnacDecoder(read_snac_config(str(save(reference, config, tmp_path, "parametrizations")))).eval()
    load_snac_weights(model, str(tmp_path))
    codes = random_codes(3)
    with torch.no_grad():
        torch.testing.assert_close(model(codes), reference.decode(codes), rtol=0, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    ({"attn_window_size": 32}, "local attention .* not supported"),
    ({"vq_strides": [4, 3, 1]}, "every vq stride divide the first"),
    ({"decoder_rates": "x"}, "missing or bad field"),
    # each was a C++ stack trace from a rank, or a message naming no file
    ({"decoder_rates": [1e308, 1e308]}, "sizes, rates and strides of at most 1048576"),
    ({"sampling_rate": float("inf")}, "missing or bad field"),
])
def test_bad_config_is_refused(change, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIG, **change)))
    with pytest.raises(WeightsError, match=message):
        read_snac_config(str(tmp_path))


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000, "not JSON the engine can read"),
    ('{"decoder_dim": ' + "9" * 5000 + "}", "not JSON the engine can read"),
])
def test_unreadable_config_json_is_refused_naming_it(text, message, tmp_path):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(WeightsError, match=f"config.json: {message}"):
        read_snac_config(str(tmp_path))


def test_missing_tensor_is_refused(tmp_path):
    reference = random_snac(CONFIG)
    save(reference, CONFIG, tmp_path, "parametrizations")
    state = torch.load(tmp_path / "pytorch_model.bin")
    del state["quantizer.quantizers.1.codebook.weight"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    model = SnacDecoder(read_snac_config(str(tmp_path)))
    with pytest.raises(WeightsError, match="no tensor quantizer.quantizers.1.codebook.weight"):
        load_snac_weights(model, str(tmp_path))


def test_frame_order_is_depth_first():
    from mstar.runtime.engine.models.snac_codec import frame_order

    assert frame_order((4, 2, 1)) == [0, 1, 2, 2, 1, 2, 2]  # Orpheus's 7 tokens a frame
    assert frame_order((8, 4, 2, 1)) == [0, 1, 2, 3, 3, 2, 3, 3, 1, 2, 3, 3, 2, 3, 3]
