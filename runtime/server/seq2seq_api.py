"""The OpenAI-compatible routes of encoder-decoder (seq2seq) artifacts, and what they do.

Speech artifacts (Whisper) get ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations`` (the
latter decodes with Whisper's ``translate`` task: into English). A multipart form, as OpenAI's:

    file              required: WAV or FLAC, any length (30 s windows, their texts joined), any rate (resampled)
    model             this server's model name (404 otherwise); may be left out
    language          ISO-639-1 code of the speech ("en"); absent: detected (translations take it too)
    response_format   json ({"text"}) | text (the text alone, text/plain) | verbose_json ({"task", "language"
                      (the code, e.g. "en"), "duration" (s), "text", "segments": []}); srt / vtt are refused
    temperature       absent or 0: greedy (beams if the generation config says); > 0: sampling at it
    prompt            refused when not empty: precast's Whisper decoding does not condition on a previous text
    timestamp_granularities[], stream=true, chunking_strategy, include[]: refused (400 naming the field)

A file that is not WAV / FLAC, is empty, truncated or larger than --max-audio-bytes is a 400 whose message
names the file (OpenAI's error shape, ``param`` "file"). The routes' body limit is --max-audio-bytes + 1 MiB of
form (body_limit.py's ``path_limits``): a larger body is a 413 before it is read (so before the file's name is
known).

Text artifacts (T5, BART, Marian) get ``POST /v1/completions``: ``prompt`` is the source text (a string, a list
of them, token ids or a list of those: each prompt is one choice, all decoded together); ``max_tokens`` ->
max_new_tokens (absent: the generation config's, else 20); ``temperature`` absent or 0: greedy, or the beam search
the generation config asks for; > 0: sampling (``top_p``, ``seed``; extensions ``top_k``, ``num_beams``).
``stream`` = true (one prompt): server-sent events, a chunk per text delta as tokens come. Not supported, so
refused (400 naming the field): ``n`` or
``best_of`` other than 1 (use ``num_beams``: the best beam is returned), ``logprobs``, ``stop``, penalties,
``ignore_eos``, ``min_p``, structured outputs (``response_format`` other than text, ``guided_*``), ``echo``,
``suffix``, and what openai_params.py refuses for every model (unknown keys too). ``usage`` counts the
source's tokens (prompt) and the generated ones (completion).

Every blocking engine call waits in the service's threads (seq2seq_service.py), watching for the client going
away and for --timeout (504): a completion is then cancelled in the engine; a transcription's windows run on.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from precast.errors import InputError, LLMRequestError
from precast.runtime.server.http_errors import HTTPError
from precast.runtime.server.openai_params import (
    MAX_PROMPTS,
    ParamError,
    _completion_prompts,
    _number,
    refuse_unsupported,
)
from precast.runtime.server.protocol import completion_choice, usage
from precast.runtime.server.serving import check_model, read_openai_request

__all__ = ["AUDIO_PATHS", "add_seq2seq_routes", "upload_limit"]

AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")
FORM_BYTES = 1 << 20  # what a form may hold beside its file (boundaries, headers, fields)
MAX_FIELD_BYTES = 64 << 10  # one non-file form field
MAX_BEAMS = 16
RESPONSE_FORMATS = ("json", "text", "verbose_json")


def upload_limit(config) -> int:
    """The audio routes' body limit: one file of max_audio_bytes and its form, within the in-flight budget."""
    return min(config.max_audio_bytes + FORM_BYTES, config.max_inflight_bytes)


def _service(request: Request, speech: bool):
    state = request.app.state.precast
    svc = state.host.current.seq2seq
    if svc is None or svc.speech != speech:
        what = "a speech (Whisper)" if speech else "a text-to-text"
        raise HTTPError(400, f"model '{state.name}' is not {what} seq2seq model")
    return state, svc


