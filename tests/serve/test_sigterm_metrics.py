"""`mstar serve` as a process: SIGTERM stops it accepting, lets the stream in flight finish, and
it exits 0. /metrics parsed by prometheus_client's own parser. `import mstar` stays light."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mstar.runtime.serve.api import LLM
from serve_harness import LLAMA, ROOT, free_port, make_service, running

pytestmark = pytest.mark.usefixtures("ordinary_signals")  # conftest.py: signals not inherited ignored

openai = pytest.importorskip("openai")


def _wait_healthy(port, process, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if json.loads(response.read())["status"] == "ok":
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    raise AssertionError("the server did not come up")


@contextmanager
def _serving(*options: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """`mstar serve` of the llama plan on the sim engine (30 steps a second) as a process, healthy;
    (the process, its port). Killed on the way out if still running."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "mstar.cli.mstar", "serve", "--plan", LLAMA, "--engine", "sim",
                                "--sim-pace", "30", "--port", str(port), *options],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_healthy(port, process)
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_drains_in_flight_requests_and_exits_0():
    with _serving("--log-level", "warning") as (process, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="llama", prompt=[1, 2, 3], max_tokens=150, stream=True)
        chunks = iter(stream)
        received = [next(chunks)]
        process.send_signal(signal.SIGTERM)
        refused = threading.Event()

        def try_connect():
            time.sleep(0.3)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                refused.set()

        prober = threading.Thread(target=try_connect)
        prober.start()
        received.extend(chunks)
        prober.join()
        assert refused.is_set()  # no longer accepting while the stream drains
        assert received[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].model_extra["token_ids"]) for c in received if c.choices) == 150
        assert process.wait(30) == 0, process.stderr.read().decode()


def test_a_drain_that_runs_out_of_time_ends_the_stream_cleanly():
    """--drain-timeout 1 and a stream far longer: the request is cancelled just before the timeout,
    so its stream ends with an error event and [DONE] and the server exits 0 with no traceback
    (uvicorn's own timeout cancelled the handler: the stream was cut, CancelledError logged)."""
    with _serving("--drain-timeout", "1") as (process, port):
        body = json.dumps({"model": "llama", "prompt": [1, 2, 3], "max_tokens": 2000, "stream": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            lines = [response.readline()]
            process.send_signal(signal.SIGTERM)
            lines += response.read().splitlines()
        events = [line.decode() for line in lines if line.strip()]
        assert events[-1] == "data: [DONE]" and "cancelled" in events[-2] and '"error"' in events[-2], events[-3:]
        assert process.wait(30) == 0
        assert "Traceback" not in process.stderr.read().decode()


def test_metrics_parse_with_prometheus_client():
    llm = LLM(LLAMA, engine="sim", sim_pace=0, kv_pages=8)  # 128 tokens of KV at most
    service = make_service(llm)
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        for _ in range(3):
            client.completions.create(model="llama", prompt=[1, 2, 3], max_tokens=5)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="llama", prompt=[1, 2, 3], temperature=-2)
        with pytest.raises(openai.BadRequestError, match="can never fit"):  # the engine refuses it
            client.completions.create(model="llama", prompt=[1, 2, 3], max_tokens=1000)
        with urllib.request.urlopen(url.replace("/v1", "/metrics")) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("mstar_requests_total", (("outcome", "length"),))] == 3
    # each refusal counted once: the HTTP layer's as invalid, the engine's as refused (not both)
    assert samples[("mstar_requests_total", (("outcome", "invalid"),))] == 1
    assert samples[("mstar_requests_total", (("outcome", "refused"),))] == 1
    assert samples[("mstar_time_to_first_token_seconds_count", ())] == 3
    assert samples[("mstar_inter_token_latency_seconds_count", ())] == 3 * 4
    assert samples[("mstar_queue_depth", ())] == 0 and samples[("mstar_requests_running", ())] == 0
    assert samples[("mstar_kv_pages_in_use", (("node", "LLM"),))] == 0
    assert samples[("mstar_kv_pages_total", (("node", "LLM"),))] > 0
    steps = {labels: v for (name, labels), v in samples.items() if name == "mstar_steps_total"}
    assert sum(steps.values()) >= 5 and all(dict(k)["key"] == "LLM:mixed" for k in steps)
    assert {dict(k)["mixture"] for k in steps} <= {"prefill", "decode", "prefill+decode"}


