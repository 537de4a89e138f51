"""Real weights: all-MiniLM-L6-v2 compiled with INT8 dynamic quantization keeps sentence embeddings."""

import numpy as np
import pytest

from precast.passes.quantize_int8 import _host_has_vnni


@pytest.mark.slow
def test_minilm_int8_dynamic_artifact(tmp_path, minilm_dir):
    pytest.importorskip("torch")
    from tokenizers import Tokenizer

    from precast.compiler.driver import CompileOptions, compile_model
    from precast.compiler.frontends.source import load_source
    from precast.ir.parity import ort_run_model
    from precast.runtime import load

    source = load_source(str(minilm_dir))
    # The default budget (cosine>=0.99), measured on tokenized text over the real (unpadded) tokens. On a CPU
    # without VNNI ONNX Runtime's u8 x s8 kernels lose more (0.9899 measured on an AVX2-only EPYC, 7-bit
    # weights included): there the compile is held to cosine>=0.985, explicitly.
    budget = None if _host_has_vnni() else "cosine>=0.985"
    res = compile_model(
        source, tmp_path / "q8", CompileOptions(passes="default,quantize-int8", accuracy_budget=budget)
    )
    quant = next(p for p in res.manifest["passes"] if p["pass"].startswith("quantize-int8"))
    # The packed Attention is unpacked so Q/K/V quantize too: 6 layers x (q, k, v, attention out, fc1, fc2)
    assert quant["stats"]["attention_unpacked"] == 6 and quant["stats"]["int8_weights"] >= 36
    assert res.manifest["parity"]["budget"] == {
        **res.manifest["parity"]["budget"],
        "budget": budget or "cosine>=0.99",
        "ok": True,
    }
    assert res.manifest["parity"]["padding_mask"] == "attention_mask"
    assert res.manifest["parity"]["outputs"]["last_hidden_state"]["cosine"] >= (
        0.99 if budget is None else 0.985
    )

    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    sentences = [
        "A compiler turns source code into machine code.",
        "Heavy rain is expected tomorrow.",
        "How do I reset my password?",
        "The museum opens at nine in the morning.",
    ]
    enc = tok.encode_batch(sentences)
    feeds = {
        "input_ids": np.array([e.ids for e in enc], np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
        "token_type_ids": np.array([e.type_ids for e in enc], np.int64),
    }
    mask = feeds["attention_mask"][..., None].astype(np.float32)

    def embed(hidden):
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    fp32 = embed(ort_run_model(source.model, feeds)["last_hidden_state"])
    int8 = embed(load(tmp_path / "q8").run(feeds)["last_hidden_state"])
    cos = (fp32 * int8).sum(1)
    assert cos.min() >= 0.98 and cos.mean() >= 0.99, cos
