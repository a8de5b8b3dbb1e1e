"""Start-up stays light: `--help` and `solve` import none of the heavy libraries.

Counted, not timed: a fresh interpreter builds the parser (every command's help) or runs
`solve`, then lists which of the heavy modules ended up in sys.modules. Importing any of
them costs from a tenth of a second (FastAPI) to seconds (transformers, torch).
"""

import json
import os
import subprocess
import sys

import pytest

# `solve` needs neither the table (Gymnasium, NumPy) nor any model or server library; the flags
# are read from the settings models, which must not pull any of them in either.
HEAVY = ("fastapi", "starlette", "uvicorn", "httpx", "aiohttp", "transformers", "torch", "llama_cpp", "ray",
         "gymnasium", "numpy")

PROBE = """
import json, sys
import blackjack_rl.cli as cli
{body}
print(json.dumps({{"heavy": [m for m in {heavy!r} if m in sys.modules], "modules": len(sys.modules)}}),
      file=sys.stderr)
"""

HELP = """
import contextlib, io
parser = cli.build_parser()
with contextlib.redirect_stdout(io.StringIO()):
    parser.format_help()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        sub.format_help()
"""

SOLVE = """
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(["solve"]) == 0
"""


def _loaded(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(body=body, heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("body", [HELP, SOLVE], ids=["help", "solve"])
def test_help_and_solve_import_no_heavy_library(body):
    loaded = _loaded(body)
    assert loaded["heavy"] == [], f"imported at start-up: {loaded['heavy']} ({loaded['modules']} modules in all)"


def test_the_probe_sees_a_heavy_import():
    """The probe itself works: a command that needs FastAPI does load it."""
    loaded = _loaded("import blackjack_rl.api.server")
    assert "fastapi" in loaded["heavy"]


def test_the_token_id_path_loads_no_chat_client():
    """The completions policy (`--server`, `--token-path`) talks through httpx; the chat body it shares
    with the chat policy lives apart from aiohttp, whose import builds TLS contexts it never uses."""
    loaded = _loaded("import blackjack_rl.policies.openai_completions")
    assert "httpx" in loaded["heavy"] and "aiohttp" not in loaded["heavy"], loaded


def test_the_api_client_loads_no_server():
    """A trainer or worker that talks to the API imports its client, never FastAPI and the server."""
    loaded = _loaded("import blackjack_rl.api.client, blackjack_rl.train.sources\nfrom blackjack_rl.api import TrainerClient")
    assert "httpx" in loaded["heavy"] and not {"fastapi", "starlette", "uvicorn"} & set(loaded["heavy"]), loaded
    assert "fastapi" in _loaded("from blackjack_rl.api import create_app")["heavy"]


def test_an_api_client_error_is_still_one_line(monkeypatch, capsys):
    """The API client's errors stay user errors (one line, exit 2) now that cli.py imports the
    client only in the handlers that use it."""
    import blackjack_rl.cli as cli
    from blackjack_rl.api.client import ApiRejected

    def refused(args, console):
        raise ApiRejected(409, "no trainer has registered; POST /register first", "POST", "/scored_data")

    monkeypatch.setattr(cli, "_cmd_solve", refused)
    assert cli.main(["solve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: POST /scored_data refused with 409") and err.count("\n") == 1


@pytest.mark.parametrize("given", [None, "0"])
def test_commands_give_torch_huge_pages_unless_the_user_chose(monkeypatch, capsys, given):
    """Large torch buffers (the vocabulary head's) are backed by transparent huge pages in every
    command: without it a tiny model's training run spent a third of its time in page faults."""
    from blackjack_rl.cli import main

    if given is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", given)
    assert main(["solve", "--json"]) == 0
    capsys.readouterr()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == (given or "1")
