"""precast.runtime.seq2seq.generation against Hugging Face transformers' generate(): tiny random-weight BART,
Marian, T5 and Whisper models, their generation configs mimicking the real checkpoints', driven by the numpy
decoding logic (full-recompute forwards) and compared token for token (and beam scores) with model.generate()."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig, GenerationMixin  # noqa: E402
from transformers.modeling_outputs import BaseModelOutput  # noqa: E402

from precast.errors import ArtifactError, InputError, UsageError  # noqa: E402
from precast.runtime.seq2seq import generation as gen  # noqa: E402
from precast.runtime.seq2seq.generation import (  # noqa: E402
    BeamSearch,
    GenerationSettings,
    greedy_next,
    is_finished,
    sample_next,
)

VOCAB = 1000
NEW = 32  # new tokens per generation
LOGIT_SCALE = 15.0

# ---- generation configs mimicking the real checkpoints' generation_config.json --------------------------------

BART = {  # facebook/bart-base / bart-large-cnn style
    "_from_model_config": True,
    "bos_token_id": 0,
    "decoder_start_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "forced_bos_token_id": 0,
    "forced_eos_token_id": 2,
    "no_repeat_ngram_size": 3,
    "num_beams": 4,
    "length_penalty": 1.0,
    "early_stopping": True,
    "min_length": 4,
    "max_length": 1 + NEW,
    "transformers_version": "4.27.0.dev0",
}
MARIAN = {  # Helsinki-NLP/opus-mt-* style (max_length 512 there)
    "bad_words_ids": [[999]],
    "bos_token_id": 0,
    "decoder_start_token_id": 999,
    "eos_token_id": 0,
    "forced_eos_token_id": 0,
    "max_length": 1 + NEW,
    "num_beams": 4,
    "pad_token_id": 999,
    "renormalize_logits": True,
    "transformers_version": "4.34.0.dev0",
}
T5 = {  # google-t5/t5-small style
    "decoder_start_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "max_new_tokens": NEW,
    "transformers_version": "4.27.0.dev0",
}
SOT, LANG, TRANSCRIBE, NOTS, W_EOS = 990, 991, 992, 994, 999
WHISPER = {  # openai/whisper-tiny style
    "alignment_heads": [[1, 0]],
    "begin_suppress_tokens": [220, W_EOS],
    "bos_token_id": W_EOS,
    "decoder_start_token_id": SOT,
    "eos_token_id": W_EOS,
    "is_multilingual": True,
    "lang_to_id": {"<|en|>": LANG},
    "task_to_id": {"transcribe": TRANSCRIBE, "translate": 993},
    "max_initial_timestamp_index": 50,
    "no_timestamps_token_id": NOTS,
    "prev_sot_token_id": 989,
    "return_timestamps": False,
    "pad_token_id": W_EOS,
    "suppress_tokens": [
        1,
        2,
        7,
        8,
        9,
        10,
        14,
        25,
        26,
        27,
        28,
        29,
        31,
        58,
        59,
        60,
        61,
        62,
        63,
        90,
        91,
        92,
        93,
        359,
    ],
    "max_new_tokens": NEW,
    "transformers_version": "4.31.0.dev0",
}
WHISPER_PROMPT = [SOT, LANG, TRANSCRIBE, NOTS]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one torch thread is faster (and steadier on a shared 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_HF_ONLY = {"alignment_heads", "lang_to_id", "task_to_id", "is_multilingual", "return_timestamps"}


def _gc(d: dict, **kw) -> GenerationConfig:
    vals = {k: v for k, v in d.items() if k not in ("_from_model_config", "transformers_version")}
    vals.update(kw)
    return GenerationConfig(**vals)


# ---- tiny models ---------------------------------------------------------------------------------------------

_SMALL = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=128,
)


def _finish(model, seed: int, eos: int, eos_slope: float):
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    model.eval()

    # Logits scaled to a real model's spread (random weights give a nearly flat distribution), and an EOS logit
    # that grows with the decoder position, so that hypotheses end after a few to tens of steps.
    def hook(mod, inp, out):
        out = out * LOGIT_SCALE
        out[..., eos] += eos_slope * torch.arange(out.shape[-2], dtype=out.dtype)
        return out

    model.get_output_embeddings().register_forward_hook(hook)
    return model


def _bart(seed, eos_slope):
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(**_SMALL, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return _finish(BartForConditionalGeneration(cfg), seed, 2, eos_slope)


def _marian(seed, eos_slope):
    from transformers import MarianConfig, MarianMTModel

    cfg = MarianConfig(**_SMALL, pad_token_id=999, eos_token_id=0, decoder_start_token_id=999)
    return _finish(MarianMTModel(cfg), seed, 0, eos_slope)


def _t5(seed, eos_slope):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        tie_word_embeddings=False,
    )
    return _finish(T5ForConditionalGeneration(cfg), seed, 1, eos_slope)


def _whisper(seed, eos_slope):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=64,
        pad_token_id=W_EOS,
        bos_token_id=W_EOS,
        eos_token_id=W_EOS,
        decoder_start_token_id=SOT,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return _finish(WhisperForConditionalGeneration(cfg), seed, W_EOS, eos_slope)


FAMILIES = {
    "bart": (_bart, BART, None),
    "marian": (_marian, MARIAN, None),
    "t5": (_t5, T5, None),
    "whisper": (_whisper, WHISPER, WHISPER_PROMPT),
}
SEEDS = {"bart": 1, "marian": 2, "t5": 3, "whisper": 4}
EOS_SLOPE = {"bart": 0.3, "marian": 0.3, "t5": 0.3, "whisper": 0.3}

_cache: dict = {}


def _model(name, i):
    """Model i of a family (one per test input: random decoders barely listen to their encoder, so the seeds are
    what makes the inputs' generations differ)."""
    if (name, i) not in _cache:
        build, d, _ = FAMILIES[name]
        m = build(SEEDS[name] + 10 * i, EOS_SLOPE[name])
        m.generation_config = _gc(d)  # so generate() merges nothing else in
        _cache[name, i] = m
    return _cache[name, i]


def _inputs(name: str, i: int) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    if name == "whisper":
        return {"input_features": torch.randn(1, 16, 32, generator=g)}
    n = (5, 11, 17)[i]
    ids = torch.randint(3, 990, (1, n), generator=g)
    ids[0, -1] = FAMILIES[name][1]["eos_token_id"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class Decoder:
    """The model's decoder, recomputed over the full sequences each step (no KV cache), on top of one encoder
    pass; rows are expanded like HF's beam search expands them."""

    def __init__(self, model, inputs: dict):
        self.model = model
        with torch.no_grad():
            enc = model.get_encoder()(**inputs)
        self.hidden = enc.last_hidden_state
        self.mask = inputs.get("attention_mask")

    def __call__(self, seqs: list[list[int]]) -> np.ndarray:
        n = len(seqs)
        kw = {"encoder_outputs": BaseModelOutput(last_hidden_state=self.hidden.repeat_interleave(n, dim=0))}
        if self.mask is not None:
            kw["attention_mask"] = self.mask.repeat_interleave(n, dim=0)
        with torch.no_grad():
            out = self.model(**kw, decoder_input_ids=torch.tensor(seqs), use_cache=False)
        return out.logits[:, -1].to(torch.float32).numpy()


def _prompt(name, settings):
    return list(FAMILIES[name][2] or [settings.decoder_start_token_id])


def _hf(name, i, inputs, prompt, *, whisper_own=False, **kw):
    m = _model(name, i)
    gc = _gc(FAMILIES[name][1], use_cache=False, **kw)
    if name == "whisper":
        gc = _gc({k: v for k, v in FAMILIES[name][1].items() if k not in _HF_ONLY}, use_cache=False, **kw)
        extra = {"decoder_input_ids": torch.tensor([prompt])}
        if whisper_own:
            return m.generate(**inputs, generation_config=gc, **extra)
        return GenerationMixin.generate(m, **inputs, generation_config=gc, **extra)
    return m.generate(**inputs, generation_config=gc)


def _run_greedy(settings, dec, prompt, max_length):
    seq = list(prompt)
    while True:
        tok = greedy_next(settings, dec([seq]), [seq], len(prompt), max_length=max_length)
        seq.append(int(tok[0]))
        if is_finished(settings, seq, max_length):
            return seq


def _run_beam(settings, dec, prompt, max_length):
    bs = BeamSearch(settings, prompt, max_length)
    while not bs.done:
        before = bs.beams
        parents = bs.step(dec(bs.beams))
        # the step contract: new beam i = old beam parents[i] + one token
        for new, p in zip(bs.beams, parents):
            assert new[:-1] == before[p]
    return bs


# ---- greedy ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_hf(name):
    settings = GenerationSettings.from_json(FAMILIES[name][1], name)
    ended_early = 0
    for i in range(3):
        inputs = _inputs(name, i)
        prompt = _prompt(name, settings)
        max_length = settings.resolve_max_length(len(prompt))
        ours = _run_greedy(settings, Decoder(_model(name, i), inputs), prompt, max_length)
        out = _hf(name, i, inputs, prompt, num_beams=1, whisper_own=True, return_dict_in_generate=True)
        hf = out.sequences.tolist()[0]
        if name == "whisper":
            assert hf[: len(prompt)] == prompt
        assert ours == hf, f"{name} input {i}"
        ended_early += len(ours) < max_length
    if name in ("bart", "t5"):
        assert ended_early, "no greedy run ended on EOS: the EOS bias is too weak to test anything"


# ---- beam search -----------------------------------------------------------------------------------------------


def _beam_case(name, i, length_penalty, early_stopping, own=False, nrs=4):
    settings = GenerationSettings.from_json(FAMILIES[name][1], name).with_overrides(
        num_beams=4, num_return_sequences=nrs, length_penalty=length_penalty, early_stopping=early_stopping
    )
    inputs = _inputs(name, i)
    prompt = _prompt(name, settings)
    max_length = settings.resolve_max_length(len(prompt))
    bs = _run_beam(settings, Decoder(_model(name, i), inputs), prompt, max_length)
    out = _hf(
        name,
        i,
        inputs,
        prompt,
        whisper_own=own,
        num_beams=4,
        num_return_sequences=nrs,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return settings, bs, out, max_length


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize(
    "length_penalty,early_stopping", [(1.0, True), (2.0, False), (1.0, False), (2.0, True)]
)
def test_beam_search_matches_hf(name, length_penalty, early_stopping):
    stats = {"eos": 0, "early": 0}
    for i in range(3):
        settings, bs, out, max_length = _beam_case(name, i, length_penalty, early_stopping)
        seqs, scores = bs.padded_results()
        hf_seqs = out.sequences.numpy()
        hf_scores = out.sequences_scores.numpy()
        assert seqs.tolist() == hf_seqs.tolist(), f"{name} input {i}"
        assert bs.steps == len(out.scores), f"{name} input {i}: HF stopped after {len(out.scores)} steps"
        np.testing.assert_allclose(scores, hf_scores, rtol=2e-6, atol=2e-6, err_msg=f"{name} input {i}")
        res = bs.results()
        assert [s for _, s in res] == scores.tolist()
        for (toks, _), row in zip(res, seqs.tolist()):
            assert row[: len(toks)] == toks
            assert all(t == settings.beam_fill_token_id for t in row[len(toks) :])
            stats["eos"] += toks[-1] in settings.eos_token_id and len(toks) < max_length
        stats["early"] += bs.cur_len < max_length
    assert stats["eos"] > 0, f"{name}: no hypothesis ended on EOS before max_length"


def test_beam_scores_bit_exact_with_torch_log_softmax(monkeypatch):
    """With torch's own float32 log-softmax, the rest of the beam arithmetic is bit-for-bit HF's."""

    def torch_log_softmax(x):
        return torch.log_softmax(torch.from_numpy(np.asarray(x, dtype=np.float32)), dim=-1).numpy()

    monkeypatch.setattr(gen, "_log_softmax", torch_log_softmax)
    for name, lp, es in [
        ("bart", 2.0, False),
        ("t5", 1.0, True),
        ("marian", 0.8, "never"),
        ("t5", 1.3, "never"),
    ]:
        for i in range(2):
            _, bs, out, _ = _beam_case(name, i, lp, es)
            seqs, scores = bs.padded_results()
            assert seqs.tolist() == out.sequences.tolist(), f"{name} {lp} {es} input {i}"
            assert scores.tobytes() == out.sequences_scores.numpy().tobytes(), f"{name} {lp} {es} input {i}"


def test_whisper_own_generate_beam():
    for i in range(2):
        _, bs, out, _ = _beam_case("whisper", i, 1.0, True, own=True, nrs=1)
        seqs, scores = bs.padded_results()
        assert seqs.tolist() == out.sequences.tolist()
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), rtol=2e-6, atol=2e-6)


def test_never_and_default_min_length():
    settings = GenerationSettings.from_json(T5, "t5").with_overrides(
        num_beams=4, num_return_sequences=2, early_stopping="never", min_new_tokens=6, no_repeat_ngram_size=2
    )
    for i in range(2):
        inputs = _inputs("t5", i)
        prompt = [0]
        bs = _run_beam(settings, Decoder(_model("t5", i), inputs), prompt, settings.resolve_max_length(1))
        out = _hf(
            "t5",
            i,
            inputs,
            prompt,
            num_beams=4,
            num_return_sequences=2,
            early_stopping="never",
            min_new_tokens=6,
            no_repeat_ngram_size=2,
            output_scores=True,
            return_dict_in_generate=True,
        )
        seqs, scores = bs.padded_results()
        assert seqs.tolist() == out.sequences.tolist()
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), rtol=2e-6, atol=2e-6)
        assert all(len(t) >= 7 for t, _ in bs.results())


