"""precast.runtime.bench, the library side: options parsing, generated feeds, statistics, the import rule."""

from __future__ import annotations

import numpy as np
import pytest

from precast.artifact.manifest import TensorSpec
from precast.errors import UsageError
from precast.runtime.bench import (
    BenchOptions,
    closed_loop,
    parse_concurrency,
    parse_duration,
)
from precast.runtime.bench.http import loopback_url
from precast.runtime.bench.inputs import (
    FeedHints,
    generate_feeds,
    leading_batch,
    resolve_dims,
)
from precast.runtime.bench.report import Sample, level_from_samples
from tests.helpers import COMPILER_MODULES, run_with_imports_blocked, save, tiny_mlp


@pytest.mark.parametrize(
    "text, seconds",
    [("30s", 30.0), ("2m", 120.0), ("500ms", 0.5), ("1.5", 1.5), (" 1h ", 3600.0), ("0.25 s", 0.25)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "5 parsecs", "-1s", "1e3s", "0s", "1,5s"])
def test_parse_duration_refuses(text):
    with pytest.raises(UsageError, match="--duration"):
        parse_duration(text)


def test_parse_duration_zero_warmup_allowed():
    assert parse_duration("0", "--warmup", allow_zero=True) == 0.0


def test_parse_concurrency():
    assert parse_concurrency("1,4,16") == (1, 4, 16)
    assert parse_concurrency(" 2 , 2,1") == (2, 1)  # each once, in the given order
    for bad in ("", "1,", "0", "a", "1.5", "-2", "99999"):
        with pytest.raises(UsageError, match="bad --concurrency"):
            parse_concurrency(bad)


def test_options_check():
    with pytest.raises(UsageError, match="not both"):
        BenchOptions(duration_s=1.0, requests=3).check()
    with pytest.raises(UsageError, match="--output-len"):
        BenchOptions(output_len=0).check()
    BenchOptions(duration_s=None, requests=3).check()


SPECS = [
    TensorSpec("input_ids", "int64", ("batch", "sequence")),
    TensorSpec("attention_mask", "int64", ("batch", "sequence")),
    TensorSpec("token_type_ids", "int64", ("batch", "sequence")),
    TensorSpec("flag", "bool", ()),
    TensorSpec("x", "float32", ("batch", None, 3)),
]


def test_resolve_dims_defaults_and_names():
    dims, defaulted = resolve_dims(SPECS, {"sequence": 32})
    assert dims == {"batch": 1, "sequence": 32, "x_1": 128}  # axis 0 -> 1, others -> 128; unnamed: input_axis
    assert defaulted == ["batch", "x_1"]
    with pytest.raises(
        UsageError, match=r"unknown --dim 'seq'; this artifact's symbolic dims are: batch, sequence, x_1"
    ):
        resolve_dims(SPECS, {"seq": 8})
    with pytest.raises(UsageError, match=r"inputs are all static: a\[2,3\]"):
        resolve_dims([TensorSpec("a", "float32", (2, 3))], {"batch": 2})


def test_generated_feeds_follow_the_compiler_rules():
    dims = {"batch": 3, "sequence": 7, "x_1": 2}
    feeds, infos = generate_feeds(SPECS, dims, FeedHints(vocab=50))
    assert feeds["input_ids"].shape == (3, 7) and feeds["input_ids"].dtype == np.int64
    assert 0 <= feeds["input_ids"].min() and feeds["input_ids"].max() < 50
    assert (feeds["attention_mask"] == 1).all() and (feeds["token_type_ids"] == 0).all()
    assert isinstance(feeds["flag"], np.ndarray) and feeds["flag"].shape == () and feeds["flag"].dtype == bool
    assert feeds["x"].shape == (3, 2, 3) and feeds["x"].dtype == np.float32
    assert [i.values.split(" ")[0] for i in infos] == ["ids", "ones", "zeros", "random", "standard"]
    assert leading_batch(SPECS, dims) == 3  # every input of rank >= 1 starts with 'batch'
    assert leading_batch([SPECS[0], TensorSpec("y", "float32", (5,))], dims) == 1  # no common axis 0


def test_integer_inputs_without_a_vocabulary_stay_in_the_stored_range():
    spec = [TensorSpec("ids", "int32", ("n",))]
    feeds, infos = generate_feeds(spec, {"n": 1000}, FeedHints(stored={"ids": np.array([3, 9, 5])}))
    assert feeds["ids"].min() >= 3 and feeds["ids"].max() <= 9 and "stored" in infos[0].values
    feeds, infos = generate_feeds(spec, {"n": 1000})
    assert feeds["ids"].max() < 100 and "no bound known" in infos[0].values


def test_generated_feeds_are_sized_before_they_are_allocated():
    with pytest.raises(UsageError, match=r"input 'x': \[100000, 100000\] float32 needs .* use smaller --dim"):
        generate_feeds([TensorSpec("x", "float32", ("a", "b"))], {"a": 100_000, "b": 100_000})
    with pytest.raises(UsageError, match="cannot generate str"):
        generate_feeds([TensorSpec("s", "str", (2,))], {})


