"""Real Hugging Face model files, as their hub repositories hold them: preprocessor_config.json of each model
(older ones still name the feature extractor and give ``size`` as an int), and wav2vec2-base-960h's CTC
vocabulary and tokenizer_config.json. The processing tests run each through transformers and precast."""

IMAGENET_DEFAULT = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
HALF = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}

CONFIGS = {
    "google/vit-base-patch16-224": {
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "ViTFeatureExtractor",
        **HALF,
        "resample": 2,
        "size": 224,
    },
    "openai/clip-vit-base-patch32": {
        "crop_size": 224,
        "do_center_crop": True,
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor",
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
        "size": 224,
    },
    "google/siglip-base-patch16-224": {
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        **HALF,
        "image_processor_type": "SiglipImageProcessor",
        "processor_class": "SiglipProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": 224, "width": 224},
    },
    "facebook/dinov2-small": {
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        **IMAGENET_DEFAULT,
        "image_processor_type": "BitImageProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 256},
    },
    "microsoft/swin-tiny-patch4-window7-224": {
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "ViTFeatureExtractor",
        **IMAGENET_DEFAULT,
        "resample": 3,  # bicubic, as timm trained it (ViT's own default is bilinear)
        "size": 224,
    },
    "facebook/convnext-tiny-224": {
        "crop_pct": 0.875,
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "ConvNextFeatureExtractor",
        **IMAGENET_DEFAULT,
        "resample": 3,
        "size": 224,
    },
    "microsoft/resnet-50": {
        "crop_pct": 0.875,
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "ConvNextFeatureExtractor",
        **IMAGENET_DEFAULT,
        "resample": 3,
        "size": 224,
    },
    "facebook/wav2vec2-base-960h": {
        "do_normalize": True,
        "feature_extractor_type": "Wav2Vec2FeatureExtractor",
        "feature_size": 1,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
        "sampling_rate": 16000,
    },
}

IMAGE_MODELS = [name for name, cfg in CONFIGS.items() if "sampling_rate" not in cfg]

WAV2VEC2_VOCAB = {
    token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAONIHSRDLUMWCFGYPBVK'XJQZ"])
}
WAV2VEC2_TOKENIZER_CONFIG = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "do_lower_case": False,
    "return_attention_mask": False,
    "do_normalize": True,
}
