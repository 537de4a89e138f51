"""Recurrent-state layers on the generic path: Mamba / Mamba2 mixers and short convolutions over state slots.

transformers routes every recurrent layer of these families through module-level functions it lets a
runtime replace (``use_kernel_forward_from_hub``), each reading and writing its state in the model's cache:

    causal_conv1d_forward(conv1d, x [B,C,S], cache, layer_idx, activation, state_idx)   mamba, mamba2, jamba,
                                                                                        falcon_h1, lfm2, ...
    mamba_scan_forward(mixer, x [B,I,S], time_step, B, C, gate, cache)                  mamba, jamba
    mamba2_scan_forward(mixer, x [B,S,H*P], B, C, dt, cache)                            mamba2, falcon_h1
    torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state)                       qwen3_next

Inside a precast step (generic_decoder._Step) ``install`` points them at the versions below, which read each
request's state from the step's inputs instead (``states``: one [B, *shape] tensor per state, what the
runner gathered from the request's state slot; zeros for a request that starts at position 0) and record the
state after each row's last real new token (``new_states``). Outside a step the model's own functions run.

    conv:  state [B, C, K-1] = the last K-1 inputs; out = conv1d(cat(state, x)); new state = the K-1 inputs
           ending at row b's new_lens[b]-th token (right padding never enters a state)
    ssm:   h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,  y_t = C_t . h_t + D x_t          (Mamba: h [B,I,N];
           Mamba2: h [B,H,P,N], A one scalar per head)   as an ONNX Scan over the new tokens (torch's
           ``scan`` higher-order op, which the dynamo exporter lowers to Scan); a padded token leaves h as is

The state of a Mamba layer is a few KiB per channel whatever the context: a fixed-size slot per request
(docs/llm-step-contract.md, "Recurrent state"), not per-token blocks.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

__all__ = ["FAMILIES", "StateLayer", "install"]

# transformers modules whose recurrent layers go through the functions above (the ones precast replaces)
FAMILIES = (
    "mamba",
    "mamba2",
    "jamba",
    "falcon_h1",
    "lfm2",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "qwen3_next",
)
_FUNCTIONS = (
    "causal_conv1d_forward",
    "mamba_scan_forward",
    "mamba2_scan_forward",
    "torch_chunk_gated_delta_rule",
)


@dataclass(frozen=True)
class StateLayer:
    """One recurrent state of one layer: ``kind`` "conv" (the last K-1 inputs of a causal convolution) or
    "ssm" (a selective scan's state); ``shape`` without the batch dim."""

    layer: int
    kind: str
    index: int
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        """The step graph's input (``conv_state.3``); its output is ``new_`` + this."""
        return f"{self.kind}_state.{self.layer}" + (f".{self.index}" if self.index else "")


def _step():
    from precast.compiler.decoder.generic_decoder import current_step

    return current_step()


def _state(step, kind: str, layer: int, index: int, shape: tuple[int, ...], like: torch.Tensor):
    """The state the step hands this layer (probe: zeros, and the layer recorded)."""
    key = (kind, int(layer), int(index))
    if step.probe:
        step.state_layers[key] = StateLayer(int(layer), kind, int(index), tuple(int(d) for d in shape[1:]))
        return torch.zeros(shape, dtype=torch.float32, device=like.device)
    return step.states[key]


def _valid(step, b: int, s: int, device) -> torch.Tensor:
    """Bool [B,S]: token s of row b is real (s < new_lens[b]); the probe's rows are all real."""
    if step.probe:
        return torch.ones(b, s, dtype=torch.bool, device=device)
    return torch.arange(s, device=device)[None, :] < step.new_lens[:, None]


def precast_causal_conv1d(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs):
    """x [B,C,S] -> [B,C,S] over the request's conv state (the module doc)."""
    from transformers.activations import ACT2FN

    step = _step()
    step.conv_layer = int(layer_idx)
    b, c, s = hidden_states.shape
    k = int(conv1d.kernel_size[0])
    prev = _state(step, "conv", layer_idx, state_idx, (b, c, k - 1), hidden_states)
    xx = torch.cat([prev.to(hidden_states.dtype), hidden_states], dim=-1)  # [B,C,K-1+S]
    # the depthwise convolution as one gather of every output's K inputs and a weighted sum: ONNX Runtime's
    # grouped Conv runs one small GEMM per channel (1536 of them in Mamba-130m: 0.1 ms a layer for one token)
    taps = torch.arange(s, device=xx.device)[:, None] + torch.arange(k, device=xx.device)[None, :]  # [S,K]
    out = (xx[:, :, taps] * conv1d.weight[:, 0, :][None, :, None, :]).sum(-1)  # [B,C,S,K] -> [B,C,S]
    if conv1d.bias is not None:
        out = out + conv1d.bias[None, :, None]
    if step.probe:
        new_lens = torch.full((b,), s, dtype=torch.long, device=xx.device)
    else:
        new_lens = step.new_lens
    # the K-1 inputs before row b's first unused column: xx[:, :, n_b : n_b + K-1]
    idx = (new_lens[:, None] + torch.arange(k - 1, device=xx.device)[None, :])[:, None, :]
    step.new_states[("conv", int(layer_idx), int(state_idx))] = torch.gather(xx, 2, idx.expand(b, c, k - 1))
    if activation is not None:
        out = ACT2FN[activation](out)
    return out


def precast_mamba_scan(module, hidden_states, time_step, B, C, gate, cache, **kwargs):
    """Mamba's selective scan over the request's state: x, time_step, gate [B,I,S], B, C [B,S,N] -> [B,I,S]
    (the D skip connection and the silu(gate) product included, as transformers' mamba_scan_forward).

    Written for ONNX Runtime's per-node cost (a decode step runs ~50 small nodes a layer): every token's
    decay and input at once ([S,B,I,N]: the scan reads axis 0, where ONNX Runtime's Scan slices without
    copying), its body one multiply-add and the output's contraction."""
    step = _step()
    b, i, s = hidden_states.shape
    n = int(module.ssm_state_size)
    a = -torch.exp(module.A_log.float())  # [I,N]
    dt = time_step.float().transpose(1, 2)  # [B,S,I]
    if module.dt_proj.bias is not None:
        dt = dt + module.dt_proj.bias.float()
    # a padded token gets dt 0: decay exp(0) = 1 and input 0, so it leaves the state as it is
    dt = F.softplus(dt) * _valid(step, b, s, hidden_states.device)[..., None].float()
    h0 = _state(step, "ssm", module.layer_idx, 0, (b, i, n), hidden_states)
    x = hidden_states.float().transpose(1, 2)  # [B,S,I]
    dt_s = dt.transpose(0, 1)[..., None]  # [S,B,I,1]
    decay = torch.exp(dt_s * a)
    u = (dt_s * x.transpose(0, 1)[..., None]) * B.float().transpose(0, 1)[:, :, None, :]

    def body(h, xs):
        decay_t, u_t, c_t = xs  # [B,I,N], [B,I,N], [B,N]
        hn = decay_t * h + u_t
        return hn, (hn * c_t[:, None, :]).sum(-1)

    h, ys = scan(body, h0, (decay, u, C.float().transpose(0, 1)))  # ys [S,B,I]
    step.new_states[("ssm", int(module.layer_idx), 0)] = h
    y = (ys.transpose(0, 1) + x * module.D.float()) * F.silu(gate.float().transpose(1, 2))  # [B,S,I]
    # returned as [B,I,S], a transpose the mixer undoes before out_proj: ONNX Runtime drops the pair and
    # runs out_proj as one MatMul over all rows (a transposed operand would run it once per request)
    return y.to(hidden_states.dtype).transpose(1, 2)


def precast_mamba2_scan(module, hidden_states, B, C, dt, cache, **kwargs):
    """Mamba2's scan (state space duality) over the request's state: x [B,S,H*P], B, C [B,S,G*N], dt [B,S,H]
    -> [B,S,H*P] (D skip included; the gate is the caller's), as transformers' mamba2_scan_forward."""
    step = _step()
    b, s, _ = hidden_states.shape
    h_, p, n, g = (
        int(module.num_heads),
        int(module.head_dim),
        int(module.ssm_state_size),
        int(module.n_groups),
    )
    a = -torch.exp(module.A_log.float())  # [H]
    dt = F.softplus(dt.float() + module.dt_bias.float())
    low, high = getattr(module, "time_step_limit", (0.0, float("inf")))
    if low > 0.0 or high != float("inf"):
        dt = torch.clamp(dt, min=float(low), max=float(high))
    x = hidden_states.float().reshape(b, s, h_, p)
    bh = B.float().reshape(b, s, g, n).repeat_interleave(h_ // g, dim=2)  # [B,S,H,N]
    ch = C.float().reshape(b, s, g, n).repeat_interleave(h_ // g, dim=2)
    h0 = _state(step, "ssm", module.layer_idx, 0, (b, h_, p, n), hidden_states)
    valid = _valid(step, b, s, hidden_states.device)

    def body(h, xs):
        dt_t, x_t, b_t, c_t, v_t = xs  # [B,H], [B,H,P], [B,H,N], [B,H,N], [B]
        hn = (
            torch.exp(dt_t * a)[..., None, None] * h + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        )
        hn = torch.where(v_t[:, None, None, None], hn, h)
        return hn, (hn * c_t[:, :, None, :]).sum(-1)

    xs = tuple(t.transpose(0, 1) for t in (dt, x, bh, ch, valid))
    h, ys = scan(body, h0, xs)  # ys [S,B,H,P]
    step.new_states[("ssm", int(module.layer_idx), 0)] = h
    y = ys.transpose(0, 1) + x * module.D.float()[:, None]
    return y.reshape(b, s, h_ * p).to(hidden_states.dtype)


def precast_gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **kw,
):
    """Qwen3-Next's gated delta rule over the request's state: q, k [B,S,Hk,Dk], v [B,S,Hv,Dv], g, beta
    [B,S,Hv] -> (out [B,S,Hv,Dv], state [B,Hv,Dk,Dv]), as transformers' torch_recurrent_gated_delta_rule:

        S = S exp(g_t);  S += k_t (beta_t (v_t - S^T k_t))^T;  out_t = S^T q_t / sqrt(Dk)

    The function is not told its layer: it is the layer of the convolution that ran just before it (the
    gated delta net calls its conv1d, then this, on the same layer)."""
    step = _step()
    layer = step.conv_layer
    b, s, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (t.float() for t in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / (dk**0.5)
    h0 = _state(step, "ssm", layer, 0, (b, hv, dk, dv), value)
    valid = _valid(step, b, s, value.device)

    def body(h, xs):
        q_t, k_t, v_t, g_t, b_t, ok = xs  # [B,Hv,Dk], [B,Hv,Dk], [B,Hv,Dv], [B,Hv], [B,Hv], [B]
        hd = h * torch.exp(g_t)[..., None, None]
        delta = (v_t - (hd * k_t[..., None]).sum(-2)) * b_t[..., None]
        hn = hd + k_t[..., None] * delta[..., None, :]
        hn = torch.where(ok[:, None, None, None], hn, h)
        return hn, (hn * q_t[..., None]).sum(-2)

    h, ys = scan(body, h0, tuple(t.transpose(0, 1) for t in (q, k, v, g, beta, valid)))
    step.new_states[("ssm", int(layer), 0)] = h
    return ys.transpose(0, 1).to(value.dtype), (h if output_final_state else None)


_PRECAST = {
    "causal_conv1d_forward": precast_causal_conv1d,
    "mamba_scan_forward": precast_mamba_scan,
    "mamba2_scan_forward": precast_mamba2_scan,
    "torch_chunk_gated_delta_rule": precast_gated_delta_rule,
}


def _routed(own, ours):
    def call(*args, **kwargs):
        return (own if _step() is None else ours)(*args, **kwargs)

    call.precast_routed = True
    return call


def install() -> None:
    """Route the families' recurrent functions through precast's inside a step (idempotent)."""
    for family in FAMILIES:
        try:
            mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        for name in _FUNCTIONS:
            own = getattr(mod, name, None)
            if own is not None and not getattr(own, "precast_routed", False):
                setattr(mod, name, _routed(own, _PRECAST[name]))
