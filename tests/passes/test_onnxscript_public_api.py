"""Passes use onnxscript's public API only: a private module or name (a leading underscore) can change or
vanish in any release. What onnxscript keeps private is written in passes/ with a note saying where from."""

import ast
from pathlib import Path

PASSES = Path(__file__).resolve().parents[2] / "passes"


def test_passes_import_no_private_onnxscript_module_or_name():
    private = []
    for path in sorted(PASSES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("onnxscript"):
                names = node.module.split(".") + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [p for a in node.names if a.name.startswith("onnxscript") for p in a.name.split(".")]
            else:
                continue
            if any(n.startswith("_") for n in names):
                private.append(f"{path.name}:{node.lineno}")
    assert not private, f"private onnxscript imports: {private}"
