"""Ranks as processes (CPU, gloo): `mstar run --ranks processes` gives the same greedy tokens and
audio as one process, for a stream to another rank (orpheus), tensor parallelism (orpheus_tp2,
qwen3omni_thinker_tp2: each TP rank holds about half the LLM's weights) and prefill/decode
disaggregation (the KV pages move); a rank killed or frozen mid-run stops the run with an error
naming it, exit 1, its requests reported failed, and no process left behind; SIGINT ends every rank.

Every command runs in its own session and is killed with its whole process group in `finally`.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plan_variants import compiled
from runtime_plans import ROOT

pytestmark = pytest.mark.usefixtures("ordinary_signals")  # conftest.py: signals not inherited ignored

ORPHEUS_PD_TP_SWAPPED = """model: "orpheus"
max_seq_len: 131072
node_groups:
  - node_names: [LLM]
    ranks: [0, 1]
    tp_size: 2
    graph_walks: [prefill]
  - node_names: [LLM]
    ranks: [3, 2]
    tp_size: 2
    graph_walks: [decode]
  - node_names: [snac_decoder]
    ranks: [0]
    graph_walks: [snac_chunk]
kv_pool:
  page_size: 16
  num_pages: 16384
"""
START_TIMEOUT_S = 240.0  # interpreters and torch start-up, several processes, a busy 2-core machine
RUN = ["--requests", "3", "--output-len", "8..8", "--no-progress"]
# The most a run may take to stop after losing a rank before the test calls it a hang: the run
# notices a killed rank at once and a frozen one after --rank-timeout (3 s), so this only needs to
# sit far below the minutes its 400 requests would take, not near the expected few seconds.
LOST_RANK_STOP_S = 120.0


def _command(plan: str | Path, *extra: str) -> list[str]:
    """plan: a checked-in plan's name, or a plan file's path."""
    path = plan if isinstance(plan, Path) else ROOT / "generated" / f"{plan}.plan"
    return [sys.executable, "-m", "mstar.cli.mstar", "run", "--plan", str(path), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _run(tmp_path: Path, plan: str | Path, ranks: str, workload: tuple[str, ...] = tuple(RUN)) -> tuple[dict, dict]:
    """(id -> (tokens, finish reason, media bytes), report) of a small run."""
    name = plan.stem if isinstance(plan, Path) else plan
    out, report = tmp_path / f"{name}-{ranks}", tmp_path / f"{name}-{ranks}.json"
    process = subprocess.Popen(_command(plan, *workload, "--ranks", ranks, "--out", str(out), "--report", str(report)),
                               cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=START_TIMEOUT_S)
    finally:
        _kill_group(process)
    assert process.returncode == 0, stderr.decode()
    found = {}
    for line in (out / "outputs.jsonl").read_text().splitlines():
        record = json.loads(line)
        media = [(out / name).read_bytes() for name in record["media"]]
        found[record["id"]] = (record["output_tokens"], record["finish_reason"], media)
    return found, json.loads(report.read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same runs in one process: the reference every layout must reproduce."""
    tmp = tmp_path_factory.mktemp("inproc")
    return {plan: _run(tmp, plan, "inproc")[0] for plan in ("orpheus_colocated", "qwen3_omni")}


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """plan -> its run on rank processes, each made once for the tests of this module."""
    tmp, runs = tmp_path_factory.mktemp("processes"), {}

    def run(plan: str) -> tuple[dict, dict]:
        if plan not in runs:
            runs[plan] = _run(tmp, plan, "processes")
        return runs[plan]
    return run


@pytest.mark.parametrize("plan, reference", [
    ("orpheus", "orpheus_colocated"),  # LLM on rank 0, SNAC on rank 1: the token stream crosses ranks
    ("orpheus_tp2", "orpheus_colocated"),  # the LLM sharded over ranks 0 and 1
    ("orpheus_pd_disaggregated", "orpheus_colocated"),  # prefill on rank 0, decode on rank 1
    ("qwen3omni_thinker_tp2", "qwen3_omni"),  # the Thinker sharded over ranks 0 and 1, Talker on 2
])
def test_rank_processes_give_the_tokens_and_audio_of_one_process(processes, one_process, plan, reference):
    found, report = processes(plan)
    assert found == one_process[reference]
    ranks = report["ranks"]
    assert ranks["mode"] == "spawn"
    assert ranks["world_size"] == 1 + max(int(rank) for rank in ranks["memory"])
    assert (ranks["num_kv_moves"] == 3) == (plan == "orpheus_pd_disaggregated"), ranks


