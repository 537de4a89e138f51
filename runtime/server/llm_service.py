"""One LLM artifact behind the server: the engine's background loop, async token streams, chat templates.

Chat prompts use the artifact's ``tokenizer/tokenizer_config.json`` ``chat_template`` (Jinja, rendered
with ``jinja2``'s sandbox as Hugging Face does) when it has one; otherwise this documented default (ChatML):

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

With ``tools`` (the template's ``tools`` variable: OpenAI's tool dicts, as transformers passes them) it starts with
a system block listing them as JSON, and writes calls and results in ``<tool_call>`` / ``<tool_response>`` tags,
as Hermes and Qwen templates do.

The template and the tokenizer are the artifact's code: requests render and tokenize in a TextSandbox
(text_sandbox.py: a process per call, with a deadline and a memory limit), never in the server's threads.

Priorities: ``high`` / ``normal`` / ``low`` (or an integer, lower = more urgent) map to the engine's
priority classes 0 / 1 / 2; the engine ages waiting requests so low priority still progresses.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from precast.artifact.llm_spec import LLMSpec
from precast.artifact.manifest import Manifest, artifact_path, read_manifest
from precast.errors import LLMRequestError
from precast.runtime.server.text_sandbox import TextLimits, TextSandbox
from precast.runtime.server.text_worker import TOOLS_HEAD, TOOLS_TAIL

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_CHAT_TEMPLATE",
    "PRIORITIES",
    "LLMService",
    "TokenStream",
    "parse_priority",
    "text_chars",
]

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
DEFAULT_PRIORITY = PRIORITIES["normal"]
# What an OpenAI chat message may hold (anything else is a 400, never ignored); "refusal" is an assistant's
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
# ... and what a response's message carries back when a client appends it whole (model_dump()): fine empty
_EMPTY_OK = frozenset({"annotations", "audio", "function_call"})
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # developer is rendered as system

# (text_worker._ChatML renders the same in plain Python. The '\\n' in {{ }}: trim_blocks drops a newline after a tag.)
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    + TOOLS_HEAD.replace("\n", "{{ '\\n' }}")
    + "{% for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}{{ '\\n' }}"
    + TOOLS_TAIL.replace("\n", "{{ '\\n' }}")
    + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}{{ '<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}{{ '\\n<tool_call>\\n' }}"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "{{ '\\n</tool_call>' }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def parse_priority(value) -> int:
    if value is None or value == "":
        return DEFAULT_PRIORITY
    if isinstance(value, str):
        v = value.strip().lower()
        if v in PRIORITIES:
            return PRIORITIES[v]
        try:
            value = int(v)
        except ValueError:
            raise LLMRequestError(
                f"priority must be one of {', '.join(PRIORITIES)} or an integer, got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9:
        raise LLMRequestError(
            f"priority must be one of {', '.join(PRIORITIES)} or an integer 0-9, got {value!r}"
        )
    return value


class _ModelView:
    """What the generic routes need from a served model (name, target, IO) without a plain Model."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest
        self.inputs = list(manifest.io.inputs)
        self.outputs = list(manifest.io.outputs)

    @property
    def target(self) -> str:
        return self.manifest.target.name


