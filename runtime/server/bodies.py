"""JSON bodies in and out: the reader every route uses, the two error formats, large responses.

A body is read once, already bounded by ``BodyLimitMiddleware`` (body_limit.py), then parsed here:
large bodies in a worker thread (so ``/health`` and other requests keep being answered while it parses),
and every way the standard parser can fail on hostile input is one InputError line, never a 500:

    nesting deeper than the parser allows  RecursionError        -> 400 "nested too deeply"
    an integer of more than 4300 digits    ValueError            -> 400 naming the limit
    a lone UTF-16 surrogate ("\\ud800")    (parses, then breaks  -> 400 "lone surrogate"
                                            tokenizers and JSON encoding later)
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor

from fastapi.responses import JSONResponse, Response

from precast.errors import InputError

__all__ = ["error_body", "json_response", "openai_error", "parse_json", "read_json", "v2_error"]

# Below this, parsing takes microseconds: cheaper inline than a hop to a thread.
_INLINE_PARSE_BYTES = 64 << 10

# JSON work holds the GIL, so more threads than this would not parse faster; and each thread that parses
# hostile input keeps what it touched (its stack, ~0.6 MB after 1000 levels of nesting; its malloc arena),
# so a few dedicated threads bound that where the shared request thread pool (40) would not.
_JSON_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="precast-json")

# A lone surrogate can only come from a \uD800-\uDFFF escape or from raw surrogate bytes (json.loads
# decodes bytes with 'surrogatepass'). Bodies without either (nearly all) skip the walk below.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def v2_error(status: int, message: str, headers: dict | None = None):
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def openai_error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict | None = None,
):
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_body(path: str, status: int, message: str) -> bytes:
    """The error body a route under ``path`` would send (OpenAI's shape under /v1/, KServe's elsewhere)."""
    if path.startswith("/v1/"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        body: dict = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    else:
        body = {"error": message}
    return json.dumps(body).encode()


class _NonFinite(Exception):
    pass


def _no_constant(name: str):  # Python's json takes NaN / Infinity, which JSON does not have
    raise _NonFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise _NonFinite(f"{text[:20]} (out of range)")
    return value


def parse_json(raw: bytes) -> object:
    """``raw`` as JSON, or InputError with one line naming what is wrong."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except _NonFinite as e:
        raise InputError(f"JSON body holds {e}: not a JSON number (inputs must be finite)") from None
    except RecursionError:
        raise InputError("JSON body is nested too deeply (the parser's limit is about 1000 levels)") from None
    except UnicodeDecodeError as e:
        raise InputError(f"malformed JSON body: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"malformed JSON body: {e}") from None
    except ValueError:  # int('9' * 5000): Python's guard against quadratic int parsing
        raise InputError(
            f"JSON body holds an integer of more than {sys.get_int_max_str_digits()} digits (the limit)"
        ) from None
    if _MAYBE_SURROGATE.search(raw):
        _check_no_lone_surrogates(obj)
    return obj


def _check_no_lone_surrogates(obj: object) -> None:
    """Walk without recursion (the value may be ~1000 levels deep); pairs were joined by the parser."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m:
                raise InputError(
                    f"JSON body holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x}) in a string: not valid text"
                )
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


async def read_json(request) -> object:
    """The request body as JSON (InputError when it is not): parsed off the event loop when large."""
    raw = await request.body()
    if len(raw) < _INLINE_PARSE_BYTES:
        return parse_json(raw)
    return await asyncio.get_running_loop().run_in_executor(_JSON_THREADS, parse_json, raw)


async def json_response(obj: object) -> Response:
    """``obj`` as a JSON response, encoded in a worker thread: an infer response can hold millions of
    numbers, and encoding them on the event loop would stall every other request (FastAPI's own path
    for a returned dict also walks it in Python first). ValueError: a NaN or infinity, which JSON lacks."""
    body = await asyncio.get_running_loop().run_in_executor(_JSON_THREADS, _dumps, obj)
    return Response(body, media_type="application/json")


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