def test_level_statistics():
    t0 = 100.0
    samples = [Sample(t0 + i * 0.01, t0 + i * 0.01 + 0.004 + 0.001 * (i % 3)) for i in range(100)]
    lv = level_from_samples(2, samples, 1, "HTTP 429: busy", t0, items_per_request=4)
    assert lv.requests == 100 and lv.errors == 1 and lv.first_error == "HTTP 429: busy"
    assert lv.wall_s == pytest.approx(samples[-1].end - t0)
    assert lv.requests_per_s == pytest.approx(100 / lv.wall_s) and lv.items_per_s == pytest.approx(
        4 * lv.requests_per_s
    )
    assert 4.0 <= lv.latency.p50_ms <= lv.latency.p90_ms <= lv.latency.p99_ms <= 6.0 + 1e-9
    assert lv.ttft is None and lv.tokens_per_s is None

    tokens = [Sample(0.0, 0.5, [0.1, 0.2, 0.3, 0.5]), Sample(0.0, 1.0, [0.2, 0.4, 0.6, 1.0])]
    lv = level_from_samples(2, tokens, 0, None, 0.0)
    assert lv.output_tokens == 8 and lv.tokens_per_s == pytest.approx(8.0)
    assert lv.ttft.p50_ms == pytest.approx(150.0) and lv.ttft.count == 2
    assert (
        lv.itl.count == 6 and lv.itl.min_ms == pytest.approx(100.0) and lv.itl.max_ms == pytest.approx(400.0)
    )
    assert lv.request_tokens_per_s == pytest.approx(np.median([3 / 0.4, 3 / 0.8]))


def test_closed_loop_counts_requests_and_errors():
    from precast.runtime.bench import RequestFailed

    calls = []

    def ok():
        calls.append(1)

    samples, errors, first, _ = closed_loop([ok, ok, ok], duration_s=None, requests=10)
    assert len(samples) == 10 and errors == 0 and first is None

    def busy():
        raise RequestFailed("HTTP 429: queue full")

    samples, errors, first, _ = closed_loop([busy], duration_s=0.05, requests=None)
    assert not samples and errors >= 1 and first == "HTTP 429: queue full"

    def broken():
        raise ValueError("boom")

    samples, errors, first, _ = closed_loop([broken, broken], duration_s=5.0, requests=None)
    assert errors == 2 and first == "ValueError: boom"  # any other error stops its client at once


@pytest.mark.parametrize(
    "url, ok",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.1.2.3:9/", "http://127.1.2.3:9"),
        ("http://[::1]:8000/", "http://[::1]:8000"),
        ("http://localhost:8000", "http://localhost:8000"),
    ],
)
def test_loopback_urls(url, ok):
    assert loopback_url(url) == ok


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://10.0.0.1:8000", "not a loopback address"),
        ("http://example.com", "not a loopback address"),
        ("http://0.0.0.0:8000", "not a loopback address"),
        ("ftp://127.0.0.1", "expected http://127.0.0.1:PORT"),
        ("127.0.0.1:8000", "expected http://127.0.0.1:PORT"),
        ("http://127.0.0.1:8000/?a=1", "base URL only"),
        ("http://127.0.0.1:99999", "bad --url"),
    ],
)
def test_non_loopback_urls_are_refused(url, message):
    with pytest.raises(UsageError, match=message):
        loopback_url(url)


def test_bench_imports_only_numpy_and_the_backend(tmp_path):
    """The runtime's dependency rule holds for bench too (its http client and plot are elsewhere / lazy)."""
    from precast.compiler.driver import CompileOptions, compile_model

    compile_model(str(save(tiny_mlp(), tmp_path / "mlp.onnx")), tmp_path / "art", CompileOptions())
    r = run_with_imports_blocked(
        f"""
        from precast.runtime.bench import BenchOptions, bench
        r = bench({str(tmp_path / "art")!r}, BenchOptions(concurrency=(1, 2), duration_s=0.1, warmup_s=0))
        assert [lv.concurrency for lv in r.levels] == [1, 2] and r.levels[0].requests > 0
        bad = [k for k in sys.modules if k.split(".")[0] in ("torch", "onnx_ir", "onnxscript", "onnx", "matplotlib")]
        assert not bad, bad
        print("BENCH-OK")
        """,
        blocked=(
            *COMPILER_MODULES,
            "matplotlib",
            "httpx",
        ),
    )
    assert "BENCH-OK" in r.stdout, r.stderr


def test_report_of_run_takes_the_window_and_mode_from_the_options():
    from pathlib import Path

    from precast.runtime.bench.report import BenchReport, Host

    host = Host(2, "x86_64", "Linux", 0.1, 0.1)
    options = BenchOptions(duration_s=None, requests=7, warmup_s=0.5)
    report = BenchReport.of_run(
        options, Path("a"), None, host, [], kind="model", target="ort-cpu", threads="2"
    )
    assert (report.artifact, report.mode, report.url, report.requests) == ("a", "in-process", None, 7)
    assert (report.duration_s, report.warmup_s, report.host) == (None, 0.5, host)
    served = BenchReport.of_run(
        options, Path("a"), "http://127.0.0.1:1", host, [], kind="llm", target="t", threads=""
    )
    assert served.mode == "http" and served.url == "http://127.0.0.1:1"


def test_level_from_samples_without_tokens_has_no_token_fields():
    level = level_from_samples(2, [Sample(0.0, 0.5), Sample(0.0, 1.0)], 1, "boom", 0.0, items_per_request=3)
    assert (level.concurrency, level.requests, level.errors, level.first_error) == (2, 2, 1, "boom")
    assert level.requests_per_s == pytest.approx(2.0) and level.items_per_s == pytest.approx(6.0)
    assert level.output_tokens is None and level.ttft is None
