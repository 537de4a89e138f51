"""sentence-similarity: the folder's sentence-transformers pooling and normalisation, exported in the graph.

    modules.json: Transformer -> Pooling (1_Pooling/config.json: cls | mean | max | mean_sqrt_len | lasttoken)
                  -> Normalize (L2) ?

A folder without modules.json pools by mean, as sentence-transformers does for a plain Hugging Face model.
Other modules (Dense, a second Transformer, custom code) are refused: the artifact would embed differently.
"""

from __future__ import annotations

import json
from pathlib import Path

from precast.errors import ModelLoadError

__all__ = ["read_pooling", "pooling_files", "SentenceEmbedding"]

_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
_ST = "sentence_transformers.models."


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e})") from e


def pooling_files(folder: Path) -> list[Path]:
    """The sentence-transformers files that decide the embedding (hashed into the source)."""
    files = [folder / n for n in ("modules.json", "sentence_bert_config.json") if (folder / n).is_file()]
    if (folder / "modules.json").is_file():
        for m in _modules(folder):
            cfg = folder / str(m.get("path", "")) / "config.json"
            if m.get("path") and cfg.is_file() and cfg.resolve().is_relative_to(folder.resolve()):
                files.append(cfg)
    return files


def _modules(folder: Path) -> list[dict]:
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{folder}/modules.json must be a list of module objects")
    return modules


def read_pooling(folder: Path) -> tuple[str, bool]:
    """(mode, normalize) from modules.json and the Pooling module's config.json."""
    if not (folder / "modules.json").is_file():
        return "mean_tokens", False
    mode, normalize = None, False
    for i, m in enumerate(_modules(folder)):
        kind = str(m.get("type", ""))
        if kind == _ST + "Transformer" and i == 0:
            continue
        if kind == _ST + "Pooling":
            mode = _pooling_mode(folder, folder / str(m.get("path", "")) / "config.json")
        elif kind == _ST + "Normalize":
            normalize = True
        else:
            raise ModelLoadError(
                f"{folder}/modules.json: module {i} '{kind}' is not supported for sentence-similarity "
                "(Transformer, Pooling, Normalize are)"
            )
    if mode is None:
        raise ModelLoadError(f"{folder}/modules.json names no {_ST}Pooling module")
    return mode, normalize


def _pooling_mode(folder: Path, path: Path) -> str:
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ModelLoadError(f"{folder}/modules.json: the Pooling path leaves the folder ({path})")
    if not path.is_file():
        return "mean_tokens"  # sentence-transformers' default Pooling
    cfg = _json(path)
    on = [m for m in _MODES if isinstance(cfg, dict) and cfg.get(f"pooling_mode_{m}")]
    extra = [
        k
        for k, v in (cfg.items() if isinstance(cfg, dict) else ())
        if k.startswith("pooling_mode_") and v and k.removeprefix("pooling_mode_") not in _MODES
    ]
    if len(on) != 1 or extra:
        raise ModelLoadError(
            f"{path}: exactly one pooling mode of {', '.join(_MODES)} must be on (found {', '.join(on + extra) or 'none'})"
        )
    return on[0]


def SentenceEmbedding(model, mode: str, normalize: bool, takes_types: bool):  # noqa: N802 (a torch Module)
    """``model`` (a transformers encoder) followed by sentence-transformers' pooling, as one torch Module whose
    forward returns the sentence embedding [batch, hidden]."""
    import torch

    class _SentenceEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config = model.config

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            kwargs = {"token_type_ids": token_type_ids} if takes_types and token_type_ids is not None else {}
            h = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            if mode == "cls_token":
                x = h[:, 0]
            elif mode == "max_tokens":
                x = torch.where(m > 0, h, torch.finfo(h.dtype).min).max(dim=1).values
            elif mode == "lasttoken":  # the last token the mask keeps (right padding)
                last = attention_mask.sum(dim=1) - 1
                x = h[torch.arange(h.shape[0]), last]
            else:
                total, count = (h * m).sum(dim=1), m.sum(dim=1).clamp(min=1e-9)
                x = total / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)
            if normalize:
                x = torch.nn.functional.normalize(x, p=2, dim=1)
            return x

    return _SentenceEmbedding().eval()
