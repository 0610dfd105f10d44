"""V-JEPA 2-AC (specs/vjepa2_ac.mw, stand-in networks at tiny dims) through `mstar run --prompts`:
the rollout loop accumulates one prediction per step, for the request's own horizon, and hands them
to the client once, in step order (outputs.jsonl `latents`: one emission, a list per step); the
streaming rollout emits the same predictions one step at a time; the encoder-only walk returns the
frames' features."""
import json
from pathlib import Path

import numpy as np

from mstar.cli.mstar import main

PLAN = Path(__file__).resolve().parents[2] / "generated" / "vjepa2_ac.plan"


def run_prompts(tmp_path: Path, lines: list[dict]) -> dict[str, dict]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", "--plan", str(PLAN), "--prompts", str(prompts), "--out", str(tmp_path / "out")]) == 0
    outputs = [json.loads(text) for text in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    return {line["id"]: line for line in outputs}


def test_the_rollout_accumulates_one_prediction_per_step(tmp_path):
    # the same actions and seed (the stand-in frames are seeded by it): the same predictions
    common = {"prompt_tokens": [5, 6, 7], "max_tokens": 64, "seed": 11}
    outputs = run_prompts(tmp_path, [
        {"id": "rollout", "loop_counts": {"rollout_horizon": 4}, **common},
        {"id": "streamed", "loop_counts": {"rollout_horizon": 4},
         "route": {"VJEPA": ["prefill_video_rollout_streaming"]}, **common},
        {"id": "full", **common},
        {"id": "features", "route": {"VJEPA": ["prefill_video_encoder_only"]}, **common},
    ])
    assert all(line["finish_reason"] == "stop" for line in outputs.values()), outputs
    (steps,) = outputs["rollout"]["latents"]  # one emission: the accumulated list
    assert len(steps) == 4
    assert steps == outputs["streamed"]["latents"]  # step by step, in the same order
    firsts = [np.asarray(step)[-1] for step in steps]
    assert all(not np.allclose(a, b) for a, b in zip(firsts, firsts[1:]))  # each step moves on from the last
    (full,) = outputs["full"]["latents"]
    assert len(full) == 16  # without a horizon of its own: the spec's rollout_horizon
    assert full[:4] == steps  # a longer rollout begins with the same steps
    (features,) = outputs["features"]["latents"]
    assert np.asarray(features).ndim == 2
