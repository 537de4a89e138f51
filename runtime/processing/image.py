"""Image preprocessing as transformers' slow (PIL) image processors do it, in numpy + PIL.

    image (uint8 HWC, grey HW, RGBA, or float in [0, 1])
      -> RGB -> resize (PIL: height/width, shortest edge, or ConvNext's crop_pct rule) -> center crop
      -> rescale (x * 1/255) -> normalize ((x - mean) / std) -> float32 [N, 3, H, W]

Each step repeats transformers' arithmetic (PIL resize on uint8, float64 rescale cast to float32, float32
normalize), so the pixel values match ``AutoImageProcessor.from_pretrained(..., backend="pil")`` to float32
rounding. Two deliberate differences, both about inputs transformers refuses or mishandles:

- grey and RGBA images are always made RGB (RGBA composited onto white, as transformers' ``convert_to_rgb``),
  whatever ``do_convert_rgb`` says: the model takes 3 channels, and transformers fails on them without the flag;
- a float image is read as already rescaled (``x`` stands for the pixel ``255 * x``), so it is not divided by
  255 a second time (transformers would; it equals transformers called with ``do_rescale=False``).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from precast.errors import ArtifactError, InputError, first_line
from precast.runtime.processing.fields import (
    CONFIG,
    bad,
    check_int,
    processor_type,
    read_bool,
    read_float,
    read_floats,
    read_int,
)

__all__ = ["IMAGE_ALIASES", "IMAGE_TYPES", "MAX_PIXELS", "MAX_SIDE", "ImageProcessing", "load_image"]

MAX_SIDE = 4096  # the largest size / crop_size a config may ask for
MAX_PIXELS = 50_000_000  # an image (file, array, or an intermediate resize) larger than this is refused
BILINEAR, BICUBIC = (
    2,
    3,
)  # PIL's resample numbers: NEAREST 0, LANCZOS 1, BILINEAR 2, BICUBIC 3, BOX 4, HAMMING 5
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class _Defaults:
    """A transformers image processor's class attributes: what a key missing from its config means."""

    resample: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    size: dict
    default_to_square: bool  # how an int ``size`` is read: a square, or the shortest edge
    do_center_crop: bool = False
    crop_size: dict | None = None
    do_convert_rgb: bool = False
    crop_pct: float | None = None  # ConvNext's resize rule (the only processor here that reads crop_pct)


_CLIP = dict(resample=BICUBIC, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, size={"shortest_edge": 224})
_CROP = dict(do_center_crop=True, crop_size={"height": 224, "width": 224}, do_convert_rgb=True)
IMAGE_TYPES = {
    "ViTImageProcessor": _Defaults(
        BILINEAR, IMAGENET_STANDARD, IMAGENET_STANDARD, {"height": 224, "width": 224}, default_to_square=True
    ),
    "CLIPImageProcessor": _Defaults(**_CLIP, default_to_square=False, **_CROP),
    "SiglipImageProcessor": _Defaults(
        BICUBIC,
        IMAGENET_STANDARD,
        IMAGENET_STANDARD,
        {"height": 224, "width": 224},
        False,
        do_convert_rgb=True,
    ),
    "BitImageProcessor": _Defaults(**_CLIP, default_to_square=False, **_CROP),
    "ConvNextImageProcessor": _Defaults(
        BICUBIC, IMAGENET_STANDARD, IMAGENET_STANDARD, {"shortest_edge": 384}, False, crop_pct=224 / 256
    ),
}
# older configs name the feature extractor (ResNet's and Swin's still do)
IMAGE_ALIASES = {
    "ViTFeatureExtractor": "ViTImageProcessor",
    "CLIPFeatureExtractor": "CLIPImageProcessor",
    "ConvNextFeatureExtractor": "ConvNextImageProcessor",
}


def _read_size(cfg: Mapping, key: str, default: dict, default_to_square: bool) -> tuple[int, int] | int:
    """(height, width), or an int: the shortest edge. transformers' get_size_dict, restricted to the two forms
    these processors resize by."""
    value = cfg.get(key)
    if value is None:
        value = default
    if isinstance(value, int) and not isinstance(value, bool):
        side = check_int(key, value, 1, MAX_SIDE)
        return (side, side) if default_to_square else side
    if isinstance(value, list) and len(value) == 2:
        return (check_int(f"{key}[0]", value[0], 1, MAX_SIDE), check_int(f"{key}[1]", value[1], 1, MAX_SIDE))
    if isinstance(value, Mapping) and set(value) == {"height", "width"}:
        return tuple(check_int(f"{key}.{k}", value[k], 1, MAX_SIDE) for k in ("height", "width"))
    if isinstance(value, Mapping) and set(value) == {"shortest_edge"}:
        return check_int(f"{key}.shortest_edge", value["shortest_edge"], 1, MAX_SIDE)
    raise bad(key, value, '{"height": h, "width": w}, {"shortest_edge": n}, an integer or [h, w]')


