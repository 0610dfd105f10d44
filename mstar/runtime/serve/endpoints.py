"""Which OpenAI-style endpoints a plan serves, read from its roles, never from a name.

In: a plan. Out: `Endpoints` with, per kind of request, whether the plan can serve it and the
route a request of that kind takes:
- text (`/v1/completions`, `/v1/chat/completions`): some node input takes the text prompt, some
  walk emits text to the client, and the route a request without one takes (the first walk of
  every required stage) takes no prompt media: a text request has none to give (Qwen3-ASR's
  encoder failed every such request, a 500; Whisper's transcribed stand-in noise);
- speech (`/v1/audio/speech`): a text prompt and an audio emission to the client;
- images (`/v1/images/generations`): a text prompt and an image emission to the client; the
  route takes, in each partition with a walk that emits images, every required stage, choosing
  at each the first alternative that emits images (else the first), and leaves optional stages
  out (they take prompt media, which a text-to-image request has none of);
- transcription (`/v1/audio/transcriptions`): an audio prompt that takes a waveform (its encoder
  has a front end for one, serve/audio_input.py) and a text emission to the client.
Client emissions are the edges with `dest_kind == "client"` of every call and loop exit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

from mstar.arg_types import shown
from mstar.plan.client_images import image_outputs
from mstar.plan.schema import EdgePlan, Plan, WalkPlan
from mstar.plan.stages import default_walks
from mstar.runtime.serve.audio_input import takes_waveform


@dataclass(frozen=True)
class Endpoints:
    prompt_modalities: frozenset[str]
    emitted_modalities: frozenset[str]
    image_route: dict[str, list[str]] = field(default_factory=dict)
    takes_waveform: bool = False  # the audio prompt's encoders take samples (not feature frames)
    default_route_takes_media: bool = False  # a request without a route gives some call prompt media
    image_nodes: frozenset[str] = frozenset()  # the nodes whose calls on the image route send the client images

    @property
    def can_text(self) -> bool:
        return ("text" in self.prompt_modalities and "text" in self.emitted_modalities
                and not self.default_route_takes_media)

    @property
    def can_speech(self) -> bool:
        return "text" in self.prompt_modalities and "audio" in self.emitted_modalities

    @property
    def can_images(self) -> bool:
        return "text" in self.prompt_modalities and "image" in self.emitted_modalities

    @property
    def emits_media(self) -> bool:
        """The plan sends the client audio or images, which serve/media.py encodes (with torch: load it
        before serving, `load_media_encoders`, not in the first answer's step or handler)."""
        return bool(self.emitted_modalities & {"audio", "image"})

    @property
    def can_transcribe(self) -> bool:
        return "audio" in self.prompt_modalities and self.takes_waveform and "text" in self.emitted_modalities

    def names(self) -> list[str]:
        """The request kinds, for /v1/models and messages."""
        kinds = [("text", self.can_text), ("speech", self.can_speech), ("images", self.can_images),
                 ("transcription", self.can_transcribe)]
        return [name for name, is_on in kinds if is_on]


def _client_edges(walk: WalkPlan) -> Iterator[EdgePlan]:
    for call in walk.calls:
        yield from (edge for edge in call.edges if edge.dest_kind == "client")
    for loop in walk.loops:
        yield from (x.edge for x in loop.exits if x.edge is not None and x.edge.dest_kind == "client")


def endpoints_of(plan: Plan) -> Endpoints:
    prompts = prompt_modalities(plan)
    emits: dict[str, set[str]] = {w.name: {e.modality for e in _client_edges(w) if e.modality} for w in plan.walks}
    emitted = frozenset(m for modalities in emits.values() for m in modalities)
    route: dict[str, list[str]] = {}
    for part in plan.partitions:
        walks = [w for stage in part.stages for w in stage.walks]
        if not any("image" in emits.get(w, ()) for w in walks):
            continue
        route[part.name] = [next((w for w in stage.walks if "image" in emits.get(w, ())), stage.walks[0])
                            for stage in part.stages if not stage.is_optional]
    return Endpoints(prompts, emitted, route, takes_waveform(plan), bool(default_route_media(plan)),
                     _image_nodes(plan, {w for walks in route.values() for w in walks}))


def _image_nodes(plan: Plan, walk_names: set[str]) -> frozenset[str]:
    """The nodes whose calls in these walks send the client an image, directly or through a loop's
    exit."""
    return frozenset(node for w in plan.walks if w.name in walk_names for node, _ in image_outputs(w))


def image_size_problem(size: Optional[str], endpoints: Endpoints,
                       known: Mapping[str, tuple[int, int]]) -> Optional[str]:
    """Why an image request's `size` ("WIDTHxHEIGHT") cannot be met: the images the route's nodes
    make are of other sizes. None for no size, `auto`, or a node whose size the engine does not
    know (ranks as processes: another rank's node), where the size is not checked."""
    if size in (None, "auto") or not endpoints.image_nodes or not endpoints.image_nodes <= known.keys():
        return None
    made = sorted({f"{width}x{height}" for width, height in (known[n] for n in endpoints.image_nodes)})
    if size in made:
        return None
    return (f"size {shown(size)} is not supported: this server makes {' or '.join(made)} images (the plan's "
            f"image decoder at the dims it runs); leave it out or ask for auto")


def prompt_modalities(plan: Plan) -> frozenset[str]:
    """The modalities some node of the plan takes as its prompt (text among them)."""
    return frozenset(i.prompt for node in plan.nodes for i in node.input_roles if i.prompt is not None)


def default_route_media(plan: Plan) -> list[str]:
    """The prompt media (modalities) the calls of the default route take: the first alternative
    of every required stage (a walk, or a sequence of walks)."""
    return sorted(route_media(plan, {}))


def route_media(plan: Plan, route: dict[str, list[str]]) -> set[str]:
    """The prompt media the calls of a request's route take: the walks it names for a partition,
    the default (the first alternative of every required stage) for the others."""
    walks = {walk.name: walk for walk in plan.walks}
    taken = [name for part in plan.partitions for name in route.get(part.name, default_walks(part))]
    return {source.prompt for name in taken if name in walks for call in walks[name].calls
            for source in call.inputs if source.source == "prompt" and source.prompt not in (None, "text")}


def load_media_encoders(endpoints: Endpoints) -> None:
    """Import the media encoders (and torch) now where the plan emits audio or images: the first
    finished request's WAV or PNG imported them inside a step's post-process (`mstar run --out`:
    a qwen3_tts sim run's post-process mean 1.7-12 ms a step, 49-67 us after) or a server handler
    (the event loop blocked about a second)."""
    if endpoints.emits_media:
        import mstar.runtime.serve.media  # noqa: F401
