"""Every option of every registered pass says what it does, and `precast passes` prints it."""

import json

from precast.ir.registry import all_passes, describe_options, option_help


def test_every_pass_option_has_a_one_line_help():
    missing = [
        f"{name}.{opt}"
        for name, cls in all_passes().items()
        for opt, text in option_help(cls.Options).items()
        if not text.strip() or "\n" in text
    ]
    assert not missing, f"options without a one-line help: {missing}"


def test_precast_passes_prints_the_help(cli):
    text = "gptq: Hessian dampening"
    assert text in describe_options(all_passes()["quantize-int4"].Options)
    r = cli("passes", "--json")
    assert r.code == 0
    assert text in json.loads(r.out)["quantize-int4"]["options"]
    r = cli("passes")
    assert r.code == 0 and "percdamp=0.01" in r.out and "Hessian" in r.out
