"""First contact with the command line: the version, help printed once, a clear --trace error."""
import pytest

from simkv._version import __version__
from tests.test_cli_commands import simkv


def test_version_prints_the_package_version():
    done = simkv("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"simkv {__version__}"


@pytest.mark.parametrize("argv", [[], ["trace"], ["bench"], ["fit"]], ids=lambda a: " ".join(a) or "bare")
def test_a_group_without_a_command_prints_its_help_once(argv):
    done = simkv(*argv)
    assert done.returncode == 0
    assert done.stdout.count("Usage:") == 1, done.stdout
    assert done.stderr == ""


def test_a_missing_trace_file_names_the_trace_option(tmp_path):
    done = simkv("run", "scenarios/quickstart.yaml", "--trace", tmp_path / "trace.csv")
    assert done.returncode == 2
    assert done.stderr.startswith("error: --trace: no such file:") and "--set" not in done.stderr
    assert done.stderr.count("\n") == 1
