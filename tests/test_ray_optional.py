"""Ray is an optional extra: without it, --ray is a one-line error and everything else runs as before."""

from __future__ import annotations

import subprocess
import sys

from helpers import cli_env

# Runs the CLI with `import ray` failing, as on an install without the extra.
NO_RAY = """
import sys
sys.modules["ray"] = None
from blackjack_rl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_ray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_RAY, *args], env=cli_env(), capture_output=True, text=True,
                          timeout=120)


def test_ray_flag_without_the_extra_is_one_line_telling_what_to_install(tmp_path):
    for args in (["evaluate", "--policy", "optimal", "--episodes", "5"],
                 ["process", "--policy", "optimal", "--groups", "2"],
                 ["serve", "--policy", "optimal", "--workers", "2"]):
        run = run_without_ray(*args, "--ray", "--out", str(tmp_path / args[0]))
        assert run.returncode == 2, run.stdout + run.stderr
        lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
        assert lines == ["error: --ray needs Ray: pip install 'blackjack-rl[ray]'"]
        assert not (tmp_path / args[0] / "metrics.json").exists()


def test_without_the_extra_and_without_the_flag_nothing_changes(tmp_path):
    run = run_without_ray("evaluate", "--policy", "optimal", "--episodes", "20", "--quiet", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "metrics.json").is_file()


def test_an_address_where_no_cluster_listens_is_one_line_at_once(tmp_path):
    """ray.init would retry such an address for minutes, printing a warning every few seconds."""
    import socket

    from helpers import run_cli

    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for args in (["evaluate", "--policy", "optimal", "--episodes", "5", "--ray", f"127.0.0.1:{port}"],
                 ["serve", "--policy", "optimal", "--workers", "2", "--ray", f"ray://127.0.0.1:{port}"],
                 ["process", "--policy", "optimal", "--groups", "2", "--ray", "no-port-here"]):
        run = run_cli(*args, "--out", str(tmp_path / args[0]), timeout=60)
        assert run.returncode == 2, run.stdout + run.stderr
        lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: --ray {args[-1]}: "), lines
