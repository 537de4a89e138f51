"""The causal-LM step graph for OpenVINO: the model's own forward, attention lowered to OpenVINO's PagedAttention.

    input_ids, positions [1,T]   (every scheduled token of the step, requests back to back: no padding)
    past_lens [B] i32  subsequence_begins [B+1] i32  block_indices [N] i32  block_indices_begins [B+1] i32
    max_context_len [] i32  logits_indices [B] i64 (each request's last new token)  key_cache.i / value_cache.i
      hf(input_ids [T,1], position_ids [T,1])    the model's own embeddings, norms, rotary, MLP (as generic_decoder);
                                                 one token per batch row, as SDPAToPagedAttention makes it
        per layer: attention_interface(q, k, v)  ==>  precast::ov_paged_attention  ==>  PagedAttentionExtension
                   (q [T,H*D], k/v [T,KV*D], the layer's caches, the step's tables; the kernel writes the new
                   K/V into the cache blocks itself and reads each request's past from them)
        lm head on the hidden states at logits_indices
      logits [B,V]

This is GenAI's ContinuousBatchingPipeline model contract (its SDPAToPagedAttention output), built from the
same generic decoder path as the ort-cpu step graph instead of from an optimum export: precast keeps one
export route for every family, and the pool / tables stay the engine's (runtime/llm/runners/openvino.py). The
cache inputs are left with dynamic type and shape: the CPU plugin picks its block size (32) and layout,
and KV_CACHE_PRECISION (f32 / f16 / u8 with per-block scales) at compile_model.

The custom op's torch body is the reference (the same attention over the same tables, reading the cache
without writing it: one step's parity); torch.jit.trace keeps it as one node that the conversion extension
turns into PagedAttentionExtension. torch and openvino are imported by the caller (compile side only).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from precast.compiler.decoder.generic_decoder import DecoderOverHF
from precast.errors import ModelLoadError
from precast.runtime.llm.runners.openvino import (
    OV_STEP_INPUTS,  # the runner's feeds are the graph's inputs
)

__all__ = ["OV_STEP_INPUTS", "OVDecoder", "export_ov_step", "ov_lowering", "ov_refusal"]

ATTN_IMPLEMENTATION = "precast_ov_paged"
PA_RT_INFO = (
    "precast_paged_attention"  # the IR's model-level rt_info key (runtime/backends/openvino.py reads it)
)
_NEG = torch.finfo(torch.float32).min
# Families whose attention code bypasses the interface (attention_swaps.py points it at the ort-cpu one).
_SWAPPED = ("falcon", "bloom")


@dataclass
class _OVStep:
    past_lens: torch.Tensor
    subsequence_begins: torch.Tensor
    block_indices: torch.Tensor
    block_indices_begins: torch.Tensor
    max_context_len: torch.Tensor
    key_caches: list
    value_caches: list
    calls: int = 0


_ACTIVE: _OVStep | None = None


@torch.library.custom_op("precast::ov_paged_attention", mutates_args=())
def ov_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    past_lens: torch.Tensor,
    subsequence_begins: torch.Tensor,
    block_indices: torch.Tensor,
    block_indices_begins: torch.Tensor,
    max_context_len: torch.Tensor,
    scale: float,
    heads: int,
    kv_heads: int,
    head_size: int,
) -> torch.Tensor:
    """q [T,H*D], new k/v [T,KV*D], caches [NB,KV,bs,D] -> [T,H*D]: request b's tokens
    subsequence_begins[b]..[b+1] attend causally over its past_lens[b] cached positions (blocks
    block_indices[block_indices_begins[b]:...], in order) and its own new tokens. The reference body."""
    t, hd = query.shape
    d = head_size
    g = heads // kv_heads
    out = torch.empty_like(query)
    for b in range(past_lens.shape[0]):
        s0, s1 = int(subsequence_begins[b]), int(subsequence_begins[b + 1])
        p = int(past_lens[b])
        blocks = block_indices[int(block_indices_begins[b]) : int(block_indices_begins[b + 1])].long()
        past_k = key_cache[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :p]  # [KV,P,D]
        past_v = value_cache[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :p]
        n = s1 - s0
        k = torch.cat([past_k, key[s0:s1].view(n, kv_heads, d).transpose(0, 1)], 1)  # [KV,P+n,D]
        v = torch.cat([past_v, value[s0:s1].view(n, kv_heads, d).transpose(0, 1)], 1)
        q = query[s0:s1].view(n, kv_heads, g, d).permute(1, 2, 0, 3)  # [KV,G,n,D]
        scores = torch.matmul(q, k[:, None].transpose(-1, -2)) * scale  # [KV,G,n,P+n]
        ok = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        probs = torch.softmax(torch.where(ok, scores, torch.full_like(scores, _NEG)), dim=-1)
        out[s0:s1] = torch.matmul(probs, v[:, None]).permute(2, 0, 1, 3).reshape(n, hd)
    return out


@ov_paged_attention.register_fake
def _(
    query, key, value, key_cache, value_cache, past_lens, sb, bi, bib, mcl, scale, heads, kv_heads, head_size
):
    return torch.empty_like(query)


def _attention(
    module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kw
):
    """The attention interface's entry: q [T,H,1,D], k/v [T,KV,1,D] (a token per row) -> ([T,1,H,D], None)."""
    step = _ACTIVE
    if step is None:
        raise RuntimeError("precast_ov_paged attention called outside a precast step")
    if kw.get("s_aux") is not None or kw.get("sinks") is not None or softcap:
        raise ModelLoadError("attention sinks and logit softcaps are not supported for target openvino")
    idx = getattr(module, "layer_idx", None)
    i = idx if isinstance(idx, int) else step.calls
    step.calls += 1
    rows, h, s, d = query.shape
    t = rows * s
    kv = key.shape[1]
    scale = float(scaling) if scaling is not None else d**-0.5
    # The tokens ride the batch axis (s == 1): the model's own [T,1,H,D] <-> [T,H,1,D] transposes and this
    # one are reshapes to OpenVINO (no Transpose left in the compiled step; with the tokens on the sequence
    # axis each layer ran two real ones, after the fused RoPE of q and k).
    out = ov_paged_attention(
        query.transpose(1, 2).reshape(t, h * d),
        key.transpose(1, 2).reshape(t, kv * d),
        value.transpose(1, 2).reshape(t, kv * d),
        step.key_caches[i],
        step.value_caches[i],
        step.past_lens,
        step.subsequence_begins,
        step.block_indices,
        step.block_indices_begins,
        step.max_context_len,
        scale,
        h,
        kv,
        d,
    )
    return out.view(rows, s, h, d), None


