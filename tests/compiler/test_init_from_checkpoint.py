"""`mstarc init --from-checkpoint DIR`: tiny random checkpoints of each supported architecture saved by
transformers -> a spec and a deployment (canonical, with roles) -> compiled -> `mstar run --weights DIR`
gives transformers' greedy tokens. Refusals: an unsupported architecture, an existing output."""
import json

import pytest
import torch

from mstar.cli.mstar import main as mstar_main
from mstar.cli.mstarc import main as mstarc_main

transformers = pytest.importorskip("transformers")

PROMPT = [7, 100, 3, 55, 21, 250, 9, 31]
NUM_NEW = 8
SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SIZES, eos_token_id=[318, 319], rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0,
                                                           "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8}))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, head_dim=32, eos_token_id=319))


def _qwen3_5():
    from transformers.models import qwen3_5

    config = qwen3_5.Qwen3_5TextConfig(**{**SIZES, "num_hidden_layers": 4}, head_dim=16, linear_key_head_dim=16,
                                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                       linear_conv_kernel_dim=4, eos_token_id=319)
    return qwen3_5.Qwen3_5ForCausalLM(config)


BUILDERS = {"llama": _llama, "qwen3": _qwen3, "qwen3_5": _qwen3_5}
EXPECTED_ARGS = {
    "llama": ("rope_theta=50000", "stop_tokens=[318, 319]", "head_dim=16"),
    "qwen3": ("head_dim=32", "stop_token=319"),
    "qwen3_5": ("layer_pattern=[0, 0, 0, 1]", "state recurrent(layers=3, heads=2, key_dim=16, value_dim=16)",
                "linear_value_heads=4", "partial_rotary=0.25"),
}


def _save(model, path):
    torch.manual_seed(4)
    model.eval()
    with torch.no_grad():  # weights large enough that greedy picks are well separated; norms off zero
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, param[0].numel() ** -0.5)
            elif "norm" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)


def _hf_greedy(model, eos):
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_init_compiles_and_runs_like_transformers(arch, tmp_path, capsys):
    model = BUILDERS[arch]()
    checkpoint = tmp_path / "Tiny-Model-0.1"
    _save(model, checkpoint)
    spec, config, plan = tmp_path / "specs" / "m.mw", tmp_path / "configs" / "m.yaml", tmp_path / "out" / "m.plan"
    status = mstarc_main(["init", "--from-checkpoint", str(checkpoint), "--name", "m", "-o", str(spec),
                          "--config-out", str(config), "--plan-out", str(plan)])
    err = capsys.readouterr().err
    assert status == 0, err
    # the spec init writes compiles without a warning (Qwen3.5's packed captures held whole: MW427)
    assert "warning" not in err, err
    text = spec.read_text()
    assert "in text_inputs: tokens prompt text" in text and "model m\n" in text
    for arg in EXPECTED_ARGS[arch]:
        assert arg in text, text
    assert mstarc_main(["fmt", "--check", str(spec)]) == 0
    assert plan.exists() and (tmp_path / "out" / "m_glue.py").exists()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_tokens": PROMPT, "max_tokens": NUM_NEW}) + "\n")
    status = mstar_main(["run", "--plan", str(plan), "--weights", str(checkpoint), "--prompts", str(prompts),
                         "--out", str(tmp_path / "run"), "--no-progress"])
    assert status == 0, capsys.readouterr().err
    got = json.loads((tmp_path / "run" / "outputs.jsonl").read_text())["output_tokens"]
    eos = model.generation_config.eos_token_id
    # the spec's stop tokens are the checkpoint's eos ids: the run ends where transformers' does
    assert got == _hf_greedy(model, eos)
    assert got == _hf_greedy(model, None)[:len(got)]


