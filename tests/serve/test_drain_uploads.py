"""`mstar serve` draining on SIGTERM while request bodies are still arriving: a body that arrives
within the drain is answered as usual; one still arriving when the drain cancels the requests in
flight is a JSON 503 (`server_error`), with no traceback in the log and the exit on time. Before,
uvicorn's own graceful timeout cancelled its handler: a plain-text 500, a CancelledError traceback,
and the process exiting seconds after the drain."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from serve_harness import LLAMA, ROOT, free_port

DRAIN_S = 2.0


def _wait_healthy(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    raise AssertionError("the server did not come up")


def _answer(sock: socket.socket) -> tuple[int, str, bytes]:
    """(status, content type, body) of the HTTP/1.1 answer on `sock`, read until it closes."""
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("content-type", ""), body


def test_a_body_still_arriving_at_the_drains_end_is_a_json_503():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "mstar.cli.mstar", "serve", "--plan", LLAMA, "--engine", "sim",
                                "--sim-pace", "30", "--port", str(port), "--drain-timeout", str(DRAIN_S)],
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        _wait_healthy(port, process)
        body = json.dumps({"model": "llama", "prompt": [1, 2, 3], "max_tokens": 3}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        finishing, stalled = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
        for sock in (finishing, stalled):
            sock.sendall(head + body[:10])
        time.sleep(1.0)  # both requests' heads read: they are in flight
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        finishing.sendall(body[10:])  # its body arrives within the drain: answered as ever
        status, _, answer = _answer(finishing)
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 3
        status, content_type, answer = _answer(stalled)  # cut when the drain cancels what is in flight
        assert (status, content_type) == (503, "application/json"), (status, answer)
        assert json.loads(answer)["error"] == {
            "message": "the server is shutting down: it stopped before the request body arrived",
            "type": "server_error", "param": None, "code": None}
        assert process.wait(30) == 0
        # uvicorn's own timeout (4 s for a 2 s drain) no longer ends the drain
        assert time.monotonic() - signalled < DRAIN_S + 1.5
        assert b"Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
