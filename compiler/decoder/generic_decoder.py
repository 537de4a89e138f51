"""The generic paged decoder: the Hugging Face model's own forward, with attention and the cache swapped out.

    input_ids, positions [B,S] ... key_cache.i/value_cache.i [NB,KV,bs,D]   (the paged step contract)
      hf(input_ids, position_ids=positions, use_cache=False)        the model's own embeddings, norms, rotary,
        per layer: attention_interface(module, q, k, v, ...)  ==>   precast_paged_attention (registered below):
                   past = pool[block_tables]; attend q over cat(past, k) with a length + causal mask
                   (+ the layer's sliding window, + its logit softcap); record k, v as new_key.i/new_value.i
        base model output [B,S,E] -> [B,Q,E] at last_index [B,Q]    (a forward hook: the model's own head,
                                                                     final softcap / logit scaling run after)
      logits [B*Q,V], new_key.i/new_value.i [B,KV,S,D]

transformers routes attention through ``ALL_ATTENTION_FUNCTIONS`` keyed by ``config._attn_implementation``;
an implementation that has no mask function registered gets ``attention_mask=None`` (masking_utils skips
mask creation), so the mask is built here from the step's lengths. The step's tensors reach the attention
function through a module-level context set around the forward (tracing is non-strict: plain Python).

Per-architecture code is what ``probe`` reads off one eager forward: layers, KV heads, head size, and each
layer's window and softcap. A model that does not route attention through the interface is refused; one
that does but computes something else is caught by ``check_against_hf`` (exit 2), never shipped.
torch is imported by the caller (this module is only imported on the compile side).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from precast.compiler.decoder.paged_decoder import gather_past, rows_at
from precast.errors import ModelLoadError, ParityError

__all__ = [
    "ATTN_IMPLEMENTATION",
    "EXPERTS_IMPLEMENTATION",
    "DecoderOverHF",
    "export_moe_op",
    "GenericDecoder",
    "attention_setting",
    "check_against_hf",
    "in_step",
    "probe",
    "register",
    "restored_attention",
    "set_attention",
]

ATTN_IMPLEMENTATION = "precast_paged"
EXPERTS_IMPLEMENTATION = "precast_dense"
_NEG = torch.finfo(torch.float32).min


@dataclass
class _Step:
    """What one forward step's attention calls read (the pool, tables, lengths) and write (new K/V)."""

    past_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    key_caches: list | None = None
    value_caches: list | None = None
    probe: bool = False  # no pool: attend over the new tokens only, record each layer's shapes and options
    calls: int = 0
    head_seen: bool = False
    new_keys: dict = field(default_factory=dict)
    new_values: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)  # probe: (kv_heads, head_size, window, softcap) per call
    # recurrent-state layers (recurrent.py): the rows' real new tokens, each state in ((kind, layer, index)
    # -> [B, *shape]) and after the step; the probe records each one's StateLayer
    new_lens: torch.Tensor | None = None
    states: dict = field(default_factory=dict)
    new_states: dict = field(default_factory=dict)
    state_layers: dict = field(default_factory=dict)
    conv_layer: int = -1  # the layer of the last convolution (the gated delta rule's, recurrent.py)
    kv_index: dict = field(default_factory=dict)  # model layer index -> its pool (hybrids: attention only)


_ACTIVE: _Step | None = None


def current_step() -> _Step | None:
    """The precast step running now (None outside one)."""
    return _ACTIVE


def in_step() -> bool:
    """Whether a precast step is running (its attention calls go to the pool); outside one, a swapped
    attention module runs the model's own forward (attention_swaps.py)."""
    return _ACTIVE is not None


@contextlib.contextmanager
def _active(step: _Step):
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, step
    try:
        yield step
    finally:
        _ACTIVE = prev


