"""The encoder-decoder engine: requests of different lengths decode together over the paged self-attention pool.

    engine = Seq2SeqEngine.load("out/t5")
    [r] = engine.generate(["translate English to German: hello"], num_beams=4)     # r.text, r.sequences
    h = engine.submit("summarize: ...", max_new_tokens=64); h.result()             # the serving thread

One step (``_step``): admit waiting requests (their encoder runs batched: the requests that arrive together),
then one decoder forward over every running sequence of every request (greedy / sampled rows and each beam of
a beam search: a row each, right-padded prompt chunks among one-token decodes), then each request picks its
tokens (runtime/seq2seq/generation.py: transformers' processors and beam search, token for token).

Two cache kinds, both counted (``kv_blocks_used``, ``cross_bytes``):
- self-attention K/V in the runner's paged pools; blocks from a BlockPool (reference counts). Beams fork by
  sharing their parent's blocks; the partly filled last block is copied on write when a second beam writes it.
- cross-attention K/V: computed once per request by the encoder, kept with the request (fixed size), freed with
  it; stacked per step for the rows that read them (the stack is reused while the rows do not change).
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from precast.artifact.seq2seq_spec import SEQ2SEQ_FILE, Seq2SeqSpec
from precast.errors import ArtifactError, InputError, UsageError
from precast.runtime.llm.block_pool import BlockPool
from precast.runtime.seq2seq.generation import (
    BeamSearch,
    GenerationSettings,
    greedy_next,
    is_finished,
    sample_next,
)
from precast.runtime.seq2seq.runner import CrossBatch, Seq2SeqRunner

__all__ = ["Seq2SeqEngine", "Seq2SeqHandle", "Seq2SeqResult", "read_spec"]

MAX_ROWS = 64  # sequences one decoder step runs (beams included)


@dataclass
class Seq2SeqResult:
    text: str  # the best sequence, decoded (special tokens skipped)
    sequences: list[list[int]]  # decoder tokens (prompt included), best first
    scores: list[float]  # beam search: transformers' sequences_scores; greedy: []
    prompt_len: int
    language: str | None = None  # Whisper: the language token used (given or detected)

    @property
    def tokens(self) -> list[int]:
        return self.sequences[0][self.prompt_len :]


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the pool


class Seq2SeqHandle:
    """One submitted request: ``result()`` blocks until it ends (or raises its error); ``stream()`` yields the
    generated token ids as each decoder step picks them (greedy and sampling; beam search yields the best
    sequence's tokens at the end, when the beams are decided); ``cancel()``."""

    def __init__(self, engine: Seq2SeqEngine, req: _Request):
        self._engine, self._req = engine, req

    def result(self, timeout: float | None = None) -> Seq2SeqResult:
        if not self._req.event.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self._req.error is not None:
            raise self._req.error
        return self._req.result

    def stream(self, timeout: float | None = None):
        """Token ids as they come; raises the request's error (after the tokens it had) when it fails."""
        q = self._req.tokens
        while True:
            try:
                tok = q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError("no token in time") from None
            if tok is None:
                break
            yield tok
        if self._req.error is not None:
            raise self._req.error

    def cancel(self) -> None:
        self._engine._cancel(self._req)


@dataclass
class _Request:
    id: int
    source: object  # token ids (text) or input_features [mels, frames] (speech)
    settings: GenerationSettings
    prompt: list[int]
    max_length: int
    detect_language: bool = False
    seqs: list[_Seq] = field(default_factory=list)
    beam: BeamSearch | None = None
    rng: np.random.Generator | None = None
    cross: tuple | None = None  # (keys, values): each layer's [H, E, D]
    cross_len: int = 0
    language: str | None = None
    result: Seq2SeqResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    priority: int = 0  # lower runs first (ties: arrival order), as the LLM engine's classes
    finished_step: int = -1  # the engine step it ended at (tests, metrics)
    event: threading.Event = field(default_factory=threading.Event)
    tokens: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # generated ids, then None


def read_spec(root: Path) -> Seq2SeqSpec:
    """``root/seq2seq.json`` read strictly, and the sha256 of every file it lists checked."""
    import hashlib

    path = root / SEQ2SEQ_FILE
    if not root.is_dir():
        raise ArtifactError(
            f"artifact not found: {root}" if not root.exists() else f"{root} is not a directory"
        )
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ArtifactError(f"{root}: no {SEQ2SEQ_FILE} (not a seq2seq artifact)") from e
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: not readable JSON ({e})") from e
    spec = Seq2SeqSpec.from_json(data, str(root))
    base = root.resolve()
    for rel, digest in sorted(spec.files.items()):
        file = (root / rel).resolve()
        if not file.is_relative_to(base) or file.is_symlink():
            raise ArtifactError(f"{path}: files names {rel!r}, outside the artifact")
        try:
            got = hashlib.sha256(file.read_bytes()).hexdigest()
        except OSError as e:
            raise ArtifactError(f"{root}: {rel} is missing ({e.strerror})") from e
        if got != digest:
            raise ArtifactError(f"{root}: {rel} does not match its sha256 in {SEQ2SEQ_FILE} (tampered?)")
    for part in ("encoder", "decoder"):
        if f"{part}/manifest.json" not in spec.files:
            raise ArtifactError(f"{path}: files lacks {part}/manifest.json")
    return spec


def _json(root: Path, rel: str) -> dict:
    p = root / rel
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text())
    except ValueError as e:
        raise ArtifactError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{p}: must be a JSON object")
    return data


