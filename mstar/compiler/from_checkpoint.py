"""`mstarc init --from-checkpoint DIR`: a spec and a deployment from a checkpoint's config.json.

In: a Hugging Face checkpoint directory (config.json, and generation_config.json when present)
and a model name. Out: `InitFiles` (the spec's and the deployment's text), or an `InitError`
naming the file and what is wrong.

The architectures are those the engine loads (docs/models.md): `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM` (a plain decoder spec) and `Qwen3_5ForCausalLM` /
`Qwen3_5ForConditionalGeneration` (the gated delta-net hybrid: its layer pattern and recurrent
state; the text model of a VLM checkpoint). Without `architectures`, `model_type` decides. The
spec states the dims (layers, heads, head_dim, hidden, intermediate, vocab), `rope_theta`,
`partial_rotary` where it is not 1, and the stop tokens: `eos_token_id` (an id or a list) of
config.json and generation_config.json together. The RoPE scaling kind and the attention details
are read from config.json again when the checkpoint loads, so the spec need not state them.
The walks are those of specs/llama.mw (prompt rows and decode rows in one combined step), every
input and output with its role.

Only the fields the spec needs are read here: the compiler does not import the runtime, whose
checkpoint reader (mstar/runtime/engine/checkpoint_config.py) checks the whole file at load time.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mstar.arg_types import shown_path
from mstar.files import MAX_JSON_CONFIG_BYTES, InputFileError, read_text_bounded
from mstar.compiler.memory_bounds import MAX_LAYERS
from mstar.plan.dims import ROPE_KINDS

# architecture -> decoder style of the spec
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}
MODEL_TYPES = {"llama": "llama", "qwen2": "llama", "qwen3": "llama", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}
MAX_SEQ_LEN = 32768  # the deployment's default ceiling; a longer context is one edit away


class InitError(Exception):
    """A checkpoint init cannot describe (the message names the file and the field)."""


@dataclass
class InitFiles:
    spec: str
    deployment: str
    architecture: str


# A model name names the default spec and deployment files (specs/NAME.mw, configs/NAME.yaml): kept
# well under a file name's 255 bytes (a --name of 5,000 letters failed writing them, an OS error)
MAX_MODEL_NAME_CHARS = 200


def model_name(text: str) -> str:
    """A spec model name from a directory name: `Llama-3.2-1B` -> `llama_3_2_1b` (its first
    MAX_MODEL_NAME_CHARS characters: a directory's name may be 255 bytes)."""
    name = re.sub(r"[^a-z0-9_]+", "_", text.lower()).strip("_") or "model"
    return (name if not name[0].isdigit() else f"m_{name}")[:MAX_MODEL_NAME_CHARS]


def read_json(path: Path, what: str, max_bytes: int = MAX_JSON_CONFIG_BYTES) -> dict:
    try:
        data = json.loads(read_text_bounded(path, max_bytes=max_bytes, what=what))
    except InputFileError as error:
        raise InitError(str(error)) from None
    except (ValueError, RecursionError) as error:
        raise InitError(f"{shown_path(path)}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise InitError(f"{shown_path(path)}: not a JSON object")
    return data


def _style(config: dict, path: Path) -> tuple[str, str]:
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise InitError(f"{shown_path(path)}: architectures must be a list of names, got {architectures!r}")
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch], arch
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise InitError(f"{shown_path(path)}: model_type must be a name, got {model_type!r}")
    if not architectures and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type], str(model_type)
    found = ", ".join(map(str, architectures)) if isinstance(architectures, list) and architectures \
        else model_type or "unknown"
    raise InitError(f"{shown_path(path)}: architecture {found} is not supported; mstarc init writes specs for "
                    f"{', '.join(ARCHITECTURES)} (model_type {', '.join(MODEL_TYPES)})")