class LLMService:
    def __init__(
        self,
        engine,
        path: Path,
        manifest: Manifest,
        max_active: int = 256,
        text_limits: TextLimits | None = None,
        text: TextSandbox | None = None,
    ):
        """``text``: what renders and tokenizes prompts (default: a TextSandbox over the artifact's template
        and tokenizer; tests hand in one over a fake engine's tokenizer)."""
        self.engine = engine
        self.path = path
        self.manifest = manifest
        self.max_active = max_active
        self.active = 0
        self.metrics = None
        self._exported: dict[str, int] = {}  # engine counter values already added to Prometheus
        self.retired = False
        if text is None:
            text = TextSandbox(
                template=template_source(path, manifest.files),
                tokenizer=_tokenizer_file(path, manifest),
                limits=text_limits or TextLimits(),
            ).start()
        self.text = text
        try:
            engine.start()
        except BaseException:
            self.text.close()
            raise

    @classmethod
    def from_artifact(
        cls, path: Path, max_active: int = 256, *, text_limits: TextLimits | None = None, **engine_options
    ) -> LLMService:
        """``engine_options``: the serve flags that go to the engine (config.LLM_OPTIONS, by name):
        ``num_blocks`` or ``kv_cache_memory`` (bytes) sizes the KV pool; ``max_num_seqs`` and
        ``max_num_batched_tokens`` override SchedulerConfig's defaults (`precast serve --max-num-seqs ...`);
        ``draft``, ``speculative`` and ``num_speculative_tokens`` turn on speculative decoding
        (speculative_options.SpeculativeOptions: `precast serve --draft DIR ...`)."""
        from precast.runtime.llm.engine import Engine

        engine = Engine.load(path, **_engine_options(path, **engine_options))
        try:
            service = cls(
                engine, Path(path), read_manifest(path), max_active=max_active, text_limits=text_limits
            )
            service.warm_up()
        except BaseException:
            engine.close()  # a failed (re)load leaves no engine thread behind
            raise
        return service

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def model_view(self) -> _ModelView:
        return _ModelView(self.path, self.manifest)

    def warm_up(self) -> None:
        """One tiny greedy generation, so a reload swaps in a model that has run."""
        from precast.runtime.llm.sampler import SamplingParams

        prompt = [LLMSpec.from_manifest(self.manifest, str(self.path)).bos_id or 1]
        self.engine.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True)).result()

    def bind_metrics(self, metrics) -> None:
        self.metrics = metrics

    def export_gauges(self, metrics) -> None:
        m = self.engine.metrics()
        metrics.llm_running.set(m.running)
        metrics.llm_waiting.set(m.waiting)
        metrics.kv_used.set(m.kv_blocks_used)
        metrics.kv_free.set(m.kv_blocks_free)
        metrics.kv_resident.set(m.kv_bytes_resident)
        metrics.kv_reserved.set(m.kv_bytes_reserved)
        metrics.queue_capacity.set(self.max_active)
        # The engine's counters are its own (a reloaded model starts at 0): add what grew since the last scrape.
        seen = self._exported
        for counter, now, key in (
            (metrics.preemptions, m.preemptions, "preemptions"),
            (metrics.prefix_queries, m.prefix_query_tokens, "queries"),
            (metrics.prefix_hits, m.prefix_hit_tokens, "hits"),
        ):
            if now > seen.get(key, 0):
                counter.inc(now - seen.get(key, 0))
            seen[key] = now
        self._export_speculation(metrics, m)

    def _export_speculation(self, metrics, m) -> None:
        """Speculative decoding's counters, and the engine's per-row acceptance counts (index j: verified rows
        that kept j drafts) as observations of the histogram, for what grew since the last scrape."""
        if not m.spec_proposed_tokens:  # (not speculating, or nothing proposed yet)
            return
        seen = self._exported
        for counter, now, key in (
            (metrics.spec_proposed, m.spec_proposed_tokens, "spec_proposed"),
            (metrics.spec_accepted, m.spec_accepted_tokens, "spec_accepted"),
        ):
            if now > seen.get(key, 0):
                counter.inc(now - seen.get(key, 0))
            seen[key] = now
        for kept, rows in enumerate(m.spec_accepted_per_row):
            key = f"spec_rows_{kept}"
            for _ in range(rows - seen.get(key, 0)):
                metrics.spec_kept_per_step.observe(kept)
            seen[key] = rows

    def retire(self) -> None:
        """Take no new requests; close once the running ones are done (in a thread)."""
        self.retired = True
        threading.Thread(target=self.close, args=(600.0,), name="precast-llm-retire", daemon=True).start()

    def close(self, drain: float = 0.0) -> None:
        """Take no new requests, wait up to ``drain`` s for the running ones, then close the engine
        (its loop stops; a temp dir it unpacked is removed). Idempotent."""
        self.retired = True
        deadline = time.monotonic() + drain
        # (requests still rendering or tokenizing are not in the engine yet: wait for them too)
        while (self.engine.has_unfinished() or self.text.running) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.text.close()
        self.engine.close()

    def healthy(self) -> bool:
        """Takes requests and its engine loop runs (a loop that died would leave every request hanging)."""
        return not self.retired and self.engine.is_running()

    # -- prompts ---------------------------------------------------------------------------------
    def clean_messages(
        self, messages: object, max_chars: int | None = None, tools: list | None = None
    ) -> list[dict]:
        """The chat messages as the template sees them, or LLMRequestError naming the fault; ``max_chars`` bounds
        their text (tool calls and ``tools``' JSON included) before anything renders it.

        As transformers hands them to templates: ``developer`` becomes ``system``; an assistant message's
        ``tool_calls`` keep OpenAI's shape with ``function.arguments`` parsed into a dict (its content may be
        null: ""); a ``tool`` message keeps ``tool_call_id`` (an id of an earlier call) and ``name``."""
        if not isinstance(messages, list) or not messages:
            raise LLMRequestError("'messages' must be a non-empty list")
        clean: list[dict] = []
        call_ids: set[str] = set()
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise LLMRequestError(f"messages[{i}] must be an object with a 'role' and 'content'")
            role = m["role"]
            unknown = sorted(
                k for k in set(m) - _MESSAGE_KEYS if not (k in _EMPTY_OK and m[k] in (None, [], {}))
            )
            if unknown:
                raise LLMRequestError(f"messages[{i}] has unknown key(s) {', '.join(map(repr, unknown))}")
            if role not in CHAT_ROLES:
                raise LLMRequestError(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
                )
            calls = m.get("tool_calls") if role == "assistant" else None
            content = _text(m.get("content"), i, optional=bool(calls))
            out = {"role": "system" if role == "developer" else role, "content": content}
            if calls:
                out["tool_calls"] = _tool_calls(calls, i)
                call_ids.update(c["id"] for c in out["tool_calls"])
            elif m.get("tool_calls") not in (None, []):
                raise LLMRequestError(f"messages[{i}].tool_calls: only assistant messages make tool calls")
            if role == "tool":
                cid = m.get("tool_call_id")
                if not isinstance(cid, str) or cid not in call_ids:
                    raise LLMRequestError(
                        f"messages[{i}].tool_call_id must be the id of a tool call of an earlier assistant "
                        f"message, got {cid!r}"
                    )
                out["tool_call_id"] = cid
                if isinstance(m.get("name"), str):
                    out["name"] = m["name"]
            clean.append(out)
        chars = text_chars(clean, tools)
        if max_chars is not None and chars > max_chars:
            raise LLMRequestError(
                f"'messages' hold {chars} characters; this server tokenizes at most {max_chars} per request "
                "(--max-text-chars)"
            )
        return clean

    async def chat_ids(
        self, messages: list[dict], max_chars: int | None, timeout: float, tools: list | None = None
    ) -> list[int]:
        """The token ids of the prompt the chat template renders (both in the sandbox, within ``timeout``);
        ``tools``: OpenAI's tool dicts, the template's ``tools`` variable."""
        args = {"messages": messages, "max_chars": max_chars, "tools": tools}
        out = await self.text.acall("chat", args, timeout, text_chars(messages, tools))
        if "ids" not in out:
            raise LLMRequestError("this artifact has no tokenizer: chat needs one")
        return out["ids"]

    async def encode(self, texts: list[str], timeout: float) -> list[list[int]]:
        """Token ids of each text (the artifact's tokenizer, in the sandbox, within ``timeout``)."""
        return await self.text.acall("encode", {"texts": texts}, timeout, sum(map(len, texts)))

    # -- generation ------------------------------------------------------------------------------
    async def start(self, prompt, params, priority: int, request_id: str) -> TokenStream:
        """Submit now (bad input and a full server raise here, before any response is sent)."""
        from precast.runtime.server.batcher import QueueFullError

        if self.retired:
            raise QueueFullError(self.active, 1.0)
        if self.active >= self.max_active:
            raise QueueFullError(self.active, 1.0)
        stream = TokenStream(self, asyncio.get_running_loop())
        stream.handle = await asyncio.to_thread(
            self.engine.submit, prompt, params, priority, request_id=request_id, on_token=stream.on_token
        )
        self.active += 1
        return stream