def test_import_mstar_stays_light():
    """`import mstar` loads nothing heavy, and the API (`from mstar import LLM`) not torch, which
    a torch engine loads when it is built."""
    code = ("import sys, mstar; heavy = [m for m in ('torch', 'fastapi', 'uvicorn', 'numpy') if m in sys.modules]; "
            "print(heavy); from mstar import LLM, SamplingParams; print(LLM.__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "LLM", "False"]
    # nor a simulated engine's requests (a request's checks imported the sampler, and torch, on the
    # first generate: 0.9 s, and a Ctrl-C inside that import left the LLM unusable)
    code = ("import sys; from mstar import LLM, SamplingParams; llm = LLM(sys.argv[1], engine='sim'); "
            "print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.5, stop_token_ids=[7]))"
            "[0].finish_reason, 'torch' in sys.modules); llm.close()")
    out = subprocess.run([sys.executable, "-c", code, LLAMA], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["length", "False"]


def test_serve_refuses_a_bad_plan_in_one_line(tmp_path):
    from mstar.cli.mstar import main

    bad = tmp_path / "bad.plan"
    bad.write_text("{}")
    process = subprocess.run([sys.executable, "-m", "mstar.cli.mstar", "serve", "--plan", str(bad)],
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert process.returncode == 1
    assert process.stderr.startswith("mstar serve: error: ") and "Traceback" not in process.stderr
    with pytest.raises(SystemExit) as usage:  # a usage error, as every number option out of its range
        main(["serve", "--plan", LLAMA, "--port", "70000"])
    assert usage.value.code == 2


def test_serve_refuses_a_port_in_use_or_a_bad_host_in_one_line(capsys):
    """Bound before the plan loads: uvicorn's own bind printed its log line and exited 3."""
    from mstar.cli.mstar import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--plan", LLAMA, "--engine", "sim", "--port", str(port)]) == 1
    assert main(["serve", "--plan", LLAMA, "--engine", "sim", "--host", "999.1.1.1"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("mstar serve: error: ") for line in lines)
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "--host '999.1.1.1' does not resolve" in lines[1]


def test_the_server_says_where_it_listens_and_port_0_which_port_it_took():
    """uvicorn writes its "Uvicorn running on" line only for a socket it binds itself; `serve` binds
    the socket first, so nothing said where it listened, nor which port `--port 0` had taken."""
    import re

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "mstar.cli.mstar", "serve", "--plan", LLAMA, "--engine", "sim",
                                "--port", "0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, process.kill)  # a line that never comes ends the read, not the test run
    watchdog.start()
    try:
        said = next((line for line in iter(process.stderr.readline, "") if "running on" in line), "")
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ", said)
        assert match, said
        with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/health", timeout=10) as response:
            assert json.loads(response.read())["status"] == "ok"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_second_signal_while_draining_cancels_every_request_cleanly():
    """SIGTERM then SIGINT (Ctrl-C twice): the requests in flight are cancelled at once, a stream
    ends with its error event and [DONE], a whole answer is a JSON 503, and the server exits 0
    with no traceback (uvicorn's force exit cut the streams, answered a plain-text 500 and logged
    CancelledError tracebacks)."""
    with _serving("--drain-timeout", "30") as (process, port):
        url = f"http://127.0.0.1:{port}/v1/completions"
        answers: dict = {}

        def whole() -> None:
            body = json.dumps({"model": "llama", "prompt": [1, 2, 3], "max_tokens": 2049}).encode()
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=30)
            except urllib.error.HTTPError as error:
                answers["whole"] = (error.code, json.loads(error.read()))

        waiting = threading.Thread(target=whole)
        waiting.start()
        body = json.dumps({"model": "llama", "prompt": [4, 5, 6], "max_tokens": 2049, "stream": True}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            lines = [response.readline()]
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)
            lines += response.read().splitlines()
        waiting.join(30)
        events = [line.decode() for line in lines if line.strip()]
        assert events[-1] == "data: [DONE]" and "cancelled" in events[-2] and '"error"' in events[-2], events[-3:]
        status, error = answers["whole"]
        assert status == 503 and "cancelled" in error["error"]["message"]
        assert process.wait(30) == 0
        assert "Traceback" not in process.stderr.read().decode()


def test_a_drain_timeout_inside_a_long_step_still_answers_every_client(caplog):
    """The drain cancels its requests half a second before its timeout, and they end at the next
    step boundary; a step that outlasted that margin (a long prefill, a diffusion step, or
    `--drain-timeout 0`) let uvicorn's timeout cancel the handlers: the stream was cut mid-chunk,
    the whole answer a plain-text 500, CancelledError tracebacks logged. Now the run loop is closed
    at the timeout without waiting for the step, which answers every client: the stream ends with
    its error event and [DONE], the whole answer is an OpenAI error."""
    import asyncio
    import logging

    import uvicorn

    from mstar.runtime.serve.engine_setup import build_engine, load
    from mstar.runtime.serve.http_app import build_app
    from mstar.runtime.serve.server import _draining_server, graceful_timeout_s
    from serve_harness import Gate, wait_until

    plan = load(LLAMA)
    gate = Gate(build_engine(plan, "sim", sim_pace=0), limit=3)
    service = make_service(LLM(plan, engine=gate))
    port = free_port()
    config = uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=graceful_timeout_s(0.0))
    server = _draining_server(config, service.llm.loop, 0.0)  # --drain-timeout 0
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    assert wait_until(lambda: server.started)
    url = f"http://127.0.0.1:{port}/v1/completions"
    answers: dict = {}

    def whole() -> None:
        body = json.dumps({"model": "llama", "prompt": [1, 2, 3], "max_tokens": 50}).encode()
        try:
            urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=30)
        except urllib.error.HTTPError as error:
            answers["whole"] = (error.code, error.headers["Content-Type"], error.read())

    waiting = threading.Thread(target=whole)
    uvicorn_log = logging.getLogger("uvicorn.error")  # "uvicorn" does not propagate to the root's caplog
    uvicorn_log.addHandler(caplog.handler)
    try:
        body = json.dumps({"model": "llama", "prompt": [4, 5, 6], "max_tokens": 50, "stream": True}).encode()
        with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}),
                                    timeout=30) as response:
            lines = [response.readline()]
            waiting.start()
            assert gate.reached.wait(10) and wait_until(lambda: service.llm.loop.num_in_flight == 2)
            server.should_exit = True  # SIGTERM, while the step is held past the drain's end
            lines += response.read().splitlines()
        waiting.join(30)
        events = [line.decode() for line in lines if line.strip()]
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
        status, content_type, text = answers["whole"]
        assert status == 500 and content_type == "application/json" and "the server stopped" in text.decode()
        thread.join(30)
        assert not thread.is_alive()
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
        # what `serve` closes the run loop with: nothing is left of a drain that ran out (it waited a
        # whole drain timeout again on the step still running)
        assert server.drain_left_s() == 0.0
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        gate.release()
        server.should_exit = True
        service.llm.close(5)


def test_the_drain_left_is_the_whole_timeout_before_a_shutdown_and_less_after():
    import uvicorn

    from mstar.runtime.serve.server import _draining_server

    server = _draining_server(uvicorn.Config(lambda *_: None), loop=None, drain_s=2.0)
    assert server.drain_left_s() == 2.0
    server.drain_started_s = time.monotonic() - 1.5
    assert 0.0 < server.drain_left_s() <= 0.5
    server.drain_started_s = time.monotonic() - 3.0
    assert server.drain_left_s() == 0.0