def _positions(past_lens: torch.Tensor, s: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions [B,S] (past_lens[b]+s) and key positions [B,P+S]: key j < P is past position j, key
    P+t the new token at past_lens[b]+t."""
    dev = past_lens.device
    q_pos = past_lens[:, None] + torch.arange(s, device=dev)[None, :]
    j = torch.arange(p, device=dev)[None, :]
    return q_pos, torch.cat([j.expand(past_lens.shape[0], p), q_pos], dim=1)


def _mask(past_lens: torch.Tensor, s: int, p: int, window: int | None) -> torch.Tensor:
    """Bool [B,1,S,P+S]. Key j < P is past position j (valid iff j < past_lens[b]); key P+t is the new token
    at position past_lens[b]+t. Query s sits at past_lens[b]+s and sees keys at or before it, and with a
    window only those less than ``window`` positions back (HF: kv_idx > q_idx - sliding_window)."""
    dev = past_lens.device
    q_pos, k_pos = _positions(past_lens, s, p)
    j = torch.arange(p, device=dev)[None, :]
    k_ok = torch.cat([j < past_lens[:, None], torch.ones_like(q_pos, dtype=torch.bool)], dim=1)
    ok = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_ok[:, None, :]  # [B,S,P+S]
    if window is not None:
        ok = ok & (k_pos[:, None, :] > q_pos[:, :, None] - int(window))
    return ok[:, None]


def _same_chunk(past_lens: torch.Tensor, s: int, p: int, chunk: int) -> torch.Tensor:
    """Bool [B,1,S,P+S]: key and query in the same chunk of ``chunk`` positions (Llama 4's chunked layers)."""
    q_pos, k_pos = _positions(past_lens, s, p)
    return k_pos[:, None, None, :] // chunk == q_pos[:, None, :, None] // chunk


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B,KV,N,D] -> [B,H,N,D]: head i reads KV head i // (H/KV), as HF's repeat_kv."""
    b, kv, n, d = t.shape
    return t if kv == heads else t[:, :, None].expand(b, kv, heads // kv, n, d).reshape(b, heads, n, d)


def precast_paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    **kwargs,
):
    """q [B,H,S,D], new k/v [B,KV,S,D] (after the model's rotary / qk-norm) -> ([B,S,H,D], None).

    ``alibi_slopes`` [H] (BLOOM, MPT, from attention_swaps): score[h, q, k] += slope[h] * position of key k, as
    the model's alibi tensor (softmax is shift-invariant per query, so absolute key positions are exact).
    ``attention_chunk`` (Llama 4's chunked layers, from attention_swaps): a query sees only the keys of its own
    chunk of positions (HF: kv_idx // chunk == q_idx // chunk). ``s_aux`` / ``sinks`` [H] (gpt-oss's attention
    sinks): a per-head logit joins each query's softmax and its probability is dropped."""
    step = _ACTIVE
    if step is None:
        raise RuntimeError("precast_paged attention called outside a precast step")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss: a learned logit per head
    if attention_mask is not None and attention_mask.dtype != torch.bool and not step.probe:
        # an additive bias the model built itself (ALiBi-style): not reproduced here
        raise ModelLoadError("models that pass their own attention bias are not supported for task causal-lm")
    idx = getattr(module, "layer_idx", None)
    i = idx if isinstance(idx, int) else step.calls
    step.calls += 1
    if not step.probe:
        i = step.kv_index.get(i, i)
    b, h, s, d = query.shape
    kv = key.shape[1]
    if scaling is None:
        scaling = d**-0.5
    window = int(sliding_window) if sliding_window else None
    if getattr(module, "precast_latent", False) and value.shape[-1] == 0:
        return _latent_attention(module, step, i, query, key, value, scaling)
    if step.probe:
        step.layers.append(
            (
                i,
                kv,
                key.shape[-1],
                value.shape[-1],
                window,
                float(softcap) if softcap else None,
                sinks is not None,
            )
        )
        keys, values = key, value
        past_lens = torch.zeros(b, dtype=torch.long, device=query.device)
        mask = _mask(past_lens, s, 0, window)
    else:
        past_lens = step.past_lens
        dv = value.shape[-1]
        if (
            dv < key.shape[-1]
        ):  # multi-head latent attention (DeepSeek): V heads padded to K's size in the pool
            value = torch.nn.functional.pad(value, (0, key.shape[-1] - dv))
        step.new_keys[i], step.new_values[i] = key, value
        keys = torch.cat([gather_past(step.key_caches[i], step.block_tables), key], dim=2)
        values = torch.cat([gather_past(step.value_caches[i], step.block_tables), value], dim=2)[..., :dv]
        p = keys.shape[2] - s
        mask = _mask(step.past_lens, s, p, window)
    if attention_chunk:
        mask = mask & _same_chunk(past_lens, s, keys.shape[2] - s, int(attention_chunk))
    keys, values = _repeat_kv(keys, h), _repeat_kv(values, h)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        k_pos = _positions(past_lens, s, keys.shape[2] - s)[1].to(scores.dtype)  # [B,P+S]
        scores = scores + alibi_slopes.to(scores.dtype)[None, :, None, None] * k_pos[:, None, None, :]
    scores = torch.where(mask, scores, torch.full_like(scores, _NEG))
    if sinks is not None:
        # attention sinks (gpt-oss): one more logit per head in each softmax, attending to nothing: it takes
        # its share of the probability mass, and its column is dropped (HF's eager_attention_forward)
        sink = sinks.reshape(1, h, 1, 1).to(scores.dtype).expand(b, h, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(query.dtype)
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, values).transpose(1, 2).contiguous(), None


def _latent_expand(module: nn.Module, k_nope: torch.Tensor, k_rot: torch.Tensor):
    """DeepSeek's ``expand_kv`` inside a precast step: the latent itself, not K/V expanded per head.
    ``key`` [B,1,S,r+rope] = the normalized compressed latent and the rotary key (what the pool stores: one
    head per token), ``value`` [B,1,S,0] (none: the values are the latent). Outside a step, the model's own."""
    if not in_step():
        return type(module).expand_kv(module, k_nope, k_rot)
    return torch.cat([k_nope, k_rot], dim=-1), k_nope[..., :0]


def _latent_layers(hf: nn.Module) -> None:
    """Point every multi-head latent attention module (a ``kv_b_proj`` and an ``expand_kv`` method: DeepSeek-V2
    / V3) at the latent cache for precast's steps."""
    for m in hf.modules():
        if hasattr(m, "kv_b_proj") and callable(getattr(type(m), "expand_kv", None)):
            m.expand_kv = _latent_expand.__get__(m)
            m.precast_latent = True


def _latent_attention(module, step: _Step, i: int, query, key, value, scaling: float):
    """Multi-head latent attention over the latent cache, absorbed (as DeepSeek's own inference and llama.cpp):

        kv_b_proj [H*(nope+v), r] -> W_UK [H,nope,r], W_UV [H,v,r]
        scores = (q_nope W_UK) . latent + q_rope . k_rope       (= q_nope . (latent W_UK^T) + q_rope . k_rope)
        out    = (probs @ latent) W_UV^T                          (= probs @ (latent W_UV^T))

    query [B,H,S,nope+rope], key [B,1,S,r+rope] (this step's latent and rotary key), value [B,1,S,0]. The
    pool holds r+rope floats a token and layer, not 2 x H x (nope+rope)."""
    b, h, s, _ = query.shape
    r = int(module.kv_lora_rank)
    nope, vd = int(module.qk_nope_head_dim), int(module.v_head_dim)
    if step.probe:
        step.layers.append((i, 1, key.shape[-1], 0, None, None, False))
        keys, past_lens = key, torch.zeros(b, dtype=torch.long, device=query.device)
    else:
        step.new_keys[i], step.new_values[i] = key, value
        keys, past_lens = (
            torch.cat([gather_past(step.key_caches[i], step.block_tables), key], dim=2),
            step.past_lens,
        )
    w = module.kv_b_proj.weight.reshape(h, nope + vd, r)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H,nope,r], [H,v,r]
    q_lat = torch.matmul(query[..., :nope], w_uk)  # [B,H,S,r]
    q = torch.cat([q_lat, query[..., nope:]], dim=-1)  # [B,H,S,r+rope]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling  # [B,H,S,P+S] (the one K head broadcast)
    mask = _mask(past_lens, s, keys.shape[2] - s, None)
    scores = torch.where(mask, scores, torch.full_like(scores, _NEG))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out_lat = torch.matmul(probs, keys[..., :r])  # [B,H,S,r]
    out = torch.matmul(out_lat, w_uv.transpose(1, 2))  # [B,H,S,v]
    return out.transpose(1, 2).contiguous(), None