def test_default_paths_name_and_existing_files(tmp_path, monkeypatch, capsys):
    checkpoint = tmp_path / "Llama-3.2-Tiny"
    _save(_llama(), checkpoint)
    monkeypatch.chdir(tmp_path)
    assert mstarc_main(["init", "--from-checkpoint", str(checkpoint)]) == 0
    assert (tmp_path / "specs" / "llama_3_2_tiny.mw").exists()
    assert (tmp_path / "configs" / "llama_3_2_tiny.yaml").exists()
    assert (tmp_path / "generated" / "llama_3_2_tiny.plan").exists()
    capsys.readouterr()
    spec_before = (tmp_path / "specs" / "llama_3_2_tiny.mw").read_bytes()
    assert mstarc_main(["init", "--from-checkpoint", str(checkpoint)]) == 1
    err = capsys.readouterr().err
    assert "llama_3_2_tiny.mw and configs/llama_3_2_tiny.yaml already exist" in err and "--force" in err
    assert (tmp_path / "specs" / "llama_3_2_tiny.mw").read_bytes() == spec_before
    assert mstarc_main(["init", "--from-checkpoint", str(checkpoint), "--force"]) == 0


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "architecture GPT2LMHeadModel is not supported"),
    ({"model_type": "mistral"}, "architecture mistral is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "missing field 'num_hidden_layers'"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2.5, "num_attention_heads": 4},
     "num_hidden_layers must be a positive integer"),
    # a list or an object where a name goes was an internal error (TypeError: unhashable type)
    ({"architectures": [{"a": 1}]}, "architectures must be a list of names"),
    ({"model_type": ["llama"]}, "model_type must be a name"),
    # a Qwen3.5 of 10**12 layers built its layer pattern a layer at a time until memory ran out
    ({"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 10**12},
     "num_hidden_layers 1000000000000 is more than the 4096 layers mstar runs"),
    # RoPE rotates a head's dims in pairs: the run failed every step with a size mismatch
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "head_dim": 7},
     "head_dim is 7; RoPE rotates a head's dims in pairs, so mstar runs even head dims only"),
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "hidden_size": 60},
     "head_dim (hidden_size 60 // num_attention_heads 4) is 15; RoPE rotates"),
    # was silently replaced by 32768
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "max_position_embeddings": 0},
     "max_position_embeddings must be a positive integer, got 0"),
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "max_position_embeddings": "x"},
     "max_position_embeddings must be a positive integer, got 'x'"),
    # what the engine refuses to load: init wrote and compiled a spec for them
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"architectures": ["Qwen3ForCausalLM"], **SIZES, "use_sliding_window": True}, "sliding-window attention"),
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_type 'longrope' is not supported (the engine has default, linear, dynamic, yarn, llama3)"),
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "rope_scaling": {"type": "su", "factor": 2.0}},
     "rope_type 'su' is not supported"),
    ({"architectures": ["LlamaForCausalLM"], **SIZES,
      "rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     "RoPE parameters per layer type are not supported"),
    ({"architectures": ["LlamaForCausalLM"], **SIZES, "rope_parameters": "yarn"}, "rope_parameters must be an object"),
])
def test_unsupported_or_broken_config_is_refused(tmp_path, capsys, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    status = mstarc_main(["init", "--from-checkpoint", str(tmp_path), "-o", str(tmp_path / "s.mw"),
                          "--config-out", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err
    assert status == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "s.mw").exists() and not (tmp_path / "c.yaml").exists()


def test_missing_directory_is_refused(tmp_path, capsys):
    assert mstarc_main(["init", "--from-checkpoint", str(tmp_path / "nowhere"), "-o", str(tmp_path / "s.mw"),
                        "--config-out", str(tmp_path / "c.yaml")]) == 1
    assert "no config.json" in capsys.readouterr().err


def test_a_checkpoint_that_does_not_compile_leaves_nothing_behind(tmp_path, capsys):
    """Values init takes but the compiler refuses (a vocabulary of 2**40: MW123) fail the command
    and the spec and deployment it wrote are removed (they stayed, and a re-run then asked for
    --force); files it replaced with --force come back as they were."""
    config = {"architectures": ["LlamaForCausalLM"], **SIZES, "vocab_size": 2**40}
    (tmp_path / "config.json").write_text(json.dumps(config))
    outputs = ["-o", str(tmp_path / "s.mw"), "--config-out", str(tmp_path / "c.yaml"),
               "--plan-out", str(tmp_path / "p.plan")]
    assert mstarc_main(["init", "--from-checkpoint", str(tmp_path), *outputs]) == 1
    err = capsys.readouterr().err
    assert "MW123" in err and "were removed" in err and "Traceback" not in err
    assert not any((tmp_path / name).exists() for name in ("s.mw", "c.yaml", "p.plan"))
    (tmp_path / "s.mw").write_text("mine\n")
    assert mstarc_main(["init", "--from-checkpoint", str(tmp_path), *outputs, "--force"]) == 1
    # file by file: it said "s.mw and c.yaml were restored" where c.yaml had been removed
    assert f"{tmp_path / 's.mw'} was restored; {tmp_path / 'c.yaml'} was removed" in capsys.readouterr().err
    assert (tmp_path / "s.mw").read_text() == "mine\n" and not (tmp_path / "c.yaml").exists()


def test_one_path_for_two_outputs_is_refused(tmp_path, capsys):
    _save(_llama(), tmp_path / "ckpt")
    same = str(tmp_path / "same.txt")
    assert mstarc_main(["init", "--from-checkpoint", str(tmp_path / "ckpt"), "-o", same, "--config-out", same]) == 2
    assert "three different paths" in capsys.readouterr().err and not (tmp_path / "same.txt").exists()


def test_a_model_name_past_200_characters(tmp_path, monkeypatch, capsys):
    """--name of 5,000 letters was taken and failed writing specs/NAME.mw (an OS error, exit 1); a
    directory's name of 255 letters gave a default name whose configs/NAME.yaml passed 255 bytes."""
    from mstar.compiler.from_checkpoint import model_name

    monkeypatch.chdir(tmp_path)
    assert mstarc_main(["init", "--from-checkpoint", str(tmp_path), "--name", "m" * 5000]) == 2
    err = capsys.readouterr().err
    assert "a model name is at most 200 characters" in err and len(err) < 300
    assert len(model_name("9" * 255)) == 200 and model_name("9" * 255).startswith("m_9")
