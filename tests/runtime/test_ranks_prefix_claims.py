"""`RankEngines.claim_prefix` (serve/ranks/controller.py) over a stand-in channel: where a claim goes
and what a disagreement between a TP group's ranks does. The claims on real rank processes are in
test_ranks_processes.py."""
from __future__ import annotations

import pytest

from mstar.compiler.driver import compile_spec
from mstar.compiler.emit import write_outputs
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import load_plan
from mstar.runtime.serve.ranks.channel import Message, RankFailure
from mstar.runtime.serve.ranks.controller import RankEngines
from runtime_plans import ROOT


class _Channel:
    """Records what rank 0 sends; each rank answers a claim with its own count."""

    def __init__(self, counts: dict[int, int]):
        self.counts, self.sent = counts, []

    def send(self, dst, kind, body, tensors=None, timeout_s=None):
        self.sent.append((dst, kind, body))

    def recv(self, src, timeout_s=None, what="answering"):
        return Message("claimed", {"num_tokens": self.counts[src]})


class _Local:
    def __init__(self, count: int):
        self.count, self.claims = count, []

    def claim_prefix(self, request_id, node, tokens):
        self.claims.append((request_id, node))
        return self.count


def _plan(tmp_path, config):
    deployment = tmp_path / f"{config}.yaml"
    deployment.write_text((ROOT / "configs" / f"{config}.yaml").read_text() + "\nprefix_cache: true\n")
    diags = Diagnostics()
    compiled = compile_spec(ROOT / "specs" / "orpheus.mw", deployment, diags, tmp_path)
    assert compiled is not None, diags.render()
    write_outputs(compiled.plan_path, compiled.plan_text, compiled.glue_path, compiled.glue_text)
    return load_plan(str(compiled.plan_path))


def _engines(plan, local, channel):
    engines = RankEngines(plan, None, channel, 2, 1.0)  # built without rank 0's executor: no caps to copy
    engines.local = local
    return engines


def test_a_tp_group_claims_on_both_ranks_and_the_kv_starts_there(tmp_path):
    channel, local = _Channel({1: 32}), _Local(32)
    engines = _engines(_plan(tmp_path, "orpheus_tp2"), local, channel)
    assert engines.claim_prefix("r", "LLM", list(range(40))) == 32
    assert local.claims == [("r", "LLM")] and [(dst, kind) for dst, kind, _ in channel.sent] == [(1, "claim_prefix")]
    assert engines.homes.home[("r", "LLM")] == (0, 1)
    assert engines.claim_prefix("r", "snac_decoder", [1, 2]) == 0  # no prefix walk of that node: nothing sent
    assert len(channel.sent) == 1


def test_ranks_that_disagree_lose_the_run_naming_them(tmp_path):
    engines = _engines(_plan(tmp_path, "orpheus_tp2"), _Local(32), _Channel({1: 16}))
    with pytest.raises(RankFailure, match="rank 1 found 16 cached tokens of request r on LLM where rank 0 found 32"):
        engines.claim_prefix("r", "LLM", list(range(40)))
    assert engines.claim_prefix("s", "LLM", list(range(40))) == 0  # lost: nothing more is sent