class TokenStream:
    """Async iterator of one request's TokenEvents; close() cancels it in the engine (frees its KV blocks)."""

    def __init__(self, service: LLMService, loop: asyncio.AbstractEventLoop):
        self.service = service
        self.handle = None
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self.t0 = time.perf_counter()
        self.n_out = 0
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._closed = False

    def on_token(self, ev) -> None:
        """The engine's on_token callback (called on the engine's thread): hands ``ev`` to the event loop."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, ev)

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.request.prompt_ids)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._closed:
            raise StopAsyncIteration
        ev = await self._events.get()
        self.n_out += 1
        self._t_last = time.perf_counter()
        if self._t_first is None:
            self._t_first = self._t_last
        if ev.finish_reason is not None:
            self.close()
        return ev

    def close(self) -> None:
        """Idempotent: cancel if unfinished, record metrics once."""
        if self._closed:
            return
        self._closed = True
        svc = self.service
        svc.active -= 1
        if self.handle is not None and not self.handle.finished:
            try:
                svc.engine.cancel(self.handle.request_id)
            except LLMRequestError:
                pass
        m = svc.metrics
        if m is not None:
            m.tokens.labels("prompt").inc(self.prompt_tokens)
            m.tokens.labels("completion").inc(self.n_out)
            if self._t_first is not None:
                m.ttft.observe(self._t_first - self.t0)
                if self.n_out > 1:
                    m.tpot.observe((self._t_last - self._t_first) / (self.n_out - 1))
            if self.handle is not None:
                m.llm_e2e.observe((self._t_last or time.perf_counter()) - self.t0)
                m.llm_prompt_tokens.observe(self.prompt_tokens)
                m.llm_generation_tokens.observe(self.n_out)
                scheduled = self.handle.request.t_scheduled
                if scheduled is not None:
                    m.llm_queue_time.observe(max(0.0, scheduled - self.handle.t_submit))


def _text(content, i: int, optional: bool = False) -> str:
    """A message's content as text: a string, or a list of text parts; null only where ``optional``."""
    if content is None and optional:
        return ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
            raise LLMRequestError(f"messages[{i}].content: only text parts are supported")
        content = "".join(parts)
    if not isinstance(content, str):
        raise LLMRequestError(f"messages[{i}].content must be a string")
    return content


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls for the template: arguments parsed from their JSON text."""
    if not isinstance(calls, list):
        raise LLMRequestError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(f, dict)
            or c.get("type", "function") != "function"
            or not isinstance(c.get("id"), str)
            or not isinstance(f.get("name"), str)
        ):
            raise LLMRequestError(
                f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}"
            )
        args = f.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise LLMRequestError(
                f"{where}.function.arguments must be the JSON text of an object, got {args!r}"
            )
        out.append({"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": parsed}})
    return out


def text_chars(messages: list[dict], tools: list | None = None) -> int:
    """The characters a chat request hands the template: contents, tool calls, tool ids, ``tools``' JSON."""
    n = 0
    for m in messages:
        n += len(m["content"]) + len(m.get("tool_call_id", "")) + len(m.get("name", ""))
        for c in m.get("tool_calls", ()):
            n += len(c["id"]) + len(c["function"]["name"]) + len(json.dumps(c["function"]["arguments"]))
    return n + (len(json.dumps(tools)) if tools else 0)


