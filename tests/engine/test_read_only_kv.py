"""Read-only KV walks: `kv WALK reads main` (no `writes`) makes that walk's rows attend over the
sequence without extending it, whatever the walk's inputs are (the plan's kv access says so; no
input name or role decides it)."""
from pathlib import Path

from mstar.compiler.driver import compile_spec
from mstar.compiler.emit import write_outputs
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

SPEC = """model ro
param num_probes = 3
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=16, hidden=64, intermediate=128, vocab=512) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    kv_sequences main
    kv prefill writes main
    kv probe ACCESS main
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist
}
walk probe {
    loop probes max=num_probes {
        LLM(text_inputs)
            -> text_inputs: LLM
            -> new_token: client text
    }
}
partition P = prefill -> probe
"""
CONFIG = """model: ro
max_seq_len: 64
node_groups:
  - node_names: [LLM]
    ranks: [0]
"""


def run(tmp_path: Path, access: str, monkeypatch) -> tuple[list[int], int]:
    """(client tokens, tokens in `main` when the request ended) for `kv probe ACCESS main`."""
    (tmp_path / "specs").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    (tmp_path / "specs" / "ro.mw").write_text(SPEC.replace("ACCESS", access))
    (tmp_path / "configs" / "ro.yaml").write_text(CONFIG)
    diags = Diagnostics()
    result = compile_spec(tmp_path / "specs" / "ro.mw", tmp_path / "configs" / "ro.yaml", diags)
    assert result is not None, diags.render()
    write_outputs(result.plan_path, result.plan_text, result.glue_path, result.glue_text)
    plan = load_plan(str(result.plan_path))
    lengths = []
    end_request = DecoderRunner.end_request

    def recording(self, request_id):
        lengths.append(self.pool.num_tokens((request_id, "main")))
        end_request(self, request_id)

    monkeypatch.setattr(DecoderRunner, "end_request", recording)
    driver = Driver(plan, TorchEngine(plan, seed=3))
    driver.run(Workload([Request(id="r", prompt_tokens=[5, 6, 7, 8], max_tokens=10)]))
    record = driver.conductor.records["r"]
    assert record.finish_reason in ("stop", "done", "length"), record.finish_reason
    return [e.value[0] for e in record.emissions], lengths[0]


def test_a_read_only_walk_attends_without_extending_the_sequence(tmp_path, monkeypatch):
    read_only, read_length = run(tmp_path / "r", "reads", monkeypatch)
    writing, write_length = run(tmp_path / "w", "writes", monkeypatch)
    assert read_length == 4  # the prompt only: three probe rows attended and wrote nothing
    assert write_length == 4 + 3  # prefill's 4, then each probe row's one token
    # the first probe row sees the same context either way, so its token is the same
    assert read_only[:2] == writing[:2]
    assert len(read_only) == len(writing) == 4
