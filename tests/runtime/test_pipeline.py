"""runtime/staged/pipeline.py: a staged artifact run as a pipeline of stage workers.

The staged artifacts here are cut by hand (onnx.utils.Extractor) from a tiny encoder-like model: an
embedding Gather (out-of-range ids fail inside stage 0), then layers of MatMul/Add/Tanh/Mul(mask); the mask
is read by every stage and the embedding is a model output produced by stage 0, so tensors pass through.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from precast.compiler.driver import CompileOptions, compile_model
from precast.errors import UsageError
from precast.runtime import InputError, load
from precast.runtime.staged.pipeline import (
    PipelineClosedError,
    PipelineFullError,
    StagePipeline,
)
from tests.helpers import ort_run

VOCAB, HIDDEN, LAYERS = 50, 16, 6


def tiny_encoder(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = {"emb": rng.normal(0, 0.1, (VOCAB, HIDDEN)).astype(np.float32), "axes": np.array([-1], np.int64)}
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["embedded"], name="embed"),
        helper.make_node("Unsqueeze", ["mask", "axes"], ["m"], name="mask3"),
    ]
    h = "embedded"
    for i in range(LAYERS):
        inits[f"layer.{i}.w"] = rng.normal(0, 0.1, (HIDDEN, HIDDEN)).astype(np.float32) + np.eye(
            HIDDEN, dtype=np.float32
        )
        inits[f"layer.{i}.b"] = rng.normal(0, 0.1, HIDDEN).astype(np.float32)
        out = "hidden" if i == LAYERS - 1 else f"h{i + 1}"
        nodes += [
            helper.make_node("MatMul", [h, f"layer.{i}.w"], [f"mm{i}"], name=f"l{i}.mm"),
            helper.make_node("Add", [f"mm{i}", f"layer.{i}.b"], [f"add{i}"], name=f"l{i}.add"),
            helper.make_node("Tanh", [f"add{i}"], [f"t{i}"], name=f"l{i}.tanh"),
            helper.make_node("Mul", [f"t{i}", "m"], [out], name=f"l{i}.mask"),
        ]
        h = out
    graph = helper.make_graph(
        nodes,
        "enc",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", "seq"]),
        ],
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
            helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
        ],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def cut(model: onnx.ModelProto, n: int) -> list[tuple[onnx.ModelProto, list[str], list[str]]]:
    """n consecutive stages at layer boundaries; every stage reads the mask, stage 0 also writes 'embedded'."""
    bounds = [round(LAYERS * k / n) for k in range(n + 1)]
    crossing = ["embedded" if b == 0 else ("hidden" if b == LAYERS else f"h{b}") for b in bounds]
    extractor = onnx.utils.Extractor(onnx.shape_inference.infer_shapes(model))
    stages = []
    for k in range(n):
        ins = ["ids", "mask"] if k == 0 else [crossing[k], "mask"]
        outs = [crossing[k + 1]] + (["embedded"] if k == 0 else [])
        stages.append((extractor.extract_model(ins, outs), ins, outs))
    return stages


def staged_artifact(root, n: int):
    """An ort-cpu artifact of tiny_encoder with a hand-written stages block (n stage files)."""
    root.mkdir(parents=True, exist_ok=True)
    src = root / "enc.onnx"
    onnx.save(tiny_encoder(), src)
    art = root / "art"
    compile_model(str(src), art, CompileOptions(passes="fold-constants"))
    manifest = json.loads((art / "manifest.json").read_text())
    (art / "stages").mkdir()
    entries = []
    for k, (stage, ins, outs) in enumerate(cut(tiny_encoder(), n)):
        rel = f"stages/stage_{k}.onnx"
        onnx.save(stage, art / rel)
        manifest["files"][rel] = hashlib.sha256((art / rel).read_bytes()).hexdigest()
        size = sum(t.raw_data.__len__() or 0 for t in stage.graph.initializer)
        entries.append({"model": rel, "inputs": ins, "outputs": outs, "bytes": size})
    manifest["stages"] = {"n": n, "by": "bytes", "stages": entries}
    (art / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return art


def compiled_staged(root, n: int):
    """tiny_encoder compiled by precast with ``split-stages{n=N}`` (the pass cuts between its named layers)."""
    root.mkdir(parents=True, exist_ok=True)
    onnx.save(tiny_encoder(), root / "enc.onnx")
    compile_model(
        str(root / "enc.onnx"), root / "art", CompileOptions(passes=f"fold-constants,split-stages{{n={n}}}")
    )
    return root / "art"


@pytest.fixture(scope="module")
def art2(tmp_path_factory):
    return staged_artifact(tmp_path_factory.mktemp("staged2"), 2)


@pytest.fixture(scope="module")
def art3(tmp_path_factory):
    return staged_artifact(tmp_path_factory.mktemp("staged3"), 3)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, art2, art3):
    """Hand-cut (Extractor) and compiled (split-stages) staged artifacts, by name."""
    return {
        "cut-2": art2,
        "cut-3": art3,
        "compiled-2": compiled_staged(tmp_path_factory.mktemp("compiled2"), 2),
        "compiled-3": compiled_staged(tmp_path_factory.mktemp("compiled3"), 3),
    }


def request(tag: int, rows: int = 1, seq: int = 7) -> dict[str, np.ndarray]:
    """Inputs whose outputs identify the request: ids from the tag, a mask with tag-dependent zeros."""
    rng = np.random.default_rng(1000 + tag)
    ids = rng.integers(0, VOCAB, (rows, seq), dtype=np.int64)
    mask = (rng.random((rows, seq)) > 0.2).astype(np.float32)
    return {"ids": ids, "mask": mask}


def expected(feeds) -> dict[str, np.ndarray]:
    hidden, embedded = ort_run(tiny_encoder(), feeds)
    return {"hidden": hidden, "embedded": embedded}


def assert_outputs(got: dict, feeds: dict) -> None:
    want = expected(feeds)
    assert sorted(got) == ["embedded", "hidden"]
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def stage_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("precast-stage-")]


class GatedSession:
    """A real stage session that waits for ``gate`` before each run (to hold work inside a stage)."""

    def __init__(self, session, gate: threading.Event):
        self.session, self.gate, self.calls = session, gate, 0

    def run(self, names, feeds):
        self.calls += 1
        assert self.gate.wait(30), "test gate never opened"
        return self.session.run(names, feeds)

    def get_providers(self):
        return self.session.get_providers()


def gated(pipe: StagePipeline, k: int, gate: threading.Event, **options) -> StagePipeline:
    """A new pipeline over ``pipe``'s sessions with stage k gated (``pipe`` is closed)."""
    pipe.close()
    stages = list(pipe.stages)
    stages[k] = dataclasses.replace(stages[k], session=GatedSession(stages[k].session, gate))
    return StagePipeline(stages, pipe.inputs, pipe.outputs, **options)


