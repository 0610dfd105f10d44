"""Text prompts in, text out: `mstar run --prompts` with `prompt` (text), `messages` (chat, through the
checkpoint's chat template) and `stop` strings, on a tiny random Llama saved beside a tiny
tokenizer (tokenizer.json + tokenizer_config.json). Checked against the tokenizers library and
transformers (its tokenizer, apply_chat_template and greedy generate)."""
import json
from pathlib import Path

import pytest
import torch

from mstar.cli.mstar import main
from mstar.runtime.serve.tokenizer import TokenizerError, load_tokenizer
from mstar.runtime.serve.workload import WorkloadError, read_prompts

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "hello", "world", "you", "are", "kind", "tell",
         "me", "story", "about", "sea"]
VOCAB = 64
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "you are kind"}, {"role": "user", "content": "tell me a story"}]


def _tokenizer_files(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_with_tokenizer")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than HF's init, so greedy picks are well separated
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[1] ** -0.5)
    model.save_pretrained(directory, safe_serialization=True)
    _tokenizer_files(directory)
    return directory, model


def _hf_greedy(model, prompt, num_new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _run(tmp_path, lines, *extra):
    if not PLAN.exists():
        pytest.skip(f"{PLAN} not generated")
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    status = main(["run", "--plan", str(PLAN), "--prompts", str(prompts), "--out", str(out), "--no-progress", *extra])
    results = {}
    if (out / "outputs.jsonl").exists():
        results = {r["id"]: r for r in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    return status, results


def test_text_and_chat_prompts_give_text(checkpoint, tmp_path, capsys):
    directory, model = checkpoint
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt = "hello world the cat sat on the mat"
    chat_tokens = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_tokens, dict) or hasattr(chat_tokens, "input_ids"):
        chat_tokens = chat_tokens["input_ids"]
    status, results = _run(tmp_path, [
        {"id": "text", "prompt": prompt, "max_tokens": 8},
        {"id": "chat", "messages": MESSAGES, "max_tokens": 8},
        {"id": "chat_tokens", "prompt_tokens": list(chat_tokens), "max_tokens": 8},
    ], "--weights", str(directory))
    assert status == 0, capsys.readouterr().err
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    # the text prompt is tokenized as transformers' tokenizer does (with its BOS), and generates as transformers does
    text_ids = hf_tokenizer(prompt)["input_ids"]
    for name, prompt_ids in (("text", text_ids), ("chat", list(chat_tokens)), ("chat_tokens", list(chat_tokens))):
        assert results[name]["text"] == _after(backend, prompt_ids, results[name]["output_tokens"])
    assert text_ids[0] == 1
    assert results["text"]["output_tokens"] == _hf_greedy(model, text_ids, 8)
    # the chat prompt's tokens are the template's rendering tokenized: the same output as those tokens given
    assert results["chat"]["output_tokens"] == results["chat_tokens"]["output_tokens"]
    assert results["chat"]["output_tokens"] == _hf_greedy(model, list(chat_tokens), 8)


def test_chat_prompt_tokens_equal_transformers_template(checkpoint, tmp_path):
    directory, _ = checkpoint
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    ours = load_tokenizer(str(directory))
    rendered = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(MESSAGES) == rendered
    assert rendered.startswith("<s><|system|> you are kind <|end|> <|user|>") and rendered.endswith("<|assistant|>")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "c", "messages": MESSAGES, "max_tokens": 2}) + "\n")
    request = read_prompts(str(prompts), tokenizer=ours).requests[0]
    assert request.prompt_tokens == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_stop_string_ends_the_request(checkpoint, tmp_path, capsys):
    directory, _ = checkpoint
    prompt = "tell me a story about the sea"
    status, free = _run(tmp_path / "free", [{"id": "r", "prompt": prompt, "max_tokens": 12}],
                        "--weights", str(directory))
    assert status == 0, capsys.readouterr().err
    tokens = free["r"]["output_tokens"]
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    stop = backend.id_to_token(tokens[4])
    prompt_ids = backend.encode(prompt).ids
    # the first token at which the output's text (read after the prompt's) holds the stop string
    end = next(k for k in range(len(tokens)) if stop in _after(backend, prompt_ids, tokens[:k + 1]))
    assert end <= 4
    status, stopped = _run(tmp_path / "stopped", [{"id": "r", "prompt": prompt, "max_tokens": 12,
                                                   "stop": ["never appears", stop]}], "--weights", str(directory))
    assert status == 0, capsys.readouterr().err
    result = stopped["r"]
    assert result["output_tokens"] == tokens[:end + 1]
    assert result["finish_reason"] == "stop"
    full = _after(backend, prompt_ids, tokens[:end + 1])
    assert result["text"] == full[:full.index(stop)] and stop not in result["text"]


