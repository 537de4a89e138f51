"""The one option schema (precast/options.py): parsing, describing, and the click options generated from it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import click
import pytest
from click.testing import CliRunner

from precast.errors import PassOptionError, UsageError
from precast.options import (
    Owner,
    click_options,
    describe,
    fields_of,
    format_value,
    opt,
    parse,
)

OWNER = Owner("pass", "demo", PassOptionError)


@dataclass(frozen=True)
class Demo:
    block: int = opt(32, "weights per block", min=16, max=256)
    algo: Literal["rtn", "gptq"] = opt("rtn", "how to round")
    damp: float = opt(0.01, "dampening")
    level: int | None = opt(None, "accuracy level")
    exclude: tuple[str, ...] = opt((), "names to skip")
    fast: bool = opt(True, "take the fast path")
    size: int = opt(1024, "bytes", parse=lambda text: int(text.removesuffix("B")), metavar="size")


def test_parse_text_and_typed_values():
    o = parse(
        Demo, {"block": "64", "algo": "GPTQ", "level": "none", "exclude": ["a", "b"], "fast": "off"}, OWNER
    )
    assert (o.block, o.algo, o.level, o.exclude, o.fast) == (64, "gptq", None, ("a", "b"), False)
    typed = parse(Demo, {"block": 128, "fast": True, "damp": 0.5, "exclude": ("x",), "size": "2048B"}, OWNER)
    assert (typed.block, typed.fast, typed.damp, typed.exclude, typed.size) == (128, True, 0.5, ("x",), 2048)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"blok": "1"}, "pass 'demo' has no option 'blok'; did you mean 'block'? (options: block, algo,"),
        ({"block": "8"}, "pass 'demo' option 'block' must be >= 16, got 8"),
        ({"block": "512"}, "option 'block' must be <= 256, got 512"),
        ({"block": "big"}, "option 'block' must be an integer, got 'big'"),
        ({"damp": "nan"}, "option 'damp' must be a finite number >= 0, got nan"),
        ({"algo": "gpt"}, "option 'algo' must be one of rtn|gptq, got 'gpt'; did you mean 'gptq'?"),
        ({"fast": "maybe"}, "option 'fast' must be true or false, got 'maybe'"),
        ({"block": ["16", "32"]}, "option 'block' takes a single value, got a list"),
    ],
)
def test_errors_name_the_owner_the_key_and_what_it_accepts(raw, needle):
    with pytest.raises(PassOptionError) as e:
        parse(Demo, raw, OWNER)
    assert needle in str(e.value)


def test_the_owner_chooses_the_error_class():
    with pytest.raises(UsageError, match="target 'ort-x' has no option 'x'") as e:
        parse(Demo, {"x": "1"}, Owner("target", "ort-x"))
    assert not isinstance(e.value, PassOptionError)


def test_describe_and_format():
    d = describe(Demo)
    assert d["block"] == {"default": 32, "type": "int", "help": "weights per block"}
    assert (
        d["algo"]["type"] == "rtn|gptq"
        and d["level"]["type"] == "int|none"
        and d["exclude"]["type"] == "[str,...]"
    )
    assert [format_value(v) for v in (None, True, ("a", "b"), 0.5)] == ["none", "true", "[a,b]", "0.5"]


def _command(**kwargs):
    @click.command()
    @click_options(Demo, **kwargs)
    def cmd(**values):
        click.echo(repr(sorted(values.items())))

    return cmd


def test_click_options_carry_the_fields_defaults_bounds_and_help():
    cmd = _command(only=("block", "damp", "algo", "size", "fast"), rename={"damp": "dampening"})
    params = {p.name: p for p in cmd.params}
    assert list(params) == ["block", "damp", "algo", "size", "fast"]
    assert params["damp"].opts == ["--dampening"] and params["fast"].secondary_opts == ["--no-fast"]
    assert all(params[f.name].default == f.default for f in fields_of(Demo) if f.name in params)
    assert params["block"].help == "weights per block" and params["size"].type.name == "size"
    runner = CliRunner()
    assert "('block', 64)" in runner.invoke(cmd, ["--block", "64"]).output
    assert "('size', 4096)" in runner.invoke(cmd, ["--size", "4096B"]).output
    for argv, needle in ((["--block", "8"], "16<=x<=256"), (["--dampening", "nan"], "not a finite number")):
        r = runner.invoke(cmd, argv)
        assert r.exit_code == 2 and needle in r.output


def test_unset_click_options_default_to_none_and_say_the_default():
    params = {p.name: p for p in _command(only=("block",), unset=True, prefix="LLM: ").params}
    assert params["block"].default is None and params["block"].help == "LLM: weights per block (default 32)."


def test_serve_flags_are_the_config_fields():
    """No default or help of `precast serve` is written twice: each generated flag is its field's."""
    from precast.cli.commands_serve import serve_cmd
    from precast.runtime.llm.scheduler import SchedulerConfig
    from precast.runtime.server.config import KVPoolOptions, ServerConfig

    params = {p.name: p for p in serve_cmd.params}
    for cls in (ServerConfig, KVPoolOptions):
        for f in fields_of(cls):
            if f.name in params and f.help:
                assert params[f.name].default == f.default and f.help in params[f.name].help, f.name
    assert (
        params["request_timeout"].opts == ["--timeout"]
        and params["admin_token"].envvar == "PRECAST_ADMIN_TOKEN"
    )
    assert params["max_num_seqs"].default is None
    assert f"(default {SchedulerConfig.max_num_seqs})" in params["max_num_seqs"].help
    assert params["port"].type.min == 0 and params["port"].type.max == 65535
    assert math.isclose(params["text_timeout"].type.min, 0.001)


def test_threads_is_declared_once():
    from precast.cli import (
        commands,
        commands_bench,
        commands_ci,
        commands_eval,
        commands_llm,
        commands_serve,
    )

    commands_ = (
        commands.run,
        commands_bench.bench_cmd,
        commands_ci.profile,
        commands_serve.serve_cmd,
        commands_llm.generate_cmd,
        commands_eval.eval_cmd,
    )
    helps = set()
    for command in commands_:
        (threads,) = [p for p in command.params if p.name == "threads"]
        helps.add((threads.help, threads.type.min, threads.type.max, threads.default))
    assert len(helps) == 1, helps
