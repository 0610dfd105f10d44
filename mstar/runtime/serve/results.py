"""`mstar run --out DIR`: each request's results written the moment it finishes.

In: an output directory, the audio sample rate, and finished request records, one `write` call
per request as it ends. Out, in DIR:
- `outputs.jsonl`: one JSON line per finished request, in the order they finished:
  `{"id", "output_tokens", "text", "ttft_ms", "finish_reason", "media"}` (`media`: the request's
  file names in DIR; `text`: the output tokens decoded by the run's tokenizer, special tokens
  skipped, cut before the first of the request's stop strings it holds; null without a
  tokenizer or when the output is not token ids), and `actions` when the request emitted any
  (`client action` edges: each emission a list of rows of floats, Pi0.5's action chunk, in
  emission order), and `latents` likewise for `client latents` edges (hidden states as floats; an
  accumulated emission is a list of them, one per loop iteration), and `logprobs` for a request
  that asked for them (its line's "logprobs": N): one `{"token", "logprob", "top"}` per text token
  sent, `top` its N most likely alternatives as [id, logprob] pairs (a logprob of minus infinity
  as -9999.0; null for a token no engine row gave them of), and `prompt_logprobs` likewise for a
  request that asked for its prompt's (its line's "prompt_logprobs": N): one entry per prompt
  token, given the tokens before it (the first's logprob null). Each line goes out in one
  unbuffered write, so an interrupt or a crash keeps every line written before it whole, and a line
  is written only after its media files are.
- media: a request's audio chunks as one WAV, its images as PNGs, each written under a
  temporary name beside the final one and renamed, so a file under its final name is always
  complete.

outputs.jsonl is made new (a temporary file renamed over the name): a link left at that name is
replaced, never followed, so no file outside DIR is emptied or written.

Durability: what is written is in the operating system's hands at once, so an interrupt, a kill
or a crash of mstar loses nothing written; `close()` fsyncs outputs.jsonl and the directory.
Media files are not fsynced one by one (on ext4 here an fsync per file made writing a request
3.2 ms instead of 0.7 ms, and a 10,000-request sim run several times longer), so a power loss
during the run may lose recent media.

A write that fails (a full disk) removes its temporary file, cuts outputs.jsonl back to its last
whole line, and raises `OutputError` naming the file and what was kept. `close()` fsyncs
outputs.jsonl. outputs.jsonl removed or replaced during the run (the folder deleted, the file
unlinked or made a directory) is an `OutputError` at the next request's write and at `close()`:
the lines went on into the open but nameless file, and the run exited 0 with nothing kept.

A run killed (SIGKILL, a power loss) while a line is written may leave that last line cut short:
the kernel ends a write to a file early at a page boundary for a fatal signal (ext4 here: 2 of 40
kills of a loop of 300-byte appends left a cut line). `read_outputs` reads outputs.jsonl and
leaves such a last line out; every line before it is whole.

`write_output_file(path, data)` writes one whole output file (a report, a timeline): a regular
file (or a new one) is replaced atomically, the old one left as it was on a failure; a device or
FIFO (`/dev/stdout`, `/dev/full`) is written in place, never replaced. Failures: OutputError.

File names (`media_name`): the id with each character outside [A-Za-z0-9._-] replaced by `_`,
leading dots dropped, cut to 64 characters, then `-` and the first 8 hex digits of the id's
sha256: two ids never share a name, and no id (`/abs`, `../x`, `a/b`) names a path outside DIR.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
import tempfile
from typing import Any, Optional

from mstar.arg_types import shown_path
from mstar.files import make_dirs

MAX_NAME_STEM = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class OutputError(Exception):
    """A file under --out could not be written (the message names it and what was kept)."""


def _float_rows(value: Any) -> Any:
    """An action chunk or latents (a tensor or array, `[horizon, dim]`, or a list of them: a loop's
    accumulated values) as JSON lists of floats."""
    if isinstance(value, (list, tuple)):
        return [_float_rows(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


def media_name(request_id: str, suffix: str) -> str:
    """A file name for one of the request's media files (rules in the module docstring)."""
    stem = _UNSAFE.sub("_", request_id).lstrip(".")[:MAX_NAME_STEM]
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{stem}-{digest}{suffix}" if stem else f"{digest}{suffix}"


def sample_rate_of(plan: Any, default: int = 24000) -> int:
    """The audio sample rate a node of the plan declares (`sample_rate` dim), else `default`."""
    return next((n.dims["sample_rate"] for n in plan.nodes if isinstance(n.dims.get("sample_rate"), int)), default)