async def _wait(future, request: Request, deadline: float, give_up=None):
    """The result of ``future`` (an engine call in the service's threads); the client going away (499) or the
    deadline passing (504) calls ``give_up`` first."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even when given up on
    while True:
        done, _ = await asyncio.wait({future}, timeout=0.25)
        if done:
            return future.result()
        gone = await request.is_disconnected()
        if gone or time.monotonic() > deadline:
            if give_up is not None:
                give_up()
            if gone:
                raise HTTPError(499, "client disconnected")
            raise TimeoutError


# -- /v1/audio/* ---------------------------------------------------------------------------------------------
_AUDIO_REFUSED = {  # form field -> why it is refused when given
    "timestamp_granularities[]": "timestamps are not supported by precast serve",
    "timestamp_granularities": "timestamps are not supported by precast serve",
    "chunking_strategy": "chunking_strategy is not supported by precast serve (30 s windows are fixed)",
    "include[]": "'include' (logprobs) is not supported by precast serve",
}


def _field(form, name: str) -> str | None:
    v = form.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ParamError(f"'{name}' must be a form field, not a file", name)
    return v


async def _read_form(request: Request):
    from starlette.exceptions import HTTPException

    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise ParamError(
            f"an audio request is a multipart/form-data form with a 'file' field, got content-type {ctype!r}",
            "file",
        )
    try:
        return await request.form(max_files=1, max_fields=32, max_part_size=MAX_FIELD_BYTES)
    except HTTPException as e:  # python-multipart's: a malformed form, too many parts, a field too big
        raise ParamError(f"malformed multipart form: {e.detail}", "file") from None


def _audio_options(form, svc, task: str) -> dict:
    for name, why in _AUDIO_REFUSED.items():
        if form.get(name) not in (None, ""):
            raise ParamError(f"'{name.removesuffix('[]')}': {why}", name.removesuffix("[]"))
    if (_field(form, "stream") or "false").lower() not in ("false", "0"):
        raise ParamError(
            "'stream': streaming transcriptions are not supported by precast serve yet", "stream"
        )
    if _field(form, "prompt"):
        raise ParamError(
            "'prompt': precast's Whisper decoding does not condition on a previous text; leave it out",
            "prompt",
        )
    overrides: dict = {"task": task}
    language = _field(form, "language")
    if language:
        if not svc.multilingual and language.strip().lower() not in ("en", "english"):
            raise ParamError(f"'language': this model is English-only, got {language!r}", "language")
        if svc.multilingual:
            overrides["language"] = language.strip().lower()
    if task == "translate" and not svc.multilingual:
        raise HTTPError(400, "this model is English-only: it cannot translate (use /v1/audio/transcriptions)")
    temperature = _field(form, "temperature")
    if temperature not in (None, ""):
        try:
            t = float(temperature)
        except ValueError:
            raise ParamError(f"'temperature' must be a number, got {temperature!r}", "temperature") from None
        if not 0 <= t <= 1:
            raise ParamError(f"'temperature' must be in [0, 1], got {temperature!r}", "temperature")
        overrides.update(
            {"do_sample": True, "temperature": t, "num_beams": 1} if t > 0 else {"do_sample": False}
        )
    return overrides


def _response_format(form) -> str:
    fmt = _field(form, "response_format") or "json"
    if fmt not in RESPONSE_FORMATS:
        raise ParamError(
            f"'response_format': {fmt!r} is not supported by precast serve (one of {', '.join(RESPONSE_FORMATS)})",
            "response_format",
        )
    return fmt


async def audio(request: Request, task: str):
    from starlette.datastructures import UploadFile

    from precast.runtime.processing.whisper import read_audio

    state, svc = _service(request, speech=True)
    config = state.config
    deadline = time.monotonic() + config.request_timeout
    t0 = time.perf_counter()
    form = await _read_form(request)
    try:
        model = _field(form, "model")
        if model:
            check_model(state, model)
        fmt = _response_format(form)
        overrides = _audio_options(form, svc, task)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ParamError("'file' is required: the audio file, as a multipart file field", "file")
        name = upload.filename or "file"
        if upload.size is not None and upload.size > config.max_audio_bytes:
            raise ParamError(
                f"{name}: {upload.size} bytes; this server takes audio files of at most {config.max_audio_bytes} "
                f"bytes (--max-audio-bytes)",
                "file",
            )
        data = await upload.read()
    finally:
        await form.close()
    with svc.admit(config.max_queue):
        try:
            samples = await svc.run(read_audio, data, name, svc.sampling_rate)
        except InputError as e:  # empty, unknown format, truncated: the message names the file
            raise ParamError(str(e), "file") from None
        del data
        future = asyncio.ensure_future(svc.run(svc.engine.transcribe, samples, **overrides))
        result = await _wait(future, request, deadline)
    svc.observe(t0, None, len(result.tokens))
    if fmt == "text":
        return PlainTextResponse(result.text)
    if fmt == "verbose_json":
        return {
            "task": task,
            "language": result.language or ("en" if not svc.multilingual else None),
            "duration": round(len(samples) / svc.sampling_rate, 3),
            "text": result.text,
            "segments": [],
        }
    return {"text": result.text}


# -- /v1/completions (text to text) --------------------------------------------------------------------------
def _is(v, *ok) -> bool:
    return v is None or any(type(v) is type(o) and v == o for o in ok)


_COMPLETION_REFUSED = {  # field -> (is its value harmless?, why it is refused)
    "stream": (lambda v: v is None or isinstance(v, bool), "'stream' must be true or false"),
    "n": (lambda v: _is(v, 1), "n > 1 is not supported for seq2seq models; num_beams runs a beam search"),
    "best_of": (lambda v: _is(v, 1), "best_of > 1 is not supported for seq2seq models; use num_beams"),
    "logprobs": (lambda v: v is None, "logprobs are not supported for seq2seq models yet"),
    "stop": (lambda v: v is None or v == [], "stop strings are not supported for seq2seq models yet"),
    "presence_penalty": (lambda v: _is(v, 0, 0.0), "presence_penalty is not supported for seq2seq models"),
    "frequency_penalty": (lambda v: _is(v, 0, 0.0), "frequency_penalty is not supported for seq2seq models"),
    "repetition_penalty": (
        lambda v: _is(v, 1, 1.0),
        "repetition_penalty is not supported for seq2seq models",
    ),
    "ignore_eos": (lambda v: _is(v, False), "ignore_eos is not supported for seq2seq models"),
    "min_p": (lambda v: _is(v, 0, 0.0), "min_p is not supported for seq2seq models"),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        "structured outputs are not supported for seq2seq models",
    ),
    **{
        k: (lambda v: v is None, "structured outputs are not supported for seq2seq models")
        for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    },
}


def _generation(body: dict) -> dict:
    """The request's generation overrides for the engine (its own checks follow: UsageError -> 400)."""
    out: dict = {}
    max_tokens = _number(body, "max_tokens", None, int)
    if max_tokens is not None:
        if max_tokens < 1:
            raise ParamError(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
        out["max_new_tokens"] = max_tokens
    beams = _number(body, "num_beams", None, int)
    if beams is not None:
        if not 1 <= beams <= MAX_BEAMS:
            raise ParamError(f"'num_beams' must be an integer 1-{MAX_BEAMS}, got {beams}", "num_beams")
        out["num_beams"] = beams
    t = _number(body, "temperature", None)
    if t is not None and not 0 <= t <= 2:
        raise ParamError(f"'temperature' must be in [0, 2], got {t!r}", "temperature")
    if t is None or t == 0:
        out["do_sample"] = False  # greedy, or the generation config's beam search
    else:
        out.update(do_sample=True, temperature=t)
        out.setdefault("num_beams", 1)
    for key, kind in (("top_p", float), ("top_k", int), ("seed", int)):
        v = _number(body, key, None, kind)
        if v is not None:
            out[key] = v
    return out


def _parse_completion(body: dict, svc, config) -> tuple[list, dict]:
    refuse_unsupported(body, chat=False, extra=frozenset({"num_beams"}))
    for key, (ok, why) in _COMPLETION_REFUSED.items():
        if key in body and not ok(body[key]):
            raise ParamError(f"'{key}': {why}", key)
    prompts = _completion_prompts(body.get("prompt"), svc.spec.max_source + 1)
    if len(prompts) > MAX_PROMPTS:  # a list of token-id lists is not bounded there
        raise ParamError(
            f"'prompt' holds {len(prompts)} prompts; this server takes at most {MAX_PROMPTS}", "prompt"
        )
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    if chars > config.max_text_chars:
        raise ParamError(
            f"'prompt' has {chars} characters; this server tokenizes at most {config.max_text_chars} "
            "per request (--max-text-chars)",
            "prompt",
        )
    return prompts, _generation(body)


def _submit(svc, prompts: list, overrides: dict) -> tuple[list, list[int]]:
    """Tokenize the prompts and submit each (a worker thread: tokenizing takes a while). All or none."""
    engine = svc.engine
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if engine.tokenizer is None:
                raise InputError("this artifact ships no tokenizer: send 'prompt' as token ids")
            p = engine.tokenizer.encode(p)
        ids.append(list(p))
    handles = []
    try:
        for p in ids:
            handles.append(engine.submit(p, **overrides))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return handles, [len(p) for p in ids]


def _results(handles: list) -> list:
    return [h.result() for h in handles]


def _cancel(handles: list) -> None:
    for h in handles:
        h.cancel()


async def completions(request: Request):
    state, svc = _service(request, speech=False)
    config = state.config
    deadline = time.monotonic() + config.request_timeout
    t0 = time.perf_counter()
    body, _ = await read_openai_request(request, state, error_cls=LLMRequestError)
    prompts, overrides = _parse_completion(body, svc, config)
    if body.get("stream") is True:
        if len(prompts) != 1:
            raise ParamError("'stream': streaming takes one prompt per request", "stream")
        return await _stream(request, state, svc, prompts, overrides, deadline, t0)
    with svc.admit(config.max_queue):
        handles, lengths = await svc.run(_submit, svc, prompts, overrides)
        future = asyncio.ensure_future(svc.run(_results, handles))
        results = await _wait(future, request, deadline, lambda: _cancel(handles))
    eos = set(svc.engine.settings.eos_token_id)
    choices = []
    for k, r in enumerate(results):
        finish = "stop" if r.tokens and r.tokens[-1] in eos else "length"
        choices.append(completion_choice(k, r.text, finish, None))
    generated = sum(len(r.tokens) for r in results)
    svc.observe(t0, sum(lengths), generated)
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.name,
        "choices": choices,
        "usage": usage(sum(lengths), generated),
    }


