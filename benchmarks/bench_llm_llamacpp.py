"""llama.cpp for bench_llm.py (run by llama-cpp-python's interpreter): the GGUF build and the timed engine.

    python bench_llm_llamacpp.py convert HF_FOLDER OUT.gguf {f32,q4_0}

Conversion: llama.cpp's own `convert_hf_to_gguf.py` (from the llama.cpp sources llama-cpp-python vendors,
copied to $VENV/share/llama.cpp, or $LLAMACPP_CONVERT_DIR) writes f32; Q4_0 is `llama_model_quantize` of that.
The converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know (ours is trained locally);
the bench feeds token ids and never tokenizes, so the pre-tokenizer is declared "gpt-2" (byte-level, like ours).

The engine (`LlamaCpp`, used by bench_llm_worker.py) drives llama.cpp's C API through ctypes: one context
with a sequence per request, and the same step policy as precast's scheduler: every running request's
decode token first, then prompt chunks up to 512 tokens a step; greedy (argmax of the logits), EOS ignored.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np

BUDGET = 512  # tokens per llama_decode call (n_batch), as precast's max_num_batched_tokens


def convert(folder: str, out: str, prec: str) -> None:
    share = Path(
        os.environ.get("LLAMACPP_CONVERT_DIR", Path(sys.executable).parent.parent / "share" / "llama.cpp")
    )
    if not (share / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"no llama.cpp converter at {share}/convert_hf_to_gguf.py (set LLAMACPP_CONVERT_DIR)")
    sys.path[:0] = [str(share), str(share / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    f32 = out if prec == "f32" else out + ".f32.tmp"
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", f32, "--outtype", "f32"]
    convert_hf_to_gguf.main()
    if prec == "f32":
        return
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0
    rc = L.llama_model_quantize(f32.encode(), out.encode(), ctypes.byref(params))
    os.remove(f32)
    if rc != 0:
        sys.exit(f"llama_model_quantize {prec} failed (rc {rc})")


class LlamaCpp:
    def __init__(self, path: str, a) -> None:
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = a.max_requests * a.max_len
        cp.n_batch = cp.n_ubatch = BUDGET
        cp.n_seq_max = a.max_requests
        cp.n_threads = cp.n_threads_batch = a.threads
        if a.force_f32:  # its KV cache is f16 by default; f32 for the fp32-equivalent column
            cp.type_k = cp.type_v = getattr(L, "GGML_TYPE_F32", 0)  # ggml type 0
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self._b = L.llama_batch_init(BUDGET, 0, a.max_requests)
        self.mem = L.llama_get_memory(self.ctx)
        self.info = f"llama-cpp-python {L.__version__}, n_ctx {cp.n_ctx}, {a.max_requests} sequences"

    def _run(self, prompts: list[list[int]], new: int) -> tuple[float, list[float], list[list[int]]]:
        """Continuous batching over sequences 0..n-1: (wall s, per-request first-token s, generated ids)."""
        L, b = self.L, self._b
        L.llama_memory_clear(self.mem, True)
        n = len(prompts)
        done = [0] * n  # prompt tokens already in the cache
        outs: list[list[int]] = [[] for _ in range(n)]
        first = [0.0] * n
        t0 = time.perf_counter()
        while any(len(o) < new for o in outs):
            k, rows = 0, []  # rows: the request whose next token each logits row gives
            for s in range(n):  # decodes first: the last sampled token of each running request
                if done[s] == len(prompts[s]) and 0 < len(outs[s]) < new:
                    k = self._put(k, outs[s][-1], done[s] + len(outs[s]) - 1, s, True)
                    rows.append(s)
            for s in range(n):  # then prompt chunks, oldest request first, up to the step's budget
                left = len(prompts[s]) - done[s]
                if left == 0 or k == BUDGET:
                    continue
                take = min(left, BUDGET - k)
                for j in range(take):
                    pos = done[s] + j
                    k = self._put(k, prompts[s][pos], pos, s, j == take - 1 and take == left)
                done[s] += take
                if done[s] == len(prompts[s]):
                    rows.append(s)
            b.n_tokens = k
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(len(rows), self.vocab))
            now = time.perf_counter()
            for s, tok in zip(rows, logits.argmax(axis=1).tolist()):
                if not outs[s]:
                    first[s] = now - t0
                outs[s].append(tok)
                if len(outs[s]) == new:
                    L.llama_memory_seq_rm(self.mem, s, -1, -1)
        return time.perf_counter() - t0, first, outs

    def _put(self, k: int, tok: int, pos: int, seq: int, logits: bool) -> int:
        b = self._b
        b.token[k], b.pos[k], b.n_seq_id[k] = tok, pos, 1
        b.seq_id[k][0], b.logits[k] = seq, logits
        return k + 1

    def b1(self, prompt: list[int], new: int) -> dict:
        wall, first, outs = self._run([prompt], new)
        return {"ttft": first[0], "wall": wall, "n": len(outs[0]), "ids": outs[0][:32]}

    def batch(self, prompts: list[list[int]], new: int) -> dict:
        wall, _, outs = self._run(prompts, new)
        return {"wall": wall, "n": sum(len(o) for o in outs)}


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "convert" or sys.argv[4] not in ("f32", "q4_0"):
        sys.exit(__doc__.splitlines()[2].strip())
    convert(*sys.argv[2:])
