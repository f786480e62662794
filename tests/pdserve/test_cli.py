"""pdserve/cli.py: each process builds only its own sub-command's flags (and imports only its
modules), and parses what the whole command line parses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cli import ROLES, _command_of, build_parser


def test_the_command_is_the_first_word_that_is_not_an_option() -> None:
    assert _command_of(["serve", "--model", "m"]) == "serve"
    assert _command_of(["--log-level", "DEBUG", "gateway", "--port", "1"]) == "gateway"
    assert _command_of(["--log-level=DEBUG", "decode"]) == "decode"
    assert _command_of(["--help"]) is None
    assert _command_of([]) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["gateway", "--model", "m", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
        ["serve", "--model", "m", "--num-prefill", "0", "--max-num-seqs", "8"],
        ["decode", "--model", "m", "--max-num-batched-tokens", "64"],
        ["prefill", "--model", "m", "--dtype", "float32"],
    ],
)
def test_one_command_parses_as_the_whole_parser_does(argv: list[str]) -> None:
    assert build_parser(argv[0]).parse_args(argv) == build_parser().parse_args(argv)


def test_help_lists_every_command_and_a_gateway_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from pdserve.cli import build_parser\n"
        "build_parser('gateway').parse_args(sys.argv[1:])\n"
        "print('torch' in sys.modules)\n"
    )
    argv = ["gateway", "--model", "m", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0
    for name in (*ROLES, "generate", "make-model", "bench"):
        assert name in helped.stdout, name
