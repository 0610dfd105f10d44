"""Shared builders for the compiler tests: specs and deployments from short texts."""
from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

from mstar.compiler import lower
from mstar.compiler.deployment import Deployment, parse_deployment
from mstar.compiler.driver import check_spec
from mstar.lang.ast import Spec
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse
from mstar.plan.schema import Hashes, Header, Plan


def spec_from(text: str) -> Spec:
    diags = Diagnostics()
    spec = parse(textwrap.dedent(text), "test.mw", diags)
    assert spec is not None and not diags.has_errors, diags.render()
    return spec


def deployment_from(text: str, name: str = "test") -> Deployment:
    diags = Diagnostics()
    deployment = parse_deployment(textwrap.dedent(text), f"{name}.yaml", diags)
    assert deployment is not None and not diags.has_errors, diags.render()
    deployment._name = name
    return deployment


def blank_header(model: str = "test") -> Header:
    return Header(
        compiler_version="test", model=model, deployment="test", spec_path="s.mw",
        deployment_path="d.yaml", glue_path="g.py", hashes=Hashes(spec="", deployment="", glue=""),
    )


def checked_plan(spec_text: str, config_text: str) -> Plan:
    """The plan of a spec and deployment that pass every check (`mstarc check`), lowered: a test of
    lowering on a spec the checks refuse would hold rules no plan meets."""
    diags = Diagnostics()
    with tempfile.TemporaryDirectory() as folder:
        spec_path, config_path = Path(folder) / "test.mw", Path(folder) / "test.yaml"
        spec_path.write_text(textwrap.dedent(spec_text))
        config_path.write_text(textwrap.dedent(config_text))
        checked = check_spec(spec_path, config_path, diags)
    assert checked is not None and not diags.has_errors, diags.render()
    return lower.run(checked.spec, checked.deployment, blank_header())


# A small Orpheus-like model: an LLM with prefill and decode combined, a stateless codec
# streamed to, used by several tests with different deployments.
TTS_SPEC = """
model tts
param max_output_tokens = 100

node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=16, hidden=64, vocab=128) tp {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    cap prefill 8
    cap decode 32
    capture decode batched batch=[1, 2, 4, 8, 16, 32]
    capture prefill packed batch=[1, 2, 4, 8] tokens=[32, 64]
    combine mixed = prefill + decode {
        rows prefill <= 2
        capture packed batch=[1, 4, 16] tokens=[64, 128]
        attention packed
    }
}

node codec stateless audio_codec {
    in new_token stream: tokens
    out audio: audio
    capture chunk batched batch=[1, 2, 4]
}

walk prefill {
    LLM(text_inputs)
        -> new_token: conductor persist count_tokens
        -> new_token: codec stream
}

walk decode {
    loop decode_loop max=max_output_tokens stop {
        LLM(text_inputs)
            -> text_inputs: LLM device
            -> new_token: codec stream
    }
}

walk chunk {
    codec(new_token) -> audio: client audio
}

partition LLM = prefill -> decode
partition CODEC = chunk <- LLM.new_token window(14, stride=7)
"""

COLOCATED = """
model: tts
max_seq_len: 4096
node_groups:
  - node_names: [LLM, codec]
    ranks: [0]
"""

PD_SPLIT = """
model: tts
max_seq_len: 4096
node_groups:
  - node_names: [LLM]
    ranks: [0]
    graph_walks: [prefill]
  - node_names: [LLM]
    ranks: [1]
    graph_walks: [decode]
  - node_names: [codec]
    ranks: [0]
speculation_mixes_walks: [LLM.decode]
"""

TP2 = """
model: tts
max_seq_len: 4096
node_groups:
  - node_names: [LLM]
    ranks: [0, 1]
    tp_size: 2
  - node_names: [codec]
    ranks: [2]
kv_pool:
  page_size: 16
  num_pages: 512
max_concurrent_requests: 64
"""
