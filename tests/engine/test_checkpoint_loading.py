"""Loading a checkpoint shard by shard: a sharded save_pretrained checkpoint gives the same tokens
as transformers; a tied LM head shares the embedding's storage (no second copy); weights arrive in
the asked dtype; a tensor of the wrong shape is named; the image-flow head, which no checkpoint
has, still gets its seeded random weights."""
import json

import pytest
import torch

from engine_plans import generate, llm_plan
from mstar.runtime.engine.checkpoint_config import read_checkpoint_config
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine
from mstar.runtime.engine.weights import WeightsError, init_random, load_decoder

transformers = pytest.importorskip("transformers")


def tiny_llama(path, is_tied, max_shard_size="40KB"):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=is_tied)
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[1] ** -0.5)
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return model


def test_sharded_checkpoint_matches_transformers(tmp_path):
    model = tiny_llama(tmp_path, is_tied=False)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert generate(TorchEngine(llm_plan(), weights_dir=str(tmp_path)), {"r": prompt}, 8)["r"] == expected


def test_an_engine_reads_each_header_once(tmp_path, monkeypatch):
    """Start-up read every file's header twice: the layer-count check before the model is built,
    then the loader. Within one start-up each is read once; the next start-up reads them again."""
    from collections import Counter

    from mstar.runtime.engine import checkpoint_files

    tiny_llama(tmp_path, is_tied=False)
    files = sorted(path.name for path in tmp_path.glob("*.safetensors"))
    assert len(files) > 2
    reads: Counter = Counter()
    real = checkpoint_files.read_header_keys

    def counted(file):
        reads[file.name] += 1
        return real(file)

    monkeypatch.setattr(checkpoint_files, "read_header_keys", counted)
    engine = TorchEngine(llm_plan(), weights_dir=str(tmp_path))
    assert reads == Counter(files)
    assert generate(engine, {"r": [3, 1, 4]}, 2)["r"]  # the weights were loaded from those names
    TorchEngine(llm_plan(), weights_dir=str(tmp_path))
    assert reads == Counter({name: 2 for name in files})


def test_tied_head_shares_storage_and_dtype_is_the_target(tmp_path):
    reference = tiny_llama(tmp_path, is_tied=True)
    dims = read_checkpoint_config(str(tmp_path))
    model = load_decoder(lambda: Decoder(dims), str(tmp_path), True, dtype=torch.bfloat16, seed=3, position=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(model.model.embed_tokens.weight,
                               reference.model.embed_tokens.weight.to(torch.bfloat16))
    seeded = Decoder(dims)  # the flow head is not in the checkpoint: seeded as with random weights
    init_random(seeded, 3, 0)
    torch.testing.assert_close(model.flow.latent_in.weight, seeded.flow.latent_in.weight.to(torch.bfloat16))


def test_wrong_shape_is_named(tmp_path):
    tiny_llama(tmp_path, is_tied=True, max_shard_size="10MB")
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"model.layers.0.mlp.down_proj.weight has shape \(32, 64\), "
                                          r"config.json implies \(32, 48\)"):
        TorchEngine(llm_plan(), weights_dir=str(tmp_path))


def test_truncated_shard_is_named(tmp_path):
    tiny_llama(tmp_path, is_tied=True, max_shard_size="10MB")
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    dims = read_checkpoint_config(str(tmp_path))
    with pytest.raises(WeightsError, match="cannot read model.safetensors"):
        load_decoder(lambda: Decoder(dims), str(tmp_path), True)


def test_large_finite_values_pass_the_finite_check(tmp_path):
    """The NaN/Inf check sums each tensor first; values whose sum overflows are still finite."""
    from safetensors.torch import load_file, save_file

    tiny_llama(tmp_path, is_tied=True, max_shard_size="10MB")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = torch.full((64, 32), 3e38)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    dims = read_checkpoint_config(str(tmp_path))
    model = load_decoder(lambda: Decoder(dims), str(tmp_path), True)
    assert float(model.model.layers[0].mlp.up_proj.weight.detach().max()) == pytest.approx(3e38)
    weights["model.layers.0.mlp.up_proj.weight"][5, 7] = float("nan")
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="up_proj.weight holds 1 NaN"):
        load_decoder(lambda: Decoder(dims), str(tmp_path), True)
