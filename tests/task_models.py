"""Tiny Hugging Face folders of every non-text task family, random weights N(0, 0.1), with the real models'
preprocessor_config.json (tests/runtime/processor_configs.py) and, for the two-tower models, a word-level tokenizer.

    build(family, folder) -> the transformers model saved there (config.json, model.safetensors, preprocessor
    config, tokenizer.json / vocab.json)
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import randomize_weights_
from tests.runtime.processor_configs import CONFIGS, WAV2VEC2_TOKENIZER_CONFIG, WAV2VEC2_VOCAB

LABELS = {0: "cat", 1: "dog", 2: "bird", 3: "fish"}
_L = {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}}
_H = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_AUDIO = {
    **_H,
    "conv_dim": (32, 32, 32),
    "conv_stride": (5, 4, 4),
    "conv_kernel": (10, 4, 4),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}
WORDS = (
    "a photo of cat dog bird fish diagram circuit this is the quick brown fox jumps over lazy man playing guitar ."
).split()

# family -> (transformers class, config class, config kwargs, processor config name, task)
FAMILIES = {
    "vit": ("ViTForImageClassification", "ViTConfig", {**_H, "image_size": 32, "patch_size": 8, **_L},
            "google/vit-base-patch16-224", "image-classification"),
    "swin": ("SwinForImageClassification", "SwinConfig", {"image_size": 32, "patch_size": 4, "embed_dim": 16,
             "depths": [2, 2], "num_heads": [2, 4], "window_size": 4, **_L},
             "microsoft/swin-tiny-patch4-window7-224", "image-classification"),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig", {"hidden_sizes": [16, 32], "depths": [1, 1],
                 "num_stages": 2, **_L}, "facebook/convnext-tiny-224", "image-classification"),
    "resnet": ("ResNetForImageClassification", "ResNetConfig", {"embedding_size": 16, "hidden_sizes": [16, 32],
               "depths": [1, 1], **_L}, "microsoft/resnet-50", "image-classification"),
    "dinov2": ("Dinov2Model", "Dinov2Config", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "image_size": 32, "patch_size": 8}, "facebook/dinov2-small", "image-feature-extraction"),
    "clip_vision": ("CLIPVisionModel", "CLIPVisionConfig", {**_H, "image_size": 32, "patch_size": 8},
                    "openai/clip-vit-base-patch32", "image-feature-extraction"),
    "siglip_vision": ("SiglipVisionModel", "SiglipVisionConfig", {**_H, "image_size": 32, "patch_size": 8},
                      "google/siglip-base-patch16-224", "image-feature-extraction"),
    "clip": ("CLIPModel", "CLIPConfig", {}, "openai/clip-vit-base-patch32", "zero-shot-image-classification"),
    "siglip": ("SiglipModel", "SiglipConfig", {}, "google/siglip-base-patch16-224", "zero-shot-image-classification"),
    "wav2vec2_ctc": ("Wav2Vec2ForCTC", "Wav2Vec2Config", {**_AUDIO, "vocab_size": len(WAV2VEC2_VOCAB),
                     "pad_token_id": 0}, "facebook/wav2vec2-base-960h", "automatic-speech-recognition"),
    # wav2vec2-large-lv60's layout: layer-norm feature encoder, and an attention mask from the feature extractor
    "wav2vec2_masked": ("Wav2Vec2ForCTC", "Wav2Vec2Config", {**_AUDIO, "vocab_size": len(WAV2VEC2_VOCAB),
                        "pad_token_id": 0, "feat_extract_norm": "layer", "do_stable_layer_norm": True},
                        "facebook/wav2vec2-base-960h", "automatic-speech-recognition"),
    "wav2vec2_cls": ("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", {**_AUDIO, **_L},
                     "facebook/wav2vec2-base-960h", "audio-classification"),
}  # fmt: skip


def _two_tower(cls_name: str, vocab: int):
    text = {**_H, "vocab_size": vocab, "max_position_embeddings": 16, "bos_token_id": 2, "eos_token_id": 3,
            "pad_token_id": 0}  # fmt: skip
    vision = {**_H, "image_size": 32, "patch_size": 8}
    if cls_name == "CLIPConfig":
        return {"text_config": text, "vision_config": vision, "projection_dim": 32}
    return {"text_config": text, "vision_config": vision}


def write_tokenizer(folder: Path) -> int:
    """A word-level tokenizer.json (<|start|> text <|end|>, pad id 0); returns its vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<|start|>", "<|end|>", *dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation: "cat." -> "cat", "."
    tok.post_processor = processors.TemplateProcessing(
        single="<|start|> $A <|end|>", special_tokens=[("<|start|>", 2), ("<|end|>", 3)]
    )
    tok.save(str(folder / "tokenizer.json"))
    return len(vocab)


def build(family: str, folder: Path, processor: bool = True):
    """The tiny model of ``family`` saved into ``folder`` (created); returns the transformers model (eval)."""
    import torch
    import transformers

    cls_name, config_name, kwargs, processor_name, _ = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    if family in ("clip", "siglip"):
        kwargs = _two_tower(config_name, write_tokenizer(folder))
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    model = randomize_weights_(getattr(transformers, cls_name)(config).eval())
    with torch.no_grad():  # BatchNorm statistics away from (0, 1), so folding them is tested
        for name, buf in model.named_buffers():
            if name.endswith("running_mean"):
                buf.normal_(0, 0.1)
            elif name.endswith("running_var"):
                buf.uniform_(0.5, 1.5)
        if hasattr(model, "logit_scale"):  # a trained model's sharpness, so the labels' scores differ
            model.logit_scale.fill_(3.4)
    model.save_pretrained(folder)
    if processor:
        cfg = dict(CONFIGS[processor_name])
        if "sampling_rate" not in cfg:  # the real processor, at the tiny model's image size
            cfg = _resized(cfg)
        if family == "wav2vec2_masked":
            cfg["return_attention_mask"] = True
        (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    if family in ("wav2vec2_ctc", "wav2vec2_masked"):
        (folder / "vocab.json").write_text(json.dumps(WAV2VEC2_VOCAB))
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**WAV2VEC2_TOKENIZER_CONFIG, "tokenizer_class": "Wav2Vec2CTCTokenizer"})
        )
    return model


def _resized(cfg: dict, side: int = 32) -> dict:
    """The real processor config at the tiny models' 32 px input, its resize and crop rules kept: a shortest-edge
    resize (CLIP, DINOv2's Bit, ConvNext with crop_pct) stays one, resized a bit past the crop."""
    cfg = dict(cfg)
    kind = str(cfg.get("image_processor_type") or cfg.get("feature_extractor_type"))
    size = cfg.get("size")
    shortest = (isinstance(size, dict) and "shortest_edge" in size) or (
        isinstance(size, int) and kind.startswith(("CLIP", "ConvNext", "Bit"))
    )
    if not shortest:
        cfg["size"] = {"height": side, "width": side}
    elif cfg.get("do_center_crop") and "crop_size" in cfg:
        cfg["size"] = {"shortest_edge": side + side // 7}
        cfg["crop_size"] = {"height": side, "width": side}
    else:  # ConvNext: crop_pct crops below 384
        cfg["size"] = {"shortest_edge": side}
    return cfg
