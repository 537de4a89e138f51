"""The process that runs an artifact's text code (chat template, tokenizer) for the server: one fork per call.

An artifact's chat template (Jinja) and tokenizer (``tokenizer.json``: normalizer and pre-tokenizer regexes)
are code its author chose. Run in the server's threads, a template with a nested loop or a pre-tokenizer
regex that backtracks holds a shared thread (and the GIL) for as long as it likes, and a template that
doubles a string takes the server's memory. Threads cannot be stopped; processes can. So this process (the
*zygote*) loads the template and the tokenizer once, and forks a child for each call:

- the child runs at the lowest CPU priority (``nice`` 19: the engine and the event loop come first), first in
  line for the kernel's OOM killer (``oom_score_adj`` 1000), under an
  address-space limit (``RLIMIT_AS`` = the zygote's size + the call's memory budget) and a CPU-time limit, with
  stdin, stdout and stderr on /dev/null (a Rust panic prints nothing), and writes one result frame to its pipe;
- the zygote kills a child at its deadline (or when the server cancels the call) and answers ``timeout``;
  a child that dies without a result (a memory limit, a crash) is answered ``failed``;
- at most ``max_live`` children run at once; more calls wait in order, each still bound by its deadline.

Protocol (stdin -> zygote -> stdout): frames of a 4-byte big-endian length and a JSON object. First
``{"template": str | null (null: ChatML), "tokenizer": path | null, "memory": bytes, "max_live": n}``, answered
``{"ready": true}`` or ``{"error": "..."}``. Then calls ``{"id", "op", "args", "timeout", "expires", "memory"}`` and cancels
``{"cancel": id}`` (``timeout``: seconds the call may run; ``expires``: seconds it may take in all,
waiting included; ``memory``: bytes it may add to the zygote's address space); each call is answered once: ``{"id", "ok": result}`` or ``{"id", "error": kind,
"message": line}`` with kind ``request`` (the input is wrong: a 400), ``timeout`` or ``failed``.
The zygote exits when its stdin closes, and kills its children first.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import struct
import sys
import time
from collections import deque

__all__ = ["read_frame", "write_frame", "frame"]

_HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20  # a frame longer than this is a protocol error (the server's bodies are far smaller)


def frame(obj) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return _HEADER.pack(len(data)) + data


def write_frame(fd: int, obj) -> None:
    view = memoryview(frame(obj))
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(fd: int):
    """The next frame's object, or None at end of file."""
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    data = _read_exact(fd, n)
    if data is None:
        return None
    return json.loads(data.decode("utf-8", "surrogatepass"))


class _Frames:
    """Frames out of a byte stream read in chunks (a non-blocking fd)."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes")
            if len(self.buf) < _HEADER.size + n:
                break
            out.append(
                json.loads(bytes(self.buf[_HEADER.size : _HEADER.size + n]).decode("utf-8", "surrogatepass"))
            )
            del self.buf[: _HEADER.size + n]
        return out


# -- what a child runs -------------------------------------------------------------------------------------
class _RequestError(Exception):
    """The caller's input is wrong (a 400), e.g. the template raised, or the prompt is too long."""


# With tools, the default template lists them in a system block as Hermes / Qwen templates do (after the
# request's own system message, if it starts with one), and writes calls and results in the same tags.
TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_TAIL = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)


