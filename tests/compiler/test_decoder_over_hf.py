"""generic_decoder's seams for ov_decoder and attention_swaps: the shared base, the step flag, the setting."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


class _Config:
    def __init__(self):
        self._attn_implementation, self._experts_implementation = "eager", None


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _Config()
        self.head = torch.nn.Linear(4, 3, bias=False)

    def get_output_embeddings(self):
        return self.head


def test_in_step_is_false_outside_a_step():
    from precast.compiler.decoder.generic_decoder import in_step

    assert in_step() is False


def test_restored_attention_puts_the_setting_back():
    from precast.compiler.decoder.generic_decoder import (
        attention_setting,
        restored_attention,
        set_attention,
    )

    lm = _TinyLM()
    with restored_attention(lm):
        set_attention(lm, "precast_paged", "precast_dense")
        assert attention_setting(lm) == ("precast_paged", "precast_dense")
    assert attention_setting(lm) == ("eager", "precast_dense")  # experts None: left as it was set


def test_decoders_share_the_base_and_hook_the_head():
    from precast.compiler.decoder.generic_decoder import (
        DecoderOverHF,
        DecoderShape,
        GenericDecoder,
    )
    from precast.compiler.decoder.ov_decoder import OVDecoder

    assert issubclass(GenericDecoder, DecoderOverHF) and issubclass(OVDecoder, DecoderOverHF)
    shape = DecoderShape(
        layers=2, heads=4, kv_heads=2, head_size=8, windows=(None, None), softcaps=(None, None)
    )
    lm = _TinyLM()
    module = GenericDecoder(lm, shape, max_context=64)
    assert (module.heads, module.kv_heads, module.head_dim, len(module.layers)) == (4, 2, 8, 2)
    x = torch.ones(1, 2, 4)
    assert torch.equal(lm.head(x), x @ lm.head.weight.T)  # outside a step the hook passes the input through
