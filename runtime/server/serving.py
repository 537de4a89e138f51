"""What the non-LLM routes do: KServe v2 metadata and infer, /v1/models, /v1/embeddings.

Each function takes the ``ServerState`` and the parsed request and returns a body; failures are raised
(http_errors.py turns them into answers), so the routers stay one line per route.
"""

from __future__ import annotations

import base64

import numpy as np
from starlette.concurrency import run_in_threadpool

from precast.errors import InputError, PrecastError
from precast.runtime.server.bodies import json_response, read_json
from precast.runtime.server.embeddings import (
    check_dimensions,
    check_embedding_work,
    mean_pool_normalize,
    parse_inputs,
)
from precast.runtime.server.http_errors import HTTPError
from precast.runtime.server.kserve import (
    decode_request,
    encode_response,
    model_metadata,
    requested_outputs,
)
from precast.runtime.server.protocol import (
    EmbeddingRequest,
    OpenAIRequest,
    embedding_response,
    model_list,
    parse_request,
)
from precast.runtime.server.task_infer import (
    raw_feeds,
    raw_texts,
    split_raw,
    task_metadata,
    task_output_names,
    task_outputs,
)

__all__ = [
    "check_model",
    "create_embeddings",
    "infer",
    "list_models",
    "metadata",
    "read_openai_request",
    "server_metadata",
]


def check_model(state, name: str) -> None:
    if name != state.name:
        raise HTTPError(404, f"unknown model '{name}'; this server serves '{state.name}'", param="model")


async def read_openai_request(
    request, state, cls: type[OpenAIRequest] = OpenAIRequest, error_cls: type[PrecastError] = InputError
):
    """The body as ``cls``, for this server's model (or none): else 404; malformed bodies raise ``error_cls``."""
    body = await read_json(request)
    req = parse_request(cls, body, error_cls)
    check_model(state, state.name if req.model is None else req.model)
    return body, req


# -- KServe v2 ------------------------------------------------------------------------------------------
def server_metadata() -> dict:
    import precast

    return {"name": "precast", "version": precast.__version__, "extensions": []}


def metadata(state, name: str) -> dict:
    check_model(state, name)
    served = state.host.current
    body = model_metadata(state.name, str(served.version), served.model)
    return {**body, **task_metadata(served.task, served.encoder)}


async def infer(state, name: str, version: str | None, request):
    check_model(state, name)
    served = state.host.current
    if served.llm is not None:
        raise HTTPError(400, f"model '{name}' is an LLM; use /v1/completions or /v1/chat/completions")
    if getattr(served, "seq2seq", None) is not None:
        raise HTTPError(400, f"model '{name}' is a seq2seq model; use {served.seq2seq.endpoints}")
    if version is not None and version != str(served.version):
        raise HTTPError(404, f"model '{name}' has no version {version}; serving version {served.version}")
    body = await read_json(request)
    texts = raw_texts(
        body, served.task, served.encoder
    )  # a text classifier's 'text' input: the sandbox tokenizes
    if texts is not None:
        config = state.config
        feeds, _ = await served.encoder.tokenize(texts, config.request_timeout)
        check_embedding_work(feeds, config.max_embedding_tokens)
    # Off the event loop: turning up to max_request_bytes of JSON numbers into arrays takes a while.
    feeds, wanted = await run_in_threadpool(
        _decode_infer, body, served.model, served.task, feeds if texts is not None else None
    )
    outputs = await state.batcher.submit(feeds, timeout=state.config.request_timeout)
    outputs = {**outputs, **task_outputs(served.task, body, outputs)}  # labels, decoded text
    if wanted is not None:
        outputs = {n: outputs[n] for n in wanted}
    rid = body.get("id") if isinstance(body.get("id"), str) else None
    try:
        return await json_response(encode_response(state.name, str(served.version), outputs, rid))
    except ValueError:
        raise HTTPError(500, f"model '{name}' produced NaN or infinity, which JSON cannot carry") from None


def _decode_infer(body: object, model, task=None, text_feeds=None) -> tuple[dict, list[str] | None]:
    from precast.runtime.feeds import check_feeds

    raw, rest = split_raw(body, task) if isinstance(body, dict) else ({}, body)
    if text_feeds is not None:
        feeds = text_feeds
    else:  # an image / a waveform, through the artifact's preprocessing
        feeds = raw_feeds(task, raw) if raw else {}
    if not raw or rest.get("inputs"):
        feeds.update(decode_request(rest))
    feeds = check_feeds(feeds, model.inputs)  # fail fast, before queueing
    return feeds, requested_outputs(body, [o.name for o in model.outputs] + task_output_names(task))


# -- OpenAI-style --------------------------------------------------------------------------------------
def list_models(state) -> dict:
    return model_list(state.name, state.host.current.loaded_at)


async def create_embeddings(state, request):
    served = state.host.current
    config = state.config
    body, req = await read_openai_request(request, state, EmbeddingRequest)
    spec = served.encoder
    if spec is not None and not spec.embeds:
        raise HTTPError(
            400,
            f"model '{state.name}' is a {served.task.spec.task} model, not an embedder; send its texts to "
            f"/v2/models/{state.name}/infer as a 'text' input",
        )
    if spec is None:
        raise HTTPError(
            400,
            f"model '{state.name}' is not a text encoder (needs input_ids/attention_mask "
            f"inputs and tokenizer/tokenizer.json); use /v2/models/{state.name}/infer",
        )
    texts = parse_inputs(body, config.max_embedding_inputs, config.max_text_chars)
    check_dimensions(body, spec.dim)
    feeds, n_tokens = await spec.tokenize(texts, config.request_timeout)  # in the sandbox, off the loop
    check_embedding_work(feeds, config.max_embedding_tokens)
    pad = None if spec.static else {"input_ids": spec.pad_id, "attention_mask": 0, "token_type_ids": 0}
    outputs = await state.batcher.submit(feeds, pad=pad, timeout=config.request_timeout)
    if spec.pooled:
        vectors = outputs[spec.output]
    else:
        vectors = mean_pool_normalize(outputs[spec.output], feeds["attention_mask"])
    if spec.dim is None:  # a symbolic width: 'dimensions' is checked against the result
        check_dimensions(body, vectors.shape[1])
    vectors = vectors.astype(np.float32)
    if req.encoding_format == "base64":
        embeddings = [base64.b64encode(v.tobytes()).decode() for v in vectors]
    else:
        embeddings = [v.tolist() for v in vectors]
    try:
        return await json_response(embedding_response(state.name, embeddings, n_tokens))
    except ValueError:
        raise HTTPError(500, "the model produced NaN or infinity, which JSON cannot carry") from None