def _tojson(x, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` filter for chat templates (plain JSON, not jinja2's HTML-safe one)."""
    return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class _ChatML:
    """llm_service.DEFAULT_CHAT_TEMPLATE in plain Python (no jinja2 needed for artifacts without a template)."""

    def render(self, messages, tools=None, add_generation_prompt=True, **_):
        out = []
        if tools:
            first_system = bool(messages) and messages[0]["role"] == "system"
            system = messages[0]["content"] + "\n\n" if first_system else ""
            listed = "".join("\n" + _tojson(t) for t in tools)
            out.append(f"<|im_start|>system\n{system}{TOOLS_HEAD}{listed}\n{TOOLS_TAIL}<|im_end|>\n")
            messages = messages[1:] if first_system else messages
        for m in messages:
            content = m["content"]
            if m["role"] == "tool":
                content = f"<tool_response>\n{content}\n</tool_response>"
            for c in m.get("tool_calls") or ():
                call = {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                content += f"\n<tool_call>\n{_tojson(call)}\n</tool_call>"
            out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
        return "".join(out) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _load(init: dict):
    template = _ChatML()
    if init.get("template") is not None:
        try:
            import jinja2
        except ImportError:
            raise ValueError("its chat template needs jinja2: pip install jinja2") from None
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise _RequestError(str(message))

        def strftime_now(fmt):
            from datetime import datetime

            return datetime.now().strftime(str(fmt))

        # As transformers renders chat templates: loop controls ({% break %}), raise_exception, strftime_now,
        # a plain-JSON tojson; ``tools`` (OpenAI's tool dicts) or None.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        env.filters["tojson"] = _tojson
        try:
            template = env.from_string(init["template"])
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {_line(e)}") from None
    tokenizer = None
    if init.get("tokenizer") is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(init["tokenizer"])
        if init.get("plain"):  # the embeddings server pads and truncates itself
            tokenizer.no_padding()
            tokenizer.no_truncation()
    return template, tokenizer


def _line(e: BaseException) -> str:
    """One line of an error for the client: at most 300 characters, valid UTF-8 (a template's message may hold
    a lone surrogate, which JSON responses cannot carry)."""
    text = " ".join(str(e).split())
    text = (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _encode(tokenizer, texts: list[str], special: bool) -> list:
    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    try:
        return batch(texts, add_special_tokens=special)
    except MemoryError:
        raise
    except BaseException as e:  # noqa: BLE001  (a regex engine's panic is a BaseException)
        raise _RequestError(f"the artifact's tokenizer failed on this input: {_line(e)}") from None


def _run(template, tokenizer, op: str, args: dict):
    if op == "chat":
        try:
            text = template.render(
                messages=args["messages"],
                tools=args.get("tools") or None,
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )
        except (_RequestError, MemoryError):
            raise
        except Exception as e:
            raise _RequestError(f"chat template failed: {_line(e)}") from None
        limit = args.get("max_chars")
        if limit is not None and len(text) > limit:
            raise _RequestError(
                f"the rendered chat prompt has {len(text)} characters; this server tokenizes at most {limit} "
                "per request (--max-text-chars)"
            )
        if tokenizer is None or not args.get("encode", True):
            return {"text": text}
        return {"ids": list(_encode(tokenizer, [text], True)[0].ids)}
    if op == "encode":
        if tokenizer is None:
            raise _RequestError("this artifact has no tokenizer: pass token ids, not text")
        encs = _encode(tokenizer, args["texts"], bool(args.get("special", True)))
        if args.get("type_ids"):
            return [[list(e.ids), list(e.type_ids)] for e in encs]
        return [list(e.ids) for e in encs]
    raise _RequestError(f"unknown op {op!r}")


def _die_with_parent() -> None:
    """SIGKILL this child when the zygote dies (the server also kills the whole group; this covers a zygote
    killed on its own, e.g. by the OOM killer)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the zygote died before the prctl
            os._exit(1)
    except (OSError, AttributeError):
        pass


def _child(template, tokenizer, call: dict, fd: int, address_space: int) -> None:
    """In the forked child: limits, the call, one frame to ``fd``, exit. Never returns."""
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):
            os.dup2(devnull, std)
        _die_with_parent()
        os.nice(19)
        try:  # under memory pressure the kernel's OOM killer takes a sandbox child before the server
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        cpu = int(call.get("timeout", 60)) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        try:
            result = {"ok": _run(template, tokenizer, call["op"], call.get("args") or {})}
        except _RequestError as e:
            result = {"error": "request", "message": _line(e)}
        except MemoryError:
            result = {"error": "memory", "message": "out of its memory limit"}
        except BaseException as e:  # noqa: BLE001  (a tokenizers panic is a BaseException)
            result = {"error": "request", "message": f"{type(e).__name__}: {_line(e)}"}
        try:
            write_frame(fd, result)
        except MemoryError:
            write_frame(fd, {"error": "memory", "message": "out of its memory limit"})
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


# -- the zygote ------------------------------------------------------------------------------------------
class _Live:
    __slots__ = ("id", "pid", "fd", "deadline", "frames", "answered")

    def __init__(self, id_, pid, fd, deadline):
        self.id, self.pid, self.fd, self.deadline = id_, pid, fd, deadline
        self.frames = _Frames()
        self.answered = False


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 1 << 30


def _failure(status: int) -> dict:
    """The answer for a child whose pipe closed without a result: it exited (a memory limit, a crash)."""
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {
        "error": "failed",
        "message": (
            f"was killed by signal {sig} (over its memory or CPU limit)"
            if sig
            else "ended without an answer (over its memory limit)"
        ),
    }


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_TIMEOUT = {"error": "timeout", "message": "ran past its deadline"}
_CANCELLED = {"error": "cancelled", "message": "cancelled"}


class _Zygote:
    """The zygote's state between events: the calls waiting, the children running, the children dying.

    One object rather than closures in ``serve`` so that each event (a frame from the server, a child's
    output, a deadline) is one method that reads on its own.
    """

    def __init__(self, template, tokenizer, init: dict, stdin: int, stdout: int):
        self.template, self.tokenizer = template, tokenizer
        self.stdin, self.stdout = stdin, stdout
        self.base = _vm_size()
        self.default_memory = int(init.get("memory", 128 << 20))
        self.max_live = max(1, int(init.get("max_live", 32)))
        self.sel = selectors.DefaultSelector()
        self.incoming = _Frames()
        self.waiting: deque[tuple[dict, float]] = deque()
        self.live: dict[int, _Live] = {}  # fd -> child
        # killed children not waited for yet (a busy nice-19 child takes a while to exit)
        self.dying: set[int] = set()

    def answer(self, id_, obj) -> None:
        write_frame(self.stdout, {"id": id_, **obj})

    def start(self, call: dict, deadline: float) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            memory = self.base + int(call.get("memory", self.default_memory))
            _child(self.template, self.tokenizer, call, w, memory)
        os.close(w)
        os.set_blocking(r, False)
        self.live[r] = _Live(call["id"], pid, r, deadline)
        self.sel.register(r, selectors.EVENT_READ, r)

    def reap(self, child: _Live, why: dict | None) -> None:
        """Stop following a child: answer ``why`` if it did not answer; kill it if it runs. Never blocks on a
        running child: the killed ones are collected later (collect)."""
        self.sel.unregister(child.fd)
        os.close(child.fd)
        del self.live[child.fd]
        if why is not None or child.answered:
            _kill(child.pid)
            self.dying.add(child.pid)
        else:  # its pipe closed without an answer: it has exited (a memory limit, a crash)
            why = _failure(os.waitpid(child.pid, 0)[1])
        if not child.answered:
            self.answer(child.id, why)

    def collect(self) -> None:
        for pid in list(self.dying):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.dying.discard(pid)

    def schedule(self) -> float | None:
        """Time out what is past its deadline, start what may start; the next instant to wake up at."""
        now = time.monotonic()
        for child in [c for c in self.live.values() if c.deadline <= now]:
            self.reap(child, _TIMEOUT)
        while self.waiting and self.waiting[0][1] <= now:
            call, _ = self.waiting.popleft()
            self.answer(call["id"], _TIMEOUT)
        while self.waiting and len(self.live) < self.max_live:
            call, expires = self.waiting.popleft()  # (the reaping above took time: read the clock again)
            self.start(call, min(expires, time.monotonic() + float(call.get("timeout", 60))))
        self.collect()
        nxt = min([c.deadline for c in self.live.values()] + [d for _, d in self.waiting], default=None)
        if self.dying:
            soon = time.monotonic() + 0.05
            nxt = min(nxt, soon) if nxt is not None else soon
        return nxt

    def on_server(self) -> bool:
        """Read the server's frames: calls and cancels. False when the server closed our stdin."""
        data = os.read(self.stdin, 1 << 20)
        if not data:
            return False
        for msg in self.incoming.feed(data):
            if "cancel" in msg:
                self.cancel(msg["cancel"])
            else:  # the whole call must end within "expires" s; its run within "timeout" s
                expires = time.monotonic() + float(msg.get("expires", msg.get("timeout", 60)))
                self.waiting.append((msg, expires))
        return True

    def cancel(self, gone) -> None:
        for child in [c for c in self.live.values() if c.id == gone]:
            self.reap(child, _CANCELLED)
        for item in [w for w in self.waiting if w[0]["id"] == gone]:
            self.waiting.remove(item)
            self.answer(gone, _CANCELLED)

    def on_child(self, fd: int) -> None:
        """Pass a child's result frame on (once), or reap it when its pipe closes."""
        child = self.live.get(fd)
        if child is None:
            return
        try:
            data = os.read(child.fd, 1 << 20)
        except BlockingIOError:
            return
        if not data:
            self.reap(child, None)
            return
        for result in child.frames.feed(data):
            if not child.answered:
                child.answered = True
                self.answer(child.id, result)

    def run(self) -> int:
        os.set_blocking(self.stdin, False)
        self.sel.register(self.stdin, selectors.EVENT_READ, None)
        try:
            while True:
                nxt = self.schedule()
                events = self.sel.select(None if nxt is None else max(0.0, nxt - time.monotonic()))
                for key, _ in events:
                    if key.data is None:  # the server
                        if not self.on_server():
                            return 0
                    else:
                        self.on_child(key.data)
        finally:
            for pid in [c.pid for c in self.live.values()] + list(self.dying):
                _kill(pid)


def serve(stdin: int = 0, stdout: int = 1) -> int:
    init = read_frame(stdin)
    if init is None:
        return 0
    try:
        template, tokenizer = _load(init)
    except Exception as e:  # noqa: BLE001  (reported to the server, which names the artifact file)
        write_frame(stdout, {"error": _line(e)})
        return 1
    zygote = _Zygote(template, tokenizer, init, stdin, stdout)
    write_frame(stdout, {"ready": True, "base": zygote.base})
    return zygote.run()


def main() -> int:
    # The zygote forks; tokenizers' thread pool must not exist before a fork (and one call uses one core).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C reaches the whole group: it ends us
    try:
        return serve()
    except (BrokenPipeError, ConnectionResetError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