# -- numbers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cut-2", "cut-3", "compiled-2", "compiled-3"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_concurrent_requests_match_the_unsplit_model(kind, max_batch, artifacts):
    model = load(artifacts[kind])
    n = int(kind[-1])
    assert len(model.manifest.stages.stages) == n
    results: dict[int, tuple[dict, dict]] = {}
    with model.pipeline(max_batch=max_batch, batch_wait=0.005) as pipe:
        assert len(pipe.stages) == n

        def client(c: int) -> None:
            futures = []
            for i in range(16):
                tag = c * 100 + i
                # rows 1-3, two sequence lengths: micro-batches form only among requests of one shape
                feeds = request(tag, rows=1 + tag % 3, seq=5 if c % 2 else 9)
                futures.append((tag, feeds, pipe.submit(feeds)))
            for tag, feeds, fut in futures:
                results[tag] = (feeds, fut.result(timeout=60))

        clients = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        stats = pipe.stats
    assert len(results) == 64
    for feeds, got in results.values():
        assert_outputs(got, feeds)  # each future holds its own request's outputs
    assert stats.rows == sum(f["ids"].shape[0] for f, _ in results.values())
    if max_batch == 1:
        assert stats.batches == 64 and stats.max_rows == 3
    else:  # 4 clients submitting at once: some requests were merged, never past max_batch rows
        assert stats.batches < 64 and 1 < stats.max_rows <= 4
    assert not stage_threads()


def test_outputs_subset_and_run(art2):
    model = load(art2)
    feeds = request(7, rows=2)
    with model.pipeline() as pipe:
        got = pipe.run(feeds, outputs="hidden")
        assert list(got) == ["hidden"]
        np.testing.assert_allclose(got["hidden"], expected(feeds)["hidden"], rtol=1e-5, atol=1e-6)
        with pytest.raises(InputError, match="unknown output 'nope'"):
            pipe.run(feeds, outputs=["nope"])
    # the Model's own run is sequential through its sessions and gives the same numbers
    np.testing.assert_allclose(model.run(feeds)["hidden"], got["hidden"], rtol=1e-5, atol=1e-6)


