"""Pi0.5 (specs/pi05.mw) on the CPU engine at tiny dims: the prefix expert prefills the image and
the instruction, the action expert (a sub-model of the LLM node) denoises an action chunk over the
prefix KV for the spec's 10 flow steps, and the chunk reaches the client as `client action`, also
in outputs.jsonl."""
import json
from pathlib import Path

import torch

from mstar.cli.mstarc import main as mstarc_main
from mstar.compiler import check_roles
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.results import ResultWriter

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "generated" / "pi05.plan"


def test_pi05_denoises_one_action_chunk_per_request_on_the_action_expert(tmp_path):
    plan = load_plan(str(PLAN))
    engine = TorchEngine(plan)
    flow_steps: dict[str, int] = {}
    launch = engine.launch

    def counting(step):
        for row in step.rows:
            if row.walk == "action_gen":
                flow_steps[row.request_id] = flow_steps.get(row.request_id, 0) + 1
        return launch(step)

    engine.launch = counting  # type: ignore[method-assign]
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id=r, prompt_tokens=[5, 6, 7], max_tokens=1, seed=i) for i, r in enumerate("ab")]))
    records = driver.conductor.records
    chunks = {}
    for request_id, record in records.items():
        assert record.finish_reason in ("stop", "done"), record.finish_reason
        actions = [e.value for e in record.emissions if e.modality == "action"]
        assert len(actions) == 1 and actions[0].dtype == torch.float32
        chunks[request_id] = actions[0]
    expert = engine.runners["LLM"].models_by_walk["action_gen"]  # type: ignore[attr-defined]
    node = engine.runners["LLM"].model  # type: ignore[attr-defined]
    # tiny dims: the expert keeps half the node's width (1024 of 2048) and its latent shape
    assert (expert.dims.hidden * 2, chunks["a"].shape) == (node.dims.hidden, (expert.dims.latent_tokens,
                                                                              expert.dims.latent_channels))
    assert flow_steps == {"a": 10, "b": 10}  # num_flow_steps, no early stop
    assert not torch.equal(chunks["a"], chunks["b"])  # each request's own seeded noise

    writer = ResultWriter(str(tmp_path), 24000)
    writer.write(records["a"])
    writer.close()
    line = json.loads((tmp_path / "outputs.jsonl").read_text())
    assert line["actions"] == [chunks["a"].tolist()] and line["media"] == []


def test_a_client_action_edge_carries_flow_latents():
    text = (ROOT / "specs" / "pi05.mw").read_text()
    wrong = text.replace("-> timestep_index: LLM\n", "-> timestep_index: client action\n")
    diags = Diagnostics()
    spec = parse(wrong, "pi05.mw", diags)
    assert spec is not None, diags.render()
    check_roles.run(spec, diags)
    assert ("error[MW118]: `client action` carries `flow_latents`, but output timestep_index of node LLM is "
            "`flow_time`") in diags.render()


def test_explain_lists_the_action_expert(capsys):
    assert mstarc_main(["explain", str(PLAN)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console may wrap long lines
    assert ("LLM submodel action_expert (hidden=1024 intermediate=4096 latent_channels=32 latent_tokens=50) "
            "for action_gen") in out
