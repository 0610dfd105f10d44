"""`--weights [NODE=]DIR`: which kv node gets which checkpoint (mstar.runtime.engine.weights.weights_by_node)."""
import pytest

from mstar.runtime.engine.weights import WeightsError, weights_by_node


def test_a_bare_directory_goes_to_the_only_kv_node():
    assert weights_by_node(["LLM"], "ckpt") == {"LLM": "ckpt"}
    assert weights_by_node(["LLM"], ["ckpt"]) == {"LLM": "ckpt"}
    assert weights_by_node(["LLM"], None) == {}


def test_named_nodes_on_a_plan_with_several_kv_nodes():
    assert weights_by_node(["Thinker", "Talker"], ["Thinker=a", "Talker=b"]) == {"Thinker": "a", "Talker": "b"}
    assert weights_by_node(["Thinker", "Talker"], ["Talker=b"]) == {"Talker": "b"}  # Thinker stays random


def test_a_directory_whose_name_holds_an_equals_sign(tmp_path):
    odd = tmp_path / "lr=3e-4"
    odd.mkdir()
    assert weights_by_node(["LLM"], [str(odd)]) == {"LLM": str(odd)}


@pytest.mark.parametrize("nodes, entries, message", [
    (["Thinker", "Talker"], ["ckpt"], "the plan has 2 kv nodes (Thinker, Talker)"),
    ([], ["ckpt"], "the plan has 0 kv nodes (none)"),
    (["LLM"], ["Talker=ckpt"], "'Talker' is not a kv or audio codec node of the plan (those nodes: LLM)"),
    (["LLM"], ["LLM=a", "b"], "node LLM already gets a"),
])
def test_refused(nodes, entries, message):
    with pytest.raises(WeightsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        weights_by_node(nodes, entries)