def test_threads_none_shares_the_models_stage_sessions(art3):
    model = load(art3, threads=1)
    with model.pipeline(threads=None, max_batch=4) as pipe:
        assert [s.session for s in pipe.stages] == [s for _, s in model.session.stages]
        futures = [(i, pipe.submit(request(i, rows=2))) for i in range(8)]
        direct = model.run(request(50))  # the Model's own run on the same sessions meanwhile
        for i, fut in futures:
            assert_outputs(fut.result(timeout=30), request(i, rows=2))
    assert_outputs(direct, request(50))


def test_unstaged_artifact_is_a_one_stage_pipeline(tmp_path):
    onnx.save(tiny_encoder(), tmp_path / "enc.onnx")
    compile_model(str(tmp_path / "enc.onnx"), tmp_path / "art", CompileOptions())
    model = load(tmp_path / "art")
    assert model.manifest.stages is None
    feeds = request(3, rows=3)
    with model.pipeline(threads=2, max_batch=8) as pipe:
        assert len(pipe.stages) == 1 and pipe.max_batch == 8
        assert_outputs(pipe.submit(feeds).result(timeout=30), feeds)


def test_completion_follows_submission_order(art3):
    done: list[int] = []
    lock = threading.Lock()
    with load(art3).pipeline(max_batch=3) as pipe:
        futures = []
        for i in range(40):
            fut = pipe.submit(request(i, rows=1, seq=4 + i % 2))  # alternating shapes: batches of one shape
            fut.add_done_callback(lambda f, i=i: (lock.acquire(), done.append(i), lock.release()))
            futures.append(fut)
        outs = [f.result(timeout=60) for f in futures]
    assert done == list(range(40))
    for i, got in enumerate(outs):
        assert_outputs(got, request(i, rows=1, seq=4 + i % 2))


# -- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch", [1, 8])
def test_a_bad_request_fails_alone(max_batch, art2):
    bad_ids = request(5)
    bad_ids["ids"] = bad_ids["ids"].copy()
    bad_ids["ids"][0, 2] = VOCAB + 7  # passes the signature check; Gather in stage 0 rejects it
    bad_dtype = {"ids": request(6)["ids"].astype(np.int32), "mask": request(6)["mask"]}
    gate = threading.Event()
    # stage 0 is held until all are queued, so with max_batch 8 the bad request shares a micro-batch
    pipe = gated(load(art2).pipeline(), 0, gate, max_batch=max_batch, queue_size=16)
    with pipe:
        feeds = [request(i) for i in range(12)]
        feeds[5], feeds[6] = bad_ids, bad_dtype
        futures = [pipe.submit(f) for f in feeds]
        gate.set()
        for i, (f, fut) in enumerate(zip(feeds, futures)):
            if i == 5:
                with pytest.raises(InputError, match=r"stage 'stages/stage_0.onnx' rejected these feeds: .*"):
                    fut.result(timeout=30)
            elif i == 6:
                with pytest.raises(InputError, match="input 'ids': expected dtype int64, got int32"):
                    fut.result(timeout=30)
            else:
                assert_outputs(fut.result(timeout=30), f)
        if max_batch == 8:
            assert pipe.stats.max_rows > 1  # the bad request really was in a merged micro-batch
        assert_outputs(pipe.run(request(99)), request(99))  # and the pipeline keeps flowing


def test_options_are_checked(art2):
    model = load(art2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="queue_size must be an integer >= 1"):
            model.pipeline(queue_size=bad)
    with pytest.raises(UsageError, match="max_batch must be an integer >= 1"):
        model.pipeline(max_batch=0)
    with pytest.raises(UsageError, match="batch_wait must be a finite number"):
        model.pipeline(batch_wait=float("nan"))
    with pytest.raises(UsageError, match="threads lists 3 budgets for 2 stages"):
        model.pipeline(threads=[1, 1, 1])
    with pytest.raises(UsageError, match="threads must be an integer in 1..256"):
        model.pipeline(threads=[1, 0])
    with model.pipeline(threads=[1, 2]) as pipe:
        assert_outputs(pipe.run(request(1)), request(1))
    assert not stage_threads()