# ---- settings --------------------------------------------------------------------------------------------------


def test_settings_from_real_configs():
    bart = GenerationSettings.from_json(BART, "bart")
    assert bart.eos_token_id == (2,) and bart.forced_eos_token_id == (2,) and bart.early_stopping is True
    assert bart.resolve_max_length(1) == 1 + NEW and bart.beam_fill_token_id == 1
    t5 = GenerationSettings.from_json(T5, "t5")
    assert t5.resolve_max_length(1) == 1 + NEW and t5.beam_fill_token_id == 1  # HF: `pad or eos` with pad 0
    assert t5.effective_pad_token_id == 0
    w = GenerationSettings.from_json(WHISPER, "whisper")
    assert w.begin_suppress_tokens == (220, W_EOS) and w.resolve_max_length(4) == 4 + NEW
    m = GenerationSettings.from_json(MARIAN, "marian")
    assert m.bad_words_ids == ((999,),) and m.renormalize_logits
    d = GenerationSettings.from_json(
        {"eos_token_id": [1, 2], "do_sample": True, "repetition_penalty": 1.0}, "x"
    )
    assert d.eos_token_id == (1, 2) and d.do_sample and d.top_k == 50
    assert GenerationSettings.from_json({}, "x").resolve_max_length(3, max_position_embeddings=10) == 10


