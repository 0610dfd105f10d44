"""Behaviour a mutation audit found no test holding: outputs.jsonl's ttft_ms, several
images of one request, and min_tokens with stop strings in `text` (serve/results.py)."""
import json

import torch

from mstar.runtime.conductor.request import Request, RequestRecord
from mstar.runtime.serve.results import ResultWriter, media_name


class _Words:
    """A tokenizer whose token i is the word WORDS[i], joined with spaces."""
    WORDS = ["the", "cat", "sat", "on", "mat"]

    def decode(self, ids):
        return " ".join(self.WORDS[i] for i in ids)


def _line(tmp_path, record, tokenizer=None):
    writer = ResultWriter(str(tmp_path), 24000, tokenizer)
    writer.write(record)
    writer.close()
    [line] = [json.loads(text) for text in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    return line


def test_ttft_counts_from_the_requests_arrival(tmp_path):
    record = RequestRecord(request=Request(id="r", prompt_tokens=[1], max_tokens=2), arrival_s=3.0,
                           first_token_s=3.25, finish_s=3.5, finish_reason="length", output_tokens=[1, 2])
    assert _line(tmp_path, record)["ttft_ms"] == 250.0


def test_each_image_of_a_request_gets_a_file_of_its_own(tmp_path):
    record = RequestRecord(request=Request(id="r", prompt_tokens=[1], max_tokens=2), arrival_s=0.0,
                           first_token_s=0.1, finish_s=0.2, finish_reason="stop", output_tokens=[])
    record.emit(0.1, ("image", "image"), torch.zeros(3, 4, 4))
    record.emit(0.2, ("image", "image"), torch.ones(3, 4, 4))
    names = _line(tmp_path, record)["media"]
    assert names == [media_name("r", "_0.png"), media_name("r", "_1.png")]
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in names)
    assert (tmp_path / names[0]).read_bytes() != (tmp_path / names[1]).read_bytes()


def test_a_stop_string_within_the_first_min_tokens_does_not_cut_the_text(tmp_path):
    # tokens: the cat sat cat on; min_tokens=2: the first "cat" ends inside the first two tokens'
    # text, so the text is cut before the second one (as the server's stream is)
    request = Request(id="r", prompt_tokens=[], max_tokens=5, stop_strings=["cat"], min_tokens=2)
    record = RequestRecord(request=request, arrival_s=0.0, first_token_s=0.1, finish_s=0.2,
                           finish_reason="stop", output_tokens=[0, 1, 2, 1, 3])
    assert _line(tmp_path, record, _Words())["text"] == "the cat sat "