class _WhisperPrompt:
    """Whisper's decoder prompt: <|startoftranscript|> <|lang|> <|task|> <|notimestamps|> (generation_config)."""

    def __init__(self, gen: dict, where: str):
        self.sot = gen.get("decoder_start_token_id")
        self.langs = gen.get("lang_to_id") or {}
        self.tasks = gen.get("task_to_id") or {}
        self.no_ts = gen.get("no_timestamps_token_id")
        self.multilingual = bool(gen.get("is_multilingual", bool(self.langs)))
        for name, v in (("decoder_start_token_id", self.sot), ("no_timestamps_token_id", self.no_ts)):
            if not isinstance(v, int):
                raise ArtifactError(f"{where}: generation_config.json needs an integer {name} for Whisper")

    def language_id(self, language: str) -> int:
        key = language if language.startswith("<|") else f"<|{language}|>"
        if key not in self.langs:
            codes = sorted(k.strip("<|>") for k in self.langs)
            shown = ", ".join(codes[:12]) + (f" ... ({len(codes)} in all)" if len(codes) > 12 else "")
            raise UsageError(f"unknown language {language!r}: give a code this model knows ({shown})")
        return int(self.langs[key])

    def prompt(self, lang_id: int | None, task: str) -> list[int]:
        if not self.multilingual:
            return [self.sot, self.no_ts]
        if task not in self.tasks:
            raise UsageError(f"unknown Whisper task {task!r} (one of {', '.join(sorted(self.tasks))})")
        return [self.sot, int(lang_id), int(self.tasks[task]), self.no_ts]

    def language_name(self, lang_id: int) -> str | None:
        for k, v in self.langs.items():
            if v == lang_id:
                return k.strip("<|>")
        return None


