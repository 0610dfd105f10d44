"""A Whisper checkpoint directory as transformers saves `WhisperForConditionalGeneration`.

In: the directory (config.json, *.safetensors, optionally generation_config.json). Out:
`read_whisper_dims(dir)` -> (encoder dims, decoder dims) from config.json; `read_rules(dir, eos)`
-> the decoding rules from generation_config.json (or None without one); `load_part(module, dir,
prefix)` copies the tensors under `model.encoder.` or `model.decoder.` into a model of
mstar/runtime/engine/models/whisper.py by name. Each refusal is a WeightsError naming the file and
the field or tensor: another architecture, an activation other than GELU, scaled embeddings, a
field that is not a positive integer, a missing tensor, a wrong shape, NaN or infinite values
(files and values checked as for decoders, checkpoint_files.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from mstar.arg_types import shown_path
from mstar.runtime.engine.checkpoint_config import WeightsError, read_json_object
from mstar.runtime.engine.checkpoint_files import check_finite, tensor_index
from mstar.runtime.engine.models.whisper import WhisperDecoderDims, WhisperEncoderDims
from mstar.runtime.engine.runners.whisper_rules import WhisperRules

ARCHITECTURE = "WhisperForConditionalGeneration"
POSITIVE = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "decoder_layers",
            "decoder_attention_heads", "decoder_ffn_dim", "vocab_size", "num_mel_bins", "max_source_positions",
            "max_target_positions")
RULE_IDS = ("decoder_start_token_id", "no_timestamps_token_id", "max_initial_timestamp_index")
RULE_LISTS = ("suppress_tokens", "begin_suppress_tokens")


def is_whisper_checkpoint(weights_dir: str) -> bool:
    path = Path(weights_dir) / "config.json"
    if not path.is_file():
        return False
    config = read_json_object(path, "checkpoint config")
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("model_type") == "whisper"


def read_whisper_dims(weights_dir: str) -> tuple[WhisperEncoderDims, WhisperDecoderDims]:
    path = Path(weights_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"--weights {shown_path(weights_dir)}: no config.json there (expected a Whisper checkpoint)")
    config = read_json_object(path, "checkpoint config")
    if not is_whisper_checkpoint(weights_dir):
        found = ", ".join(config.get("architectures") or []) or config.get("model_type") or "unknown"
        raise WeightsError(f"{path}: architecture {found}; a whisper node loads {ARCHITECTURE}")
    for name in POSITIVE:
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise WeightsError(f"{path}: {name} must be a positive integer, not {value!r}")
    if config.get("activation_function", "gelu") != "gelu":
        raise WeightsError(f"{path}: activation_function={config['activation_function']!r}; the engine uses gelu")
    if config.get("scale_embedding"):
        raise WeightsError(f"{path}: scale_embedding is set; the engine's Whisper decoder does not scale")
    hidden = config["d_model"]
    encoder = WhisperEncoderDims(config["num_mel_bins"], hidden, config["encoder_layers"],
                                 config["encoder_attention_heads"], config["encoder_ffn_dim"],
                                 config["max_source_positions"])
    decoder = WhisperDecoderDims(hidden, config["decoder_layers"], config["decoder_attention_heads"],
                                 config["decoder_ffn_dim"], config["vocab_size"], config["max_target_positions"])
    for what, heads in (("encoder", encoder.num_heads), ("decoder", decoder.num_heads)):
        if hidden % heads:
            raise WeightsError(f"{path}: d_model={hidden} is not a multiple of {what}_attention_heads={heads}")
    return encoder, decoder


def read_rules(weights_dir: str, eos: int) -> Optional[WhisperRules]:
    """The rules from generation_config.json, None when the checkpoint has none."""
    path = Path(weights_dir) / "generation_config.json"
    if not path.is_file():
        return None
    config = read_json_object(path, "generation config")
    if not _is_id(config.get("decoder_start_token_id")):
        raise WeightsError(f"{path}: decoder_start_token_id must be a token id")
    for name in RULE_IDS:
        if config.get(name) is not None and not _is_id(config[name]):
            raise WeightsError(f"{path}: {name} must be a token id, not {config[name]!r}")
    for name in RULE_LISTS:
        if config.get(name) is not None and not _is_id_list(config[name]):
            raise WeightsError(f"{path}: {name} must be a list of token ids")
    for name in ("lang_to_id", "task_to_id"):
        table = config.get(name)
        if table is not None and not (isinstance(table, dict) and _is_id_list(list(table.values()))):
            raise WeightsError(f"{path}: {name} must map names to token ids")
    forced = config.get("forced_decoder_ids")
    if forced is not None and not (isinstance(forced, list) and all(
            isinstance(f, list) and len(f) == 2 and _is_id(f[0]) and (f[1] is None or _is_id(f[1])) for f in forced)):
        raise WeightsError(f"{path}: forced_decoder_ids must be a list of [position, token id or null]")
    end = config.get("eos_token_id", eos)
    if not (_is_id(end) or (_is_id_list(end) and end)):
        raise WeightsError(f"{path}: eos_token_id must be a token id")
    return WhisperRules.of_config(config, eos)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_id(v) for v in value)


def load_part(module: nn.Module, weights_dir: str, prefix: str) -> None:
    """Copy `prefix + name` for every parameter `name` of `module` (shapes and values checked)."""
    from safetensors import SafetensorError, safe_open

    index = tensor_index(weights_dir)
    params = dict(module.named_parameters())
    missing = sorted(prefix + name for name in params if prefix + name not in index)
    if missing:
        raise WeightsError(f"--weights {shown_path(weights_dir)}: missing tensors {', '.join(missing[:4])}"
                           + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    by_file: dict[Path, list[str]] = {}
    for name in sorted(params):
        by_file.setdefault(index[prefix + name][0], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as shard:
                    for name in names:
                        key, param = index[prefix + name][1], params[name]
                        shape = tuple(shard.get_slice(key).get_shape())
                        if shape != tuple(param.shape):
                            raise WeightsError(f"--weights {shown_path(weights_dir)}: {key} has shape {shape}, "
                                               f"config.json implies {tuple(param.shape)}")
                        param.copy_(shard.get_tensor(key))
                        check_finite(weights_dir, file, key, param)
            except (SafetensorError, OSError) as error:
                raise WeightsError(f"--weights {shown_path(weights_dir)}: cannot read {file.name}: {error}") from None