def ov_refusal(model_type: str, shape) -> str | None:
    """Why this model cannot take the OpenVINO step graph (None: it can). ``shape``: generic_decoder.probe's."""
    if model_type in _SWAPPED:
        return f"'{model_type}' computes its own attention (not through transformers' interface)"
    if shape.states:
        layers = sorted({st.layer for st in shape.states})
        kinds = "/".join(sorted({st.kind for st in shape.states}))
        return (
            f"'{model_type}' has recurrent-state layers {layers} ({kinds} state per request), not lowered to "
            "OpenVINO yet (ort-cpu serves it)"
        )
    if shape.value_size == 0:
        return (
            f"'{model_type}' has multi-head latent attention (a latent cache of {shape.head_size} floats a "
            "token and layer), not lowered to OpenVINO's PagedAttention yet (ort-cpu serves it)"
        )
    if shape.value_size is not None and shape.value_size != shape.head_size:
        return (
            f"'{model_type}' has K heads of {shape.head_size} and V heads of {shape.value_size}, not lowered to "
            "OpenVINO's PagedAttention yet (ort-cpu serves it)"
        )
    if any(shape.sinks):
        return f"'{model_type}' has attention sinks, not lowered to OpenVINO's PagedAttention yet (ort-cpu serves it)"
    if any(shape.softcaps):
        return "attention logit softcaps are not in OpenVINO's PagedAttention"
    if any(shape.windows):
        return "sliding-window layers are not lowered to OpenVINO's PagedAttention yet"
    return None


