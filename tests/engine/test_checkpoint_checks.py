"""Honest weights: a checkpoint that would give silently wrong tokens is refused, naming the file.

Tiny Llama checkpoints are built in tmp dirs from the engine's own decoder (its parameter names
are the checkpoint's), so no download and no transformers are needed: non-finite values, config
values (dims, rope_theta, rms_norm_eps, layer count), the safetensors index and stale files.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mstar.cli.mstar import main
from mstar.runtime.engine.kv.cache import KvCache, KvCacheError
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.weights import WeightsError, init_random, load_checkpoint_weights, read_checkpoint_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def _state(config: dict) -> dict[str, torch.Tensor]:
    """Random weights with the names and shapes a checkpoint of `config` holds."""
    model = Decoder(_dims(config))
    init_random(model, 0, "LLM")
    # the decoder's image-flow head is not part of a text checkpoint (the loader skips it)
    return {name: p.detach().clone().contiguous() for name, p in model.named_parameters()
            if not name.startswith("flow.")}


def _dims(config: dict):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        return read_checkpoint_config(folder)


def _checkpoint(path: Path, config: dict = CONFIG, state: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(state if state is not None else _state(config), str(path / "model.safetensors"))
    return path


def _load(path: Path) -> None:
    dims = read_checkpoint_config(str(path))
    load_checkpoint_weights(Decoder(dims), str(path), dims.is_tied_embeddings)


def _load_as_the_device_path(path: Path) -> Decoder:
    """The GPU fast path's loader (`device_model.build_decoder`, reading onto the device), on the CPU."""
    from mstar.runtime.engine.gpu.device_model import build_decoder

    dims = read_checkpoint_config(str(path))
    return build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0, weights_dir=str(path))


@pytest.fixture(params=["reference", "device_path"])
def load(request):
    """Each loader refuses alike: the device path's globbed every file (the first name winning a
    tensor two held, a stale shard read), took NaN weights and any layer count."""
    return _load if request.param == "reference" else _load_as_the_device_path


def test_a_good_checkpoint_loads(load, tmp_path):
    load(_checkpoint(tmp_path / "ck"))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_in_one_weight_is_refused_with_file_and_tensor(load, tmp_path, value):
    state = _state(CONFIG)
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    path = _checkpoint(tmp_path / "ck", state=state)
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\.weight "
                                           r"holds 1 NaN or infinite value\(s\) of 2048"):
        load(path)


def test_a_nan_checkpoint_fails_the_run_not_the_tokens(tmp_path, capsys):
    state = _state(CONFIG)
    state["model.embed_tokens.weight"][7, 0] = math.nan
    path = _checkpoint(tmp_path / "ck", state=state)
    status = main(["run", "--plan", str(ROOT / "generated" / "llama.plan"), "--weights", str(path),
                   "--requests", "3", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1 and "tensor model.embed_tokens.weight holds 1 NaN" in err, err


@pytest.mark.parametrize("patch, fragment", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"hidden_size": -32}, "hidden_size must be a positive integer, got -32"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer, got 2.5"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got true"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"vocab_size": "many"}, 'vocab_size must be a positive integer, got "many"'),
    ({"rope_theta": 0}, "rope_theta must be a finite positive number, got 0"),
    ({"rope_theta": -10000.0}, "rope_theta must be a finite positive number, got -10000.0"),
    ({"rope_theta": math.nan}, "rope_theta must be a finite positive number, got nan"),
    ({"rope_theta": 10**400}, "rope_theta must be a finite positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.inf}},
     "rope_theta must be a finite positive number, got inf"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a finite positive number, got -1"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a finite positive number, got 0.0"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in (0, 1], got 1.5"),
    ({"rope_parameters": [1, 2]}, "rope_parameters [1, 2] is not an object"),
    # (2**62 overflowed the memory probe's sizes: "internal error ... a bug in mstar")
    ({"vocab_size": 2**62}, "vocab_size is 4611686018427387904, past any model's (2147483647)"),
])
def test_bad_config_values_are_refused(tmp_path, patch, fragment):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **patch}))
    with pytest.raises(WeightsError) as caught:
        read_checkpoint_config(str(tmp_path))
    assert str(caught.value).startswith(f"{tmp_path / 'config.json'}: ") and fragment in str(caught.value)


