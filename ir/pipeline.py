"""MLIR-style pipeline strings and the pass manager that runs them.

    fold-constants,eliminate-dead-code,unroll-loops{max_trip=16},quantize-int4{block=32,algo=gptq}

``parse_pipeline`` -> list[PassSpec]; ``format_pipeline`` prints the canonical string (options that
differ from their defaults, in declaration order), so parse(format(x)) == x. The pseudo-pass ``default``
expands to the target's default pipeline.
"""

from __future__ import annotations

import copy
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from precast.errors import PassFailedError, PipelineError, first_line
from precast.ir.registry import (
    Pass,
    PassContext,
    PassFacts,
    build_options,
    format_option_value,
    get_pass,
    option_fields,
)

__all__ = ["PassSpec", "PassRecord", "parse_pipeline", "format_pipeline", "check_last", "PassManager"]

_NAME = re.compile(r"[a-z][a-z0-9-]*")
_VALUE = re.compile(r"[^,{}\[\]=\s]+")
_KEY = re.compile(r"[a-z_][a-z0-9_]*")


@dataclass(frozen=True)
class PassSpec:
    name: str
    options: Any = None

    def instantiate(self, context: PassContext | None = None) -> Pass:
        return get_pass(self.name)(self.options, context=context)

    def __str__(self) -> str:
        if self.options is None:
            return self.name
        parts = [
            f"{n}={format_option_value(getattr(self.options, n))}"
            for n, _, default in option_fields(type(self.options))
            if getattr(self.options, n) != default
        ]
        return f"{self.name}{{{','.join(parts)}}}" if parts else self.name


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def error(self, what: str) -> PipelineError:
        col = self.pos + 1
        near = self.text[self.pos : self.pos + 12] or "end of string"
        return PipelineError(
            f"pipeline syntax error at column {col}: {what} (near '{near}') in '{self.text}'"
        )

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def match(self, regex: re.Pattern, what: str) -> str:
        self.skip_ws()
        m = regex.match(self.text, self.pos)
        if not m:
            raise self.error(f"expected {what}")
        self.pos = m.end()
        return m.group(0)

    def peek(self) -> str:
        self.skip_ws()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, ch: str) -> None:
        if self.peek() != ch:
            raise self.error(f"expected '{ch}'")
        self.pos += 1

    def value(self) -> str | list[str]:
        if self.peek() == "[":
            self.pos += 1
            items: list[str] = []
            if self.peek() != "]":
                items.append(self.match(_VALUE, "a value"))
                while self.peek() == ",":
                    self.pos += 1
                    items.append(self.match(_VALUE, "a value"))
            self.expect("]")
            return items
        return self.match(_VALUE, "a value")

    def items(self) -> list[tuple[str, dict[str, Any], int]]:
        out = []
        if not self.text.strip():
            return out
        while True:
            start = self.pos
            name = self.match(_NAME, "a pass name (lowercase, dashes)")
            opts: dict[str, Any] = {}
            if self.peek() == "{":
                self.pos += 1
                if self.peek() != "}":
                    while True:
                        key_pos = self.pos
                        key = self.match(_KEY, "an option name")
                        if key in opts:
                            self.pos = key_pos
                            raise self.error(f"option '{key}' given twice")
                        self.expect("=")
                        opts[key] = self.value()
                        if self.peek() == ",":
                            self.pos += 1
                            continue
                        break
                self.expect("}")
            out.append((name, opts, start))
            if self.peek() == "":
                return out
            self.expect(",")


def parse_pipeline(text: str, default: str | None = None) -> list[PassSpec]:
    """Parse a pipeline string. ``default`` (a pipeline string) is what the ``default`` item expands to."""
    parser = _Parser(text)
    specs: list[PassSpec] = []
    for name, opts, _start in parser.items():
        if name == "default":
            if opts:
                raise PipelineError("the 'default' pipeline takes no options")
            if default is None:
                raise PipelineError("'default' used where no target default pipeline is known")
            specs.extend(parse_pipeline(default))
            continue
        cls = get_pass(name)
        specs.append(PassSpec(name, build_options(cls, opts)))
    check_last(specs)
    return specs


def check_last(specs: Sequence[PassSpec]) -> None:
    """A pass that must end the pipeline (``must_be_last``: split-stages annotates every node, and a later pass
    would add nodes it never saw) followed by another is a PipelineError naming both."""
    for spec, after in zip(specs, specs[1:]):
        if getattr(get_pass(spec.name), "must_be_last", False):
            raise PipelineError(
                f"pass '{spec.name}' must be the last pass of a pipeline, but '{after.name}' follows it; "
                f"move '{spec.name}' to the end"
            )


def format_pipeline(specs: Iterable[PassSpec]) -> str:
    return ",".join(str(s) for s in specs)


@dataclass
class PassRecord:
    name: str
    spec: str
    stats: dict[str, Any]
    seconds: float
    nodes_before: int
    nodes_after: int

    def to_json(self, with_time: bool = True) -> dict:
        d = {
            "pass": self.spec,
            "stats": self.stats,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
        }
        if with_time:
            d["seconds"] = round(self.seconds, 4)
        return d


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph.all_nodes())


@dataclass
class PassManager:
    """Runs specs in order with instruments: timing, stats, --print-ir-after, callbacks before and after each pass.

    Every pass gets the same frozen ``context``; what they learn is merged, in order, into ``facts``."""

    specs: Sequence[PassSpec]
    print_ir_after: frozenset[str] = frozenset()
    on_pass: Callable[[PassRecord], None] | None = None
    on_start: Callable[[PassSpec], None] | None = None  # e.g. a progress step: the pass about to run
    context: PassContext | None = None
    records: list[PassRecord] = field(default_factory=list)
    facts: PassFacts = field(default_factory=PassFacts)

    def run(self, model: ir.Model, *, copy_input: bool = True) -> ir.Model:
        if copy_input:
            model = clone_model(model)
        done: list[str] = []
        for spec in self.specs:
            pass_ = spec.instantiate(self.context)
            before = count_nodes(model)
            if self.on_start:
                self.on_start(spec)
            t0 = time.perf_counter()
            try:
                result = pass_(model)
            except PipelineError:
                raise
            except Exception as e:
                after = f" after [{', '.join(done)}]" if done else ""
                raise PassFailedError(f"pass '{spec}' failed{after}: {first_line(e)}") from e
            seconds = time.perf_counter() - t0
            model = result.model
            self.facts = self.facts.merge(result.facts)
            rec = PassRecord(spec.name, str(spec), dict(result.stats), seconds, before, count_nodes(model))
            self.records.append(rec)
            done.append(spec.name)
            if spec.name in self.print_ir_after or "all" in self.print_ir_after:
                print(f"// ----- IR after {spec} -----", file=sys.stderr)
                print(str(model), file=sys.stderr)
            if self.on_pass:
                self.on_pass(rec)
        return model


def clone_model(model: ir.Model) -> ir.Model:
    """Deep copy through the proto, so a pipeline never mutates its caller's model."""
    proto = ir.serde.serialize_model(model)
    return ir.serde.deserialize_model(copy.deepcopy(proto))