def positive_int(config: dict, name: str, path: Path, default: Optional[int] = None) -> int:
    value = config.get(name, default)
    if value is None:
        raise InitError(f"{shown_path(path)}: missing field {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InitError(f"{shown_path(path)}: {name} must be a positive integer, got {value!r}")
    return value


def _positive_number(value: Any, name: str, path: Path) -> float:
    is_ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_ok or not math.isfinite(value) or value <= 0:
        raise InitError(f"{shown_path(path)}: {name} must be a finite positive number, got {value!r}")
    return value


def _eos_ids(*sources: tuple[dict, Path]) -> list[int]:
    found: list[int] = []
    for config, path in sources:
        value = config.get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        for item in values:
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise InitError(f"{shown_path(path)}: eos_token_id must be a token id or a list of them, got {value!r}")
            if item not in found:
                found.append(item)
    return found


def _number(value: float) -> str:
    """A number as the spec grammar reads it (an int when whole)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _pattern_unit(flags: list[int]) -> list[int]:
    """The shortest prefix that, repeated, gives the whole layer pattern."""
    for size in range(1, len(flags) + 1):
        if len(flags) % size == 0 and flags[:size] * (len(flags) // size) == flags:
            return flags[:size]
    return flags


def _hybrid_args(config: dict, path: Path, num_layers: int) -> tuple[list[str], str]:
    """Qwen3.5's node arguments beyond a plain decoder's, and its recurrent state line."""
    types = config.get("layer_types")
    if types is None:
        interval = positive_int(config, "full_attention_interval", path, 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or \
            not all(t in ("full_attention", "linear_attention") for t in types):
        raise InitError(f"{shown_path(path)}: layer_types must list full_attention / linear_attention for each of the "
                        f"{num_layers} layers")
    flags = [1 if t == "full_attention" else 0 for t in types]
    num_linear = flags.count(0)
    if not num_linear:
        raise InitError(f"{shown_path(path)}: no linear_attention layer; a Qwen3.5 spec needs its gated delta-net "
                        "layers")
    key_heads = positive_int(config, "linear_num_key_heads", path)
    value_heads = positive_int(config, "linear_num_value_heads", path)
    key_dim = positive_int(config, "linear_key_head_dim", path)
    value_dim = positive_int(config, "linear_value_head_dim", path)
    args = [f"layer_pattern=[{', '.join(map(str, _pattern_unit(flags)))}]",
            f"conv_kernel={positive_int(config, 'linear_conv_kernel_dim', path, 4)}"]
    if value_heads != key_heads:
        args.append(f"linear_value_heads={value_heads}")
    state = f"state recurrent(layers={num_linear}, heads={key_heads}, key_dim={key_dim}, value_dim={value_dim})"
    return args, state


@dataclass
class DecoderArgs:
    """What a checkpoint's config.json says about its decoder, as spec text pieces."""

    args: list[str]  # `layers=16`, ... for the node header (stop tokens last)
    state: Optional[str]  # the recurrent state line of a hybrid, else None
    max_seq_len: int
    source: str  # `DIR/config.json (ARCHITECTURE)`, for the written files' first line
    architecture: str
    style: str  # "llama" or "qwen3_5"


def read_checkpoint(directory: str, name: str) -> InitFiles:
    """The spec and deployment for the checkpoint in `directory` (module docstring)."""
    decoder = read_decoder(directory)
    return InitFiles(_spec_text(name, decoder.source, decoder.args, decoder.state),
                     _deployment_text(name, decoder.source, decoder.max_seq_len, decoder.state),
                     decoder.architecture)


def _refuse_unsupported(config: dict, path: Path) -> None:
    """What the engine's decoder refuses to load (runtime/engine/checkpoint_config.py, which the
    compiler does not import), refused here too: `init` wrote and compiled a spec and plan for them,
    and only `mstar run --weights` said no."""
    if config.get("hidden_act", "silu") != "silu":
        raise InitError(f"{shown_path(path)}: hidden_act={config['hidden_act']!r}; the engine's decoder uses silu")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise InitError(f"{shown_path(path)}: sliding-window attention is not supported by the engine's decoder")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise InitError(f"{shown_path(path)}: rope_parameters must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if set(rope) & {"full_attention", "sliding_attention"}:
        raise InitError(f"{shown_path(path)}: RoPE parameters per layer type are not supported by the engine's decoder")
    if kind not in ROPE_KINDS:
        raise InitError(f"{shown_path(path)}: rope_type {kind!r} is not supported (the engine has "
                        f"{', '.join(ROPE_KINDS)})")


def read_decoder(directory: str, eos_ids: Optional[list[int]] = None) -> DecoderArgs:
    """The decoder of the checkpoint in `directory`; `eos_ids` replace the checkpoint's own stop
    tokens when given (a TTS model stops on its end of speech, not on end of text)."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise InitError(f"--from-checkpoint {shown_path(directory)}: no config.json there (expected a Hugging Face "
                        "checkpoint directory)")
    outer = read_json(path, "checkpoint config")
    style, architecture = _style(outer, path)
    config = outer["text_config"] if isinstance(outer.get("text_config"), dict) else outer
    _refuse_unsupported(config, path)
    sources = [(outer, path)] + ([(config, path)] if config is not outer else [])
    generation = Path(directory) / "generation_config.json"
    if generation.exists():
        sources.append((read_json(generation, "generation config"), generation))
    args = _dims_args(config, path)
    state = None
    if style == "qwen3_5":
        more, state = _hybrid_args(config, path, int(args[0].split("=")[1]))
        args += more
    eos = _eos_ids(*sources) if eos_ids is None else eos_ids
    if len(eos) == 1:
        args.append(f"stop_token={eos[0]}")
    elif eos:
        args.append(f"stop_tokens=[{', '.join(map(str, eos))}]")
    source = f"{Path(directory).resolve().name}/config.json ({architecture})"
    return DecoderArgs(args, state, _max_seq_len(config, path), source, architecture, style)


def _dims_args(config: dict, path: Path) -> list[str]:
    """`layers=...` through `partial_rotary=...`: the dims and position encoding of the spec."""
    num_layers = positive_int(config, "num_hidden_layers", path)
    if num_layers > MAX_LAYERS:  # before anything is built per layer (a Qwen3.5 layer pattern)
        raise InitError(f"{shown_path(path)}: num_hidden_layers {num_layers} is more than the {MAX_LAYERS} layers "
                        "mstar runs")
    num_heads = positive_int(config, "num_attention_heads", path)
    hidden = positive_int(config, "hidden_size", path)
    num_kv_heads = positive_int(config, "num_key_value_heads", path, num_heads)
    if num_heads % num_kv_heads:
        raise InitError(f"{shown_path(path)}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                        f"{num_kv_heads}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {}
    theta = _positive_number(rope.get("rope_theta", config.get("rope_theta", 10000.0)), "rope_theta", path)
    args = [f"layers={num_layers}", f"kv_heads={num_kv_heads}", f"qo_heads={num_heads}",
            f"head_dim={_head_dim(config, path, hidden, num_heads)}", f"hidden={hidden}",
            f"intermediate={positive_int(config, 'intermediate_size', path)}",
            f"vocab={positive_int(config, 'vocab_size', path)}", f"rope_theta={_number(theta)}"]
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None:
        partial = _positive_number(partial, "partial_rotary_factor", path)
        if partial > 1:
            raise InitError(f"{shown_path(path)}: partial_rotary_factor must be in (0, 1], got {partial!r}")
        args.append(f"partial_rotary={_number(partial)}")
    return args


def _head_dim(config: dict, path: Path, hidden: int, num_heads: int) -> int:
    """config.json's head_dim, else hidden_size / num_attention_heads (as transformers derives it).
    It must be even: RoPE rotates a head's dims in pairs (the first half with the second), so the
    runtime's attention cannot run an odd one (head_dim 7 failed every step with a size mismatch)."""
    if config.get("head_dim") is None:
        head_dim, given = hidden // num_heads, f"head_dim (hidden_size {hidden} // num_attention_heads {num_heads})"
    else:
        head_dim, given = positive_int(config, "head_dim", path), "head_dim"
    if head_dim < 2 or head_dim % 2:
        raise InitError(f"{shown_path(path)}: {given} is {head_dim}; RoPE rotates a head's dims in pairs, so mstar "
                        "runs even head dims only")
    return head_dim


def _max_seq_len(config: dict, path: Path) -> int:
    """The deployment's max_seq_len: max_position_embeddings (a positive integer when given), at
    most MAX_SEQ_LEN; MAX_SEQ_LEN when config.json has none."""
    if config.get("max_position_embeddings") is None:
        return MAX_SEQ_LEN
    return min(positive_int(config, "max_position_embeddings", path), MAX_SEQ_LEN)


def node_header(start: str, args: list[str]) -> str:
    """`node LLM kv(a=1, b=2, ...) {` wrapped at 100 columns, continuation lines aligned after `(`."""
    lines, line = [], start
    for index, arg in enumerate(args):
        piece = arg + (", " if index + 1 < len(args) else ")")
        if len(line) + len(piece) > 100:
            lines.append(line.rstrip())
            line = " " * len(start)
        line += piece
    lines.append(line + " {")
    return "\n".join(lines)


def _spec_text(name: str, source: str, args: list[str], state: Optional[str]) -> str:
    header = node_header("node LLM kv(", args)
    state_line = f"    {state}\n" if state else ""
    # a recurrent layer's kernels follow each step's row lengths, so a packed step is captured around them
    # (held whole, it would run eagerly: warning MW427)
    packed = " piecewise" if state else ""
    return f"""# Written by `mstarc init` from {source}.
# A decoder whose prompt rows and decode rows may share one step (the combined walk `mixed`).
# The checkpoint's config.json gives the dims again when `mstar run --weights DIR` loads it.
model {name}

param max_output_tokens = 2048

{header}
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    kv_sequences main
{state_line}    cap prefill 16
    cap decode 64
    capture decode batched batch=[1, 2, 4, 8, 16, 32, 64]
    capture prefill packed batch=[1, 2, 4, 8, 16] tokens=[32, 64, 128, 256, 512, 1024]{packed}
    combine mixed = prefill + decode {{
        cap 64
        rows prefill <= 4
        capture packed batch=[1, 4, 16, 64] tokens=[128, 256, 512, 1024, 2048, 4096, 8192]{packed}
        attention split
    }}
}}

walk prefill {{
    LLM(text_inputs) -> new_token: client text persist count_tokens
}}

walk decode {{
    loop decode_loop max=max_output_tokens stop {{
        LLM(text_inputs)
            -> text_inputs: LLM device  # the sampled token loops back without visiting the host
            -> new_token: client text
    }}
}}

partition LLM = prefill -> decode
"""


def _deployment_text(name: str, source: str, max_seq_len: int, state: Optional[str]) -> str:
    slots = "# one recurrent-state slot per live request, plus the padding rows of captured steps\n" \
            "recurrent_state_slots: 96\n" if state else ""
    return f"""# Written by `mstarc init` from {source}.
# The model on one GPU.
model: "{name}"
max_seq_len: {max_seq_len}
node_groups:
  - node_names: [LLM]
    ranks: [0]

kv_pool:
  page_size: 16
  num_pages: 8192           # 131072 tokens
capture_memory_budget_mb: 4096
speculation_mixes_walks: [LLM.decode]
{slots}"""
