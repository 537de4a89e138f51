"""JUnit XML reports (``--junit FILE.xml``): one testcase per parity output, which CI systems render natively."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["error_case", "parity_cases", "write_junit"]

Case = dict  # {"classname", "name", "ok", "message", "details", "seconds"}


def _details(r: dict) -> str:
    return ", ".join(f"{k}={r[k]}" for k in ("max_abs", "max_rel", "cosine", "mismatches", "error") if k in r)


def parity_cases(target: str, outputs: dict, tolerance: dict | None = None) -> list[Case]:
    tol = ", ".join(f"{k}={v}" for k, v in (tolerance or {}).items())
    cases = []
    for name, r in outputs.items():
        msg = f"output '{name}' out of tolerance ({tol}): {_details(r)}" if not r.get("ok") else ""
        cases.append(
            {
                "classname": f"precast.{target}",
                "name": f"parity:{name}",
                "ok": bool(r.get("ok")),
                "message": msg,
                "details": _details(r),
            }
        )
    return cases


def error_case(classname: str, name: str, error: BaseException) -> Case:
    return {
        "classname": classname,
        "name": name,
        "ok": False,
        "message": str(error),
        "details": type(error).__name__,
        "error": True,
    }


def write_junit(path: str | os.PathLike, suite: str, cases: list[Case], seconds: float = 0.0) -> None:
    """Write one <testsuite> (atomically: temp file + rename)."""
    failures = sum(1 for c in cases if not c["ok"] and not c.get("error"))
    errors = sum(1 for c in cases if c.get("error"))
    root = ET.Element(
        "testsuites",
        name="precast",
        tests=str(len(cases)),
        failures=str(failures),
        errors=str(errors),
        time=f"{seconds:.3f}",
    )
    ts = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(cases)),
        failures=str(failures),
        errors=str(errors),
        time=f"{seconds:.3f}",
    )
    for c in cases:
        tc = ET.SubElement(
            ts, "testcase", classname=c["classname"], name=c["name"], time=f"{c.get('seconds', 0.0):.3f}"
        )
        if c.get("error"):
            ET.SubElement(tc, "error", message=c["message"], type=c["details"]).text = c["message"]
        elif not c["ok"]:
            ET.SubElement(tc, "failure", message=c["message"], type="ParityError").text = c["message"]
        elif c.get("details"):
            ET.SubElement(tc, "system-out").text = c["details"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
    os.replace(tmp, path)


def compile_junit(
    path: str | os.PathLike,
    *,
    manifest: dict | None = None,
    output: str | os.PathLike | None = None,
    error: BaseException | None = None,
    seconds: float = 0.0,
) -> None:
    """Compile report: parity cases per target (from the manifest, or from a ParityError's report)."""
    import json

    cases: list[Case] = []
    if error is not None:
        parity = getattr(error, "report", None) or {}
        if parity.get("outputs"):
            cases = parity_cases("compile", parity["outputs"], parity.get("tolerance"))
            for c in cases:
                if not c["ok"]:
                    c["message"] = str(error)  # names the first broken pass when bisection found one
        else:
            cases = [error_case("precast.compile", "compile", error)]
    elif manifest is not None:
        if manifest.get("kind") == "multi-target" and output is not None:
            for name, entry in sorted(manifest["targets"].items()):
                sub = json.loads((Path(output) / entry["dir"] / "manifest.json").read_text())
                p = sub.get("parity") or {}
                cases += parity_cases(name, p.get("outputs", {}), p.get("tolerance"))
        else:
            p = manifest.get("parity") or {}
            cases = parity_cases(
                manifest["target"].get("name", "?"), p.get("outputs", {}), p.get("tolerance")
            )
    write_junit(path, "precast compile", cases, seconds)


def verify_junit(
    path: str | os.PathLike, reports: dict | None = None, error: BaseException | None = None
) -> None:
    """Verify report: {target: {"outputs": ..., "tolerance": ...}} -> parity cases, or one error case."""
    cases: list[Case] = []
    if error is not None and not reports:
        cases = [error_case("precast.verify", "integrity", error)]
    for target, r in sorted((reports or {}).items()):
        cases += parity_cases(target, r.get("outputs", {}), r.get("tolerance"))
    write_junit(path, "precast verify", cases)
