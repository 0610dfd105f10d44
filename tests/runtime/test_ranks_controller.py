"""`RankEngines` (serve/ranks/controller.py) over a stand-in channel: where a prefix claim goes and
what a disagreement between a TP group's ranks does; how the ranks' KV offload figures add up. Both
on real rank processes are in test_ranks_processes.py."""
from __future__ import annotations

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.serve.ranks.channel import Message, RankFailure
from mstar.runtime.serve.ranks.controller import RankEngines
from plan_variants import compiled
from runtime_plans import ROOT


class _Channel:
    """Records what rank 0 sends; each rank answers a claim with its own count, and the offload
    figures with its own."""

    def __init__(self, counts: dict[int, int], figures: dict | None = None):
        self.counts, self.figures, self.sent = counts, figures or {}, []

    def send(self, dst, kind, body, tensors=None, timeout_s=None):
        self.sent.append((dst, kind, body))

    def recv(self, src, timeout_s=None, what="answering"):
        if self.sent[-1][1] == "offload_figures":
            return Message("offload", {"figures": self.figures[src]})
        return Message("claimed", {"num_tokens": self.counts[src]})


class _Local:
    def __init__(self, count: int, figures: dict | None = None):
        self.count, self.figures, self.claims = count, figures or {}, []
        self.engine = self  # RankExecutor.engine: the offload figures come from rank 0's engine

    def claim_prefix(self, request_id, node, tokens):
        self.claims.append((request_id, node))
        return self.count

    def offload_figures(self):
        return self.figures


def _plan(tmp_path, config):
    deployment = tmp_path / f"{config}.yaml"
    deployment.write_text((ROOT / "configs" / f"{config}.yaml").read_text() + "\nprefix_cache: true\n")
    return load_plan(str(compiled(ROOT / "specs" / "orpheus.mw", deployment, tmp_path)))


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


def _moved(offloaded: int, restored: int) -> dict:
    return {"LLM": {"offloaded_pages": offloaded, "restored_pages": restored}}


def test_a_tp_groups_offload_figures_count_once(tmp_path):
    """Each rank of a TP group moves its shard of the same pages: the group's figure is its leader's."""
    engines = _engines(_plan(tmp_path, "orpheus_tp2"), _Local(0, _moved(5, 3)), _Channel({}, {1: _moved(5, 3)}))
    assert engines.offload_figures() == _moved(5, 3)


def test_the_offload_figures_of_a_nodes_instances_add_up(tmp_path):
    """Prefill on rank 0 and decode on rank 1, each with a pool of its own: the node's figures are the sum."""
    engines = _engines(_plan(tmp_path, "orpheus_pd_disaggregated"), _Local(0, _moved(4, 0)),
                       _Channel({}, {1: _moved(2, 1)}))
    assert engines.offload_figures() == _moved(6, 1)


def test_no_offload_figures_from_a_lost_run_or_mid_step(tmp_path):
    """A rank that may not answer (the run is lost), or whose step's answer is due first: None."""
    channel = _Channel({}, {1: _moved(5, 3)})
    engines = _engines(_plan(tmp_path, "orpheus_tp2"), _Local(0, _moved(5, 3)), channel)
    engines.running.add(1)
    assert engines.offload_figures() is None
    engines.running.clear()
    engines.lost = "rank 1 exited"
    assert engines.offload_figures() is None
    assert channel.sent == []


class _Answers(_Channel):
    def __init__(self, answer: Message):
        super().__init__({})
        self.answer = answer

    def recv(self, src, timeout_s=None, what="answering"):
        return self.answer


@pytest.mark.parametrize("local, answer, says", [
    (RuntimeError("Timed out waiting 3000ms for recv"), Message("step_error", {"message": "pair closure"}),
     "rank 1 failed a tensor-parallel step, which leaves its group's collectives out of step: pair closure"),
    (RuntimeError("Timed out waiting 3000ms for recv"), Message("done", {}),
     "rank 0 failed a tensor-parallel step, .*: RuntimeError: Timed out waiting 3000ms"),
])
def test_a_failed_tensor_parallel_step_loses_the_run(tmp_path, local, answer, says):
    """A rank paused past --rank-timeout: rank 0's collective timed out, gloo closed the group's
    connections, and as an ordinary step failure every later step failed with the transport's
    message while the run exited 0."""
    from mstar.runtime.step import StepHandle

    engines = _engines(_plan(tmp_path, "orpheus_tp2"), _Local(0), _Answers(answer))
    with pytest.raises(RankFailure, match=says):
        engines.wait(StepHandle(step=None, pending=((0, 1), [], local)))
    assert engines.lost is not None and engines.add_request("s", None).startswith("not run: rank")
