import numpy as np
import pytest

from precast.errors import PassOptionError, PipelineError, UnknownPassError
from precast.ir.pipeline import PassManager, format_pipeline, parse_pipeline
from precast.ir.registry import all_passes, get_pass
from tests.helpers import op_types, ort_run, tiny_mlp


def test_round_trip_canonical():
    text = "fold-constants{input_size_limit=100},eliminate-dead-code{cse=false},infer-shapes"
    specs = parse_pipeline(text)
    assert format_pipeline(specs) == text
    assert parse_pipeline(format_pipeline(specs)) == specs


def test_defaults_are_dropped_and_whitespace_ignored():
    specs = parse_pipeline(" fold-constants { input_size_limit = 8192 } , eliminate-dead-code{cse=true}")
    assert format_pipeline(specs) == "fold-constants,eliminate-dead-code"


def test_default_expands_to_target_pipeline():
    specs = parse_pipeline("default,infer-shapes", default="fold-constants,eliminate-dead-code")
    assert [s.name for s in specs] == ["fold-constants", "eliminate-dead-code", "infer-shapes"]
    with pytest.raises(PipelineError, match="no target default"):
        parse_pipeline("default")


def test_unknown_pass_suggests_close_name():
    with pytest.raises(UnknownPassError, match="did you mean 'fold-constants'"):
        parse_pipeline("fold-constant")


@pytest.mark.parametrize(
    "text, column",
    [
        ("fold-constants{input_size_limit=1", 34),
        ("fold-constants,,infer-shapes", 16),
        ("Fold", 1),
        ("infer-shapes{=1}", 14),
    ],
)
def test_syntax_error_points_at_column(text, column):
    with pytest.raises(PipelineError, match=f"column {column}\\b"):
        parse_pipeline(text)


def test_bad_option_name_and_type():
    with pytest.raises(PassOptionError, match="has no option 'cse_x'.*did you mean 'cse'"):
        parse_pipeline("eliminate-dead-code{cse_x=true}")
    with pytest.raises(PassOptionError, match="must be true or false, got 'maybe'"):
        parse_pipeline("eliminate-dead-code{cse=maybe}")
    with pytest.raises(PassOptionError, match="must be an integer"):
        parse_pipeline("fold-constants{input_size_limit=big}")
    with pytest.raises(PipelineError, match="given twice"):
        parse_pipeline("eliminate-dead-code{cse=true,cse=false}")


def test_every_registered_pass_has_a_doc_and_round_trips():
    for name, cls in all_passes().items():
        assert cls.summary(), f"pass {name} has no docstring"
        assert format_pipeline(parse_pipeline(name)) == name
        assert get_pass(name) is cls


def test_pass_manager_records_stats_and_keeps_numbers(rng):
    model = tiny_mlp()
    feeds = {"x": rng.standard_normal((3, 8), dtype=np.float32)}
    expected = ort_run(model, feeds)
    pm = PassManager(parse_pipeline("infer-shapes,fold-constants,eliminate-dead-code"))
    out = pm.run(model)
    assert "Identity" not in op_types(out) and "Constant" not in op_types(out) and "Mul" not in op_types(out)
    assert op_types(model).count("Identity") == 1  # the input model is untouched
    assert [r.name for r in pm.records] == ["infer-shapes", "fold-constants", "eliminate-dead-code"]
    assert pm.records[1].stats["folded"] >= 2  # Constant*w2 folded, Identity dropped
    assert pm.records[1].nodes_after < pm.records[1].nodes_before
    assert all(r.seconds >= 0 for r in pm.records)
    np.testing.assert_allclose(ort_run(out, feeds)[0], expected[0], rtol=1e-5, atol=1e-5)
    # idempotent: a second run changes nothing
    again = PassManager(parse_pipeline("fold-constants,eliminate-dead-code")).run(out)
    assert op_types(again) == op_types(out)


def test_print_ir_after(capsys):
    PassManager(parse_pipeline("eliminate-dead-code"), print_ir_after=frozenset({"eliminate-dead-code"})).run(
        tiny_mlp()
    )
    err = capsys.readouterr().err
    assert "IR after eliminate-dead-code" in err and "MatMul" in err


def test_pass_result_and_facts_are_frozen_and_facts_merge_in_order():
    import dataclasses

    from precast.ir.registry import PassFacts, PassResult

    first = PassFacts(symbolic_io={"x": ("batch",)}, calibration_used=True)
    merged = first.merge(PassFacts(symbolic_io={"x": (2,)}))
    assert merged == PassFacts(symbolic_io={"x": (2,)}, calibration_used=True)
    assert first.merge(PassFacts()) == first
    result = PassResult(tiny_mlp(), False, {"fused": 0})
    assert result.facts == PassFacts()
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.modified = True  # type: ignore[misc]


def test_a_fusion_that_finds_nothing_reports_unmodified():
    result = get_pass("fuse-gelu")()(tiny_mlp())
    assert result.modified is False and result.stats["fused"] == 0
