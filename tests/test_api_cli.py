"""`blackjack-rl api` command line: help, flags over environment variables, clear refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_env

from blackjack_rl.api.cli import build_parser, config_from_args, main


def test_help_names_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--db", "--token", "--max-queued-sequences", "--max-body-mb",
                 "--cors-origin", "--sync", "--ingest-workers", "BLACKJACK_RL_API_TOKEN", "127.0.0.1"):
        assert flag in out


def test_flags_win_over_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLACKJACK_RL_API_TOKEN", "from-env")
    monkeypatch.setenv("BLACKJACK_RL_API_PORT", "9001")
    config = config_from_args(build_parser().parse_args(["--port", "9002", "--max-body-mb", "2",
                                                         "--cors-origin", "https://a", "--cors-origin", "https://b"]))
    assert config.port == 9002 and config.token_value() == "from-env"
    assert config.max_body_bytes == 2 * 1024 * 1024 and config.cors_origins == ["https://a", "https://b"]
    assert config.host == "127.0.0.1"
    assert config_from_args(build_parser().parse_args(["--token", "flag"])).token_value() == "flag"


def test_invalid_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-queued-sequences", "0"]) == 2
    assert "max_queued_sequences" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--env-lease", "0.1"], ["--env-lease", "nan"], ["--env-lease", "1e9"],
                                  ["--env-lease", "soon"]])
def test_an_env_lease_out_of_bounds_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: not a number at all
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "--env-lease" in err and len(err.strip().splitlines()) == 1, err


def test_an_env_lease_from_the_environment_is_checked_too(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("BLACKJACK_RL_API_ENV_LEASE_S", "0")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "env_lease_s" in err and "greater than or equal to 0.5" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("BLACKJACK_RL_API_ENV_LEASE_S", "5")
    assert config_from_args(build_parser().parse_args([])).env_lease_s == 5.0
    assert config_from_args(build_parser().parse_args(["--env-lease", "7"])).env_lease_s == 7.0


def run_api_cli(db: Path) -> subprocess.CompletedProcess[str]:
    """`python -m blackjack_rl.api --db DB` on a free port; it is expected to refuse and exit."""
    return subprocess.run([sys.executable, "-m", "blackjack_rl.api", "--db", str(db), "--port", "0"],
                          capture_output=True, text=True, timeout=60,
                          env=cli_env({k: v for k, v in os.environ.items() if not k.startswith("BLACKJACK_RL_API_")}))


@pytest.mark.parametrize("name", ["same path", "hard link", "symlink"])
def test_a_database_in_use_is_refused_with_one_line(tmp_path: Path, name: str) -> None:
    """The lock follows the file, not its name: another name of the same file is refused too."""
    from blackjack_rl.api.store import take_lock

    db = tmp_path / "busy.sqlite"
    held = take_lock(db)
    other = tmp_path / "elsewhere" / "other.sqlite"
    other.parent.mkdir()
    if name == "hard link":
        os.link(db, other)
    elif name == "symlink":
        other.symlink_to(db)
    else:
        other = db
    try:
        run = run_api_cli(other)
    finally:
        held.release()
    assert run.returncode == 1
    assert "another trajectory API process is using" in run.stderr and "Traceback" not in run.stderr


def test_a_database_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    run = run_api_cli(tmp_path)
    assert run.returncode == 1 and "is not a file" in run.stderr and "Traceback" not in run.stderr


def test_a_database_under_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    run = run_api_cli(tmp_path / "a-file" / "sub" / "db.sqlite")
    assert run.returncode == 1 and run.stderr.strip().endswith(f"{tmp_path / 'a-file'} is a file, not a folder")


@pytest.mark.parametrize("content", [b"this is not an SQLite database" * 100, b"SQLite format 3\x00" + b"\xff" * 5000])
def test_a_damaged_database_is_one_line(tmp_path: Path, content: bytes) -> None:
    db = tmp_path / "damaged.sqlite"
    db.write_bytes(content)
    run = run_api_cli(db)
    assert run.returncode == 1 and "error:" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
