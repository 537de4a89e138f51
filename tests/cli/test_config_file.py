"""precast.toml: every compile option is a key (derived from the click command, so it cannot drift), values
go through the option's type, the command line wins, and a mistake is one line naming the file and key."""

import json

import pytest

from precast.cli.config_file import config_keys, read_config
from precast.errors import UsageError
from tests.helpers import save, tiny_mlp


@pytest.fixture
def compile_cmd():
    from precast.cli.main import _register, cli

    _register()
    return cli.commands["compile"]


@pytest.fixture
def mlp_path(tmp_path):
    return save(tiny_mlp(), tmp_path / "mlp.onnx")


def _last_error(r) -> str:
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in r.err, r.err
    return lines[-1]


def test_every_compile_option_is_a_key(compile_cmd):
    keys = config_keys(compile_cmd)
    options = {
        p.name for p in compile_cmd.params if p.opts[0].startswith("-") and p.name not in ("config", "help")
    }
    assert options <= {o.name for o in keys.values()}
    assert len(options) >= 18
    for key in ("targets", "target", "dim", "dims", "min_cosine", "kv_layout", "cache_dir", "json", "quiet"):
        assert key in keys, key


def test_values_take_the_option_type(compile_cmd, tmp_path):
    cfg = tmp_path / "precast.toml"
    cfg.write_text(
        "[compile]\n"
        'target = ["ort-cpu"]\natol = 1\nmin-cosine = 0.5\ndim = {batch = 2}\n'
        'target_option = ["threads=1"]\nkv_layout = "paged"\nall_or_nothing = true\nquiet = true\n'
    )
    got = read_config(compile_cmd, str(cfg))
    assert got == {
        "targets": ("ort-cpu",),
        "atol": 1.0,
        "min_cosine": 0.5,
        "dims": ("batch=2",),
        "target_options": ("threads=1",),
        "kv_layout": "paged",
        "all_or_nothing": True,
        "quiet": True,
    }


@pytest.mark.parametrize(
    "body, needles",
    [
        ("[compile]\nmin_cosin = 0.9\n", ["unknown key 'min_cosin'", "did you mean 'min_cosine'"]),
        ('[compile]\nkv_layout = "sideways"\n', ["kv_layout", "sideways"]),
        ("[compile]\ntarget = 'ort-cpu'\n", ["target must be a list"]),
        ("[compile]\natol = 1\nrtol = 1\nrtol = 2\n", ["invalid TOML"]),
        ("[compile]\ntarget = ['a']\ntargets = ['b']\n", ["twice"]),
        # a TOML value of the wrong kind: not cast (true is not atol 1.0), not an internal error
        ("[compile]\natol = true\n", ["[compile] atol must be a number, got true"]),
        ("[compile]\nquiet = 1\n", ["[compile] quiet must be true or false, got 1"]),
        ("[compile]\nreport = 5\n", ["[compile] report must be a string, got 5"]),
        ("[compile]\npasses = ['fold-constants']\n", ["[compile] passes must be a string, got a list"]),
        ("[compile]\ntarget = ['ort-cpu', true]\n", ["[compile] target[1] must be a string, got true"]),
    ],
)
def test_mistakes_name_the_file_and_key(compile_cmd, tmp_path, body, needles):
    cfg = tmp_path / "precast.toml"
    cfg.write_text(body)
    with pytest.raises(UsageError) as info:
        read_config(compile_cmd, str(cfg))
    message = str(info.value)
    assert str(cfg) in message and "\n" not in message
    for n in needles:
        assert n in message, (n, message)


def test_cli_reads_the_file_and_the_command_line_wins(cli, mlp_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ./precast.toml is read without --config
    (tmp_path / "precast.toml").write_text('[compile]\ndim = ["nosuch=3"]\n')
    r = cli("compile", mlp_path, "-o", tmp_path / "o", "-q")
    assert r.code == 1 and "'nosuch'" in _last_error(r)  # the file's --dim reached the compile
    (tmp_path / "precast.toml").write_text(
        f'[compile]\noutput = "{tmp_path / "o"}"\njson = true\natol = 0.5\n'
    )
    r = cli("compile", mlp_path, "--atol", "0.25")
    assert r.code == 0, r.err
    manifest = json.loads(r.out)
    assert manifest["artifact"]["path"] == str(tmp_path / "o")
    assert manifest["parity"]["tolerance"]["atol"] == 0.25
    (tmp_path / "precast.toml").write_text("[compile]\nbogus = 1\n")
    r = cli("compile", mlp_path, "-o", tmp_path / "p")
    assert r.code == 1 and "precast.toml: unknown key 'bogus' in [compile]" in _last_error(r)


def test_serve_reads_its_table_and_the_command_line_wins(tmp_path, monkeypatch):
    """`precast serve` takes a [serve] table, keyed by its generated flags; the ServerConfig it builds has the
    file's values where the command line says nothing."""
    import precast.runtime.server as server
    from precast.cli.main import main

    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    (tmp_path / "art").mkdir()
    cfg = tmp_path / "precast.toml"
    cfg.write_text('[serve]\nport = 9123\nmax_batch_size = 3\nmax_num_seqs = 5\nhost = "0.0.0.0"\n')
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path / "art"), "--config", str(cfg), "--port", "9124"])
    assert e.value.code == 0
    (config,) = seen
    assert (config.port, config.max_batch_size, config.host) == (9124, 3, "0.0.0.0")
    assert config.llm["max_num_seqs"] == 5
    cfg.write_text("[serve]\nmax_batch_siz = 3\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path / "art"), "--config", str(cfg)])
    assert e.value.code == 1