def _shortest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    """transformers' get_resize_output_image_size(default_to_square=False): the short side becomes ``size``, the
    long side keeps the aspect ratio, truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    return (new_long, size) if width <= height else (size, new_long)


@dataclass(frozen=True)
class ImageProcessing:
    """One image processor's settings, read from its config; ``images -> pixel_values``."""

    processor_type: str
    do_convert_rgb: bool
    do_resize: bool
    size: tuple[int, int] | None  # (height, width) to resize to, or None: resize by the shortest edge
    shortest_edge: int | None
    resample: int
    do_center_crop: bool
    crop_size: tuple[int, int] | None  # (height, width)
    # set: ConvNext's rule (shortest edge < 384: resize it to edge / crop_pct, then crop the square)
    crop_pct: float | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_config(cls, cfg: dict) -> ImageProcessing:
        name = processor_type(cfg)
        name = IMAGE_ALIASES.get(name, name)
        if name not in IMAGE_TYPES:
            raise ArtifactError(
                f"{CONFIG}: unknown image processor type '{name}'; precast reproduces {', '.join(IMAGE_TYPES)}"
            )
        d = IMAGE_TYPES[name]
        default_to_square = read_bool(cfg, "default_to_square", d.default_to_square)
        size = _read_size(cfg, "size", d.size, default_to_square)
        do_center_crop = read_bool(cfg, "do_center_crop", d.do_center_crop)
        crop = None
        if cfg.get("crop_size") is not None or d.crop_size is not None:
            crop = _read_size(cfg, "crop_size", d.crop_size or {}, default_to_square=True)
        if do_center_crop and crop is None:
            raise ArtifactError(f"{CONFIG}: 'do_center_crop' is true but there is no 'crop_size'")
        if do_center_crop and isinstance(crop, int):
            raise bad("crop_size", cfg.get("crop_size"), '{"height": h, "width": w} (a center crop is a box)')
        crop_size = crop if isinstance(crop, tuple) else None
        crop_pct = None
        if d.crop_pct is not None:
            crop_pct = read_float(cfg, "crop_pct", d.crop_pct, 0.0, 1.0, above_lo=True)
            if not isinstance(size, int):
                raise bad(
                    "size", cfg.get("size"), '{"shortest_edge": n} (ConvNext resizes by the shortest edge)'
                )
        if cfg.get("do_pad"):
            raise bad("do_pad", cfg["do_pad"], f"false ({name} does not pad)")
        processing = cls(
            processor_type=name,
            do_convert_rgb=read_bool(cfg, "do_convert_rgb", d.do_convert_rgb),
            do_resize=read_bool(cfg, "do_resize", True),
            size=None if isinstance(size, int) else size,
            shortest_edge=size if isinstance(size, int) else None,
            resample=read_int(cfg, "resample", d.resample, 0, 5),
            do_center_crop=do_center_crop,
            crop_size=crop_size,
            crop_pct=crop_pct,
            do_rescale=read_bool(cfg, "do_rescale", True),
            rescale_factor=read_float(cfg, "rescale_factor", 1 / 255, 0.0, 1.0, above_lo=True),
            do_normalize=read_bool(cfg, "do_normalize", True),
            image_mean=read_floats(cfg, "image_mean", d.mean, 3, -1000.0, 1000.0),
            image_std=read_floats(cfg, "image_std", d.std, 3, 1e-6, 1000.0),
        )
        if processing._fixed_size() is None:
            raise ArtifactError(
                f"{CONFIG}: {name} with size {cfg.get('size')!r}, do_resize {processing.do_resize} and no center "
                "crop gives each image its own size; the model needs one (height, width)"
            )
        return processing

    def _fixed_size(self) -> tuple[int, int] | None:
        if self.do_center_crop:
            return self.crop_size
        if self.do_resize and self.crop_pct is not None:
            return (self.shortest_edge, self.shortest_edge)
        if self.do_resize and self.size is not None:
            return self.size
        return None

    def output_size(self) -> tuple[int, int]:
        """(height, width) of the pixel_values the model sees."""
        size = self._fixed_size()
        assert size is not None, "from_config refuses a config without a fixed output size"
        return size

    def __call__(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """uint8 HxWxC (C = 1, 3 or 4) or HxW images, or float ones in [0, 1] -> float32 [N, 3, H, W]."""
        if isinstance(images, np.ndarray) or not isinstance(images, Sequence) or not images:
            raise InputError("expected a non-empty list of images (HxWxC arrays)")
        height, width = self.output_size()
        out = np.empty((len(images), 3, height, width), np.float32)
        for i, image in enumerate(images):
            out[i] = self._one(i, image).transpose(2, 0, 1)
        return out

    def _one(self, index: int, image: np.ndarray) -> np.ndarray:
        pixels = _as_rgb(index, image)
        # a float image holds pixel / 255: its values count 255 times in the rescale below
        unit = 255.0 if pixels.dtype != np.uint8 else 1.0
        if self.do_resize:
            pixels = self._resize(index, pixels)
            unit = 1.0
        if self.do_center_crop:
            pixels = _center_crop(pixels, self.crop_size)
        # rescale in float64 then cast (transformers' rescale); normalize in float32 (its normalize)
        factor = unit * (self.rescale_factor if self.do_rescale else 1.0)
        values = (pixels.astype(np.float64) * factor).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)
            std = np.asarray(self.image_std, np.float32)
            values = (values - mean) / std
        return values

    def _resize(self, index: int, pixels: np.ndarray) -> np.ndarray:
        height, width = pixels.shape[:2]
        if self.crop_pct is not None:  # ConvNext
            edge = self.shortest_edge
            if edge >= 384:  # evaluated at 384 or more: warp to the square, no crop
                return _pil_resize(index, pixels, (edge, edge), self.resample)
            target = _shortest_edge_size(height, width, int(edge / self.crop_pct))
            return _center_crop(_pil_resize(index, pixels, target, self.resample), (edge, edge))
        if self.size is not None:
            return _pil_resize(index, pixels, self.size, self.resample)
        return _pil_resize(
            index, pixels, _shortest_edge_size(height, width, self.shortest_edge), self.resample
        )


