"""Behaviour a mutation audit found no test holding: sp_size > 1 for a node not marked
`tp` is MW316, as tp_size > 1 is (check_deployment.py)."""
from pathlib import Path

from checks_golden import check_texts

FIXTURES = Path(__file__).parent / "fixtures"
BASE = (FIXTURES / "base.mw").read_text()
BASE_OK = (FIXTURES / "base_ok.yaml").read_text()


def test_sp_size_for_a_node_not_marked_tp_is_refused():
    config = BASE_OK.replace("  - node_names: [codec]\n    ranks: [0]\n",
                             "  - node_names: [codec]\n    ranks: [0, 1]\n    sp_size: 2\n")
    assert config != BASE_OK
    found = [(d.code, d.message) for d in check_texts(BASE, config).sorted()]
    assert ("MW316", "sp_size 2 for node codec, which is not marked `tp`: give the group sp_size 1 (its ranks are "
                     "then replicas), or mark the node `tp` after its engine (`node codec stateless audio_codec(...) "
                     "tp {`)") in found, found


def test_sp_size_above_one_is_refused_for_any_node():
    """The engines run no sequence parallelism: MW327 (the sim ran such a plan, every engine refused it)."""
    config = BASE_OK.replace("    tp_size: 2\n", "    sp_size: 2\n")
    assert config != BASE_OK
    found = [d.code for d in check_texts(BASE, config).sorted()]
    assert found == ["MW327"], found


def test_a_sub_model_whose_widths_do_not_split_over_the_tp_group_is_refused():
    """Sub-models are sharded with their node: intermediate=129 over tp_size 2 passed mstarc and the
    runtime refused it at start-up; 128 splits."""
    for width, codes in ((129, ["MW326"]), (128, [])):
        spec = BASE.replace(") tp {", f") tp {{\n    submodel expert(intermediate={width}) for decode", 1)
        assert spec != BASE
        found = [(d.code, d.message) for d in check_texts(spec, BASE_OK).sorted()]
        assert [code for code, _ in found] == codes, found
        assert all("sub-model expert: intermediate=129 is not a multiple of 2" in message for _, message in found)
