"""The runtime side of hybrid and state-space models (runners/recurrent.py): what their memory is (attention
blocks grow with tokens, recurrent state slots with requests at once), what the engine turns off for them
(prefix caching) or refuses (speculative decoding), a hostile manifest ``states`` list refused in one line
(exit 3), and the compile-side refusals: the OpenVINO target, and a recurrent layer precast does not route.

    lfm2   tiny hybrid: layer 0 a short convolution (conv state [64, 2]), layer 1 full attention
    mamba  tiny state-space model: 2 Mamba mixers (conv state [128, 3], ssm state [128, 8] each), no K/V
"""

from __future__ import annotations

import importlib
import json
import shutil

import numpy as np
import pytest

from tests.helpers import edit_manifest, one_line_error
from tests.llm.fixtures import build_causal_lm
from tests.llm.test_state_kinds import RECURRENT

pytest.importorskip("transformers")

NEW = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The two tiny Hugging Face folders (seeded weights)."""
    root = tmp_path_factory.mktemp("recurrent")
    return {m: build_causal_lm(root / m, m, seed=3, **RECURRENT[m]) for m in ("lfm2", "mamba")}


@pytest.fixture(scope="module")
def lfm2_art(folders, compiled):
    return compiled(folders["lfm2"], targets=("ort-cpu",), task="causal-lm").output


@pytest.fixture(scope="module")
def mamba_art(folders, compiled):
    return compiled(folders["mamba"], targets=("ort-cpu",), task="causal-lm").output


def _params(**kw):
    from precast.runtime.llm import SamplingParams

    return SamplingParams(**{"max_tokens": NEW, "ignore_eos": True, "detokenize": False, **kw})


def _prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids (none of the special ones 0-2)."""
    return [(7 * i + 13 * seed + 3) % 500 + 5 for i in range(n)]


def _run(eng, prompts) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs (the model's own log-softmax) of ``prompts`` submitted at once: the
    logprobs tell a slightly wrong recurrent state apart where the tiny models' argmax does not."""
    got = [([], []) for _ in prompts]

    def collect(i):
        def on_token(ev):
            got[i][0].append(ev.token_id)
            got[i][1].append(ev.logprobs[0])

        return on_token

    handles = [eng.submit(p, _params(logprobs=0), on_token=collect(i)) for i, p in enumerate(prompts)]
    eng.run_until_done()
    for h, (tokens, _) in zip(handles, got):
        done = h.result()
        assert done.token_ids == tokens and len(tokens) == NEW
        assert done.num_cached_prompt_tokens == 0  # (no prefix cache: nothing of a prompt is skipped)
    return got


def _same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)


def _alone(art, prompts, **load) -> list:
    """Each prompt on a fresh engine of its own."""
    from precast.runtime.llm import Engine

    out = []
    for p in prompts:
        eng = Engine.load(art, **load)
        try:
            out += _run(eng, [p])
        finally:
            eng.close()
    return out


def _block_bytes(spec) -> int:
    return spec.layers * 2 * spec.kv_heads * spec.block_size * spec.head_size * 4


# -- memory ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hybrid_memory_grows_with_requests_at_once_and_with_tokens(lfm2_art):
    """LFM2: one attention layer over blocks (2 kv heads x 16 x 16 tokens x K and V = 4 KiB a block) and a
    conv state slot per request ([64, 2] floats = 512 B). Resident bytes = touched blocks x 4 KiB + touched
    slots x 512 B, exactly; slots go lowest first, so requests one after another keep touching slot 0."""
    from precast.runtime.llm import Engine

    def load():
        return Engine.load(lfm2_art, num_blocks=64)

    eng = load()
    try:
        runner, spec = eng.runner, eng.runner.spec
        assert type(runner).__name__ == "RecurrentRunner"
        assert spec.layers == 1 and spec.kv_heads == 2 and spec.head_size == 16 and spec.block_size == 16
        assert [(s.name, s.kind, s.layer, s.shape) for s in spec.states] == [
            ("conv_state.0", "conv", 0, (64, 2))
        ]
        state, block = spec.state_bytes, _block_bytes(spec)
        assert (state, block) == (64 * 2 * 4, 4096)
        assert runner.num_state_slots == 64  # min(num_blocks, MAX_STATE_SLOTS)
        m = eng.metrics()
        assert m.kv_bytes_reserved == runner.kv_bytes == 64 * block + 64 * state
        assert m.kv_bytes_resident == 0 and runner.state_bytes_resident == 0

        short = _prompt(4)  # 4 + 8 tokens: one block
        for _ in range(3):  # one after another: the same slot and block each time
            eng.generate([short], _params())
            assert (runner.state_slots_touched, runner.kv_blocks_touched) == (1, 1)
            assert eng.metrics().kv_bytes_resident == block + state
            assert runner.state_bytes_resident == state

        eng.generate([_prompt(4, seed=s) for s in range(4)], _params())  # 4 at once: 4 slots, 4 blocks
        m = eng.metrics()
        assert (runner.state_slots_touched, runner.kv_blocks_touched, m.kv_blocks_touched) == (4, 4, 4)
        assert m.kv_bytes_resident == 4 * block + 4 * state
        assert runner.state_bytes_resident == 4 * state
        assert m.kv_bytes_reserved == 64 * block + 64 * state  # (reserved does not move)
    finally:
        eng.close()

    eng = load()  # a long prompt alone: more blocks, the same one slot
    try:
        eng.generate([_prompt(100)], _params())  # 108 tokens: 7 blocks
        runner = eng.runner
        assert (runner.state_slots_touched, runner.kv_blocks_touched) == (1, 7)
        assert runner.state_bytes_resident == state
        assert eng.metrics().kv_bytes_resident == 7 * block + state
    finally:
        eng.close()


