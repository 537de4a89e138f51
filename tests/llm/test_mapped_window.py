"""precast::mapped_gqa with a sliding window: ONNX Runtime's GroupQueryAttention (local_window_size) computes
what the torch reference does (HF's window: a query sees the keys less than ``window`` positions back).

Cases: a first prompt longer than the window, a prompt chunk over a past, a batched decode with pasts on
both sides of the window. Random q/k/v, rotary tables and pasts; no model needed (fast).
"""

from __future__ import annotations

import numpy as np
import pytest

HEADS, KV, D, WINDOW, CTX = 4, 2, 16, 8, 64


@pytest.fixture(scope="module")
def window_graph():
    import torch
    from torch.export import Dim

    from precast.compiler.decoder.paged_ops import TRANSLATIONS, mapped_gqa
    from precast.compiler.frontends.torch_export import dynamo_export

    class Attn(torch.nn.Module):
        def forward(self, qkv, positions, cos, sin, past_key, past_value, seqlens_k, total):
            return mapped_gqa(
                qkv, positions, cos, sin, past_key, past_value, seqlens_k, total, HEADS, KV, D**-0.5, WINDOW
            )

    feeds = _feeds(np.random.default_rng(0), past=[5, 9, 0], s=3)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    b, s, c = Dim("batch"), Dim("sequence"), Dim("context")
    view = {0: b, 2: c}
    dynamic = ({0: b, 1: s}, {0: b, 1: s}, None, None, view, view, {0: b}, None)
    model = dynamo_export(
        Attn(), args, input_names=list(feeds), dynamic_shapes=dynamic, custom_translation_table=TRANSLATIONS
    )
    return Attn(), model


def _feeds(rng, past: list[int], s: int) -> dict[str, np.ndarray]:
    b = len(past)
    past_lens = np.array(past, dtype=np.int64)
    t = np.arange(CTX)[:, None] / (10000 ** (np.arange(D // 2)[None, :] / (D // 2)))
    return {
        "qkv": rng.standard_normal((b, s, (HEADS + 2 * KV) * D)).astype(np.float32),
        "positions": (past_lens[:, None] + np.arange(s)[None, :]).astype(np.int64),
        "cos": np.cos(t).astype(np.float32),
        "sin": np.sin(t).astype(np.float32),
        "past_key": rng.standard_normal((b, KV, max(past) + s + 2, D)).astype(np.float32),
        "past_value": rng.standard_normal((b, KV, max(past) + s + 2, D)).astype(np.float32),
        "seqlens_k": (past_lens + s - 1).astype(np.int32),
        "total": np.array(max(past) + s, dtype=np.int32),
    }


@pytest.mark.parametrize(
    "past,s",
    [([0], 20), ([13], 6), ([20, 3, 37, 7], 1)],
    ids=["first-prompt", "chunk-over-past", "batched-decode"],
)
def test_windowed_gqa_matches_the_reference(past, s, window_graph):
    import torch

    from tests.helpers import ort_run

    module, model = window_graph
    feeds = _feeds(np.random.default_rng(len(past) * 100 + s), past, s)
    with torch.no_grad():
        want = module(*(torch.from_numpy(v) for v in feeds.values()))[0].numpy()
    got = ort_run(model, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # and the window matters here: without it the reference differs
    if max(past) + s > WINDOW:
        from precast.compiler.decoder.paged_ops import mapped_gqa

        with torch.no_grad():
            t = [torch.from_numpy(v) for v in feeds.values()]
            unwindowed = mapped_gqa(*t, HEADS, KV, D**-0.5, -1)[0].numpy()
        assert np.abs(unwindowed - want).max() > 1e-2
