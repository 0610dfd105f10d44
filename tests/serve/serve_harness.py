"""Shared pieces of the server tests: a tiny tokenizer, an engine whose steps a test can hold
back, and a real uvicorn server on a free port in a thread of the test process."""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import uvicorn

from mstar.runtime.serve.api import LLM
from mstar.runtime.serve.http_app import Service, build_app
from mstar.runtime.serve.prom import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "generated" / "llama.plan")
ORPHEUS = str(ROOT / "generated" / "orpheus.plan")
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "hello", "world", "you", "are", "kind", "tell",
         "me", "story", "about", "sea"]
VOCAB = 512  # the tiny dims' vocabulary: every generated id decodes to a word
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer of VOCAB words with a chat template (tokenizer.json + config)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders

    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": TEMPLATE}))
    return directory


class Gate:
    """Wraps an engine: once `limit` steps have launched, each further launch waits until the
    test calls `release()` (so a test can look at a request that cannot have ended yet)."""

    def __init__(self, inner: Any, limit: Optional[int] = None):
        self.inner = inner
        self.caps = inner.caps
        self.limit = limit
        self.num_steps = 0
        self.opened = threading.Event()
        self.reached = threading.Event()

    def release(self) -> None:
        self.opened.set()

    def add_request(self, request_id: str, spec: Any) -> Any:
        return self.inner.add_request(request_id, spec)

    def end_request(self, request_id: str) -> None:
        self.inner.end_request(request_id)

    def end_node(self, request_id: str, node: str) -> None:
        self.inner.end_node(request_id, node)

    def kv_pages(self) -> dict:
        return self.inner.kv_pages()

    def launch(self, step: Any) -> Any:
        if self.limit is not None and self.num_steps >= self.limit:
            self.reached.set()
            assert self.opened.wait(30), "the test never released the gate"
        self.num_steps += 1
        return self.inner.launch(step)

    def wait(self, handle: Any) -> Any:
        return self.inner.wait(handle)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_service(llm: LLM, model: Optional[str] = None) -> Service:
    metrics = ServerMetrics()
    llm.loop.observer = metrics
    return Service(llm, model or llm.plan.header.model, metrics)


@contextmanager
def running(service: Service, app: Any = None) -> Iterator[str]:
    """A real uvicorn server for `service` on a free port (its app, or `app` built for it with more
    routes); yields its base URL ending in /v1."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app or build_app(service), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        service.llm.close(5)


@contextmanager
def llama_with_client(directory: Path) -> Iterator[tuple[LLM, Any]]:
    """The llama plan with the tiny tokenizer (written into `directory`) served on a free port:
    (its LLM, an official openai client of it)."""
    import openai

    llm = LLM(LLAMA, tokenizer=str(write_tokenizer(directory)))
    with running(make_service(llm)) as url:
        yield llm, openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def wait_until(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def post_json(url: str, data: bytes) -> tuple[int, dict]:
    """POST `data` as JSON to `url`: (status, the answer's body), or on an HTTP error (status, the
    body's `error` object)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())["error"]
