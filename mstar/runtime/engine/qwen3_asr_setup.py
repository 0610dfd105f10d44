"""Builds Qwen3-ASR's audio encoder runner: dims, weights (random or a checkpoint), the runner.

In: a plan node (a stateless `audio_encoder` with `style=qwen3_asr`), the dims mode, an optional
checkpoint directory (transformers' `Qwen3ASRForConditionalGeneration` as save_pretrained writes
it), the seed, the node's position and the width of the decoder its states feed. Out: a
`Qwen3AsrEncoderRunner` (runners/qwen3_asr.py), or a DimsError / WeightsError saying why not.

Dims: `spec` reads the node's arguments (hidden, layers, heads, feature_dim = mel bins; MLP 4 x
hidden, 480 conv channels and windows of 8 chunks, the published model's values); `tiny` keeps
the mel bins (the front end) and shrinks the rest. The projector's output is the fed decoder's
width. A checkpoint's config.json (`audio_config`) replaces both, and must agree with the front
end (`n_window` 50) and with the decoder (`output_dim` = the text model's hidden size). The text
model loads as any Qwen3 decoder (checkpoint_config.py); this module reads only the audio part.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from mstar.arg_types import shown_path
from mstar.plan.schema import NodePlan
from mstar.runtime.engine.checkpoint_config import WeightsError, read_json_object
from mstar.plan.dims import DimsError, DimsMode
from mstar.runtime.engine.models.qwen3_asr import CHUNK_FRAMES, N_WINDOW, Qwen3AsrEncoder, Qwen3AsrEncoderDims
from mstar.runtime.engine.runners.qwen3_asr import Qwen3AsrEncoderRunner
from mstar.runtime.engine.weights import init_random
from mstar.runtime.engine.whisper_checkpoint import load_part

ARCHITECTURE = "Qwen3ASRForConditionalGeneration"
TINY = {"hidden": 32, "num_layers": 2, "num_heads": 4, "ffn": 64, "conv_channels": 16}
AUDIO_POSITIVE = ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                  "downsample_hidden_size", "output_dim", "n_window", "n_window_infer")
Build = Callable[[str, Callable[[], torch.nn.Module]], torch.nn.Module]


def is_qwen3_asr(node: NodePlan) -> bool:
    return node.model_kind == "audio_encoder" and node.dims.get("style") == "qwen3_asr"


def _int(node: NodePlan, key: str, default: int) -> int:
    value = node.dims.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DimsError(f"node {node.name}: {key}={value!r} must be a positive integer")
    return value


def read_encoder_dims(weights_dir: str, out_width: int) -> Qwen3AsrEncoderDims:
    """The audio encoder's dims from config.json's `audio_config` (module docstring)."""
    path = Path(weights_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"--weights {shown_path(weights_dir)}: no config.json there (expected a Qwen3-ASR "
                           "checkpoint)")
    config = read_json_object(path, "checkpoint config")
    if ARCHITECTURE not in (config.get("architectures") or []) and config.get("model_type") != "qwen3_asr":
        found = ", ".join(config.get("architectures") or []) or config.get("model_type") or "unknown"
        raise WeightsError(f"{path}: architecture {found}; a qwen3_asr encoder loads {ARCHITECTURE}")
    audio = config.get("audio_config")
    if not isinstance(audio, dict):
        raise WeightsError(f"{path}: no audio_config object")
    for name in AUDIO_POSITIVE:
        value = audio.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise WeightsError(f"{path}: audio_config.{name} must be a positive integer, not {value!r}")
    if audio.get("activation_function", "gelu") != "gelu":
        raise WeightsError(f"{path}: audio_config.activation_function={audio['activation_function']!r}; "
                           "the engine's encoder uses gelu")
    if audio.get("scale_embedding"):
        raise WeightsError(f"{path}: audio_config.scale_embedding is set; the engine's encoder does not scale")
    if audio["n_window"] != N_WINDOW:
        raise WeightsError(f"{path}: audio_config.n_window={audio['n_window']}; the front end chunks by "
                           f"{N_WINDOW} (the feature extractor's n_window)")
    if audio["n_window_infer"] % CHUNK_FRAMES:
        raise WeightsError(f"{path}: audio_config.n_window_infer={audio['n_window_infer']} is not a multiple "
                           f"of {CHUNK_FRAMES} frames")
    if audio["d_model"] % audio["encoder_attention_heads"]:
        raise WeightsError(f"{path}: audio_config.d_model={audio['d_model']} is not a multiple of "
                           f"encoder_attention_heads={audio['encoder_attention_heads']}")
    if audio["output_dim"] != out_width:
        raise WeightsError(f"{path}: audio_config.output_dim={audio['output_dim']} differs from the decoder's "
                           f"hidden size {out_width}: the audio states could not replace its embeddings")
    return Qwen3AsrEncoderDims(audio["num_mel_bins"], audio["d_model"], audio["encoder_layers"],
                               audio["encoder_attention_heads"], audio["encoder_ffn_dim"],
                               audio["downsample_hidden_size"], audio["output_dim"],
                               audio["n_window_infer"] // CHUNK_FRAMES)


def encoder_runner(node: NodePlan, mode: DimsMode, weights_dir: Optional[str], seed: int, position: int,
                   out_width: int, new: Build) -> Qwen3AsrEncoderRunner:
    """out_width: the hidden size of the decoder the node's states feed (the projector's output)."""
    hidden = _int(node, "hidden", 1024)
    dims = Qwen3AsrEncoderDims(_int(node, "feature_dim", 128), hidden, _int(node, "layers", 24),
                               _int(node, "heads", 16), 4 * hidden, 480, out_width)
    if weights_dir is not None:
        dims = read_encoder_dims(weights_dir, out_width)
    elif mode == "tiny":
        dims = replace(dims, **TINY)
    if dims.hidden % dims.num_heads:
        raise DimsError(f"node {node.name}: hidden={dims.hidden} is not a multiple of heads={dims.num_heads}")
    model = new(node.name, lambda: Qwen3AsrEncoder(dims))
    assert isinstance(model, Qwen3AsrEncoder)
    if weights_dir is not None:
        load_part(model.audio_tower, weights_dir, "model.audio_tower.")
        load_part(model.multi_modal_projector, weights_dir, "model.multi_modal_projector.")
    else:
        init_random(model, seed, position)
    return Qwen3AsrEncoderRunner(node, model.eval(), position)
