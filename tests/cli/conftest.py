import pytest

from precast.cli.main import main


class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def cli(capsys):
    """Run the precast CLI in-process; returns (exit code, stdout, stderr)."""

    def run(*args):
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run