def _tokens_json(values: list[Any]) -> list[Any]:
    out = []
    for value in values:
        item = getattr(value, "tolist", None)
        out.append(item() if callable(item) else value)
    return out


class ResultWriter:
    """Writes finished requests into `out_dir` (created if missing); see the module docstring."""

    def __init__(self, out_dir: str, sample_rate: int, tokenizer: Any = None):
        self.out_dir = out_dir
        self.tokenizer = tokenizer  # serve/tokenizer.py TextTokenizer, or None
        self.sample_rate = sample_rate
        self.path = os.path.join(out_dir, "outputs.jsonl")
        self.num_lines = 0
        self.num_media = 0
        self._written: set[str] = set()  # the ids of the requests whose lines are written
        self._size = 0  # bytes of whole lines in outputs.jsonl
        self._is_failed = False  # an OutputError was raised: close() does not say it again
        try:
            make_dirs(out_dir)
            self._fd = _fresh_file(self.path)
            info = os.fstat(self._fd)
        except OSError as error:
            raise OutputError(f"cannot write {shown_path(self.path)}: {error.strerror or error}") from None
        self._identity = (info.st_dev, info.st_ino)

    def write(self, record: Any) -> None:
        """The finished request's media files, then its line in outputs.jsonl."""
        self._check_in_place()
        request_id = record.request.id
        media = self._write_media(request_id, record.emissions)
        ttft = None
        if record.first_token_s is not None:
            ttft = round((record.first_token_s - record.arrival_s) * 1000.0, 3)
        tokens = _tokens_json(record.output_tokens)
        text = self._text(tokens, record.request)
        line = {"id": request_id, "output_tokens": tokens, "text": text, "ttft_ms": ttft,
                "finish_reason": record.finish_reason, "media": media}
        actions = [_float_rows(e.value) for e in record.emissions if e.modality == "action"]
        if actions:
            line["actions"] = actions
        latents = [_float_rows(e.value) for e in record.emissions if e.modality == "latents"]
        if latents:
            line["latents"] = latents
        if record.request.logprobs is not None:
            line["logprobs"] = _logprobs_json(record)
        if record.request.prompt_logprobs is not None:
            line["prompt_logprobs"] = prompt_logprobs_json(record)
        self._append((json.dumps(line) + "\n").encode("utf-8"))
        self.num_lines += 1
        self._written.add(request_id)

    def has_written(self, request_id: str) -> bool:
        return request_id in self._written

    def _text(self, tokens: list[Any], request: Any) -> Optional[str]:
        """The output as text read after the prompt's last tokens (text_context.py), cut before the
        first stop string that ends past the text of its first `min_tokens` tokens."""
        if self.tokenizer is None or not all(isinstance(t, int) for t in tokens):
            return None
        from mstar.runtime.conductor.text_context import prompt_context, text_after
        from mstar.runtime.serve.tokenizer import stop_text_index

        stops, min_tokens = request.stop_strings, request.min_tokens
        context = prompt_context(request.prompt_tokens, self.tokenizer.decode)
        text = text_after(self.tokenizer.decode, context, tokens)
        after = len(text_after(self.tokenizer.decode, context, tokens[:min_tokens])) if min_tokens and stops else 0
        cut = stop_text_index(text, stops, after=after)
        return text if cut is None else text[:cut]

    def _write_media(self, request_id: str, emissions: list[Any]) -> list[str]:
        audio = [e.value for e in emissions if e.modality == "audio"]
        images = [e.value for e in emissions if e.modality == "image"]
        if not audio and not images:
            return []
        from mstar.runtime.serve import media

        names = []
        if audio:
            data, _ = media.wav_bytes(audio, self.sample_rate)
            names.append(self._write_file(media_name(request_id, ".wav"), data))
        for index, image in enumerate(images):
            try:
                data, _ = media.png_bytes(image)
            except ValueError as error:
                print(f"mstar: warning: {request_id}: image not written: {error}", file=sys.stderr)
                continue
            suffix = ".png" if len(images) == 1 else f"_{index}.png"
            names.append(self._write_file(media_name(request_id, suffix), data))
        return names

    def _write_file(self, name: str, data: bytes) -> str:
        path = os.path.join(self.out_dir, name)
        try:
            _replace(path, data)
        except OSError as error:
            self._is_failed = True
            raise OutputError(f"cannot write {shown_path(path)}: {error.strerror or error}; {self._kept()}") from None
        self.num_media += 1
        return name

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as error:
            try:  # a line cut short by a full disk is removed: the file ends on a whole line
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            self._is_failed = True
            raise OutputError(f"cannot write {shown_path(self.path)}: {error.strerror or error}; "
                              f"{self._kept()}") from None
        self._size += len(data)

    def _kept(self) -> str:
        return f"{shown_path(self.path)} holds the {self.num_lines} requests written before it"

    def _check_in_place(self) -> None:
        """outputs.jsonl still names the file this writer appends to (one stat per request);
        else an OutputError: what was written went with the removed file."""
        try:
            info = os.stat(self.path)
            is_same = (info.st_dev, info.st_ino) == self._identity
        except OSError:  # gone, or its folder gone
            is_same = False
        if not is_same:
            self._is_failed = True
            raise OutputError(f"{shown_path(self.path)} was removed or replaced during the run; the "
                              f"{self.num_lines} requests written to it went with it")

    def close(self) -> None:
        """Flush outputs.jsonl to the disk and close it (idempotent); an OutputError when it was
        removed or replaced since the last write."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            os.fsync(fd)
            _fsync_directory(self.out_dir)
        except OSError as error:
            raise OutputError(f"cannot write {shown_path(self.path)}: {error.strerror or error}") from None
        finally:
            os.close(fd)
        if not self._is_failed:
            self._check_in_place()


def read_outputs(out_dir: str) -> list[dict[str, Any]]:
    """The lines of `out_dir`'s outputs.jsonl, without a last line cut short by a kill (see the
    module docstring); a line that is not JSON elsewhere raises ValueError naming it."""
    path = os.path.join(out_dir, "outputs.jsonl")
    with open(path, "rb") as handle:
        data = handle.read()
    whole = data[:data.rfind(b"\n") + 1]  # a kill mid-write leaves a tail without its newline
    lines = []
    for number, line in enumerate(whole.split(b"\n")[:-1], start=1):
        try:
            lines.append(json.loads(line))
        except ValueError as error:
            raise ValueError(f"{shown_path(path)}:{number}: not a JSON line ({error})") from None
    return lines


def _replace(path: str, data: bytes) -> None:
    """`data` under a temporary name beside `path`, then renamed over it (no fsync: see the
    module docstring); the temporary file is removed on any failure."""
    directory, name = os.path.split(path)
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temp, 0o644 & ~_UMASK)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _fresh_file(path: str) -> int:
    """A new empty file at `path`, open for appending: made under a temporary name beside it and
    renamed over whatever was there. Opening `path` itself with O_TRUNC followed a symbolic link
    left at that name (or shared a hard link's inode) and emptied the file it led to, outside
    --out; a rename replaces the name alone."""
    directory, name = os.path.split(path)
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
    try:
        os.fchmod(fd, 0o644 & ~_UMASK)
        os.replace(temp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def _fsync_directory(directory: str) -> None:
    """The renames into `directory` reach the disk (where a directory can be opened to sync)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory: the renames are then as safe as they get
    finally:
        os.close(fd)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_UMASK = _umask()


def write_output_file(path: str, data: bytes) -> None:
    """Write `data` as the whole of `path` (rules in the module docstring)."""
    import stat

    from mstar.files import atomic_write_bytes

    try:
        is_special = os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode)
        if is_special:  # renaming over a device node would replace the device itself
            with open(path, "wb") as handle:
                handle.write(data)
        else:
            atomic_write_bytes(path, data)
    except OSError as error:
        raise OutputError(f"cannot write {shown_path(path)}: {_reason(error)}") from None


def _reason(error: OSError) -> str:
    """The OS's reason without the path atomic_write_bytes already put in its message."""
    return error.strerror.split(": ", 1)[-1] if error.strerror and error.strerror.startswith("cannot write") \
        else (error.strerror or str(error))


def _logprobs_json(record: Any) -> list[dict[str, Any]]:
    """One entry per text token the record sent, with its log-probabilities
    (`RequestRecord.text_token_logprobs`; null where no engine row gave them)."""
    return _entries_json(record.text_token_logprobs(0, len(record.emission_values)))


def prompt_logprobs_json(record: Any) -> list[dict[str, Any]]:
    """One entry per prompt token, with its log-probabilities given the tokens before it
    (`RequestRecord.prompt_logprobs`; null for the first, and for any the engine gave none of)."""
    return _entries_json(list(zip(record.request.prompt_tokens, record.prompt_token_logprobs())))


def _entries_json(pairs: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    from mstar.runtime.serve.logprobs_format import finite

    entries: list[dict[str, Any]] = []
    for token, found in pairs:
        own, top = found if found is not None else (None, ())
        entries.append({"token": token, "logprob": finite(own),
                        "top": [[other, finite(logprob)] for other, logprob in top]})
    return entries