@pytest.mark.parametrize(
    "d",
    [
        {"repetition_penalty": 1.2},
        {"num_beam_groups": 2},
        {"bogus_key": 1},
        {"num_beams": 0},
        {"early_stopping": "sometimes"},
        {"eos_token_id": "2"},
        {"bad_words_ids": [2]},
        {"length_penalty": None, "max_length": -1},
    ],
)
def test_settings_refuse(d):
    with pytest.raises(ArtifactError, match="where/generation_config.json"):
        GenerationSettings.from_json(d, "where/generation_config.json")


def test_overrides():
    s = GenerationSettings.from_json(BART, "bart")
    o = s.with_overrides(num_beams=2, max_length=None, max_new_tokens=5, early_stopping="never")
    assert o.num_beams == 2 and o.resolve_max_length(1) == 6 and o.early_stopping == "never"
    assert s.num_beams == 4
    with pytest.raises(UsageError, match="repetition_penalty"):
        s.with_overrides(repetition_penalty=1.3)
    with pytest.raises(UsageError, match="top_p"):
        s.with_overrides(top_p=0.0)
    with pytest.raises(UsageError, match="num_return_sequences"):
        BeamSearch(s.with_overrides(num_return_sequences=5), [2], 10)
    with pytest.raises(UsageError, match="max_length"):
        BeamSearch(s, [2, 0], 2)
    with pytest.raises(UsageError, match="do_sample"):
        BeamSearch(s.with_overrides(do_sample=True), [2], 10)