async def _stream(request: Request, state, svc, prompts: list, overrides: dict, deadline: float, t0: float):
    """Server-sent events of one text2text completion: a chunk per decoded text delta (greedy and sampled
    decoding stream token by token; a beam search's text comes when its beams are decided), then the finish
    reason, then ``[DONE]``. A client that disconnects cancels the request (its blocks come back)."""
    from fastapi.responses import StreamingResponse

    engine = svc.engine
    admitted = svc.admit(state.config.max_queue)
    admitted.__enter__()
    try:
        handles, lengths = await svc.run(_submit, svc, prompts, overrides)
    except BaseException:
        admitted.__exit__(None, None, None)
        raise
    handle, cid, created = handles[0], f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    tokens_in = handle.stream(
        timeout=max(deadline - time.monotonic(), 0.001)
    )  # (next() blocks: a worker thread)
    eos = set(engine.settings.eos_token_id)

    def chunk(text: str, finish: str | None) -> str:
        payload = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": state.name,
            "choices": [completion_choice(0, text, finish, None)],
        }
        return f"data: {json.dumps(payload)}\n\n"

    async def events():
        tokens: list[int] = []
        sent = ""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or await request.is_disconnected():
                    handle.cancel()
                    return
                try:
                    tok = await svc.run(next, tokens_in, None)
                except TimeoutError:
                    handle.cancel()
                    return
                if tok is None:
                    break
                tokens.append(tok)
                text = engine.tokenizer.decode(tokens) if engine.tokenizer is not None else ""
                if text.startswith(sent) and not text.endswith("\ufffd") and len(text) > len(sent):
                    yield chunk(text[len(sent) :], None)
                    sent = text
            try:
                result = handle.result(timeout=0)
            except Exception as e:  # (the request failed after its stream began: say so in the stream)
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': type(e).__name__}})}\n\n"
                return
            if result.text.startswith(sent) and len(result.text) > len(sent):
                yield chunk(result.text[len(sent) :], None)
            finish = "stop" if result.tokens and result.tokens[-1] in eos else "length"
            yield chunk("", finish)
            yield "data: [DONE]\n\n"
            svc.observe(t0, sum(lengths), len(result.tokens))
        finally:
            admitted.__exit__(None, None, None)

    return StreamingResponse(events(), media_type="text/event-stream")


# -- the routers -----------------------------------------------------------------------------------------------
speech_router = APIRouter()
text_router = APIRouter()


@speech_router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request):
    return await audio(request, "transcribe")


@speech_router.post("/v1/audio/translations")
async def translations(request: Request):
    return await audio(request, "translate")


@text_router.post("/v1/completions")
async def text_completions(request: Request):
    return await completions(request)


def add_seq2seq_routes(app, svc) -> None:
    """The routes of ``svc``'s kind (a reload keeps the task: host.py), each finding the current service."""
    app.include_router(speech_router if svc.speech else text_router)
