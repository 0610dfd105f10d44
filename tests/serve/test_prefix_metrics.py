"""A server's prefix-cache counters on /metrics (`serve/prom.py`): requests sharing a prompt prefix
on a plan that caches prefixes (llama_chunked, sim engine), parsed by prometheus_client's parser."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mstar.runtime.serve.api import LLM
from serve_harness import LLAMA, ROOT, make_service, running

openai = pytest.importorskip("openai")
LLAMA_CHUNKED = str(ROOT / "generated" / "llama_chunked.plan")


def _samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.replace("/v1", "/metrics")) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_requests_sharing_a_prefix_count_lookups_hits_and_cached_tokens():
    """Also OpenAI's `usage.prompt_tokens_details.cached_tokens`, per request."""
    llm = LLM(LLAMA_CHUNKED, engine="sim", sim_pace=0)
    shared = list(range(100, 200))  # 100 tokens: 6 whole pages of 16
    with running(make_service(llm)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        # one after another: the first one's pages are cached when the next arrives
        answers = [client.completions.create(model="llama", prompt=shared + [tail], max_tokens=3) for tail in (7, 8, 9)]
        samples = _samples(url)
    page_size = llm.plan.deployment.kv_pools[0].page_size
    cached = len(shared) // page_size * page_size
    assert [answer.usage.prompt_tokens_details.cached_tokens for answer in answers] == [0, cached, cached]
    assert samples["mstar_prefix_cache_lookups_total"] == 3
    assert samples["mstar_prefix_cache_hits_total"] == 2
    assert samples["mstar_prefix_cache_tokens_total"] == 2 * cached


def test_the_python_api_reports_the_cached_tokens():
    with LLM(LLAMA_CHUNKED, engine="sim") as llm:
        shared = list(range(100, 200))
        first, second = [llm.generate([shared + [tail]])[0] for tail in (7, 8)]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 96)


def test_a_plan_without_a_prefix_cache_counts_no_lookup():
    llm = LLM(LLAMA, engine="sim", sim_pace=0)
    with running(make_service(llm)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        for _ in range(2):
            client.completions.create(model="llama", prompt=list(range(100, 200)), max_tokens=3)
        samples = _samples(url)
    assert samples["mstar_prefix_cache_lookups_total"] == 0
    assert samples["mstar_prefix_cache_hits_total"] == 0 and samples["mstar_prefix_cache_tokens_total"] == 0
