"""What a plan's audio prompt takes: a waveform at one sample rate, at most so many samples.

In: a plan. Out: `takes_waveform(plan)`: every node input taking the audio prompt (`media prompt
audio`) belongs to an encoder whose front end turns a waveform into its features, and there is at
least one; `audio_input_of(plan) -> AudioInput` (the nodes, the sample rate, the most samples one
request may bring), or None when the plan takes no waveform. The stand-in encoder
(engine/models/encoders.py) takes feature frames, which no WAV file gives, so a plan whose audio
prompt goes to it takes no waveform.

Which encoders take a waveform is the plan's `style` argument (a closed set of model kinds,
mstar/plan/node_args.py ENCODER_STYLES), never a node's name: `whisper` computes Whisper's log-mel
features (engine/models/log_mel.py) from 16 kHz samples over one 30 s window, so it takes at most
480000 samples a window; a plan whose partition holding those nodes repeats (`repeat while VALUE
max=N`, docs/models.md "Long form") transcribes a longer clip window by window, so it takes N
windows; `qwen3_asr`
computes the same features over the whole clip (engine/models/qwen3_asr.py), and its spec bounds
the states at 30 s of audio, so the same window applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mstar.plan.rounds import max_rounds
from mstar.plan.schema import NodePlan, Plan

WAVEFORM_STYLES = ("whisper", "qwen3_asr")


@dataclass(frozen=True)
class AudioInput:
    nodes: tuple[str, ...]  # the nodes taking the audio prompt
    sample_rate: int  # Hz
    max_samples: int  # the front end's window times the rounds its partition may repeat
    window_samples: int  # one window of the front end

    @property
    def max_seconds(self) -> float:
        return self.max_samples / self.sample_rate


def _audio_nodes(plan: Plan) -> list[NodePlan]:
    return [node for node in plan.nodes if any(i.prompt == "audio" for i in node.input_roles)]


def takes_waveform(plan: Plan) -> bool:
    nodes = _audio_nodes(plan)
    return bool(nodes) and all(n.model_kind == "audio_encoder" and n.dims.get("style") in WAVEFORM_STYLES
                               for n in nodes)


def audio_input_of(plan: Plan) -> Optional[AudioInput]:
    if not takes_waveform(plan):
        return None
    # brings torch: only once a request needs the numbers (a simulated server never imports it)
    from mstar.runtime.engine.models.log_mel import NUM_SAMPLES, SAMPLE_RATE

    nodes = tuple(n.name for n in _audio_nodes(plan))
    # Each round of the audio nodes' partition transcribes one window.
    return AudioInput(nodes, SAMPLE_RATE, NUM_SAMPLES * max_rounds(plan, nodes), NUM_SAMPLES)
