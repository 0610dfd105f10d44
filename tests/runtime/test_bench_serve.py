"""`mstar bench serve` against a fake OpenAI-compatible server whose delays are known.

The fake (fake_openai_server.py) sends the first output event TTFT_S after a request arrives and
the next ones ITL_S apart, so the benchmark's figures must come out at those values: never below
them (nothing can arrive before it is sent), and above only by the scheduling noise of a busy
2-core machine (the bounds below). The requests it records show the workload is `mstar run`'s
(same seed, same prompt ids and max_tokens), the arrivals are the Poisson ones, and the closed
loop keeps exactly --concurrency requests in flight.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from fake_openai_server import MODEL, FakeServer
from mstar.cli.mstar import main as mstar_main
from mstar.runtime.serve.bench_serve import main as bench_main
from mstar.runtime.serve.bench_serve_client import run_requests
from mstar.runtime.serve.bench_serve_requests import generated_requests
from mstar.runtime.serve.workload import generate

TTFT_S, ITL_S = 0.1, 0.03
NOISE_MS = 60.0  # what a loaded machine (several test suites on 2 cores) may add to one event's time


def _bench(capsys, *args: str) -> dict:
    code = bench_main([*args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_closed_loop_figures_match_the_injected_delays(capsys):
    with FakeServer(TTFT_S, ITL_S) as server:
        summary = _bench(capsys, "--base-url", server.url, "--requests", "16", "--concurrency", "4",
                         "--prompt-len", "4..8", "--output-len", "4..8")
    expected = generate(16, prompt_len=(4, 8), output_len=(4, 8), seed=0).requests
    bodies = sorted((body for _, _, body in server.received), key=lambda b: b["prompt"])
    assert [(b["prompt"], b["max_tokens"]) for b in bodies] == sorted(
        (r.prompt_tokens, r.max_tokens) for r in expected)
    assert all(b["model"] == MODEL and b["stream"] is True for b in bodies)
    assert server.max_in_flight == 4
    assert summary["num_completed"] == 16 and summary["num_errors"] == 0
    assert summary["output_tokens"] == sum(r.max_tokens for r in expected)
    assert summary["prompt_tokens"] == sum(len(r.prompt_tokens) for r in expected)
    ttft, itl, tpot = summary["ttft_ms"], summary["itl_ms"], summary["tpot_ms"]
    assert TTFT_S * 1000 <= ttft["p50"] <= TTFT_S * 1000 + NOISE_MS
    assert ttft["p99"] <= TTFT_S * 1000 + 4 * NOISE_MS
    assert ITL_S * 1000 * 0.5 <= itl["p50"] <= ITL_S * 1000 + NOISE_MS / 2
    assert ITL_S * 1000 * 0.7 <= itl["mean"] <= ITL_S * 1000 * 1.5
    assert ITL_S * 1000 * 0.7 <= tpot["mean"] <= ITL_S * 1000 * 1.5
    # each request lasts TTFT + (n - 1) ITL; four at a time
    e2e_ms = [1000 * (TTFT_S + (r.max_tokens - 1) * ITL_S) for r in expected]
    assert min(e2e_ms) <= summary["e2e_ms"]["p50"] <= max(e2e_ms) + 2 * NOISE_MS
    assert summary["duration_s"] >= sum(e2e_ms) / 4 / 1000
    assert summary["requests_per_s"] == pytest.approx(16 / summary["duration_s"])


def test_poisson_arrivals_are_mstar_runs():
    requests = generated_requests(12, (8, 32), (2, 2), seed=3, prompt_kind="tokens", endpoint="completions", rate=20)
    expected = generate(12, prompt_len=(8, 32), output_len=(2, 2), arrival="poisson", rate=20, seed=3).requests
    assert [(r.body["prompt"], r.arrival_s) for r in requests] == [(e.prompt_tokens, e.arrival_s) for e in expected]
    assert expected[-1].arrival_s > 0.3  # spread out, so the check below means something
    with FakeServer(0.0, 0.0) as server:
        before = time.perf_counter()
        results = asyncio.run(run_requests(requests, server.url, MODEL, concurrency=None, timeout_s=30,
                                           extra_body={}))
    # a request is never sent before its arrival time (and, on a busy machine, not long after it)
    for request, result in zip(requests, results):
        assert request.arrival_s <= result.start_s - before <= request.arrival_s + 0.5
    assert all(result.error is None for result in results)


def test_poisson_through_the_command(capsys):
    with FakeServer(0.0, 0.0) as server:
        summary = _bench(capsys, "--base-url", server.url, "--requests", "6", "--request-rate", "50",
                         "--concurrency", "2", "--output-len", "2")
    assert summary["num_completed"] == 6 and summary["arrivals"] == "Poisson 50/s, at most 2 in flight"
    assert server.max_in_flight <= 2


def test_chat_text_prompts_count_events_when_the_server_sends_no_usage(capsys):
    with FakeServer(TTFT_S, ITL_S, send_usage=False) as server:
        summary = _bench(capsys, "--base-url", server.url, "--requests", "4", "--prompt-kind", "text",
                         "--endpoint", "chat", "--output-len", "5", "--prompt-len", "3")
    for _, path, body in server.received:
        assert path == "/v1/chat/completions"
        words = body["messages"][0]["content"].split()
        assert len(words) == 3 and all(w.isalpha() for w in words)
    assert summary["output_tokens"] == 4 * 5
    # the role-only delta comes at once; the first content TTFT_S later
    assert summary["ttft_ms"]["p50"] >= TTFT_S * 1000


def test_events_with_token_ids_and_no_text_are_output(capsys):
    with FakeServer(TTFT_S, ITL_S, send_usage=False, is_ids_only=True) as server:
        summary = _bench(capsys, "--base-url", server.url, "--requests", "3", "--output-len", "6")
    assert summary["output_tokens"] == 3 * 6 and summary["num_completed"] == 3
    assert summary["ttft_ms"]["p50"] >= TTFT_S * 1000 and summary["itl_ms"]["p50"] >= ITL_S * 1000 * 0.7


def test_dataset_errors_are_counted_by_message(tmp_path, capsys):
    lines = [{"id": "a", "prompt_tokens": [1, 2, 3], "max_tokens": 3, "temperature": 0.5},
             {"prompt": "please FAIL", "max_tokens": 3},
             {"prompt": "CUT short", "max_tokens": 5},
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop_tokens": [7]}]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with FakeServer(TTFT_S, ITL_S) as server:
        summary = _bench(capsys, "--base-url", server.url, "--dataset", str(dataset), "--concurrency", "2",
                         "--extra-body", '{"ignore_eos": true}')
    assert summary["num_completed"] == 2 and summary["num_errors"] == 2
    assert summary["errors"] == {"HTTP 500: injected failure": 1, "the stream ended before data: [DONE]": 1}
    assert summary["output_tokens"] == 3 + 2
    bodies = {json.dumps(body.get("prompt") or body.get("messages")): body for _, _, body in server.received}
    assert bodies["[1, 2, 3]"]["temperature"] == 0.5 and bodies["[1, 2, 3]"]["ignore_eos"] is True
    chat = next(body for _, path, body in server.received if path == "/v1/chat/completions")
    assert chat["stop_token_ids"] == [7]


def test_a_dataset_lines_logprobs_logit_bias_ignore_eos_and_min_tokens_reach_the_body(tmp_path, capsys):
    """The fields `mstar run` reads go out as OpenAI bodies carry them (a chat's logprobs as
    `logprobs: true` and `top_logprobs`)."""
    extra = {"logprobs": 2, "logit_bias": {"42": -100}, "ignore_eos": True, "min_tokens": 2}
    lines = [{"prompt_tokens": [1, 2, 3], "max_tokens": 3, **extra},
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with FakeServer(TTFT_S, ITL_S) as server:
        _bench(capsys, "--base-url", server.url, "--dataset", str(dataset))
    bodies = {path: body for _, path, body in server.received}
    shared = {"logit_bias": {"42": -100}, "ignore_eos": True, "min_tokens": 2}
    assert bodies["/v1/completions"].items() >= {**shared, "logprobs": 2}.items()
    assert bodies["/v1/chat/completions"].items() >= {**shared, "logprobs": True, "top_logprobs": 2}.items()


def test_table_through_the_mstar_command(capsys):
    with FakeServer(0.0, 0.0) as server:
        code = mstar_main(["bench", "serve", "--base-url", server.url + "/v1/", "--requests", "3", "--output-len", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "mstar bench serve" in out and "TTFT ms p50/p90/p99" in out and "3 ok, 0 errors" in out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--request-rate", "0"], "argument --request-rate: must be a number in (0, inf], got 0.0"),
    (["--request-rate", "nan"], "argument --request-rate: must be a number in (0, inf], got 'nan'"),
    # aiohttp's timeout overflowed at inf ("OverflowError: cannot convert float infinity to integer")
    (["--timeout", "inf"], "argument --timeout: must be a number in (0, 86400], got 'inf'"),
    (["--timeout", "9" * 5000], "argument --timeout: must be a number in (0, 86400], got '" + "9" * 39
                                + "... (5000 characters)"),
    (["--concurrency", "x" * 5000], "argument --concurrency: must be an integer, got '" + "x" * 39
                                    + "... (5000 characters)"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--prompt-len", "9..3"], "--prompt-len: need 1 <= A <= B"),
    (["--extra-body", "[1]"], "--extra-body: expected a JSON object"),
    (["--requests", "-5"], "argument --requests: must be between 1 and 1000000"),
    # each was taken: an empty model as none, a port past 65535 failed later naming only the URL, the
    # dataset's own requests ignored the generator's options, and unstreamed answers were timed as streamed
    (["--model", ""], "--model needs a name"),
    (["--base-url", "http://127.0.0.1:99999"], "Port out of range"),
    (["--dataset", "d.jsonl", "--endpoint", "chat", "--requests", "5"], "--requests, --endpoint: options of generated"),
    (["--extra-body", '{"stream": false}'], "--extra-body sets stream"),
    # n choices' chunks interleave in one stream: their gaps were read as one request's (ITL p50 0.0 ms)
    (["--extra-body", '{"n": 4}'], "--extra-body sets n: the bench times one choice a request"),
    # a URL without a host failed at the first request (exit 1, "InvalidUrlClientError"); an empty
    # dataset path was the working directory ("cannot read dataset .: is a directory")
    (["--base-url", "http://"], "--base-url 'http://' names no host (e.g. http://127.0.0.1:8000)"),
    (["--base-url", "http://:8000/v1"], "--base-url 'http://:8000/v1' names no host"),
    (["--dataset", ""], "argument --dataset: needs a path, got an empty one"),
])
def test_bad_flags_are_refused_before_sending(args, message, capsys):
    """An option's bad value is a usage error, exit 2 (docs/cli.md), as argparse's own checks."""
    with pytest.raises(SystemExit) as stop:
        bench_main(["--base-url", f"http://127.0.0.1:{_free_port()}", *args])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_chat_endpoint_needs_text_prompts(capsys):
    code = bench_main(["--base-url", f"http://127.0.0.1:{_free_port()}", "--endpoint", "chat"])
    assert code == 1 and "add --prompt-kind text" in capsys.readouterr().err


def test_bad_dataset_line_names_the_line(tmp_path, capsys):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt_tokens": [1], "max_tokens": 2}\n{"prompt": "x", "max_tokens": 2, "route": {}}\n')
    code = bench_main(["--base-url", "http://127.0.0.1:1", "--dataset", str(dataset)])
    assert code == 1 and f"{dataset}:2: 'route' is an mstar plan field" in capsys.readouterr().err


def test_unreachable_server_and_unknown_model(capsys):
    code = bench_main(["--base-url", f"http://127.0.0.1:{_free_port()}", "--requests", "2"])
    assert code == 1 and "cannot reach a model at" in capsys.readouterr().err
    code = bench_main(["--base-url", f"http://127.0.0.1:{_free_port()}", "--request-rate", "1e-300"])
    assert code == 1 and "raise --request-rate" in capsys.readouterr().err  # it named mstar run's --rate
    with FakeServer(0.0, 0.0) as server:
        code = bench_main(["--base-url", server.url, "--model", "nope", "--requests", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 1 and "every request failed" in captured.err
    assert json.loads(captured.out)["errors"] == {"HTTP 404: model 'nope' not found": 2}


def test_a_server_that_is_not_openai_compatible(capsys):
    """GET /v1/models answering HTML: one clear line, no traceback."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code = bench_main(["--base-url", f"http://127.0.0.1:{server.server_address[1]}", "--requests", "1"])
    finally:
        server.shutdown()
    assert code == 1 and "did not answer JSON" in capsys.readouterr().err
