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


@pytest.mark.parametrize("rank", [0, 1])
def test_a_torchrun_rendezvous_nobody_answers_is_refused_within_the_start_timeout(monkeypatch, rank):
    """Rank 1 given a port nobody listens on, or rank 0 whose rank 1 never comes: env:// waited the
    group's 2-hour timeout inside C++, where Ctrl-C and SIGTERM did not reach Python."""
    import socket
    import time

    with socket.socket() as probe:  # a free port, closed again: nobody listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(launch, "START_TIMEOUT_S", 2.0)
    began = time.monotonic()
    with pytest.raises(launch.LaunchError, match=f"the torchrun rendezvous at 127.0.0.1:{port} did not complete"):
        launch.join_env_group()
    assert time.monotonic() - began < 60


def _serve_torchrun_losing_rank_0(monkeypatch, error: Exception) -> None:
    """`serve_torchrun` on rank 1 of a torchrun launch whose rank loop raises `error` (rank 0 gone)."""
    def gone(*_args):
        raise error

    monkeypatch.setattr(launch, "join_env_group", lambda: None)
    monkeypatch.setattr(launch.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(launch.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(launch, "run_rank", gone)
    launch.serve_torchrun(load_plan("generated/orpheus.plan"), RankOptions())


def test_a_torchrun_rank_whose_rank_0_is_gone_says_so(monkeypatch):
    """It was `mstar: internal error (RankFailure: rank 0 closed its connection ...); this is a bug`."""
    lost = RankFailure(0, "closed its connection ([gloo/pair.cc:553] Connection closed by peer)\nmore")
    with pytest.raises(launch.LaunchError, match=r"^rank 0 is gone, so this rank stops \(rank 0 closed its connection"):
        _serve_torchrun_losing_rank_0(monkeypatch, lost)


@pytest.mark.parametrize("flags, says", [(["--engine", "sim"], "--engine sim"),
                                         (["--ranks", "inproc"], "--ranks inproc")])
def test_torchrun_with_a_one_process_run_is_refused(monkeypatch, capsys, flags, says):
    """Each of torchrun's processes ran the whole workload, writing over the others' --out."""
    from mstar.cli.mstar import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", "--plan", "generated/orpheus_tp2.plan", "--requests", "1", "--no-progress", *flags]) == 1
    assert f"but {says} runs every rank in one process: run it without torchrun" in capsys.readouterr().err


def test_an_error_without_text_is_named_by_its_type(monkeypatch):
    """An empty message made the one-line summary raise IndexError where rank 0's loss was said."""
    with pytest.raises(launch.LaunchError, match=r"^rank 0 is gone, so this rank stops \(DistError\)$"):
        _serve_torchrun_losing_rank_0(monkeypatch, launch.dist.DistError())
