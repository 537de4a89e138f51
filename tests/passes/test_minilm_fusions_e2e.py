"""End to end: the dynamo-exported all-MiniLM-L6-v2 through the ort-cpu default pipeline."""

import collections

import pytest

from precast.compiler.driver import CompileOptions, compile_model


@pytest.mark.slow
def test_minilm_default_pipeline_fuses_attention_with_parity(minilm_dir, tmp_path):
    # ort_level=none: what is counted below is precast's own work, not ONNX Runtime's offline optimizer.
    res = compile_model(
        str(minilm_dir), tmp_path / "art", CompileOptions(target_options={"ort_level": "none"})
    )
    stats = {str(r.spec): r.stats for r in res.records["ort-cpu"]}
    assert stats["fuse-attention"]["fused"] == 6
    assert stats["fuse-skip-layernorm"]["fused"] == 12
    assert stats["fuse-gelu"]["bias_fused"] == 6
    assert res.manifest["parity"]["ok"]  # the driver also refuses to write an artifact that fails parity
    import onnx

    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "art" / "model.onnx")).graph.node)
    assert ops["Attention"] == 6 and ops["Softmax"] == 0