@pytest.mark.slow
def test_state_space_model_has_no_kv_pool_and_its_default_pool_counts_tokens(mamba_art):
    """Mamba: no attention layer, so no K/V at all; its bytes are the state slots only (one per request the
    scheduler runs at once: max_num_seqs, 64 by default), and the default pool (block_bytes 0: blocks cost
    nothing) is 64 full-context requests of blocks, so blocks never preempt it before slots run out."""
    from precast.runtime.llm import Engine
    from precast.runtime.llm.scheduler import SchedulerConfig

    eng = Engine.load(mamba_art)
    try:
        runner, spec = eng.runner, eng.runner.spec
        assert spec.layers == 0 and spec.kv_inputs == () and spec.kv_outputs == () and _block_bytes(spec) == 0
        # 2 mixers of intermediate 128: conv [128, 3] (kernel 4) and ssm [128, 8] (state_size 8)
        assert [(s.kind, s.layer, s.shape) for s in spec.states] == [
            ("conv", 0, (128, 3)),
            ("ssm", 0, (128, 8)),
            ("conv", 1, (128, 3)),
            ("ssm", 1, (128, 8)),
        ]
        assert spec.state_bytes == 4 * 2 * (128 * 3 + 128 * 8)
        want_blocks = 64 * -(-spec.max_context // spec.block_size)
        assert spec.default_num_blocks() == runner.num_blocks == want_blocks
        assert runner.num_state_slots == SchedulerConfig().max_num_seqs == 64
        assert runner.kv_bytes == eng.metrics().kv_bytes_reserved == runner.num_state_slots * spec.state_bytes
        done = eng.generate([_prompt(5), _prompt(30, seed=1)], _params())
        assert [len(c.token_ids) for c in done] == [NEW, NEW]
        m = eng.metrics()
        assert runner.state_slots_touched == 2 and m.kv_blocks_touched == 1 + 3  # (blocks still count tokens)
        assert m.kv_bytes_resident == runner.state_bytes_resident == 2 * spec.state_bytes
    finally:
        eng.close()


@pytest.mark.slow
def test_more_requests_than_state_slots_wait_for_one_and_start_from_a_zero_state(mamba_art):
    """max_num_seqs=2: 2 state slots. 5 requests at once run 2 at a time, each slot reused by a later request
    (which must start from zeros, not the state its last holder left): each == the request alone."""
    from precast.runtime.llm import Engine, SchedulerConfig

    prompts = [_prompt(3 + 2 * i, seed=i) for i in range(5)]
    eng = Engine.load(mamba_art, num_blocks=64, config=SchedulerConfig(max_num_seqs=2))
    try:
        assert eng.runner.num_state_slots == 2
        got = _run(eng, prompts)
        assert eng.runner.state_slots_touched == 2
        assert eng.metrics().kv_bytes_resident == 2 * eng.runner.spec.state_bytes
    finally:
        eng.close()
    _same(got, _alone(mamba_art, prompts, num_blocks=2))


# -- prefix caching -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model", ["lfm2", "mamba"])
def test_prefix_caching_is_off_even_when_asked(model, lfm2_art, mamba_art):
    """Two prompts sharing 40 tokens (2 full blocks), one after the other on one engine and then at once:
    each == itself alone (tokens and logprobs), and nothing is served from a prefix cache. (With the cache
    on, the second would start at position 32 from the slot's stale state.)"""
    from precast.runtime.llm import Engine

    art = {"lfm2": lfm2_art, "mamba": mamba_art}[model]
    shared = _prompt(40)
    prompts = [shared + [11, 12, 13], shared + [21, 22]]
    alone = _alone(art, prompts, num_blocks=64)
    eng = Engine.load(art, num_blocks=64, enable_prefix_caching=True)
    try:
        assert eng.prefix_caching is False and eng.kv.enable_prefix_caching is False
        one_by_one = _run(eng, prompts[:1]) + _run(eng, prompts[1:])
        at_once = _run(eng, prompts)
        m = eng.metrics()
        assert m.prefix_hit_tokens == 0 and m.requests_finished == 4
    finally:
        eng.close()
    _same(one_by_one, alone)
    _same(at_once, alone)


# -- speculative decoding -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model", ["lfm2", "mamba"])
def test_speculation_is_refused_for_a_recurrent_target(model, lfm2_art, mamba_art, cli):
    from precast.errors import UsageError
    from precast.runtime.llm import Engine
    from precast.runtime.llm.speculative import SpeculativeConfig

    art = {"lfm2": lfm2_art, "mamba": mamba_art}[model]
    with pytest.raises(UsageError) as info:
        Engine.load(art, num_blocks=16, speculative=SpeculativeConfig(method="ngram"))
    msg = str(info.value)
    assert info.value.exit_code == 1 and "\n" not in msg
    assert f"the target '{model}' has recurrent-state layers" in msg and "without speculation" in msg, msg
    res = cli("generate", art, "x = 1", "--max-tokens", "4", "--speculative", "ngram")
    one_line_error(res, 1, f"the target '{model}' has recurrent-state layers")
    other = mamba_art if model == "lfm2" else lfm2_art  # (the same tokenizer)
    res = cli("generate", art, "x = 1", "--max-tokens", "4", "--draft", other)
    one_line_error(res, 1, f"the target '{model}' has recurrent-state layers")
    # and without speculation the same command serves it
    res = cli("generate", art, "x = 1", "--max-tokens", "4", "--json")
    assert res.code == 0 and len(json.loads(res.out)["token_ids"]) == 4, res.err


@pytest.mark.slow
def test_a_recurrent_draft_is_refused_for_a_plain_target(llm_artifact, lfm2_art, cli):
    """The tiny Llama (no recurrent state) with LFM2 as its draft: the draft is refused, named as such."""
    res = cli("generate", llm_artifact, "x = 1", "--max-tokens", "4", "--draft", lfm2_art)
    one_line_error(res, 1, "the draft 'lfm2' has recurrent-state layers")


# -- hostile manifests ----------------------------------------------------------------------------------------
def _states(change):
    return lambda m: change(m["llm"]["states"])


HOSTILE = {
    "unknown kind": (_states(lambda s: s[0].update(kind="lstm")), "'conv_state.0': kind must be one of"),
    "shape not the graph's": (
        _states(lambda s: s[0].update(shape=[128, 4])),
        "state 'conv_state.0' is ['s3', 128, 3] in the graph, the block says [B, 128, 4]",
    ),
    "rank not the graph's": (_states(lambda s: s[1].update(shape=[128])), "state 'ssm_state.0' is"),
    "states swapped": (
        _states(lambda s: (s[0].update(name="ssm_state.0"), s[1].update(name="conv_state.0"))),
        "state 'ssm_state.0' is ['s3', 128, 8] in the graph, the block says [B, 128, 3]",
    ),
    "not a graph input": (
        _states(lambda s: s[2].update(name="conv_state.9")),
        "'conv_state.9' is not an input of the step graph",
    ),
    "an output's name": (
        _states(lambda s: s[0].update(name="new_conv_state.0")),
        "'new_conv_state.0' is not an input of the step graph",
    ),
    "a state left out": (_states(lambda s: s.pop()), "the step graph's input 'ssm_state.1' is not among"),
    "unknown key": (_states(lambda s: s[0].update(init="ones")), "unknown key 'states[0].init'"),
    "missing key": (_states(lambda s: s[3].pop("shape")), "missing required key 'states[3].shape'"),
    "huge shape": (
        _states(lambda s: s[0].update(shape=[1 << 20, 1 << 20])),
        "state 'conv_state.0': 1099511627776 elements per request, at most 16777216",
    ),
    "zero size": (
        _states(lambda s: s[1].update(shape=[128, 0])),
        "state 'ssm_state.0': shape must be positive",
    ),
    "no dims": (_states(lambda s: s[1].update(shape=[])), "state 'ssm_state.0': shape must be positive"),
    "string dim": (
        _states(lambda s: s[0].update(shape=["128", 3])),
        "'states[0].shape[0]' must be an integer",
    ),
    "bool dim": (_states(lambda s: s[0].update(shape=[True, 3])), "'states[0].shape[0]' must be an integer"),
    "negative layer": (_states(lambda s: s[0].update(layer=-1)), "state 'conv_state.0': layer must be in"),
    "a duplicate": (_states(lambda s: s.append(dict(s[0]))), "state names must be distinct"),
    "not an object": (
        _states(lambda s: s.__setitem__(0, "conv_state.0")),
        "'states[0]' must be a JSON object",
    ),
    # each under the per-state cap, 33 x 64 MiB together: more than the 1 GiB a request's states may hold
    "too large together": (
        _states(
            lambda s: s.extend(
                {"name": f"x.{i}", "layer": 0, "kind": "ssm", "shape": [4096, 4096]} for i in range(33)
            )
        ),
        "bytes of recurrent state per request, at most 1073741824",
    ),
    "not paged": (lambda m: m["llm"].update(kv_layout="mapped"), "recurrent states need kv_layout 'paged'"),
    "no states, no layers": (
        lambda m: m["llm"].update(states=[]),
        "layers must be a positive integer, got 0",
    ),
}


@pytest.fixture(scope="module")
def hostile(mamba_art, tmp_path_factory):
    """Each HOSTILE edit on its own copy of the mamba artifact (manifest.json rewritten, no hashes redone)."""
    root = tmp_path_factory.mktemp("hostile")
    out = {}
    for i, (case, (change, _)) in enumerate(HOSTILE.items()):
        art = root / f"case{i}"
        shutil.copytree(mamba_art, art)
        out[case] = edit_manifest(art, change)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_states_list_is_refused_in_one_line(case, hostile):
    from precast.errors import ArtifactError
    from precast.runtime.llm import Engine

    with pytest.raises(ArtifactError) as info:
        Engine.load(hostile[case], num_blocks=4)
    msg = str(info.value)
    assert info.value.exit_code == 3 and "\n" not in msg, msg
    assert f"{hostile[case]}/manifest.json: llm block" in msg and HOSTILE[case][1] in msg, msg


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown kind", "shape not the graph's", "not a graph input"])
def test_the_cli_refuses_a_hostile_states_list_with_exit_3(case, hostile, cli):
    """`precast generate` and `precast verify` open the step graph: exit 3, one line naming the state;
    `precast inspect` reads the manifest alone (the block's own checks, not the graph's)."""
    art, needle = hostile[case], HOSTILE[case][1]
    one_line_error(cli("generate", art, "x = 1", "--max-tokens", "2"), 3, needle)
    one_line_error(cli("verify", art), 3, needle)
    shown = cli("inspect", art)
    if case == "unknown kind":
        one_line_error(shown, 3, needle)
    else:
        assert shown.code == 0, shown.err


# -- compile-side refusals ------------------------------------------------------------------------------------
@pytest.mark.slow  # (loads the model and probes it: ~6 s each)
@pytest.mark.parametrize(
    "model,needle",
    [
        ("lfm2", "'lfm2' has recurrent-state layers [0] (conv state per request)"),
        ("mamba", "'mamba' has recurrent-state layers [0, 1] (conv/ssm state per request)"),
    ],
)
def test_openvino_refuses_a_recurrent_model_in_one_line(model, needle, folders, cli, tmp_path):
    out = tmp_path / "ov"
    res = cli("compile", folders[model], "-o", out, "--task", "causal-lm", "--target", "openvino", "-q")
    assert res.code != 0, res.err
    line = one_line_error(res, res.code, needle, "recurrent-state layers", "ort-cpu serves it")
    assert "target 'openvino' cannot lower this model" in line and "not lowered to OpenVINO" in line, line
    assert not (out / "model.onnx").exists()


def _own(fn):
    """transformers' own function behind precast's routing wrapper (recurrent._routed), or ``fn`` itself."""
    from precast.compiler.decoder import recurrent

    if not getattr(fn, "precast_routed", False):
        return fn
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    return next(c for c in cells if callable(c) and c not in recurrent._PRECAST.values())


def _unroute(monkeypatch, family: str, name: str, replacement=None):
    """Point ``family``'s module-level ``name`` at transformers' own (or ``replacement``), marked as routed
    so that recurrent.install() leaves it alone: precast's step never sees that layer's state."""
    from precast.compiler.decoder.generic_decoder import register

    register()  # (install first, so that it does not wrap our replacement afterwards)
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    own = _own(getattr(mod, name))

    def plain(*args, **kwargs):
        return (replacement or own)(*args, **kwargs)

    plain.precast_routed = True
    monkeypatch.setattr(mod, name, plain)


def _raises(*args, **kwargs):
    raise RuntimeError("a hub kernel that needs a cache")


@pytest.mark.parametrize("replacement", [None, _raises], ids=["own-forward", "raises"])
def test_an_unrouted_recurrent_layer_is_refused_naming_family_and_kind(replacement, folders, monkeypatch):
    """LFM2's short convolution left on transformers' own code: it runs without recording a state (or fails
    on precast's step); either way the probe refuses it naming the family, the layer and its kind."""
    from precast.compiler.decoder.causal_lm import build_paged_decoder
    from precast.errors import ModelLoadError

    _unroute(monkeypatch, "lfm2", "causal_conv1d_forward", replacement)
    with pytest.raises(ModelLoadError) as info:
        build_paged_decoder(folders["lfm2"], "lfm2")
    msg = str(info.value)
    assert "\n" not in msg
    for needle in ("'lfm2' has recurrent-state layers", "layers [0] are conv layers (Lfm2ShortConv)"):
        assert needle in msg, msg
    assert msg.endswith("not supported for task causal-lm"), msg


@pytest.mark.parametrize("name", ["mamba_scan_forward", "causal_conv1d_forward"])
def test_a_half_routed_mamba_mixer_is_still_refused(name, folders, monkeypatch):
    """A Mamba mixer with one of its two states not routed (the other is): refused before export, naming the
    layers and their kind (the probe wants a conv and a scan state of each mixer)."""
    from precast.compiler.decoder.causal_lm import build_paged_decoder
    from precast.errors import ModelLoadError

    _unroute(monkeypatch, "mamba", name)
    with pytest.raises(ModelLoadError) as info:
        build_paged_decoder(folders["mamba"], "mamba")
    msg = str(info.value)
    assert "\n" not in msg and "not supported for task causal-lm" in msg, msg
    assert "'mamba' has recurrent-state layers" in msg and "MambaMixer" in msg, msg


@pytest.mark.slow
def test_pipeline_stages_refuse_a_recurrent_model_at_compile(folders, cli, tmp_path):
    """split-stages on a hybrid: one line naming the family and the layer kind, no artifact."""
    out = tmp_path / "staged"
    passes = "default,split-stages{n=2}"
    res = cli("compile", folders["lfm2"], "-o", out, "--task", "causal-lm", "--passes", passes, "-q")
    lines = res.err.strip().splitlines()
    assert res.code != 0 and len(lines) == 1, res.err
    assert "'lfm2' has recurrent-state layers" in lines[0] and "pipeline stages" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_inspect_shows_the_recurrent_state_and_what_is_off(mamba_art, cli):
    res = cli("inspect", mamba_art)
    assert res.code == 0, res.err
    # 2 layers x (conv 128 x 3 + ssm 128 x 8) floats = 11 KiB a request
    assert "recurrent state: 2 layer(s) (conv/ssm), 11.0 KiB per request" in res.out, res.out
    assert "prefix caching off, no speculative decoding" in res.out


@pytest.mark.slow
def test_kv_cache_memory_counts_the_state_slots_and_refuses_a_state_space_model(lfm2_art, mamba_art):
    """--kv-cache-memory: a hybrid's blocks are what is left after max_num_seqs state slots; a size that
    holds only the slots is refused; a state-space model (no K/V) is refused, naming its state bytes."""
    from precast.artifact.manifest import read_manifest
    from precast.errors import UsageError
    from precast.runtime.server.kv_memory import block_bytes, blocks_for_memory

    lfm2, mamba = (read_manifest(a).llm for a in (lfm2_art, mamba_art))
    per_block, slots = block_bytes(lfm2), 8 * lfm2.state_bytes
    assert blocks_for_memory(lfm2, slots + 10 * per_block + 1, max_num_seqs=8) == 10
    with pytest.raises(UsageError, match="holds the recurrent state slots"):
        blocks_for_memory(lfm2, slots + per_block - 1, max_num_seqs=8)
    with pytest.raises(
        UsageError, match=f"'mamba' has none: each running request holds {mamba.state_bytes} bytes"
    ):
        blocks_for_memory(mamba, 1 << 30, max_num_seqs=8)
