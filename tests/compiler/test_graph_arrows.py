"""`mstarc graph`'s arrows (compiler/graph_picture.py `_target`): every edge drawn to a call box of
its node lands on a call that takes the edge's input where one does, and a loop-back stays inside
its loop. wan22's denoise loop-backs (latents, time_index) pointed at `dit(text_embeds)` outside the
loop, and vjepa2_ac's `encoder_hidden` at `rollout_predictor(actions)`."""
from __future__ import annotations

from pathlib import Path

import pytest

from mstar.compiler import graph_picture
from mstar.compiler.lower_walks import lower_walks
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec_path", sorted((ROOT / "specs").glob("*.mw")), ids=lambda p: p.stem)
def test_every_arrow_lands_on_a_call_taking_its_input(spec_path):
    diags = Diagnostics()
    spec = parse(spec_path.read_text(), str(spec_path), diags)
    assert spec is not None, diags.render()
    for walk in lower_walks(spec, ast.values_by_name(spec.params)):
        layout = graph_picture._Layout()
        graph_picture._place(walk.body, 0, 0, 0, layout)
        for box in layout.boxes:
            for edge in box.call.edges:
                target = graph_picture._target(layout.boxes, box, edge) if edge.dest_kind == "node" else None
                if target is None:
                    continue
                takers = [b for b in layout.boxes if b.call.node == edge.dest and edge.name in b.call.inputs]
                if takers:
                    assert edge.name in target.call.inputs, (walk.name, box.call.node, edge.name)
                if edge.is_loop_back:
                    assert target.col <= box.col and target.loop_depth >= box.loop_depth, (walk.name, edge.name)