# ---- processors in isolation -----------------------------------------------------------------------------------


def test_processors_edge_cases():
    s = GenerationSettings(eos_token_id=(5,), no_repeat_ngram_size=2, bad_words_ids=((3,), (7, 8), (5,)))
    logits = np.zeros((1, 10), np.float32)
    # 2-grams seen: (1,2), (2,1); the sequence ends with 1 -> 2 is banned; bad word 3 always, 8 after 7
    out = gen.process_logits(s, logits, [[1, 2, 1]], 1, 50)
    assert np.isinf(out[0, [2, 3]]).all() and np.isfinite(out[0, [1, 5, 8]]).all()  # [5] is EOS: not banned
    out = gen.process_logits(s, logits, [[1, 7]], 1, 50)
    assert np.isinf(out[0, 8])
    # forced EOS at max_length - 1, begin suppression at the prompt length
    s = GenerationSettings(eos_token_id=(5,), forced_eos_token_id=(5,), begin_suppress_tokens=(4,))
    assert greedy_next(s, np.arange(10, dtype=np.float32)[None], [[0, 1, 2]], 1, max_length=4)[0] == 5
    out = gen.process_logits(s, logits, [[0, 1, 2]], 3, 50)
    assert np.isinf(out[0, 4])
    with pytest.raises(InputError):
        greedy_next(s, np.zeros((2, 10), np.float32), [[0]], 1)
    # sampling: reproducible from the seed, restricted to top-k
    s = GenerationSettings(do_sample=True, top_k=2, temperature=0.7)
    lg = np.arange(10, dtype=np.float32)[None].repeat(3, 0)
    a = sample_next(s, lg, [[0]] * 3, 1, [np.random.default_rng(i) for i in range(3)])
    b = sample_next(s, lg, [[0]] * 3, 1, [np.random.default_rng(i) for i in range(3)])
    assert a.tolist() == b.tolist() and set(a.tolist()) <= {8, 9}