def test_a_moved_request_keeps_the_tokens_its_output_penalties_count(tmp_path):
    """Prefill on rank 0 samples the first token; the decode rank's presence and frequency
    penalties count it. Negative penalties make the first token win again at every step, so a
    decode rank that lost it (the KV move carried no sampled tokens) picks another."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt_tokens": [1, 9 + i, 10, 11], "max_tokens": 6,
                                           "presence_penalty": -2.0, "frequency_penalty": -2.0}) + "\n"
                               for i in range(2)))
    workload = ("--prompts", str(prompts), "--no-progress")
    moved, report = _run(tmp_path, "orpheus_pd_disaggregated", "processes", workload)
    alone, _ = _run(tmp_path, "orpheus_colocated", "inproc", workload)
    assert report["ranks"]["num_kv_moves"] == 2
    assert moved == alone
    assert all(len(set(tokens)) == 1 for tokens, _, _ in alone.values())  # the first token, again and again


LLAMA_PD = """model: "llama"
max_seq_len: 8192
node_groups:
  - node_names: [LLM]
    ranks: [0]
    graph_walks: [prefill]
  - node_names: [LLM]
    ranks: [1]
    graph_walks: [decode]
kv_pool:
  page_size: 16
  num_pages: 8192
"""


def test_kv_moves_between_tp_groups_listed_out_of_order_by_shard(tmp_path, one_process):
    """Prefill on TP group [0, 1], decode on a group listed [3, 2]: a rank's shard is its place in
    its group's ranks in ascending order, and the KV move paired ranks by their place in the plan's
    list (rank 0's shard 0 went to rank 3, which holds shard 1): decode read other heads' KV, every
    token past the first was wrong, and the run exited 0."""
    deployment = tmp_path / "orpheus_pd_tp.yaml"
    deployment.write_text(ORPHEUS_PD_TP_SWAPPED)
    plan = compiled(ROOT / "specs" / "orpheus.mw", deployment, tmp_path)
    found, report = _run(tmp_path, plan, "processes")
    assert report["ranks"]["num_kv_moves"] == 3
    assert found == one_process["orpheus_colocated"]


def test_log_probabilities_cross_ranks_as_one_process_gives_them(tmp_path):
    """Llama's prefill on rank 0 and decode on rank 1: the decode rank's rows answer their tokens'
    log-probabilities across ranks (RowResult's `logprobs`, sent beside its fields:
    serve/ranks/wire.py) as one process answers them."""
    deployment = tmp_path / "llama_pd.yaml"
    deployment.write_text(LLAMA_PD)
    plan = compiled(ROOT / "specs" / "llama.mw", deployment, tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt_tokens": [1, 9 + i, 10, 11], "max_tokens": 5,
                                           "logprobs": 2}) + "\n" for i in range(2)))
    workload = ("--prompts", str(prompts), "--no-progress")
    _, report = _run(tmp_path, plan, "processes", workload)
    assert report["ranks"]["num_kv_moves"] == 2
    _run(tmp_path, "llama", "inproc", workload)

    def logprobs(name: str) -> dict:
        lines = (tmp_path / name / "outputs.jsonl").read_text().splitlines()
        return {line["id"]: line["logprobs"] for line in map(json.loads, lines)}
    moved, alone = logprobs("llama_pd-processes"), logprobs("llama-inproc")
    assert moved.keys() == alone.keys() == {"r0", "r1"}
    for request_id, entries in alone.items():
        assert len(entries) == 5 and all(len(entry["top"]) == 2 for entry in entries)
        assert moved[request_id] == entries  # the same model, weights and kernels on either rank


def _orpheus_plan_with(tmp_path: Path, config: str, extra_yaml: str) -> Path:
    """specs/orpheus.mw compiled against configs/CONFIG.yaml with `extra_yaml` appended; the plan's path."""
    deployment = tmp_path / f"{config}_variant.yaml"
    deployment.write_text((ROOT / "configs" / f"{config}.yaml").read_text() + "\n" + extra_yaml)
    return compiled(ROOT / "specs" / "orpheus.mw", deployment, tmp_path)


def test_kv_offloaded_on_the_prefill_rank_moves_to_the_decode_rank_from_the_host(tmp_path):
    """Prefill on rank 0, decode on rank 1, a device pool too small for the clients (`--kv-pages
    40`) and a host pool: a request whose pages were offloaded on the prefill rank moves to the
    decode rank from its host pages (it had sent no KV at all, and decoded from nothing: other
    tokens than one process's with room for everyone)."""
    plan = _orpheus_plan_with(tmp_path, "orpheus_pd_disaggregated", "kv_cache:\n  cpu_offload_pages: 4096\n")
    workload = ("--requests", "16", "--concurrency", "16", "--prompt-len", "40..120", "--output-len", "20..40",
                "--no-progress")
    roomy, _ = _run(tmp_path, plan, "inproc", workload)
    tight, report = _run(tmp_path, plan, "processes", (*workload, "--kv-pages", "40"))
    assert tight == roomy
    assert report["num_oom_rows"] > 0 and report["ranks"]["num_kv_moves"] == 16
    # the report adds up the ranks' host pools (one node, the LLM, on the prefill and the decode rank;
    # pages offloaded on the prefill rank leave it from the host, never restored there)
    (_, moved), = report["kv_offload"].items()
    assert moved["offloaded_pages"] > 0, report["kv_offload"]


@pytest.mark.parametrize("config", ["orpheus_tp2", "orpheus_pd_disaggregated"])
def test_a_prefix_cache_claims_on_the_ranks_of_its_prefix_walks(tmp_path, config):
    """A deployment with `prefix_cache: true` on rank processes: the prompt's cached pages are
    claimed on every rank of the instance that runs the prefill (a TP group's two ranks; the
    prefill rank, whose KV then moves to the decode rank), and requests sharing a prefix one after
    another find it cached and give one process's tokens."""
    plan = _orpheus_plan_with(tmp_path, config, "prefix_cache: true\n")
    prompts = tmp_path / "prompts.jsonl"
    shared = list(range(200, 264))  # four whole pages of 16
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt_tokens": shared + [300 + i, 301 + i],
                                           "max_tokens": 6}) + "\n" for i in range(3)))
    workload = ("--prompts", str(prompts), "--concurrency", "1", "--no-progress")
    runs = {ranks: _run(tmp_path, plan, ranks, workload) for ranks in ("inproc", "processes")}
    (one, one_report), (found, report) = runs["inproc"], runs["processes"]
    assert found == one
    for figures in (one_report, report):
        assert (figures["num_prefix_lookups"], figures["num_prefix_hits"], figures["num_prefix_cached_tokens"]) == (
            3, 2, 2 * len(shared))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_torchrun_runs_the_same_command_as_one_rank_each(tmp_path, one_process):
    out, report = tmp_path / "out", tmp_path / "run.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "-m", "mstar.cli.mstar", "run",
               "--plan", str(ROOT / "generated" / "orpheus_tp2.plan"), *RUN, "--out", str(out), "--report", str(report)]
    process = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=START_TIMEOUT_S)
    finally:
        _kill_group(process)
    assert process.returncode == 0, stderr.decode()
    found = {}
    for line in (out / "outputs.jsonl").read_text().splitlines():
        record = json.loads(line)
        found[record["id"]] = (record["output_tokens"], record["finish_reason"],
                               [(out / name).read_bytes() for name in record["media"]])
    assert found == one_process["orpheus_colocated"]
    assert json.loads(report.read_text())["ranks"]["mode"] == "torchrun"


