"""Tiny random-weight encoder-decoder folders (N(0, 0.1) weights) with the real vocab sizes and generation configs
of t5-small, bart-base, opus-mt-en-de and whisper-tiny, and a byte-level BPE tokenizer trained on local text."""

from __future__ import annotations

import json
from pathlib import Path

REAL = {  # model_type -> (vocab size, generation_config.json as the hub's checkpoint has it)
    "t5": (32128, {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}),
    "bart": (
        50265,
        {
            "bos_token_id": 0,
            "decoder_start_token_id": 2,
            "early_stopping": True,
            "eos_token_id": 2,
            "forced_bos_token_id": 0,
            "forced_eos_token_id": 2,
            "no_repeat_ngram_size": 3,
            "num_beams": 4,
            "pad_token_id": 1,
        },
    ),
    "marian": (
        58101,
        {
            "bad_words_ids": [[58100]],
            "bos_token_id": 0,
            "decoder_start_token_id": 58100,
            "eos_token_id": 0,
            "forced_eos_token_id": 0,
            "max_length": 512,
            "num_beams": 4,
            "pad_token_id": 58100,
        },
    ),
    "whisper": (51865, None),  # built by _whisper_generation_config
}
_LANGS = ["en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr"]


def _whisper_generation_config() -> dict:
    langs = {f"<|{c}|>": 50259 + i for i, c in enumerate(_LANGS)}
    return {
        "begin_suppress_tokens": [220, 50257],
        "bos_token_id": 50257,
        "decoder_start_token_id": 50258,
        "eos_token_id": 50257,
        "pad_token_id": 50257,
        "forced_decoder_ids": [[1, None], [2, 50359]],
        "is_multilingual": True,
        "lang_to_id": langs,
        "task_to_id": {"transcribe": 50359, "translate": 50358},
        "no_timestamps_token_id": 50363,
        "max_initial_timestamp_index": 50,
        "max_length": 448,
        "prev_sot_token_id": 50361,
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
            357,
            366,
            438,
            532,
            685,
            705,
            796,
            930,
            1058,
            1220,
            1267,
            1279,
            1303,
            1343,
            1377,
            50360,
            50361,
            50362,
        ],
    }


def _text() -> str:
    import inspect
    import json as j

    return inspect.getsource(j) * 2


def _tokenizer(vocab: int, specials: dict[str, int], template: tuple[list[str], str] | None):
    """A byte-level BPE (~400 tokens) with the model's special tokens at their real ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    low = sorted(i for i in specials.values() if i < 400)
    trainer = trainers.BpeTrainer(
        vocab_size=380, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]
    )
    tok.train_from_iterator([_text()], trainer)
    data = json.loads(tok.to_str())
    # move the learned tokens past the low special ids, then put every special at its id
    learned = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    free = (i for i in range(vocab) if i not in low)
    data["model"]["vocab"] = {t: next(free) for t, _ in learned}
    added = []
    for content, i in sorted(specials.items(), key=lambda kv: kv[1]):
        data["model"]["vocab"][content] = i
        added.append(
            {
                "id": i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    data["added_tokens"] = added
    if template is not None:
        pre, post = template
        single = [{"SpecialToken": {"id": t, "type_id": 0}} for t in pre] + [
            {"Sequence": {"id": "A", "type_id": 0}}
        ]
        single += [{"SpecialToken": {"id": post, "type_id": 0}}]
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": single,
            "pair": single,
            "special_tokens": {t: {"id": t, "ids": [specials[t]], "tokens": [t]} for t in [*pre, post]},
        }
    _ = processors  # (TemplateProcessing written as JSON: the ids are the real ones)
    return Tokenizer.from_str(json.dumps(data))


def make_folder(
    kind: str,
    path: Path,
    seed: int = 0,
    *,
    d_model: int = 64,
    layers: int = 2,
    eos_bias: float = 0.0,
    heads: int = 4,
    d_kv: int = 16,
) -> Path:
    """Save a tiny ``kind`` (t5 | bart | marian | whisper) model folder at ``path``. ``eos_bias`` (BART, Marian:
    added to final_logits_bias at the EOS id) makes beams end at different lengths within a few dozen steps."""
    import torch
    import transformers as t

    vocab, gen = REAL[kind]
    common = dict(vocab_size=vocab, d_model=d_model)
    if kind == "t5":
        cfg = t.T5Config(
            **common,
            d_kv=d_kv,
            d_ff=4 * d_model if d_model >= 512 else 2 * d_model,
            num_layers=layers,
            num_heads=heads,
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            decoder_start_token_id=0,
            eos_token_id=1,
            pad_token_id=0,
        )
        cfg.architectures = ["T5ForConditionalGeneration"]
        specials, template = {"<pad>": 0, "</s>": 1, "<unk>": 2}, ([], "</s>")
        cls = t.T5ForConditionalGeneration
    elif kind in ("bart", "marian"):
        ids = dict(
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2
        )
        if kind == "marian":
            ids = dict(
                pad_token_id=58100,
                bos_token_id=0,
                eos_token_id=0,
                decoder_start_token_id=58100,
                forced_eos_token_id=0,
            )
        cfgcls = t.BartConfig if kind == "bart" else t.MarianConfig
        cfg = cfgcls(
            **common,
            encoder_layers=layers,
            decoder_layers=layers,
            encoder_attention_heads=heads,
            decoder_attention_heads=heads,
            encoder_ffn_dim=2 * d_model,
            decoder_ffn_dim=2 * d_model,
            max_position_embeddings=256,
            **ids,
        )
        cfg.architectures = ["BartForConditionalGeneration" if kind == "bart" else "MarianMTModel"]
        cls = t.BartForConditionalGeneration if kind == "bart" else t.MarianMTModel
        if kind == "bart":
            specials, template = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}, (["<s>"], "</s>")
        else:
            specials, template = {"</s>": 0, "<unk>": 1, "<pad>": 58100}, ([], "</s>")
    elif kind == "whisper":
        gen = _whisper_generation_config()
        ffn = 4 * d_model if d_model >= 384 else 2 * d_model  # (whisper-tiny: 384 -> 1536)
        cfg = t.WhisperConfig(
            **common,
            encoder_layers=layers,
            decoder_layers=layers,
            encoder_attention_heads=heads,
            decoder_attention_heads=heads,
            encoder_ffn_dim=ffn,
            decoder_ffn_dim=ffn,
            num_mel_bins=80,
            max_source_positions=1500,
            max_target_positions=448,
            pad_token_id=50257,
            bos_token_id=50257,
            eos_token_id=50257,
            decoder_start_token_id=50258,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        )
        cfg.architectures = ["WhisperForConditionalGeneration"]
        cls = t.WhisperForConditionalGeneration
        specials = {
            "<|endoftext|>": 50257,
            "<|startoftranscript|>": 50258,
            "<|translate|>": 50358,
            "<|transcribe|>": 50359,
            "<|startoflm|>": 50360,
            "<|startofprev|>": 50361,
            "<|nospeech|>": 50362,
            "<|notimestamps|>": 50363,
        }
        specials.update(gen["lang_to_id"])
        template = None
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
        if eos_bias:
            model.final_logits_bias[0, cfg.eos_token_id] += eos_bias
    path = Path(path)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _tokenizer(vocab, specials, template).save(str(path / "tokenizer.json"))
    if kind == "whisper":
        from transformers import WhisperFeatureExtractor

        WhisperFeatureExtractor(feature_size=80).save_pretrained(path)
    return path