def _as_rgb(index: int, image: object) -> np.ndarray:
    """HxWx3, uint8 or float64 in [0, 1]. Grey is repeated; RGBA is composited onto white by transformers'
    numpy formula (alpha * rgb + (1 - alpha) * white, rounded for uint8)."""
    if not isinstance(image, np.ndarray):
        raise InputError(f"image {index}: expected a numpy array, got {type(image).__name__}")
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise InputError(
            f"image {index}: expected HxW or HxWxC with C = 1, 3 or 4 (channels last), got shape {image.shape}"
        )
    height, width, channels = image.shape
    if height == 0 or width == 0 or height * width > MAX_PIXELS:
        raise InputError(
            f"image {index}: {width}x{height} is empty or over {MAX_PIXELS // 1_000_000} megapixels"
        )
    if image.dtype == np.uint8:
        white = 255.0
    elif image.dtype.kind == "f":
        image = image.astype(np.float64)
        if not np.isfinite(image).all() or image.min() < 0.0 or image.max() > 1.0:
            raise InputError(f"image {index}: a float image must hold finite values in [0, 1]")
        white = 1.0
    else:
        raise InputError(f"image {index}: expected uint8 pixels or floats in [0, 1], got {image.dtype}")
    if channels == 1:
        return np.repeat(image, 3, axis=2)
    if channels == 4:
        alpha = image[:, :, 3:4] / white
        rgb = alpha * image[:, :, :3] + (1 - alpha) * white
        return np.round(rgb).astype(np.uint8) if image.dtype == np.uint8 else rgb
    return image


def _pil_resize(index: int, pixels: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    height, width = size
    if height * width > MAX_PIXELS:
        raise InputError(
            f"image {index}: {pixels.shape[1]}x{pixels.shape[0]} resizes to {width}x{height}, over "
            f"{MAX_PIXELS // 1_000_000} megapixels (too elongated)"
        )
    if pixels.dtype != np.uint8:  # PIL resizes uint8: transformers scales by 255 and truncates, so do we
        pixels = (pixels * 255).astype(np.float32).astype(np.uint8)
    Image = _pil().Image
    return np.asarray(Image.fromarray(pixels).resize((width, height), resample=resample))


def _center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' center_crop: the top-left of the crop at ((H - h) // 2, (W - w) // 2); an image smaller than
    the crop is first padded with zeros, centered (the extra pixel of an odd pad goes before)."""
    crop_h, crop_w = size
    height, width = pixels.shape[:2]
    if crop_h > height or crop_w > width:
        new_h, new_w = max(crop_h, height), max(crop_w, width)
        top, left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
        padded = np.zeros((new_h, new_w, pixels.shape[2]), pixels.dtype)
        padded[top : top + height, left : left + width] = pixels
        pixels, height, width = padded, new_h, new_w
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return pixels[top : top + crop_h, left : left + crop_w]


def _pil():
    try:
        import PIL.Image
        import PIL.ImageOps
    except ImportError as e:
        raise ArtifactError("image artifacts need the 'pillow' package: pip install 'precast[vision]'") from e
    return PIL


def load_image(path: str | os.PathLike | bytes, name: str = "image") -> np.ndarray:
    """An image file (or its bytes, called ``name`` in errors) as RGB uint8 HxWx3, as transformers' load_image
    (EXIF orientation applied, then ``convert("RGB")``: an alpha channel is dropped, not composited). Files over
    MAX_PIXELS are refused before their pixels are decoded (a decompression bomb is a small file)."""
    PIL = _pil()
    data = isinstance(path, (bytes, bytearray))
    source = io.BytesIO(path) if data else Path(path)
    path = name if data else source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            with PIL.Image.open(source) as im:
                width, height = im.size
                if width * height > MAX_PIXELS:
                    raise InputError(
                        f"{path}: {width}x{height} is over {MAX_PIXELS // 1_000_000} megapixels; refused"
                    )
                return np.asarray(PIL.ImageOps.exif_transpose(im).convert("RGB"))
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except PIL.Image.DecompressionBombError:
        raise InputError(f"{path}: over {MAX_PIXELS // 1_000_000} megapixels; refused") from None
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, struct.error... on a bad file
        raise InputError(f"{path}: not a readable image ({first_line(e)})") from None