def test_each_tp_rank_holds_about_half_the_llm(processes):
    whole = processes("orpheus")[1]["ranks"]["memory"]["0"]["weight_bytes"]  # rank 0 runs the LLM alone
    shard = processes("orpheus_tp2")[1]["ranks"]["memory"]["1"]["weight_bytes"]  # rank 1: its LLM shard alone
    assert 0.45 * whole <= shard <= 0.6 * whole, (shard, whole)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _rank_pid(pid: int) -> int:
    """The spawned rank 1 among the command's children (beside multiprocessing's resource tracker)."""
    for child in _children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    raise AssertionError("no spawned rank process")


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_long_run(tmp_path: Path, *extra: str, plan: str = "orpheus"
                    ) -> tuple[subprocess.Popen, Path, list[int], int]:
    """A run of `plan` on two rank processes, once its first request finished: (process, report,
    its child processes, rank 1's pid)."""
    out, report = tmp_path / "out", tmp_path / "run.json"
    process = subprocess.Popen(_command(plan, "--requests", "400", "--output-len", "64..64", "--no-progress",
                                        "--out", str(out), "--report", str(report), *extra),
                               cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (out / "outputs.jsonl").exists() or not (out / "outputs.jsonl").read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            _kill_group(process)
            raise AssertionError(f"no request finished: {process.communicate()}")
        time.sleep(0.05)
    return process, report, _children(process.pid), _rank_pid(process.pid)


@pytest.mark.parametrize("plan, signum, says", [("orpheus", signal.SIGKILL, "rank 1 was killed by SIGKILL"),
                                                ("orpheus", signal.SIGSTOP, "rank 1 hangs"),
                                                ("orpheus_tp2", signal.SIGSTOP, "rank 1 hangs")],
                         ids=["killed", "frozen", "frozen_in_rank_0s_tp_group"])
def test_a_lost_rank_stops_the_run_naming_it(tmp_path, plan, signum, says):
    """The run ends on its own (the wait is for the process's exit, bounded only so that a hang
    fails instead of stalling the suite) with the error naming the rank and its requests failed,
    long before its 400 requests could finish. How fast it notices is not timed here: on a busy
    2-core machine a 10 s wall-clock bound failed once at 10.6 s. orpheus_tp2: rank 0 runs its own
    shard of the LLM beside rank 1, so a frozen rank 1 held it in a collective; the TP groups'
    collectives now give up after the rank timeout (before, the run hung until rank 1 was killed)."""
    process, report, children, rank = _start_long_run(tmp_path, "--rank-timeout", "3", plan=plan)
    try:
        os.kill(rank, signum)
        try:
            _, stderr = process.communicate(timeout=LOST_RANK_STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not stop within {LOST_RANK_STOP_S:.0f} s of losing rank 1: it hangs")
    finally:
        _kill_group(process)
    err = stderr.decode()
    assert process.returncode == 1, err
    assert f"mstar: error: {says}" in err and "its step" in err, err
    assert "Traceback" not in err
    # the requests it had not run yet: not "could not admit or advance", not "every request failed"
    assert "requests never finished: the run stopped when it lost the rank" in err and "every request" not in err, err
    summary = json.loads(report.read_text())
    counts = summary["num_completed"] + summary["num_failed"] + summary["num_unfinished"]
    assert summary["num_requests"] == 400 == counts
    reasons = summary["failed_requests"].values()
    assert reasons and all(says in reason for reason in reasons), summary["failed_requests"]
    assert summary["finish_kinds"].get("error", 0) == len(reasons)
    _assert_gone(children)


def _is_ignored(pid: int, signum: int) -> bool:
    """Whether process `pid` ignores `signum` (Linux: the SigIgn mask of /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask >> (signum - 1) & 1)


def _assert_gone(children: list[int]) -> None:
    """Every child of the command ended (multiprocessing's resource tracker may take a moment to
    notice that its last user exited)."""
    deadline = time.monotonic() + 10.0
    while [pid for pid in children if _is_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if _is_alive(pid)], "a rank process was left behind"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_the_process_group_ends_every_rank(tmp_path, signum):
    """Ctrl-C, a closed terminal, a service stop: every process of the group gets the signal; the
    ranks ignore it and rank 0 stops after its step, so no request fails of a rank's death."""
    process, report, children, rank = _start_long_run(tmp_path)
    try:
        # The run's outcome alone is a race (a rank that dies of the signal fails only the
        # requests of a step it has in progress then): the rank's ignored signals say it at once.
        assert _is_ignored(rank, signum), f"rank 1 does not ignore {signum.name}"
        os.killpg(process.pid, signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        _kill_group(process)
    err = stderr.decode()
    assert process.returncode == 128 + signum, err
    assert f"interrupted by {signum.name}" in err and "Traceback" not in err and "error" not in err, err
    summary = json.loads(report.read_text())
    assert summary["interrupted"] == signum.name and not summary["failed_requests"], summary["failed_requests"]
    _assert_gone(children)


def test_a_second_signal_mid_step_ends_the_run_at_once(tmp_path):
    """Two Ctrl-Cs 1 ms apart while prefill and decode run on two ranks (KV moving between them):
    the ranks' state mid-step is unknown, so none is messaged again and both are killed (a rank
    blocked sending an answer nobody read took no more messages: 7-9 s to exit, and the teardown
    aborted the process one time in five). What finished is kept, the report says interrupted."""
    process, report, children, _ = _start_long_run(tmp_path, plan="orpheus_pd_disaggregated")
    try:
        os.kill(process.pid, signal.SIGINT)
        time.sleep(0.001)
        os.kill(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        _kill_group(process)
    err = stderr.decode()
    assert process.returncode == 130 and "interrupted by SIGINT" in err and "Traceback" not in err, err
    assert "terminate called" not in err, err
    lines = (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["id"] for line in lines)
    if report.exists():  # (a second signal once the run stopped and wrote abandons the report: documented)
        summary = json.loads(report.read_text())
        assert summary["interrupted"] == "SIGINT" and summary["num_completed"] == len(lines)
    _assert_gone(children)
