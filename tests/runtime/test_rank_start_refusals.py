"""Start-up refusals of ranks as processes, without spawning any: a plan that needs more GPUs than
the machine has is refused before a rank builds its models, and a rank whose engine is refused
while rank 0 is still busy building its own exits quietly (rank 0 then reports it exited while
starting), instead of printing a traceback of the undelivered message."""
import pytest
import torch

from mstar.plan.io import load_plan
from mstar.runtime.serve.ranks import launch
from mstar.runtime.serve.ranks.channel import RankFailure
from mstar.runtime.serve.ranks.worker import RankOptions


def test_a_plan_of_more_ranks_than_gpus_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(launch.LaunchError, match="runs 2 ranks, one GPU each .* this machine has 1"):
        launch._check_gpus("cuda", 2)
    launch._check_gpus("cuda", 1)
    launch._check_gpus("cpu", 8)  # CPU ranks share the host


def test_a_refused_rank_exits_quietly_when_rank_0_cannot_take_the_message(monkeypatch):
    class Unheard:
        def __init__(self, _problem):
            pass

        def send(self, _dst, kind, *_args, **_kwargs):
            if kind == "hello":  # taken: rank 0 reads the hellos before it builds its engine
                return
            raise RankFailure(0, "hangs: no progress taking a message within the rank timeout")

    def refuse(*_args):
        raise ValueError("--device cuda:1: there are only 1 CUDA device(s)")

    monkeypatch.setattr(launch, "Channel", Unheard)
    monkeypatch.setattr(launch, "tp_comms", lambda *args: None)
    monkeypatch.setattr(launch, "build_executor", refuse)
    with pytest.raises(SystemExit) as exited:
        launch.run_rank(load_plan("generated/orpheus.plan"), 1, 1, RankOptions(), lambda peer: None)
    assert exited.value.code == 1


def test_a_refused_rank_tells_rank_0_one_line(monkeypatch):
    """A torch error's message carries its C++ frames: rank 0 printed them all, twice."""
    sent = []

    class Heard:
        def __init__(self, _problem):
            pass

        def send(self, _dst, kind, body=None, **_kwargs):
            sent.append((kind, body))

    def refuse(*_args):
        raise TypeError("empty(): argument 'size' failed to unpack\nException raised from THPUtils_unpackLong\n"
                        "frame #0: c10::Error::Error")

    monkeypatch.setattr(launch, "Channel", Heard)
    monkeypatch.setattr(launch, "tp_comms", lambda *args: None)
    monkeypatch.setattr(launch, "build_executor", refuse)
    launch.run_rank(load_plan("generated/orpheus.plan"), 1, 1, RankOptions(), lambda peer: None)
    assert sent[-1] == ("fatal", {"message": "cannot start its engine: empty(): argument 'size' failed to unpack"})
