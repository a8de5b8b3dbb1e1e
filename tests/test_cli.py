"""The real command line, run as subprocesses: what scripts and docs rely on."""

import json
import os
import subprocess
import sys
from functools import partial

import pytest
from helpers import CLI, poll_until, run_cli

run = partial(run_cli, check=True)


def _commands():
    from blackjack_rl.cli import build_parser
    from blackjack_rl.cli_options import subcommands

    return sorted(subcommands(build_parser()))


COMMANDS = _commands()  # read from the parser, so a new command cannot be left out


def test_the_help_lists_every_command():
    out = run("--help").stdout
    assert "usage:" in out and {"solve", "process", "evaluate", "grid", "compare", "serve", "train", "api"} <= set(COMMANDS)
    for name in COMMANDS:
        assert f"\n    {name} " in out, name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    """The real `--help` of each command names each of its flags."""
    from blackjack_rl.cli import build_parser
    from blackjack_rl.cli_options import subcommands

    if command == "api":
        from blackjack_rl.api.cli import build_parser as api_parser

        parser = api_parser()
    else:
        parser = subcommands(build_parser())[command]
    out = run(command, "--help").stdout
    assert out.startswith(f"usage: blackjack-rl {command}")
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    assert len(flags) > 1
    for flag in flags:
        assert flag in out, flag


def test_solve_json_gives_the_optimum_and_the_chart():
    data = json.loads(run("solve", "--json").stdout)
    assert data["expected_return"] == pytest.approx(-0.04656, abs=5e-6)
    assert data["chart"]["hard"]["16"]["10"] == "hit" and data["chart"]["hard"]["13"]["2"] == "stick"
    assert len(data["q"]) == 18 * 10 + 10 * 10 + 10
    sab = json.loads(run("solve", "--json", "--sab").stdout)
    assert sab["rules"]["sab"] and sab["expected_return"] > data["expected_return"]


def test_solve_prints_a_readable_table():
    out = run("solve").stdout
    assert "-0.04656" in out and "42.95%" in out and "soft hands" in out