def test_the_bad_config_values_of_the_audit_are_messages_in_mstar_run(tmp_path, capsys):
    """These were internal errors (IndexError, ZeroDivisionError) behind the catch-all."""
    for patch in ({"num_attention_heads": 0}, {"rope_parameters": [1, 2]}, {"vocab_size": 0}):
        path = _checkpoint(tmp_path / str(len(os.listdir(tmp_path))), {**CONFIG, **patch}, state=_state(CONFIG))
        status = main(["run", "--plan", str(ROOT / "generated" / "llama.plan"), "--weights", str(path),
                       "--requests", "1", "--no-progress"])
        err = capsys.readouterr().err
        assert status == 1 and err.startswith(f"mstar: error: {path / 'config.json'}: "), err


def test_a_layer_count_is_checked_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    """config.json's 20,000 layers for a 2-layer checkpoint: `mstar run` took 30 s and 1.4 GB
    building them before the loader refused; the engine now asks the files' headers first."""
    from mstar.runtime.engine.models import decoder

    path = _checkpoint(tmp_path / "ck")
    (path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 20000}))
    monkeypatch.setattr(decoder.Decoder, "__init__", lambda *args, **kwargs: pytest.fail("built a model"))
    status = main(["run", "--plan", str(ROOT / "generated" / "llama.plan"), "--weights", str(path), "--requests", "1",
                   "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1 and "num_hidden_layers is 20000 but the checkpoint holds 2 layers" in err, err


@pytest.mark.parametrize("num_layers", [1, 3])
def test_a_layer_count_other_than_the_checkpoints_is_refused(load, tmp_path, num_layers):
    path = _checkpoint(tmp_path / "ck")
    (path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": num_layers}))
    with pytest.raises(WeightsError, match=f"num_hidden_layers is {num_layers} but the checkpoint holds 2 layers"):
        load(path)


def _sharded(path: Path) -> tuple[Path, dict[str, str]]:
    """The checkpoint in two files with an index, as save_pretrained shards it."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    state = _state(CONFIG)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, shard in shards.items():
        save_file({name: state[name] for name in shard}, str(path / file))
        weight_map.update({name: file for name in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path, weight_map


def test_a_sharded_checkpoint_with_its_index_loads(load, tmp_path):
    path, _ = _sharded(tmp_path / "ck")
    load(path)


def test_a_stale_file_the_index_does_not_list_is_refused(load, tmp_path):
    """The stale file sorts last: it used to win, overwriting every tensor it holds."""
    path, _ = _sharded(tmp_path / "ck")
    save_file(_state(CONFIG), str(path / "model-stale.safetensors"))
    with pytest.raises(WeightsError, match="model-stale.safetensors not listed in model.safetensors.index.json"):
        load(path)


def test_the_index_decides_which_file_a_tensor_comes_from(tmp_path):
    """A second copy of a first-shard tensor in the second shard (read later: it used to win)."""
    path, weight_map = _sharded(tmp_path / "ck")
    name = "lm_head.weight"
    assert weight_map[name] == "model-00001-of-00002.safetensors"
    from safetensors.torch import load_file

    second = path / "model-00002-of-00002.safetensors"
    shard = load_file(str(second))
    shard[name] = torch.full(tuple(_state(CONFIG)[name].shape), 7.0)
    save_file(shard, str(second))
    dims = read_checkpoint_config(str(path))
    model = Decoder(dims)
    load_checkpoint_weights(model, str(path), False)
    assert not torch.any(dict(model.named_parameters())[name] == 7.0)


@pytest.mark.parametrize("damage, fragment", [
    ("missing_file", "lists 'model-00002-of-00002.safetensors', which is not a file in"),
    ("missing_tensor", "which does not hold it"),
    ("no_weight_map", "no weight_map object"),
    ("path_in_index", "lists '../x.safetensors', which is not a file in"),
])
def test_a_broken_index_is_refused(load, tmp_path, damage, fragment):
    path, weight_map = _sharded(tmp_path / "ck")
    index = path / "model.safetensors.index.json"
    if damage == "missing_file":
        (path / "model-00002-of-00002.safetensors").unlink()
    elif damage == "missing_tensor":
        index.write_text(json.dumps({"weight_map": {**weight_map, "model.extra.weight": weight_map["lm_head.weight"]}}))
    elif damage == "no_weight_map":
        index.write_text(json.dumps({"metadata": {}}))
    else:
        index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(WeightsError, match=fragment):
        load(path)


def test_without_an_index_a_tensor_in_two_files_is_refused(load, tmp_path):
    path = _checkpoint(tmp_path / "ck")
    save_file({"model.norm.weight": torch.ones(32)}, str(path / "old.safetensors"))
    either_order = ("tensor model.norm.weight is in both model.safetensors and old.safetensors"
                    "|tensor model.norm.weight is in both old.safetensors and model.safetensors")
    with pytest.raises(WeightsError, match=either_order):
        load(path)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_config_json_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    config = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(config)
    else:
        config.mkdir()
    started = time.monotonic()
    with pytest.raises(WeightsError, match="config.json"):
        read_checkpoint_config(str(tmp_path))
    assert time.monotonic() - started < 2.0


def test_a_kv_cache_past_what_a_tensor_can_address_is_a_message():
    """--kv-pages 9223372036854775807 was an internal error (an overflow inside torch.empty)."""
    with pytest.raises(KvCacheError, match=r"cannot allocate a KV cache of 9223372036854775807 pages x 16 "
                                           r"positions \(\d+\.\d GiB for 2 layers\)"):
        KvCache(PagePool(2**63 - 1, 16), 2, 2, 16)


def test_kv_pages_of_2_63_in_mstar_run(capsys):
    status = main(["run", "--plan", str(ROOT / "generated" / "orpheus.plan"), "--requests", "1", "--no-progress",
                   "--kv-pages", str(2**63 - 1)])
    err = capsys.readouterr().err
    assert status == 1 and "mstar: error: cannot allocate a KV cache of 9223372036854775807 pages" in err, err
    assert "GiB" in err and "internal error" not in err


def test_a_checkpoint_of_another_vocabulary_is_said_and_its_ids_bound_prompts(tmp_path, caplog):
    """llama.plan's spec says 128,256 tokens; a 128-token checkpoint loads (its dims replace the
    spec's) with a warning that the plan's stop tokens and prompt checks are the spec's, and a
    prompt id past the checkpoint's vocabulary is refused (the embedding took it modulo 128, so
    [5, 200, 7] ran as [5, 72, 7])."""
    import logging

    from mstar.plan.io import load_plan
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine

    plan = load_plan(ROOT / "generated" / "llama.plan")
    with caplog.at_level(logging.WARNING):
        engine = TorchEngine(plan, weights_dir=str(_checkpoint(tmp_path / "ck")))
    assert "the checkpoint's vocabulary is 128 tokens, node LLM's spec says 128256" in caplog.text
    refused = engine.add_request("a", Request(id="a", prompt_tokens=[5, 200, 7], max_tokens=2))
    assert refused is not None and "prompt token id 200 is outside the checkpoint's vocabulary [0, 128)" in refused
    assert engine.add_request("b", Request(id="b", prompt_tokens=[5, 100, 7], max_tokens=2)) is None


@pytest.mark.parametrize("plan_name, refused", [("llama", False), ("llama_chunked", True)])
def test_dynamic_rope_is_refused_where_a_prompt_may_run_in_several_steps(tmp_path, plan_name, refused):
    """Dynamic NTK RoPE scales by the length each step sees, and the KV keeps keys rotated at their
    step's scale: chunked prompts and a prefix cache changed the tokens (transformers' on the whole
    prompt came out of llama.plan, other ones out of llama_chunked.plan)."""
    from mstar.plan.io import load_plan
    from mstar.runtime.engine.torch_engine import EngineError, TorchEngine

    config = {**CONFIG, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}, "max_position_embeddings": 64}
    weights = str(_checkpoint(tmp_path / "ck", config))
    plan = load_plan(ROOT / "generated" / f"{plan_name}.plan")
    if not refused:
        TorchEngine(plan, weights_dir=weights)
        return
    with pytest.raises(EngineError, match="dynamic NTK RoPE .* chunked prompts on node LLM"):
        TorchEngine(plan, weights_dir=weights)