@contextlib.contextmanager
def _ov_attention(hf: nn.Module):
    """Point the model at the OpenVINO attention for one forward, then back (the model is shared with the
    ort-cpu decoder of the same compile)."""
    from transformers import AttentionInterface

    from precast.compiler.decoder.generic_decoder import (
        EXPERTS_IMPLEMENTATION,
        register,
        restored_attention,
        set_attention,
    )

    register()
    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    with restored_attention(hf):
        set_attention(hf, ATTN_IMPLEMENTATION, EXPERTS_IMPLEMENTATION)
        yield


class OVDecoder(DecoderOverHF):
    """The step over OpenVINO's paged cache (positional: OV_STEP_INPUTS, then every layer's key cache, then
    every layer's value cache) -> logits [B,V]."""

    kv_layout = "ov-paged"

    def __init__(self, hf_model: nn.Module, shape, max_context: int):
        super().__init__(hf_model, shape, max_context)
        self._indices = None

    def _head_input(self, _module, args):
        if self._indices is not None:  # only the rows whose logits the step returns reach the head
            # index_select: one Gather on the token (batch) axis
            return (torch.index_select(args[0], 0, self._indices), *args[1:])
        return None

    def forward(self, input_ids, positions, past_lens, sb, bi, bib, max_context_len, logits_indices, *caches):
        global _ACTIVE
        n = self.shape.layers
        step = _OVStep(past_lens, sb, bi, bib, max_context_len, list(caches[:n]), list(caches[n:]))
        prev, _ACTIVE, self._indices = _ACTIVE, step, logits_indices
        try:
            with _ov_attention(self.hf):
                out = self.hf(
                    input_ids=input_ids.reshape(-1, 1), position_ids=positions.reshape(-1, 1), use_cache=False
                )
        finally:
            _ACTIVE, self._indices = prev, None
        # [B,1,V] -> [B,V] by a squeeze, not a select: OpenVINO runs a select as a reference Gather that copies
        # the logits (0.8 ms of a 21 ms c32 step on the bench model); a Squeeze is a view.
        return out.logits.squeeze(1)


