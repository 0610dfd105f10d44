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
    assert ("MW316", "sp_size 2 for node codec, which is not marked `tp`") in found, found