def test_process_is_reproducible_with_a_bot(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run("process", "--policy", "random", "--groups", "5", "--group-size", "4", "--seed", "7", "--out", str(out), "--quiet")
    assert (a / "groups.jsonl").read_bytes() == (b / "groups.jsonl").read_bytes()
    lines = (a / "groups.jsonl").read_text().splitlines()
    assert len(lines) == 5
    group = json.loads(lines[0])
    for key in ("tokens", "masks", "scores", "inference_logprobs", "messages", "generation_params", "episodes"):
        assert key in group
    html = (a / "groups.html").read_text()
    assert "<script" in html and 'src="http' not in html and 'href="http' not in html  # self-contained
    other = tmp_path / "c"
    run("process", "--policy", "random", "--groups", "5", "--group-size", "4", "--seed", "8", "--out", str(other), "--quiet")
    assert (other / "groups.jsonl").read_bytes() != (a / "groups.jsonl").read_bytes()


def test_evaluate_optimal_bot_metrics(tmp_path):
    run("evaluate", "--policy", "optimal", "--episodes", "3000", "--out", str(tmp_path), "--quiet")
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["episodes"] == m["episodes_played"] == 3000 and m["episodes_failed"] == 0
    assert m["decision_accuracy"]["rate"] == 1.0 and m["mean_regret"]["mean"] == 0.0
    r = m["mean_reward"]
    assert r["ci95_low"] <= m["optimal_value"] <= r["ci95_high"]
    assert m["win"]["rate"] + m["draw"]["rate"] + m["loss"]["rate"] == pytest.approx(1.0)
    samples = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 3000
    first = json.loads(samples[0])
    assert first["seed"] == m["seeds"]["first"] and first["decisions"][0]["optimal"] in ("hit", "stick")


def test_evaluate_uses_the_same_deals_for_every_policy(tmp_path):
    seeds = []
    for policy in ("optimal", "random"):
        run("evaluate", "--policy", policy, "--episodes", "50", "--out", str(tmp_path / policy), "--quiet")
        rows = [json.loads(x) for x in (tmp_path / policy / "samples.jsonl").read_text().splitlines()]
        seeds.append([(r["seed"], r["player_hand"][:2], r["dealer_hand"][:1]) for r in rows])
    assert seeds[0] == seeds[1]


def test_threshold_bot_and_rules_flags(tmp_path):
    proc = run("evaluate", "--policy", "threshold", "--threshold", "12", "--episodes", "400", "--natural",
               "--out", str(tmp_path), "--quiet")
    assert proc.stderr == ""  # a bot reads the embedded model's vocabulary: llama.cpp's warnings stay out
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["rules"]["natural"] is True and m["policy"]["policy"] == "threshold-12"
    assert m["decision_accuracy"]["rate"] < 1.0


def test_yaml_config_env_and_flags_precedence(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("policy:\n  kind: threshold\n  threshold: 15\nevaluate:\n  episodes: 20\n")
    env = {**__import__("os").environ, "BLACKJACK_RL_EVALUATE__EPISODES": "30"}
    proc = subprocess.run([*CLI, "evaluate", "--config", str(cfg), "--out", str(tmp_path / "o"), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["policy"]["policy"] == "threshold-15" and m["episodes"] == 30  # env beats YAML
    proc = subprocess.run([*CLI, "evaluate", "--config", str(cfg), "--episodes", "10", "--out", str(tmp_path / "p"),
                           "--quiet"], capture_output=True, text=True, env=env, timeout=120)
    assert json.loads((tmp_path / "p" / "metrics.json").read_text())["episodes"] == 10  # flag beats env


def test_bad_settings_give_a_clear_error():
    proc = run("evaluate", "--policy", "openai", "--episodes", "1", check=False)
    assert proc.returncode == 2 and "--model" in proc.stderr
    proc = run("evaluate", "--config", "/nonexistent.yaml", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = run("evaluate", "--config", "/", check=False)
    assert proc.returncode == 2 and "is a folder" in proc.stderr


@pytest.mark.embedded
@pytest.mark.slow  # whole commands on the embedded model
def test_process_and_evaluate_on_the_embedded_model(tmp_path):
    run("process", "--groups", "1", "--group-size", "2", "--max-tokens", "24", "--out", str(tmp_path / "p"), "--quiet")
    group = json.loads((tmp_path / "p" / "groups.jsonl").read_text())
    assert group["generation_params"]["policy"] == "embedded" and len(group["tokens"]) == 2
    trained = [lp for lps, ms in zip(group["inference_logprobs"], group["masks"]) for lp, m in zip(lps, ms) if m != -100]
    assert trained and all(lp <= 0 for lp in trained)
    proc = run("evaluate", "--episodes", "4", "--constrained", "--out", str(tmp_path / "e"), "--quiet")
    m = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert m["policy"]["constrained"] is True and m["invalid"]["rate"] == 0.0 and m["episodes_played"] == 4
    assert "Evaluation of" in proc.stdout


# -- user errors: one line, a non-zero exit, no traceback, no output that looks complete --------

def _yaml(tmp_path, text):
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    return ["--config", str(path)]


USER_ERRORS = {
    "YAML syntax": (lambda t: _yaml(t, "episode:\n  invalid_score: [1\n"), {}, "not valid YAML at line"),
    "YAML list": (lambda t: _yaml(t, "- policy\n- episode\n"), {}, "must hold a mapping"),
    "YAML unknown key": (lambda t: _yaml(t, "episode:\n  invalid_scor: 1\n"), {}, "episode.invalid_scor"),
    "YAML NaN": (lambda t: _yaml(t, "episode:\n  invalid_score: .nan\n"), {}, "finite number"),
    "NaN invalid score": (lambda t: ["--invalid-score", "nan"], {}, "--invalid-score"),
    "inf format bonus": (lambda t: ["--format-bonus=inf"], {}, "--format-bonus"),
    "-inf format bonus": (lambda t: ["--format-bonus=-inf"], {}, "--format-bonus"),
    "NaN temperature": (lambda t: ["--temperature", "nan"], {}, "--temperature"),
    "inf top-p": (lambda t: ["--top-p", "inf"], {}, "--top-p"),
    "inf timeout": (lambda t: ["--timeout", "inf"], {}, "--timeout"),
    "NaN from the environment": (lambda t: [], {"BLACKJACK_RL_EPISODE__FORMAT_BONUS": "nan"}, "format_bonus"),
    "not JSON in the environment": (lambda t: [], {"BLACKJACK_RL_POLICY__SERVERS": "http://x"}, "holds JSON"),
    "--out under a file": (lambda t: ["--out", str(_file(t) / "run")], {}, "cannot write to the output folder"),
    "--out is a file": (lambda t: ["--out", str(_file(t))], {}, "cannot write to the output folder"),
}


def _file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    return path


def _one_error_line(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize("command", ["evaluate", "process"])
@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_are_one_line_and_a_non_zero_exit(case, command, tmp_path):
    args, env, expected = USER_ERRORS[case]
    extra = args(tmp_path)
    out = [] if "--out" in extra else ["--out", str(tmp_path / "run")]
    count = ["--episodes", "3"] if command == "evaluate" else ["--groups", "1", "--group-size", "2"]
    proc = subprocess.run([*CLI, command, "--policy", "optimal", *count, *out, *extra, "--quiet"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert expected in _one_error_line(proc)
    assert not (tmp_path / "run" / "metrics.json").exists() and not (tmp_path / "run" / "groups.jsonl").exists()


def test_api_settings_from_the_environment_that_are_not_json_are_one_line():
    proc = subprocess.run([*CLI, "api", "--port", "1"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BLACKJACK_RL_API_CORS_ORIGINS": "https://example.org"})
    assert "BLACKJACK_RL_API_CORS_ORIGINS" in _one_error_line(proc)


# The CLI as a terminal starts it, with Ctrl-C delivered: a shell that ran the test suite in the
# background (`nohup ... &`) leaves SIGINT ignored in every child, and Python then keeps it ignored.
INTERRUPTIBLE_CLI = [sys.executable, "-c", "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "runpy.run_module('blackjack_rl.cli', run_name='__main__', alter_sys=True)"]


def _stop_when(server, proc, posts):
    """SIGINT once the server has answered `posts` requests (counted, so the run is surely under way)."""
    import signal

    poll_until(lambda: server.posts >= posts or proc.poll() is not None, attempts=2400, interval_s=0.05,
               what=f"{posts} requests to the server")
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=60)


def test_a_stopped_run_leaves_no_file_that_looks_complete(tmp_path, gguf_path):
    """A finished run's folder is reused by a run that is stopped half way: none of the old
    files remain to be mistaken for the new run's, and none of the new ones is half written."""
    from canned_server import CannedServer, chat_answer

    from blackjack_rl.contract.protocol import STICK, tool_call_text

    out = tmp_path / "run"
    run("evaluate", "--policy", "optimal", "--episodes", "20", "--out", str(out), "--quiet")
    run("process", "--policy", "optimal", "--groups", "2", "--group-size", "2", "--out", str(out), "--quiet")
    assert {"metrics.json", "samples.jsonl", "report.html", "groups.jsonl"} <= {p.name for p in out.iterdir()}
    slow = ["--policy", "openai", "--model", "m", "--tokenizer", str(gguf_path), "--concurrency", "1", "--quiet",
            "--out", str(out)]
    with CannedServer(chat_answer({"role": "assistant", "content": tool_call_text(STICK)}), delay_s=0.05) as server:
        proc = subprocess.Popen([*INTERRUPTIBLE_CLI, "evaluate", *slow, "--base-url", server.url, "--episodes", "400"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, stderr = _stop_when(server, proc, 5)
        assert proc.returncode != 0 and "Traceback" not in stderr
        left = {p.name for p in out.iterdir()}
        assert not left & {"metrics.json", "samples.jsonl", "report.html", "samples.jsonl.partial"}, left

        server.posts = 0
        proc = subprocess.Popen([*INTERRUPTIBLE_CLI, "process", *slow, "--base-url", server.url, "--groups", "400",
                                 "--group-size", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, stderr = _stop_when(server, proc, 5)
    assert proc.returncode != 0 and "Traceback" not in stderr
    left = {p.name for p in out.iterdir()}
    assert "groups.jsonl" not in left and "groups.jsonl.partial" in left  # what it wrote, under a telling name
    for line in (out / "groups.jsonl.partial").read_text().splitlines():
        json.loads(line)  # whole lines only


def test_serve_with_an_unwritable_out_is_one_line(tmp_path):
    proc = subprocess.run([*CLI, "serve", "--policy", "optimal", "--out", str(_file(tmp_path) / "w"),
                           "--api-url", "http://127.0.0.1:9", "--register-timeout", "1"],
                          capture_output=True, text=True, timeout=120)
    assert "a-file" in _one_error_line(proc)


def test_serve_stops_retrying_an_api_at_its_register_timeout(tmp_path):
    """--register-timeout bounds the whole wait for registration, an API that keeps answering
    503 included: the retries stop at the deadline. The retry policy alone allows 8 attempts
    (~15 s); within 1 s its backoff (0.1, 0.2, 0.4 s at the least) leaves room for 4 at most."""
    from canned_server import CannedServer

    with CannedServer({"detail": "restarting"}, status=503) as api:
        proc = subprocess.run([*CLI, "serve", "--policy", "optimal", "--out", str(tmp_path / "w"),
                               "--api-url", api.url.removesuffix("/v1"), "--register-timeout", "1"],
                              capture_output=True, text=True, timeout=120)
    assert "register-env" in _one_error_line(proc)
    assert api.posts <= 4, api.posts  # (on a machine slow enough, even the first may not arrive in time)


# Every command that writes a folder proves it writable before it loads a model or plays: the model
# path below does not exist, so a command that loaded first would name the model instead.
OUT_FIRST = {
    "evaluate": ["evaluate", "--episodes", "2"],
    "process": ["process", "--groups", "1"],
    "grid": ["grid"],
    "fidelity": ["fidelity", "GROUPS"],
    "serve": ["serve", "--api-url", "http://127.0.0.1:9"],
    "train": ["train", "--steps", "1"],
}


@pytest.mark.parametrize("command", list(OUT_FIRST))
def test_an_unwritable_output_folder_is_refused_before_any_model_loads(command, tmp_path):
    args = [str(_file(tmp_path)) if a == "GROUPS" else a for a in OUT_FIRST[command]]
    model = ["--model-path", str(tmp_path / ("no-model.gguf" if command != "train" else "no-model"))]
    proc = subprocess.run([*CLI, *args, *model, "--out", str(_file(tmp_path) / "run"), "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert "cannot write to the output folder" in _one_error_line(proc)


def test_a_recipe_run_and_a_resumed_run_check_their_folders_before_the_model_loads(tmp_path):
    proc = subprocess.run([*CLI, "train", "--recipe", "three-phase", "--out", str(_file(tmp_path) / "run")],
                          capture_output=True, text=True, timeout=120)
    assert "cannot write to the output folder" in _one_error_line(proc)
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([*CLI, "train", "--resume", str(empty), "--model-path",
                           str(tmp_path / "no-model"), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert "not a checkpoint with trainer state" in _one_error_line(proc)


@pytest.mark.parametrize("args", [
    ["serve", "--policy", "optimal", "--api-url", "notaurl"],
    ["train", "--source", "api", "--api-url", "localhost:8000", "--steps", "1"],
    ["evaluate", "--policy", "openai", "--model", "m", "--base-url", "ftp://host/v1"],
    ["evaluate", "--policy", "openai", "--model", "m", "--base-url", "http://host:99999/v1"],
    ["process", "--policy", "openai", "--model", "m", "--server", "http://:8000/v1"],
])
def test_a_server_address_that_is_not_an_http_url_is_refused_before_any_request(args, tmp_path):
    proc = subprocess.run([*CLI, *args, "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    line = _one_error_line(proc)
    assert "URL" in line and args[-1 if args[0] != "train" else -3] in line and "Value error" not in line


@pytest.mark.parametrize("args", [
    ["evaluate", "--seed", "5", "--episodes", "2"],  # the evaluation deals and their sampling seeds are fixed
    ["grid", "--seed", "3"],
    ["grid", "--concurrency", "4"],  # the chart reads probabilities; nothing plays at once
    ["grid", "--top-p", "0.9"],  # ... at the temperature alone, untruncated
    ["grid", "--format-bonus", "0.1"],  # and scores an invalid answer as a forfeit
    ["grid", "--invalid-retries", "2"],
    ["fidelity", "--top-k", "5", "GROUPS"],
])
def test_a_flag_the_command_would_not_read_is_refused(args, tmp_path):
    args = [str(_file(tmp_path)) if a == "GROUPS" else a for a in args]
    proc = subprocess.run([*CLI, *args, "--policy", "optimal", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert f"{args[1]} is an option of" in _one_error_line(proc) and not (tmp_path / "o").exists()
