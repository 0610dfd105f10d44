"""Builds Whisper's runners for the torch engine: dims, weights (random or a checkpoint), rules.

In: a plan node (`style=whisper`: a stateless `audio_encoder` or a kv decoder with a `cross_kv`
pool), the dims mode, an optional checkpoint directory, the seed and the node's position. Out: a
`WhisperEncoderRunner` or `WhisperDecoderRunner` (runners/whisper.py), or a DimsError /
WeightsError saying why not.

Dims: `spec` reads the node's arguments (encoder: hidden, layers, heads, feature_dim = mel bins,
num_tokens = states per 30 s, MLP 4 x hidden; decoder: hidden, layers, qo_heads = kv_heads,
intermediate, vocab; its positions are the deployment's max_seq_len). `tiny` keeps the mel bins,
the 1500 states and the vocabulary (the front end and the token layout) and shrinks the rest to
width 64, 2 layers, 4 heads. A checkpoint's config.json replaces both (whisper_checkpoint.py).
Random weights are seeded by the node's position (the encoder's position table is Whisper's fixed
sinusoids); the rules come from the checkpoint's generation_config.json, else the multilingual
layout around the node's stop token (runners/whisper_rules.py).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Union

import torch

from mstar.plan.schema import NodePlan
from mstar.plan.dims import DimsError, DimsMode
from mstar.runtime.engine.kv.reserved_pages import ReservedPages
from mstar.runtime.engine.models.whisper import (
    WhisperDecoder, WhisperDecoderDims, WhisperEncoder, WhisperEncoderDims, sinusoids,
)
from mstar.runtime.engine.runners.whisper import WhisperDecoderRunner, WhisperEncoderRunner
from mstar.runtime.engine.runners.whisper_rules import WhisperRules
from mstar.runtime.engine.weights import init_random, weights_by_node
from mstar.runtime.engine.whisper_checkpoint import load_part, read_rules, read_whisper_dims

EOS = 50257  # multilingual Whisper's <|endoftext|>, when the spec states no stop token
CHECKPOINT_ENCODER_STYLES = ("whisper", "qwen3_asr")
TINY = {"hidden": 64, "num_layers": 2, "num_heads": 4, "ffn": 256}
Build = Callable[[str, Callable[[], torch.nn.Module]], torch.nn.Module]


def is_whisper(node: NodePlan) -> bool:
    return node.dims.get("style") == "whisper"


def has_checkpoint_encoder(node: NodePlan) -> bool:
    """An audio encoder whose weights a checkpoint holds (Whisper's, Qwen3-ASR's)."""
    return node.model_kind == "audio_encoder" and node.dims.get("style") in CHECKPOINT_ENCODER_STYLES


def checkpoints_by_node(nodes: list[NodePlan], entries: Optional[Union[str, list[str]]]) -> dict[str, str]:
    """{node: checkpoint dir} from `--weights` entries (weights.weights_by_node: kv nodes, audio
    codecs and checkpoint encoders may be named). A Whisper or Qwen3-ASR checkpoint holds the
    encoder and the decoder: such an encoder without its own entry takes the directory of the
    plan's decoder of its family (a whisper decoder for `whisper`; for `qwen3_asr` the one kv node
    given a checkpoint)."""
    others = [n.name for n in nodes if n.model_kind == "audio_codec" or has_checkpoint_encoder(n)]
    checkpoints = weights_by_node([n.name for n in nodes if n.engine == "kv"], entries, others)
    shared = dict(checkpoints)
    for node in nodes:
        if not has_checkpoint_encoder(node) or node.name in shared:
            continue
        decoders = [checkpoints[n.name] for n in nodes if n.engine == "kv" and n.name in checkpoints
                    and (is_whisper(n) or not is_whisper(node))]
        if len(decoders) == 1:
            shared[node.name] = decoders[0]
    return shared


def _int(node: NodePlan, key: str, default: int) -> int:
    value = node.dims.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DimsError(f"node {node.name}: {key}={value!r} must be a positive integer")
    return value


def encoder_runner(node: NodePlan, mode: DimsMode, weights_dir: Optional[str], seed: int, position: int,
                   new: Build) -> WhisperEncoderRunner:
    hidden = _int(node, "hidden", 1280)
    dims = WhisperEncoderDims(_int(node, "feature_dim", 128), hidden, _int(node, "layers", 32),
                              _int(node, "heads", 20), 4 * hidden, _int(node, "num_tokens", 1500))
    if weights_dir is not None:
        dims = read_whisper_dims(weights_dir)[0]
    elif mode == "tiny":
        dims = replace(dims, **TINY)
    if dims.hidden % dims.num_heads:
        raise DimsError(f"node {node.name}: hidden={dims.hidden} is not a multiple of heads={dims.num_heads}")
    model = new(node.name, lambda: WhisperEncoder(dims))
    assert isinstance(model, WhisperEncoder)
    if weights_dir is not None:
        load_part(model, weights_dir, "model.encoder.")
    else:
        init_random(model, seed, position)
        with torch.no_grad():
            model.embed_positions.weight.copy_(sinusoids(dims.num_positions, dims.hidden))
    return WhisperEncoderRunner(node, model.eval(), position)


def decoder_runner(node: NodePlan, mode: DimsMode, weights_dir: Optional[str], seed: int, position: int,
                   max_seq_len: int, pages: ReservedPages, new: Build) -> WhisperDecoderRunner:
    if len(node.cross_kv) != 1:
        raise DimsError(f"node {node.name}: a whisper decoder cross-attends over one cross_kv pool, "
                        f"the plan gives it {len(node.cross_kv)}")
    heads = _int(node, "qo_heads", 20)
    if _int(node, "kv_heads", heads) != heads:
        raise DimsError(f"node {node.name}: a whisper decoder has as many kv_heads as qo_heads")
    dims = WhisperDecoderDims(_int(node, "hidden", heads * _int(node, "head_dim", 64)), _int(node, "layers", 32),
                              heads, _int(node, "intermediate", 5120), _int(node, "vocab", 51866), max_seq_len)
    if weights_dir is not None:
        dims = read_whisper_dims(weights_dir)[1]
    elif mode == "tiny":
        dims = replace(dims, **TINY)
    if dims.hidden % dims.num_heads:
        raise DimsError(f"node {node.name}: hidden={dims.hidden} is not a multiple of qo_heads={dims.num_heads}")
    model = new(node.name, lambda: WhisperDecoder(dims))
    assert isinstance(model, WhisperDecoder)
    stop = node.dims.get("stop_token", EOS)
    eos = stop if isinstance(stop, int) else EOS
    rules = None
    if weights_dir is not None:
        load_part(model, weights_dir, "model.decoder.")
        rules = read_rules(weights_dir, eos)
    else:
        init_random(model, seed, position)
    rules = rules or WhisperRules.layout(dims.vocab, eos)
    return WhisperDecoderRunner(node, model.eval(), rules, max_seq_len, pages, position)