def _engine_options(
    path,
    num_blocks=None,
    kv_cache_memory=None,
    max_num_seqs=None,
    max_num_batched_tokens=None,
    draft=None,
    speculative=None,
    num_speculative_tokens=None,
    **_ignored,
) -> dict:
    """Engine.load's num_blocks, config and speculative from the serve options (UsageError naming a bad one)."""
    from precast.errors import UsageError
    from precast.runtime.llm.scheduler import SchedulerConfig, checked_config
    from precast.runtime.llm.speculative_options import SpeculativeOptions
    from precast.runtime.server.kv_memory import blocks_for_memory

    spec = LLMSpec.from_manifest(read_manifest(path), str(path))
    sizes = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    config = checked_config(SchedulerConfig(**{k: v for k, v in sizes.items() if v is not None}))
    if kv_cache_memory is not None:
        if num_blocks is not None:
            raise UsageError("--kv-cache-memory and --num-blocks both size the KV pool: give one of them")
        num_blocks = blocks_for_memory(spec, kv_cache_memory, config.max_num_seqs)
    if spec.kv_layout == "mapped" and config.max_num_seqs > _MAPPED_SLOTS:
        raise UsageError(
            f"--max-num-seqs {config.max_num_seqs}: this artifact's mapped KV pool runs at most "
            f"{_MAPPED_SLOTS} requests at once"
        )
    spec = SpeculativeOptions(draft, speculative, num_speculative_tokens).config()
    return {"num_blocks": num_blocks, "config": config, "speculative": spec}


_MAPPED_SLOTS = 64  # MappedModelRunner's request slots (its default; Engine.load does not change it)


def template_source(path: Path, files: Mapping[str, str]) -> str | None:
    """The artifact's chat template, if ``files`` (the manifest's hashes) lists its file; None: the default."""
    rel = "tokenizer/tokenizer_config.json"
    if rel not in files:  # an unhashed file must not decide what is served
        return None
    cfg = artifact_path(path, rel, "chat template")  # inside the artifact, after symlinks
    if not cfg.is_file():
        return None
    try:
        tmpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    return tmpl if isinstance(tmpl, str) and tmpl.strip() else None


def _tokenizer_file(path: Path, manifest: Manifest) -> str | None:
    rel = manifest.llm.tokenizer if manifest.llm is not None else None
    if not rel or rel not in manifest.files:
        return None
    full = artifact_path(path, rel, "llm.tokenizer")
    return str(full) if full.is_file() else None