def sample_ov_step(spec: dict, block_size: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """One mixed step (request 0 decodes after 37 cached tokens, request 1 prefills 5) for tracing."""
    rng = np.random.default_rng(seed)
    past, new = [37, 0], [1, 5]
    blocks = [-(-(p + n) // block_size) for p, n in zip(past, new)]
    nb = sum(blocks) + 1
    ids = rng.integers(0, spec["vocab"], size=(1, sum(new))).astype(np.int64)
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(past, new)])[None].astype(np.int64)
    feeds = {
        "input_ids": ids,
        "positions": pos,
        "past_lens": np.array(past, np.int32),
        "subsequence_begins": np.cumsum([0, *new]).astype(np.int32),
        "block_indices": rng.permutation(nb)[: sum(blocks)].astype(np.int32),
        "block_indices_begins": np.cumsum([0, *blocks]).astype(np.int32),
        "max_context_len": np.array(max(p + n for p, n in zip(past, new)), np.int32),
        "logits_indices": (np.cumsum(new) - 1).astype(np.int64),
    }
    shape = (nb, spec["kv_heads"], block_size, spec["head_size"])
    for kind in ("key_cache", "value_cache"):
        for i in range(spec["layers"]):
            feeds[f"{kind}.{i}"] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _converter(context):
    """precast::ov_paged_attention -> PagedAttentionExtension (the 28-input form of OpenVINO 2026)."""
    import openvino.opset13 as ops
    from openvino.op import _PagedAttentionExtension

    def const(dtype, shape, values=()):
        return ops.constant(np.array(values, dtype=dtype).reshape(shape)).output(0)

    q, k, v, kc, vc, past, sb, bi, bib, mcl = (context.get_input(i) for i in range(10))
    scale = float(context.get_values_from_const_input(10))
    kv_heads = int(context.get_values_from_const_input(12))
    head_size = int(context.get_values_from_const_input(13))
    i32, f32 = np.int32, np.float32
    args = [q, k, v, kc, vc, past, sb, bi, bib]
    args += [const(f32, [], [scale]), const(i32, [], [0]), const(f32, [0]), mcl]  # scale, window, alibi
    args += [const(i32, [0]), const(i32, [0]), const(i32, [0]), const(f32, [0])]  # scores, rotation
    args += [const(f32, [0]), const(i32, [], [0]), const(i32, [], [0])]  # xattention off
    args += [const(f32, [0, 0, 0, 0])]  # no sinks
    args += [const(i32, [], [0]), const(i32, [0]), const(i32, [0]), const(i32, [0])]  # adaptive R-KV off
    args += [const(i32, [0]), const(np.uint8, [0]), const(i32, [0])]  # token types, qq bias off
    node = _PagedAttentionExtension(args)
    rt = node.get_rt_info()  # the CPU plugin sizes its cache blocks from these
    rt["num_k_heads"] = rt["num_v_heads"] = kv_heads
    rt["k_head_size"] = rt["v_head_size"] = head_size
    return [node.output(0)]


def export_ov_step(module: OVDecoder, spec: dict):
    """torch.jit.trace + openvino.convert_model of the step -> ov.Model, inputs named by the contract
    (the caches still f32 [NB,KV,bs,D]: open_cache_inputs before saving)."""
    import openvino as ov
    from openvino.frontend.pytorch import ConversionExtension

    feeds = sample_ov_step(spec)
    names = list(feeds)
    example = tuple(torch.from_numpy(feeds[n]) for n in names)
    ext = ConversionExtension("precast::ov_paged_attention", _converter)
    with torch.no_grad():
        model = ov.convert_model(module, example_input=example, extension=[ext])
    if len(model.inputs) != len(names):
        raise ModelLoadError(f"OpenVINO step graph has {len(model.inputs)} inputs, expected {len(names)}")
    for port, name in zip(model.inputs, names):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    model.outputs[0].get_tensor().set_names({"logits"})
    # A node's rt_info is not saved in the IR; the model's is: the runtime puts these back on each node.
    model.set_rt_info(str(module.kv_heads), [PA_RT_INFO, "num_kv_heads"])
    model.set_rt_info(str(module.head_dim), [PA_RT_INFO, "head_size"])
    model.validate_nodes_and_infer_types()
    kinds = {op.get_type_name() for op in model.get_ordered_ops()}
    if "PagedAttentionExtension" not in kinds:
        raise ModelLoadError("OpenVINO step graph: no attention layer was lowered to PagedAttention")
    return model


OV_BLOCK_SIZE = 32  # the CPU plugin's PagedAttention block (its cache inputs' dim 2 once compiled)


def ov_lowering(folder, hf: nn.Module, spec: dict, max_context: int):
    """Source.lowerings["openvino"]: a callable(progress) -> (ov.Model, its llm block), run only when the
    openvino target builds. Probes the model (generic_decoder.probe) and puts its attention setting back."""
    from precast.compiler.decoder.generic_decoder import probe, restored_attention
    from precast.errors import UsageError
    from precast.runtime.progress import reporter

    def lower(progress=None):
        tell = reporter(progress)
        with restored_attention(hf):
            tell.step("[openvino] probing the model's attention layers")
            shape = probe(hf, str(folder))
        why = ov_refusal(spec.get("model_type") or "?", shape)
        if why:
            raise UsageError(f"{folder}: target 'openvino' cannot lower this model for causal-lm: {why}")
        module = OVDecoder(hf, shape, max_context).eval()
        layers = shape.layers
        llm = {
            **spec,
            "architecture": "generic",
            "layers": layers,
            "heads": shape.heads,
            "kv_heads": shape.kv_heads,
            "head_size": shape.head_size,
            "block_size": OV_BLOCK_SIZE,
            "kv_layout": "ov-paged",
            "kv_inputs": [[f"key_cache.{i}", f"value_cache.{i}"] for i in range(layers)],
            "kv_outputs": [],
            "batched_prefill": True,
            "multi_logits": True,  # logits_indices may list several tokens of a row
        }
        tell.step("[openvino] tracing the step with PagedAttention (openvino.convert_model)")
        return export_ov_step(module, llm), llm

    return lower
