"""The checked-in specs whose nodes hold two models run through `mstar run` on the CPU: Qwen3-TTS
(the Talker and its code predictor, a depth model: codebook 0 from the Talker, 1..3 at tiny dims
from the predictor) and Cosmos3 (the dit's understanding tower prefills, its generation tower, a
sub-model, denoises), one process and tensor-parallel over two rank processes alike."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from mstar.plan.io import load_plan
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.depth import DepthModel
from mstar.runtime.engine.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300.0  # interpreters, torch and (for TP) two rank processes on a busy 2-core machine


def mstar_run(tmp_path: Path, plan: str, *extra: str) -> dict[str, dict]:
    """id -> outputs.jsonl record, with its media bytes under "bytes"."""
    out = tmp_path / plan
    command = [sys.executable, "-m", "mstar.cli.mstar", "run", "--plan", str(ROOT / "generated" / f"{plan}.plan"),
               "--out", str(out), "--no-progress", *extra]
    process = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, stderr.decode()
    records = {}
    for line in (out / "outputs.jsonl").read_text().splitlines():
        record = json.loads(line)
        record["bytes"] = [(out / name).read_bytes() for name in record["media"]]
        records[record["id"]] = record
    return records


def test_qwen3_tts_speaks_with_its_code_predictor(tmp_path):
    plan = load_plan(str(ROOT / "generated" / "qwen3_tts.plan"))
    (talker,) = [n for n in plan.nodes if n.name == "Talker"]
    assert [(s.name, s.samples, s.depth, s.dims["vocab"]) for s in talker.submodels] == [
        ("code_predictor", "codec_tokens", 15, 2048)]
    runner = TorchEngine(plan).runners["Talker"]
    assert {walk: type(m) for walk, models in runner.depth_by_walk.items() for m in models.values()} == {
        "talker_prefill": DepthModel, "talker_decode": DepthModel}
    records = mstar_run(tmp_path, "qwen3_tts", "--requests", "2", "--output-len", "6..6")
    assert len(records) == 2
    for record in records.values():
        assert record["finish_reason"] in ("stop", "length") and record["bytes"] and record["bytes"][0][:4] == b"RIFF"


def test_cosmos3_towers_run_alone_and_tensor_parallel(tmp_path):
    plan = load_plan(str(ROOT / "generated" / "cosmos3.plan"))
    runner = TorchEngine(plan).runners["dit"]
    tower = runner.model_of("image_gen")
    assert isinstance(tower, Decoder) and tower is not runner.model and runner.model_of("prefill") is runner.model
    assert runner.model_of("video_gen") is tower
    alone = mstar_run(tmp_path, "cosmos3", "--requests", "1")
    sharded = mstar_run(tmp_path, "cosmos3_nano_tp2", "--requests", "1")
    assert alone.keys() == sharded.keys() and all(r["bytes"] for r in alone.values())
    for rid, record in alone.items():
        assert record["bytes"] == sharded[rid]["bytes"], rid  # the TP ranks' shards give the same image


def test_the_vae_decoder_takes_the_generation_towers_latents(tmp_path):
    """Cosmos3's generation tower makes 1024-token latents (its sub-model's `latent_tokens`), the dit
    node's own default is 4096: the VAE decoder was sized from the node's, and at spec dims every image
    request failed ("latents of shape (1024, 16); the decoder takes (4096, 16)"). Here at spec dims of a
    small dit (the VAE takes the dims of the model that runs the flow)."""
    import shutil

    from mstar.runtime.conductor.request import Request
    from mstar.runtime.serve.driver import Driver, Workload
    from plan_variants import compiled

    source = (ROOT / "specs" / "cosmos3.mw").read_text()
    header = "node dit kv(layers=36, kv_heads=8, qo_heads=32, head_dim=128, hidden=4096, vocab=151936) tp"
    small = source.replace(header, "node dit kv(layers=2, kv_heads=2, qo_heads=4, head_dim=16, hidden=64, "
                                   "intermediate=128, vocab=512) tp")
    tower = "submodel generation_tower("
    small = small.replace(tower + "hidden=4096,", tower + "hidden=64, intermediate=128,")
    assert small.count("hidden=64") == 2
    (tmp_path / "specs").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "specs" / "cosmos3.mw").write_text(small)
    shutil.copy(ROOT / "configs" / "cosmos3.yaml", tmp_path / "configs")
    plan = load_plan(compiled(tmp_path / "specs" / "cosmos3.mw", tmp_path / "configs" / "cosmos3.yaml", tmp_path))
    engine = TorchEngine(plan, dims="spec")
    driver = Driver(plan, engine)
    route = {"Cosmos": ["prefill", "image_gen"]}
    driver.run(Workload([Request(id="a", prompt_tokens=[5, 6, 7], max_tokens=1, route=route)]))
    record = driver.conductor.records["a"]
    assert record.finish_reason in ("stop", "length"), record.finish_reason
    assert any(e.modality == "image" for e in record.emissions)