class Seq2SeqEngine:
    def __init__(self, runner: Seq2SeqRunner, root: Path, tokenizer=None):
        spec = runner.spec
        self.spec, self.runner, self.root = spec, runner, root
        self.tokenizer = tokenizer
        gen = _json(root, "tokenizer/generation_config.json")
        self.settings = GenerationSettings.from_json(gen, str(root))
        self.whisper = _WhisperPrompt(gen, str(root)) if spec.model_type == "whisper" else None
        self.features = None
        if spec.input == "speech":
            from precast.runtime.processing.whisper import WhisperFeatures

            pre = _json(root, "tokenizer/preprocessor_config.json")
            if not pre:
                raise ArtifactError(f"{root}: a speech artifact needs tokenizer/preprocessor_config.json")
            self.features = WhisperFeatures.from_config(pre)
        self.pool = BlockPool(runner.num_blocks, spec.block_size)
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._ids = itertools.count()
        self._cond = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._stop = False
        self._cross_cache: tuple | None = None  # (row keys, CrossBatch) of the last step
        self.steps = 0

    # ---- loading ---------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path, num_blocks: int | None = None, threads: int | None = None, verify: bool = True):
        root = Path(path)
        spec = read_spec(root)
        if num_blocks is not None and (
            not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1
        ):
            raise UsageError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if num_blocks is None:  # 8 full-length requests of 4 beams
            num_blocks = 32 * -(-spec.max_target // spec.block_size)
        runner = Seq2SeqRunner(root, spec, num_blocks, threads=threads, verify=verify)
        tok = None
        if (root / "tokenizer/tokenizer.json").is_file():
            from precast.runtime.llm.tokenizer import TextTokenizer

            tok = TextTokenizer.from_file(root / "tokenizer/tokenizer.json")
        return cls(runner, root, tok)

    # ---- requests --------------------------------------------------------------------------------------

    @property
    def cross_bytes(self) -> int:
        with self._cond:
            return sum(sum(a.nbytes for a in (*r.cross[0], *r.cross[1])) for r in self._active if r.cross)

    @property
    def kv_blocks_used(self) -> int:
        return self.pool.num_used

    def _source(self, item) -> object:
        if self.spec.input == "text":
            if isinstance(item, str):
                if not item.strip():
                    raise InputError("empty source text")
                if self.tokenizer is None:
                    raise UsageError("this artifact ships no tokenizer: pass token ids")
                ids = self.tokenizer.encode(item)
            else:
                try:
                    arr = np.asarray(item)
                except (TypeError, ValueError) as e:
                    raise InputError(
                        f"a source must be a text or a list of token ids, got {type(item).__name__}"
                    ) from e
                if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                    raise InputError(
                        f"a source must be a text or a 1-D list of integer token ids, got {type(item).__name__}"
                        + (f" of shape {list(arr.shape)}" if arr.ndim else "")
                    )
                ids = [int(t) for t in arr]
            if not ids:
                raise InputError("empty source text")
            if len(ids) > self.spec.max_source:
                raise InputError(
                    f"the source has {len(ids)} tokens; this model takes at most {self.spec.max_source}"
                )
            if min(ids) < 0 or max(ids) >= self.spec.vocab:
                raise InputError(f"source token ids must be in [0, {self.spec.vocab})")
            return ids
        try:
            arr = np.asarray(item, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise InputError(
                f"a speech source must be a waveform (1-D float samples) or log-mel features, got {type(item).__name__}"
            ) from e
        if arr.ndim == 1:  # a waveform at the model's rate: one 30 s window (transcribe() splits longer ones)
            arr = self.features([arr])[0]
        want = (self.features.feature_size, self.spec.max_source)
        if arr.shape != want:
            raise InputError(f"input_features must be {list(want)}, got {list(arr.shape)}")
        return arr

    def _make(self, item, overrides: dict) -> _Request:
        overrides = dict(overrides)
        language = overrides.pop("language", None)
        task = overrides.pop("task", "transcribe")
        seed = overrides.pop("seed", None)
        priority = overrides.pop("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise UsageError(f"priority must be an integer (lower runs first), got {priority!r}")
        settings = self.settings.with_overrides(**overrides)
        source = self._source(item)
        detect = False
        if self.whisper is not None:
            lang_id = None
            if self.whisper.multilingual:
                if language is None:
                    detect = True
                    lang_id = self.whisper.language_id("en")  # placeholder until detection
                else:
                    lang_id = self.whisper.language_id(language)
            prompt = self.whisper.prompt(lang_id, task)
        else:
            if language is not None:
                raise UsageError("language applies to Whisper models only")
            start = settings.decoder_start_token_id
            if start is None:
                raise ArtifactError(f"{self.root}: generation_config.json has no decoder_start_token_id")
            prompt = [int(start)]
        max_length = settings.resolve_max_length(len(prompt), self.spec.max_target)
        if max_length > self.spec.max_target:
            if "max_new_tokens" in overrides or "max_length" in overrides:
                raise InputError(
                    f"max_new_tokens / max_length: {max_length} decoder tokens exceed the decoder's "
                    f"{self.spec.max_target} positions (at most {self.spec.max_target - len(prompt)} new tokens)"
                )
            # the folder's generation_config asks for more than the model has positions (opus-mt: 512 vs 256):
            # transformers would fail at position max_target; precast stops there
            max_length = self.spec.max_target
        if max_length <= len(prompt):
            raise InputError(
                f"max length {max_length} leaves no room after the {len(prompt)}-token decoder prompt"
            )
        req = _Request(
            next(self._ids), source, settings, prompt, max_length, detect_language=detect, priority=priority
        )
        if settings.do_sample:
            req.rng = np.random.default_rng(seed)
        return req

    def generate(self, items: list, **overrides) -> list[Seq2SeqResult]:
        """Every item served together (one batch: the encoder once, the decoder steps shared)."""
        reqs = [self._make(item, overrides) for item in items]
        with self._cond:
            if self._stop:
                raise UsageError("the engine is closed")
            threaded = self._thread is not None
            if not threaded:  # no serving thread: run the steps here until these requests end
                self._waiting.extend(reqs)
                try:
                    while self._waiting or self._active:
                        self._step()
                except BaseException as e:  # (a failed step: its requests end with it, their blocks back)
                    for r in [*self._active, *self._waiting]:
                        r.error = r.error or e
                        self._finish(r, None)
                    self._waiting.clear()
                    raise
        if threaded:  # (waited on outside the lock: the serving thread takes it for each step)
            return [h.result() for h in [self._enqueue(r) for r in reqs]]
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [r.result for r in reqs]

    def submit(self, item, **overrides) -> Seq2SeqHandle:
        """Queue one request for the serving thread (started on first use)."""
        return self._enqueue(self._make(item, overrides))

    def _enqueue(self, req: _Request) -> Seq2SeqHandle:
        with self._cond:
            if self._stop:
                raise UsageError("the engine is closed")
            self._waiting.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="precast-seq2seq", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return Seq2SeqHandle(self, req)

    def transcribe(self, waveform: np.ndarray, **overrides) -> Seq2SeqResult:
        """Whisper on audio of any length: sequential 30 s windows, their tokens joined."""
        from precast.runtime.processing.whisper import split_windows

        if self.features is None:
            raise UsageError("transcribe() needs a speech (Whisper) artifact")
        windows = split_windows(
            np.asarray(waveform, dtype=np.float32), self.features.sampling_rate, self.features.chunk_length
        )
        feats = self.features(windows)
        handles = [self.submit(f, **overrides) for f in feats]
        results = [h.result() for h in handles]
        tokens = [t for r in results for t in r.tokens]
        text = self.tokenizer.decode(tokens) if self.tokenizer else ""
        return Seq2SeqResult(
            text,
            [results[0].sequences[0][: results[0].prompt_len] + tokens],
            [],
            results[0].prompt_len,
            results[0].language,
        )

    def _cancel(self, req: _Request) -> None:
        with self._cond:
            if req.event.is_set():  # (already ended: its result stands)
                return
            req.cancelled = True
            req.error = InputError("the request was cancelled")
            if req in self._active:
                self._finish(req, None)  # its blocks and cross K/V back now
                return
            if req in self._waiting:
                self._waiting.remove(req)
            req.tokens.put(None)
            req.event.set()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:  # what was still queued or running ends now (nobody would wait on it forever)
            for r in [*self._active, *self._waiting]:
                r.error = r.error or UsageError("the engine was closed before this request ended")
                self._finish(r, None)
            self._waiting.clear()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._active) and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                try:
                    self._step()
                except Exception as e:  # a failed step fails its requests, never the thread
                    for r in [*self._active]:
                        r.error = e
                        self._finish(r, None)

    # ---- one step ----------------------------------------------------------------------------------------

    def _admit(self) -> None:
        rows = sum(len(r.seqs) for r in self._active)
        new: list[_Request] = []
        bs = self.spec.block_size
        if len(self._waiting) > 1:  # lower priority value first, arrival order within one
            self._waiting = deque(sorted(self._waiting, key=lambda q: (q.priority, q.id)))
        while self._waiting:
            r = self._waiting[0]
            beams = r.settings.num_beams
            need = beams * -(-r.max_length // bs)
            if rows + beams > MAX_ROWS or need > self.pool.num_free - self._reserved(new):
                if not self._active and not new:  # it can never fit: fail it alone, serve the rest
                    self._waiting.popleft()
                    r.error = InputError(
                        f"the request needs {need} KV blocks ({beams} beams x {r.max_length} tokens); the pool "
                        f"has {self.pool.num_free} (start the engine with more num_blocks)"
                    )
                    r.tokens.put(None)
                    r.event.set()
                    continue
                break
            self._waiting.popleft()
            new.append(r)
            rows += beams
        if not new:
            return
        try:
            crosses = self._encode(new)
        except Exception as e:  # (an input the encoder cannot take: these requests fail, the rest go on)
            for r in new:
                r.error = e
                self._finish(r, None)
            return
        for r, cross in zip(new, crosses):
            r.cross, r.cross_len = cross, cross[0][0].shape[1]
            if r.settings.num_beams > 1 and not r.settings.do_sample:
                r.beam = BeamSearch(r.settings, r.prompt, r.max_length)
                r.seqs = [_Seq(list(b)) for b in r.beam.beams]
            else:
                r.seqs = [_Seq(list(r.prompt[:1] if r.detect_language else r.prompt))]
            self._active.append(r)

    def _reserved(self, new: list[_Request]) -> int:
        bs = self.spec.block_size
        return sum(r.settings.num_beams * -(-r.max_length // bs) for r in new)

    def _encode(self, reqs: list[_Request]) -> list[tuple]:
        if self.spec.input == "speech":
            feats = np.stack([r.source for r in reqs])
            return self.runner.encode({"input_features": feats}, [self.spec.max_source // 2] * len(reqs))
        lens = [len(r.source) for r in reqs]
        ids = np.full((len(reqs), max(lens)), self.spec.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for b, r in enumerate(reqs):
            ids[b, : lens[b]] = r.source
            mask[b, : lens[b]] = 1
        return self.runner.encode({"input_ids": ids, "attention_mask": mask}, lens)

    def _ensure_blocks(self, seq: _Seq) -> None:
        bs = self.spec.block_size
        first = seq.computed // bs
        if first < len(seq.blocks) and self.pool.refcount(seq.blocks[first]) > 1:  # copy on write
            [fresh] = self._allocate(1)
            self.runner.copy_block(seq.blocks[first], fresh)
            self.pool.free([seq.blocks[first]])
            seq.blocks[first] = fresh
        need = -(-len(seq.tokens) // bs) - len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self._allocate(need))

    def _allocate(self, n: int) -> list[int]:
        got = self.pool.allocate(n)
        if got is None:  # admission reserves each request's worst case: this is a bookkeeping bug
            raise InputError(f"the KV pool ran out of blocks ({self.pool.num_free} free, {n} needed)")
        return got

    def _cross_batch(self, rows: list[tuple[_Request, _Seq]]) -> CrossBatch:
        key = tuple(id(r) for r, _ in rows)
        if self._cross_cache is not None and self._cross_cache[0] == key:
            return self._cross_cache[1]
        if len(rows) == 1:  # one row: the request's own arrays, viewed as a batch of one (no copy)
            r = rows[0][0]
            ones = np.ones((1, r.cross_len), dtype=np.int64)
            batch = CrossBatch([k[None] for k in r.cross[0]], [v[None] for v in r.cross[1]], ones)
            self._cross_cache = (key, batch)
            return batch
        e = max(r.cross_len for r, _ in rows)
        s = self.spec
        keys, values = [], []
        for i in range(s.layers):
            k = np.zeros((len(rows), s.heads, e, s.head_size), dtype=np.float32)
            v = np.zeros_like(k)
            for b, (r, _) in enumerate(rows):
                k[b, :, : r.cross_len] = r.cross[0][i]
                v[b, :, : r.cross_len] = r.cross[1][i]
            keys.append(k)
            values.append(v)
        mask = np.zeros((len(rows), e), dtype=np.int64)
        for b, (r, _) in enumerate(rows):
            mask[b, : r.cross_len] = 1
        batch = CrossBatch(keys, values, mask)
        self._cross_cache = (key, batch)
        return batch

    def _step(self) -> None:
        self._admit()
        rows = [(r, q) for r in self._active for q in r.seqs]
        if not rows:
            return
        for _, q in rows:
            self._ensure_blocks(q)
        new = np.array([len(q.tokens) - q.computed for _, q in rows], dtype=np.int64)
        past = np.array([q.computed for _, q in rows], dtype=np.int64)
        s = int(new.max())
        ids = np.full((len(rows), s), self.spec.pad_id, dtype=np.int64)
        pos = np.zeros((len(rows), s), dtype=np.int64)
        tables = np.zeros((len(rows), max(len(q.blocks) for _, q in rows)), dtype=np.int64)
        for b, (_, q) in enumerate(rows):
            ids[b, : new[b]] = q.tokens[q.computed :]
            pos[b, : new[b]] = np.arange(q.computed, len(q.tokens))
            tables[b, : len(q.blocks)] = q.blocks
        logits = self.runner.step(ids, pos, past, new, tables, self._cross_batch(rows))
        self.steps += 1
        for _, q in rows:
            q.computed = len(q.tokens)
        at = 0
        for r in list(self._active):
            n = len(r.seqs)
            try:
                self._advance(r, logits[at : at + n])
            except Exception as e:  # one request's bad option fails it alone
                r.error = e
                self._finish(r, None)
            at += n

    def _advance(self, r: _Request, logits: np.ndarray) -> None:
        if (
            r.detect_language
        ):  # Whisper: the language token with the highest logit after <|startoftranscript|>
            lang_ids = np.array(sorted(int(v) for v in self.whisper.langs.values()))
            lang = int(lang_ids[int(np.argmax(logits[0, lang_ids]))])
            r.detect_language = False
            r.prompt[1] = lang
            r.seqs[0].tokens = list(r.prompt)
            return
        if r.beam is not None:
            parents = r.beam.step(logits)
            if r.beam.done:
                self._finish(r, [(list(t), float(sc)) for t, sc in r.beam.results()])
                return
            old = r.seqs
            r.seqs = []
            for tokens, p in zip(r.beam.beams, parents):
                parent = old[p]
                self.pool.share(parent.blocks)
                r.seqs.append(_Seq(list(tokens), list(parent.blocks), parent.computed))
            for q in old:
                self.pool.free(q.blocks)
            return
        q = r.seqs[0]
        if r.settings.do_sample:
            tok = int(
                sample_next(r.settings, logits, [q.tokens], len(r.prompt), r.rng, max_length=r.max_length)[0]
            )
        else:
            tok = int(greedy_next(r.settings, logits, [q.tokens], len(r.prompt), max_length=r.max_length)[0])
        q.tokens.append(tok)
        r.tokens.put(tok)
        if is_finished(r.settings, q.tokens, r.max_length):
            self._finish(r, [(list(q.tokens), 0.0)])

    def _finish(self, r: _Request, hyps: list | None) -> None:
        for q in r.seqs:
            self.pool.free(q.blocks)
            q.blocks = []
        r.seqs = []
        r.cross = None
        if r in self._active:
            self._active.remove(r)
        self._cross_cache = None
        if hyps is not None and r.error is None:
            best = hyps[0][0][len(r.prompt) :]
            text = self.tokenizer.decode(best) if self.tokenizer is not None else ""
            lang = (
                self.whisper.language_name(r.prompt[1])
                if self.whisper and self.whisper.multilingual
                else None
            )
            scores = [h[1] for h in hyps] if r.beam is not None else []
            r.result = Seq2SeqResult(text, [h[0] for h in hyps], scores, len(r.prompt), lang)
            if r.beam is not None:  # (greedy rows streamed each token as it came)
                for tok in best:
                    r.tokens.put(tok)
        r.finished_step = self.steps
        r.tokens.put(None)
        r.event.set()