# -- shutdown and backpressure -------------------------------------------------------------------------------


def test_close_drains_accepted_work(art3):
    pipe = load(art3).pipeline()
    futures = [(i, pipe.submit(request(i, rows=2))) for i in range(20)]
    pipe.close()
    assert all(fut.done() for _, fut in futures)
    for i, fut in futures:
        assert_outputs(fut.result(), request(i, rows=2))
    assert not any(t.is_alive() for t in pipe.threads) and not stage_threads()
    pipe.close()  # twice is fine
    pipe.close(cancel=True)
    with pytest.raises(PipelineClosedError, match="the pipeline is closed"):
        pipe.submit(request(0))


def test_close_cancel_fails_pending_requests(art2):
    gate = threading.Event()
    pipe = gated(load(art2).pipeline(), 1, gate, queue_size=4)
    futures = [pipe.submit(request(i)) for i in range(8)]
    deadline = time.monotonic() + 10
    while pipe.stages[1].session.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # the first request is inside stage 1, the others queued behind it
    closer = threading.Thread(target=pipe.close, kwargs={"cancel": True})
    closer.start()
    deadline = time.monotonic() + 30
    while not pipe.closed and time.monotonic() < deadline:
        time.sleep(0.005)  # close(cancel) has begun (a fixed sleep may lose that race on a busy host)
    gate.set()
    closer.join(30)
    assert not closer.is_alive() and not stage_threads()
    assert all(fut.done() for fut in futures)
    assert_outputs(futures[0].result(), request(0))  # it was running: it finishes
    for fut in futures[1:]:
        with pytest.raises(PipelineClosedError, match="closed \\(cancel\\) before this request ran"):
            fut.result()


def test_backpressure_bounds_every_queue(art2):
    gate = threading.Event()
    qs = 3
    pipe = gated(load(art2).pipeline(), 1, gate, queue_size=qs)
    accepted = []
    with pytest.raises(PipelineFullError, match="pipeline full: no room for a request within 1.0 s"):
        for i in range(50):
            accepted.append(pipe.submit(request(i), timeout=1.0))
    # stage 1 holds one request (gated), the queue before it qs, stage 0 one (blocked handing it on), the
    # input slots qs: nothing else was taken in
    assert len(accepted) == 2 * qs + 2
    assert pipe.depths() == [qs, qs]
    gate.set()
    for i, fut in enumerate(accepted):
        assert_outputs(fut.result(timeout=30), request(i))
    assert max(pipe.stats.max_depths) <= qs
    pipe.close()
    assert not stage_threads()


def test_blocked_submitter_is_released_by_close(art2):
    gate = threading.Event()
    pipe = gated(load(art2).pipeline(), 1, gate, queue_size=1)
    for i in range(4):  # fills it: 1 in stage 1, 1 queued, 1 in stage 0, 1 slot
        pipe.submit(request(i), timeout=5)
    errors = []

    def submit_blocked():
        try:
            pipe.submit(request(9))
        except PipelineClosedError as e:
            errors.append(e)

    t = threading.Thread(target=submit_blocked)
    t.start()
    time.sleep(0.1)
    assert t.is_alive()  # blocked: backpressure
    closer = threading.Thread(target=pipe.close)
    closer.start()
    gate.set()
    closer.join(30)
    t.join(30)
    assert len(errors) == 1 and not stage_threads()


def test_a_forgotten_pipeline_leaves_no_thread(art2):
    model = load(art2)
    pipe = model.pipeline()
    fut = pipe.submit(request(1))
    assert_outputs(fut.result(timeout=30), request(1))
    assert len(stage_threads()) == 2
    del pipe
    gc.collect()
    deadline = time.monotonic() + 10
    while stage_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not stage_threads()


def test_close_from_a_callback_does_not_deadlock(art2):
    gate = threading.Event()
    pipe = gated(load(art2).pipeline(), 1, gate, queue_size=1)
    futures = [pipe.submit(request(i)) for i in range(3)]
    closed_on = []
    futures[0].add_done_callback(lambda f: (closed_on.append(threading.current_thread().name), pipe.close()))
    gate.set()
    for i, fut in enumerate(futures):
        assert_outputs(fut.result(timeout=30), request(i))  # accepted before the close: all finish
    assert closed_on == ["precast-stage-1"]  # the last stage's worker ran the callback
    deadline = time.monotonic() + 10
    while stage_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not stage_threads()