# inside export_moe_op(): eligible experts trace to precast::moe (ONNX Runtime's MoE kernel). A context
# variable, so that a conversion traced on another thread meanwhile (OpenVINO's) keeps the dense experts.
_MOE_OP: contextvars.ContextVar[bool] = contextvars.ContextVar("precast_moe_op", default=False)


@contextlib.contextmanager
def export_moe_op():
    """While an ONNX Runtime step graph is exported: SwiGLU experts (the default gate, silu(gate) * up, or
    gpt-oss's clamped one; see _moe_weights) trace to precast::moe, which computes only the picked experts
    (compiler/decoder/paged_ops.py). Outside it (the eager checks, OpenVINO's conversion) every expert runs
    on every token, as below."""
    token = _MOE_OP.set(True)
    try:
        yield
    finally:
        _MOE_OP.reset(token)


def _moe_weights(experts: nn.Module) -> dict | None:
    """precast::moe's weights and gate constants for experts the MoE kernel computes exactly, else None:
    the default gate (silu(gate) * up, [gate; up] concatenated, no biases) or gpt-oss's (gate and up
    interleaved, clamped at its limit, (up + 1) * gate * sigmoid(alpha * gate), biases); no post-expert norm.
    fc1 [E,2I,H] has gate and up rows interleaved, fc2 is [E,H,I]. Computed from the module's weights at each
    call (no cache: under the exporter they are its placeholders; the reshapes over initializers fold)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    if not getattr(experts, "has_gate", False) or getattr(experts, "has_post_expert_norm", False):
        return None
    gate_fn = getattr(type(experts), "_apply_gate", None)
    bias = getattr(experts, "has_bias", False)
    if gate_fn is _default_apply_gate:
        silu = type(getattr(experts, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        if not silu or bias or not getattr(experts, "is_concatenated", True):
            return None
        constants = {"alpha": 1.0, "beta": 0.0, "limit": 0.0}
    elif type(experts).__name__ == "GptOssExperts" and not getattr(experts, "is_concatenated", True):
        limit = float(experts.limit)
        if not limit > 0:
            return None
        constants = {"alpha": float(experts.alpha), "beta": 1.0, "limit": limit}
    else:
        return None
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False):  # [E,H,2I], [E,I,H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if getattr(experts, "is_concatenated", True):  # [gate; up] -> rows interleaved
        gate, up = gate_up.chunk(2, dim=1)  # [E,I,H] each
        gate_up = torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2])
    biases = (experts.gate_up_proj_bias, experts.down_proj_bias) if bias else (None, None)
    return {"fc1": gate_up, "fc2": down, "fc1_bias": biases[0], "fc2_bias": biases[1], **constants}


def precast_dense_experts(self: nn.Module, hidden_states, top_k_index, top_k_weights):
    """A mixture of experts without data-dependent shapes: every expert on every token as one batched MatMul
    over the stacked weights, weighted by the routing (zero for an expert a token did not pick).

        x [T,H], top_k_index/weights [T,K] (the model's own router: softmax, top-k, renormalisation)
        route [E,T]  = sum_k (top_k_index[:,k] == e) * top_k_weights[:,k]
        up    [E,T,*] = x @ gate_up_proj[e]^T (+ bias) -> the model's gate (act(gate) * up) or act
        out   [T,H]   = sum_e route[e] * (up @ down_proj[e]^T (+ bias))

    The same products and weights as transformers' eager loop (index / where / index_add per hit expert),
    which the exporter cannot take; only the order of the final sum differs. E times the expert FLOPs of a
    top-k dispatch: what OpenVINO's step and experts the MoE kernel cannot express run; an ONNX Runtime step
    of SwiGLU experts runs only the picked ones (export_moe_op)."""
    if _MOE_OP.get() and hidden_states.dtype == torch.float32:
        weights = _moe_weights(self)
        if weights is not None:
            from precast.compiler.decoder.paged_ops import moe

            k = int(top_k_index.shape[1])
            return moe(hidden_states, top_k_index.long(), top_k_weights.float(), k=k, **weights)
    e = int(self.num_experts)
    experts = torch.arange(e, device=top_k_index.device)
    hit = top_k_index[None] == experts[:, None, None]  # [E,T,K]
    route = torch.where(hit, top_k_weights[None], torch.zeros_like(top_k_weights[None])).sum(-1)  # [E,T]

    def linear(x, w, b):
        y = torch.matmul(x, w if self.is_transposed else w.transpose(1, 2))
        return y if b is None else y + b[:, None, :]

    has_bias = getattr(self, "has_bias", False)
    # x broadcast to [E,T,H] explicitly: OpenVINO's CPU plugin turns x[None] @ w[E] into a FullyConnected
    # that expects a batch of E at run time and fails on the broadcast batch of 1 (ONNX Runtime takes both)
    x = hidden_states[None].expand(e, -1, -1)
    if self.has_gate:
        up = self._apply_gate(linear(x, self.gate_up_proj, self.gate_up_proj_bias if has_bias else None))
    else:
        up = self.act_fn(linear(x, self.up_proj, self.up_proj_bias if has_bias else None))
    out = linear(up, self.down_proj, self.down_proj_bias if has_bias else None)  # [E,T,H]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    # where, not a product: an unpicked expert's output never reaches the sum (no 0 * inf)
    out = torch.where(hit.any(-1)[..., None], out * route[..., None], torch.zeros_like(out))
    return out.sum(0).to(hidden_states.dtype)


def register() -> None:
    """Register ``precast_paged`` (attention) and ``precast_dense`` (experts) in transformers (idempotent)."""
    from transformers import AttentionInterface

    from precast.compiler.decoder.recurrent import install

    AttentionInterface.register(ATTN_IMPLEMENTATION, precast_paged_attention)
    install()
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # transformers without the experts interface: MoE models keep their own forward
        return
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, precast_dense_experts)


def set_attention(hf: nn.Module, name: str, experts: str | None = None) -> None:
    """Point the model (and any sub-config) at attention implementation ``name`` (and experts ``experts``).

    Sets transformers' config fields ``_attn_implementation`` / ``_experts_implementation`` directly: its
    public ``PreTrainedModel.set_attn_implementation`` validates the name and skips (with a warning) the models
    whose source does not call the attention interface (BLOOM, whose attention precast swaps itself), so it
    would not do the same. This function and ``attention_setting`` are the only places that touch them."""
    for mod in hf.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name
        if experts is not None and cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = experts


def attention_setting(hf: nn.Module) -> tuple[str, str | None]:
    """The model's (attention, experts) implementations, as ``set_attention`` takes them back."""
    cfg = hf.config
    return cfg._attn_implementation, getattr(cfg, "_experts_implementation", None)


@contextlib.contextmanager
def restored_attention(hf: nn.Module):
    """Put the model's attention setting back when the block ends (the model is shared between the decoders of
    one compile: the ort-cpu one and the OpenVINO one)."""
    before = attention_setting(hf)
    try:
        yield
    finally:
        set_attention(hf, *before)


class DecoderOverHF(nn.Module):
    """What a step module over the model's own forward holds: the model, its probed shape and the context it
    serves; and a hook on the model's own lm head, where the subclass's ``_head_input`` picks the rows whose
    logits the step returns (the head, and any softcap or scaling after it, then runs on those rows only)."""

    def __init__(self, hf_model: nn.Module, shape: DecoderShape, max_context: int):
        super().__init__()
        self.hf = hf_model
        self.shape = shape
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_size
        self.layers = range(shape.layers)  # llm_block counts them
        self.max_context = max_context
        head = hf_model.get_output_embeddings()
        if head is None:
            raise ModelLoadError(f"{type(hf_model).__name__} has no output embeddings (lm head)")
        head.register_forward_pre_hook(self._head_input)

    def _head_input(self, _module, args):
        return None  # (the head's input unchanged)


@dataclass(frozen=True)
class DecoderShape:
    """What the ``llm`` block needs, read off one forward of the model."""

    layers: int  # layers with a K/V cache (a hybrid's attention layers; 0 for a state-space model)
    heads: int
    kv_heads: int
    head_size: int
    windows: tuple  # per layer: sliding window or None
    softcaps: tuple
    sinks: tuple = ()  # per layer: whether it has attention sinks (gpt-oss)
    # V's head size when smaller than K's (multi-head latent attention, DeepSeek: K 48 = 32 nope + 16 rope, V 32):
    # the pool holds V padded to head_size, the attention reads its first value_size columns
    value_size: int | None = None
    # the model's index of each K/V layer (a hybrid's attention layers among its recurrent ones); () = 0..layers-1
    attention_layers: tuple = ()
    # recurrent states (recurrent.StateLayer: Mamba mixers, short convolutions), in the step graph's order
    states: tuple = ()


def _family(hf: nn.Module) -> str:
    cfg = hf.config.get_text_config()
    return f"'{getattr(cfg, 'model_type', None) or type(hf).__name__}'"


def probe(hf: nn.Module, where: str) -> DecoderShape:
    """One eager forward of 4 tokens through the registered attention and recurrent functions: the model's
    attention layers (heads, options) and recurrent states."""
    from precast.compiler.decoder.attention_swaps import swap_attention

    cfg = hf.config.get_text_config()
    family = _family(hf)
    register()
    swap_attention(hf)  # falcon / bloom: their own attention code, pointed at precast_paged_attention
    _latent_layers(hf)  # DeepSeek's multi-head latent attention: the pool holds the latent
    set_attention(hf, ATTN_IMPLEMENTATION, EXPERTS_IMPLEMENTATION)
    step = _Step(probe=True)
    ids = torch.arange(4)[None] % int(cfg.vocab_size)
    recurrent = _recurrent_layers(hf)
    try:
        with torch.no_grad(), _active(step):
            hf(input_ids=ids, position_ids=torch.arange(4)[None], use_cache=False)
    except Exception as e:  # (a recurrent layer's own code ran on precast's step, and failed there)
        if not recurrent:
            raise
        raise ModelLoadError(_unrouted(where, family, cfg, recurrent, set(recurrent))) from e
    states = tuple(step.state_layers[k] for k in sorted(step.state_layers, key=lambda k: (k[1], k[0], k[2])))
    kinds: dict[int, set] = {}
    for st in states:
        kinds.setdefault(st.layer, set()).add(st.kind)
    # a short convolution holds a conv state; a Mamba mixer or gated delta net a conv and a scan state: a
    # layer with fewer kept part of its state outside the step (a function precast does not route)
    unrouted = {
        i
        for i, name in recurrent.items()
        if kinds.get(i, set()) < ({"conv"} if "ShortConv" in name else {"conv", "ssm"})
    }
    if unrouted:
        raise ModelLoadError(_unrouted(where, family, cfg, recurrent, unrouted))
    layers = sorted(step.layers)
    n_layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    attn = [e[0] for e in layers]
    if not layers and not states:
        raise ModelLoadError(
            f"{where}: {family} has no attention layer that goes through transformers' attention interface "
            "(needed for task causal-lm)"
        )
    stateful = {s.layer for s in states}
    if len(set(attn)) != len(attn) or (
        n_layers and any(i not in stateful and i not in attn for i in range(n_layers))
    ):
        others = [
            i for i in range(max(n_layers, max(attn, default=0) + 1)) if i not in attn and i not in stateful
        ]
        raise ModelLoadError(
            f"{where}: {family} is a hybrid model: layers {others} are {_layer_kinds(cfg, others)}, neither "
            "attention with a K/V cache nor a recurrent layer precast routes; not supported for task causal-lm yet"
        )
    if not layers:  # a state-space model: no K/V pool (its sizes are placeholders the runner never reads)
        return DecoderShape(0, 1, 1, 1, (), (), (), None, (), states)
    shapes = {(e[1], e[2], e[3]) for e in layers}
    if any(e[2] < e[3] for e in layers):
        k, v = layers[0][2], layers[0][3]
        raise ModelLoadError(
            f"{where}: {family} has K heads of size {k} and larger V heads of size {v}; the paged cache holds "
            "V padded to K's head size; not supported for task causal-lm yet"
        )
    if len(shapes) != 1:
        raise ModelLoadError(
            f"{where}: {family} has layers with different K/V shapes (kv heads, head size): {sorted(shapes)}; "
            "not supported for task causal-lm yet"
        )
    kv, d, dv = shapes.pop()
    heads = int(cfg.num_attention_heads)
    return DecoderShape(
        layers=len(layers),
        heads=heads,
        kv_heads=kv,
        head_size=d,
        windows=tuple(e[4] for e in layers),
        softcaps=tuple(e[5] for e in layers),
        sinks=tuple(e[6] for e in layers),
        value_size=dv,
        attention_layers=tuple(attn) if states else (),
        states=states,
    )


# Layers whose per-request state is a recurrent one (Mamba / Mamba2 mixers, LFM2's short convolutions,
# Qwen3-Next's gated delta net, linear attention): the paged K/V cache cannot hold it.
_RECURRENT = re.compile(r"Mixer$|ShortConv|GatedDeltaNet|LinearAttention")


def _recurrent_layers(hf: nn.Module) -> dict[int, str]:
    """Layer index -> class name of each recurrent-state module (by its ``layer_idx``)."""
    out = {}
    for m in hf.modules():
        name = type(m).__name__
        idx = getattr(m, "layer_idx", None)
        if _RECURRENT.search(name) and isinstance(idx, int):
            out[idx] = name
    return out


def _unrouted(where: str, family: str, cfg, recurrent: dict, layers: set) -> str:
    indices = sorted(layers)
    kinds = ", ".join(sorted({recurrent[i] for i in indices}))
    return (
        f"{where}: {family} has recurrent-state layers precast cannot serve yet: layers {indices} are "
        f"{_layer_kinds(cfg, indices)} ({kinds}); precast routes Mamba / Mamba2 mixers and short convolutions "
        "(docs/llm-step-contract.md); not supported for task causal-lm"
    )


def _layer_kinds(cfg, indices: list[int]) -> str:
    """What the config says layers ``indices`` are (Jamba's layers_block_type, LFM2 / Qwen3-Next's layer_types),
    e.g. "mamba" or "conv, linear_attention"; "not attention layers" when it does not say."""
    types = getattr(cfg, "layers_block_type", None) or getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and all(i < len(types) for i in indices):
        return ", ".join(sorted({str(types[i]) for i in indices})) + " layers"
    return "layers of another kind"


class GenericDecoder(DecoderOverHF):
    """Any causal LM whose attention goes through transformers' interface, over the paged pool."""

    kv_layout = "paged"
    multi_logits = True  # a last_index [B,Q] input -> logits [B*Q,V] (speculative verification)

    def __init__(self, hf_model: nn.Module, shape: DecoderShape, max_context: int):
        super().__init__(hf_model, shape, max_context)
        self._step: _Step | None = None
        self._last_index = None

    def _head_input(self, _module, args):
        # Only the rows whose logits the step returns reach the model's own head (the softcap / scaling
        # after it run on [B,Q,V]). A hook on the head's input, not the base model's output: some models
        # (OPT) call a submodule of the base model directly.
        if self._step is not None and self._last_index is not None:
            self._step.head_seen = True
            return (rows_at(args[0], self._last_index), *args[1:])
        return None

    def forward(
        self,
        input_ids,
        positions,
        past_lens,
        new_lens,
        block_tables,
        key_caches: list,
        value_caches: list,
        last_index=None,
        states: list | None = None,
    ):
        """The paged step (docs/llm-step-contract.md). ``last_index`` [B,Q] int64: the rows whose logits come
        back, as [B*Q, V] (row b's Q back to back); None: each request's last real new token (Q = 1).
        ``states``: each of ``shape.states``' [B, *shape] (a hybrid or state-space model's recurrent states)."""
        if last_index is None:
            last_index = (new_lens - 1)[:, None]
        step = _Step(past_lens, block_tables, list(key_caches), list(value_caches))
        step.new_lens = new_lens
        step.kv_index = {layer: j for j, layer in enumerate(self.shape.attention_layers)}
        if self.shape.states:
            if states is None or len(states) != len(self.shape.states):
                raise ValueError(f"the step takes {len(self.shape.states)} recurrent states")
            step.states = {(s.kind, s.layer, s.index): t for s, t in zip(self.shape.states, states)}
        self._step, self._last_index = step, last_index
        try:
            with _active(step):
                out = self.hf(input_ids=input_ids, position_ids=positions, use_cache=False)
        finally:
            self._step = self._last_index = None
        if not step.head_seen:
            raise ModelLoadError(f"{type(self.hf).__name__}: its forward does not call its lm head module")
        logits = out.logits.reshape(-1, out.logits.shape[-1])
        n = self.shape.layers
        kv = [t for i in range(n) for t in (step.new_keys[i], step.new_values[i])]
        return (logits, *kv, *(step.new_states[(s.kind, s.layer, s.index)] for s in self.shape.states))


def check_against_hf(module: GenericDecoder, hf_eager_attn: str, where: str, block_size: int) -> None:
    """Greedy-free self check before export: the paged decoder over a pool (prefill in two chunks, then
    decode steps) gives the logits of the model's own forward (``hf_eager_attn``, e.g. 'eager') on the
    whole sequence. Prompt longer than the smallest window, so windows are exercised; recurrent states carry
    from step to step as the runner's slots would. -> ParityError."""
    hf = module.hf
    windows = [w for w in module.shape.windows if w]
    n = min(max(24, (min(windows) + 8) if windows else 0), 80)
    gen = torch.Generator().manual_seed(0)
    vocab = int(hf.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (1, n), generator=gen)
    layers = module.shape.layers

    def zero_states(b: int) -> list:
        return [torch.zeros(b, *st.shape) for st in module.shape.states]

    with torch.no_grad():
        set_attention(hf, hf_eager_attn, "eager")  # the model's own attention and expert loop
        try:
            ref = hf(input_ids=ids, use_cache=False).logits[0]  # [n, V]
        finally:
            set_attention(hf, ATTN_IMPLEMENTATION, EXPERTS_IMPLEMENTATION)
        nb = -(-n // block_size) + 1
        shape = (nb, module.kv_heads, block_size, module.head_dim)
        v_shape = shape[:-1] + ((0,) if module.shape.value_size == 0 else shape[-1:])  # (latent: no V)
        kc = [torch.zeros(shape) for _ in range(layers)]
        vc = [torch.zeros(v_shape) for _ in range(layers)]
        table = torch.randperm(nb, generator=gen)[None, : nb - 1]
        cut = [0, n // 2, n - 3, n - 2, n - 1, n]  # two prefill chunks, then three decode steps
        worst = 0.0
        states = zero_states(1)
        for a, e in zip(cut, cut[1:]):
            pos = torch.arange(a, e)[None]
            out = module(
                ids[:, a:e], pos, torch.tensor([a]), torch.tensor([e - a]), table, kc, vc, None, states
            )
            for i in range(layers):
                for pool, new in ((kc[i], out[1 + 2 * i]), (vc[i], out[2 + 2 * i])):
                    for t in range(e - a):
                        p = a + t
                        pool[table[0, p // block_size], :, p % block_size] = new[0, :, t]
            states = list(out[1 + 2 * layers :])
            got, want = out[0][0], ref[e - 1]
            worst = max(worst, float((got - want).abs().max() / (want.abs().max() + 1e-6)))
        # A padded batch: row 1 holds 5 real tokens of S (what batched prefill looks like), and the states
        # it leaves are those of its 5 tokens alone.
        s = n // 2
        pad = torch.zeros(1, s, dtype=torch.long)
        batch_ids = torch.cat([ids[:, :s], torch.cat([ids[:, :5], pad[:, 5:]], 1)])
        batch_pos = torch.cat([torch.arange(s)[None], torch.cat([torch.arange(5), pad[0, 5:]])[None]])
        tables = torch.cat([table, table.flip(1)])
        zero_k = [torch.zeros(shape) for _ in range(layers)]
        zero_v = [torch.zeros(v_shape) for _ in range(layers)]
        args = (batch_ids, batch_pos, torch.tensor([0, 0]), torch.tensor([s, 5]), tables, zero_k, zero_v)
        out = module(*args, None, zero_states(2))
        for got, want in ((out[0][0], ref[s - 1]), (out[0][1], ref[4])):
            worst = max(worst, float((got - want).abs().max() / (want.abs().max() + 1e-6)))
        if module.shape.states:  # row 1's states, one more token on: the logits of token 5
            one = [torch.zeros(shape if j % 2 == 0 else v_shape) for j in range(2 * layers)]  # row 1's K/V
            for i in range(2 * layers):
                for t in range(5):
                    one[i][tables[1, t // block_size], :, t % block_size] = out[1 + i][1, :, t]
            row = [st[1:2] for st in out[1 + 2 * layers :]]
            nxt = module(
                ids[:, 5:6],
                torch.tensor([[5]]),
                torch.tensor([5]),
                torch.tensor([1]),
                tables[1:2],
                one[0::2],
                one[1::2],
                None,
                row,
            )
            got, want = nxt[0][0], ref[5]
            worst = max(worst, float((got - want).abs().max() / (want.abs().max() + 1e-6)))
    if worst > 1e-3:
        raise ParityError(
            f"{where}: the paged decoder's logits differ from the model's own forward "
            f"(max relative error {worst:.2e}); this architecture is not supported for task causal-lm"
        )