def _after(backend, prompt_ids, ids):
    """The text an output adds to its prompt's: the whole decoded, the prompt's own taken off."""
    def decode(found):
        return backend.decode(found, skip_special_tokens=True)
    return decode(prompt_ids + ids)[len(decode(prompt_ids)):]


def test_tokenizer_option_overrides(checkpoint, tmp_path, capsys):
    directory, _ = checkpoint
    status, results = _run(tmp_path, [{"id": "t", "prompt": "the dog ran", "max_tokens": 3}],
                           "--engine", "sim", "--tokenizer", str(directory))
    assert status == 0, capsys.readouterr().err
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert results["t"]["text"] == backend.decode(results["t"]["output_tokens"], skip_special_tokens=True)


@pytest.mark.parametrize("line, word", [
    ({"id": "t", "prompt": "the cat", "max_tokens": 3}, "'prompt' is text"),
    ({"id": "m", "messages": MESSAGES, "max_tokens": 3}, "'messages' is text"),
    ({"id": "s", "prompt_tokens": [1, 2], "stop": "cat", "max_tokens": 3}, "'stop' strings"),
])
def test_text_without_tokenizer_is_refused(tmp_path, capsys, line, word):
    status, _ = _run(tmp_path, [line], "--engine", "sim")
    assert status == 1
    err = capsys.readouterr().err
    assert word in err and "--weights DIR" in err and "tokenizer.json" in err and "--tokenizer DIR" in err
    assert "Traceback" not in err


def test_checkpoint_without_tokenizer_refuses_text(tmp_path, capsys):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    status, _ = _run(tmp_path, [{"id": "t", "prompt": "hi", "max_tokens": 2}], "--weights", str(tmp_path / "ckpt"))
    assert status == 1 and "no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    ({"id": "a", "prompt": "x", "prompt_tokens": [1], "max_tokens": 1}, "exactly one of"),
    ({"id": "a", "max_tokens": 1}, r"missing required field .prompt_tokens. \(or .prompt. text"),
    ({"id": "a", "prompt": "", "max_tokens": 1}, "non-empty text"),
    ({"id": "a", "messages": [{"role": "user"}], "max_tokens": 1}, "'content' string"),
    ({"id": "a", "messages": "hi", "max_tokens": 1}, "must be list"),
    ({"id": "a", "prompt": "x", "stop": [""], "max_tokens": 1}, "non-empty string"),
    ({"id": "a", "prompt": "x", "stop": 3, "max_tokens": 1}, "must be str or list"),
])
def test_bad_text_fields_are_refused(checkpoint, tmp_path, line, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(line) + "\n")
    with pytest.raises(WorkloadError, match=message):
        read_prompts(str(prompts), tokenizer=load_tokenizer(str(checkpoint[0])))


def test_messages_without_chat_template_are_refused(checkpoint, tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((checkpoint[0] / "tokenizer.json").read_bytes())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": MESSAGES, "max_tokens": 1}) + "\n")
    with pytest.raises(WorkloadError, match="no chat_template"):
        read_prompts(str(prompts), tokenizer=load_tokenizer(str(directory)))


def test_chat_template_jinja_file(checkpoint, tmp_path):
    """transformers (4.50 on) saves a tokenizer's template in chat_template.jinja and none in
    tokenizer_config.json: 'messages' was refused ("no chat_template") for such a checkpoint. That
    file's template wins over tokenizer_config.json's, as transformers loads it."""
    saved = tmp_path / "saved"
    transformers.AutoTokenizer.from_pretrained(str(checkpoint[0])).save_pretrained(str(saved))
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and (saved / "chat_template.jinja").exists()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(saved))
    rendered = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert load_tokenizer(str(saved)).render_chat(MESSAGES) == rendered
    (saved / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "ignored {{ bos_token }}"}))
    (saved / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}{{ undefined_call() }}")
    with pytest.raises(TokenizerError, match="chat_template.jinja: the chat template failed"):  # its own file named
        load_tokenizer(str(saved)).render_chat(MESSAGES)


def test_bad_tokenizer_files_are_named(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text("{not json")
    status, _ = _run(tmp_path, [{"id": "t", "prompt": "hi", "max_tokens": 2}], "--engine", "sim",
                     "--tokenizer", str(tmp_path))
    err = capsys.readouterr().err
    assert status == 1 and str(tmp_path / "tokenizer.json") in err and "Traceback" not in err
    status, _ = _run(tmp_path, [{"id": "t", "prompt": "hi", "max_tokens": 2}], "--engine", "sim",
                     "--tokenizer", str(tmp_path / "missing"))
    assert status == 1 and "no tokenizer.json" in capsys.readouterr().err
