"""What pyproject.toml promises about dependencies, checked against the installed libraries.

- httpcore is pinned because policies/pool.py replaces one of its private methods: inside
  the pinned range, httpcore must still have that method and still call it.
- matplotlib is in the `train` extra only: everything else (the commands users run and the
  reports they write) works in a process where importing it fails.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

import httpcore
import httpx
from canned_server import CannedServer
from helpers import SRC, cli_env
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from blackjack_rl.policies import pool

# Runs the rest of the script (argv[1:]) with `import matplotlib` failing as on an install
# without it; every attempt to import it is printed as `asked matplotlib...` on stderr.
WITHOUT_MATPLOTLIB = """
import importlib.abc, sys

class NoMatplotlib(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "matplotlib":
            print("asked", name, file=sys.stderr)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMatplotlib())
"""

# Imports every module of the package outside train/ (and no `__main__`, which would run a
# command), then prints what it imported and which optional extras were missing.
IMPORT_ALL = """
import importlib, json, pkgutil
import blackjack_rl

imported, missing = [], {}
for info in pkgutil.walk_packages(blackjack_rl.__path__, "blackjack_rl."):
    name = info.name
    if name.startswith("blackjack_rl.train") or name.rpartition(".")[2] == "__main__":
        continue
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name.partition(".")[0] == "matplotlib":
            raise
        missing[name] = e.name  # an optional extra that is not installed
    else:
        imported.append(name)
print(json.dumps({"imported": imported, "missing": missing}))
"""

RUN_CLI = """
from blackjack_rl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _requirement(name: str) -> Requirement:
    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (req,) = [r for r in map(Requirement, project["dependencies"]) if r.name == name]
    return req


def test_the_installed_httpcore_is_in_the_pinned_range():
    pin = _requirement("httpcore")
    assert pin.specifier, "httpcore must be pinned: policies/pool.py patches its private API"
    assert pin.specifier.contains(version("httpcore")), (version("httpcore"), str(pin.specifier))


def test_httpcore_calls_the_method_the_pool_replaces():
    """The guard in policies/pool.py accepts the installed httpcore, and a real request goes
    through our assignment: a rename inside the pinned range fails here, not silently."""
    assert "_assign_requests_to_connections" in vars(httpcore.AsyncConnectionPool)
    calls = []
    original = pool._LinearConnectionPool._assign_requests_to_connections

    def counted(self):
        calls.append(self)
        return original(self)

    async def one_request(url: str) -> int:
        transport = pool._transport(2)
        assert type(transport._pool) is pool._LinearConnectionPool
        async with httpx.AsyncClient(transport=transport) as client:
            return (await client.get(f"{url}/models")).status_code

    pool._LinearConnectionPool._assign_requests_to_connections = counted
    try:
        with CannedServer({}) as server:
            assert asyncio.run(one_request(server.url)) == 200
    finally:
        pool._LinearConnectionPool._assign_requests_to_connections = original
    assert calls, "httpcore no longer calls _assign_requests_to_connections: the patch is dead code"


def _without_matplotlib(script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB + script, *args], env=cli_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_every_module_outside_the_trainer_imports_without_matplotlib():
    run = _without_matplotlib(IMPORT_ALL)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "asked matplotlib" not in run.stderr, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert "blackjack_rl.cli" in result["imported"] and len(result["imported"]) >= 20, result
    assert all(not name.startswith("blackjack_rl.") for name in result["missing"].values()), result


def test_the_commands_and_their_reports_work_without_matplotlib(tmp_path):
    commands = [
        ["--help"],
        ["solve"],
        ["evaluate", "--policy", "optimal", "--episodes", "20", "--quiet", "--out", str(tmp_path / "optimal")],
        ["evaluate", "--policy", "threshold", "--episodes", "20", "--quiet", "--out", str(tmp_path / "threshold")],
        ["compare", str(tmp_path / "optimal"), str(tmp_path / "threshold"), "--out", str(tmp_path / "compare")],
        ["process", "--policy", "random", "--groups", "2", "--group-size", "2", "--quiet", "--out", str(tmp_path / "data")],
        ["grid", "--policy", "threshold", "--out", str(tmp_path / "grid")],
    ]
    for args in commands:
        run = _without_matplotlib(RUN_CLI, *args, cwd=tmp_path)
        assert run.returncode == 0, (args, run.stdout[-2000:], run.stderr[-2000:])
        assert "asked matplotlib" not in run.stderr, (args, run.stderr[-2000:])
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    assert {"optimal/report.html", "threshold/report.html", "compare/compare.html", "data/groups.html"} <= written


# Where the project's own imports live, and the first-party names among them (the package, the
# verifiers environment module, and the helper modules tests and benchmarks import by file name).
_SCANNED = ("src", "tests", "bench", "environments", "docs")
_ROOT = SRC.parent


def _declared_distributions() -> set[str]:
    """Every distribution the project names: core, every extra, and the environment packages."""
    files = [_ROOT / "pyproject.toml", *sorted((_ROOT / "environments").glob("*/pyproject.toml"))]
    names: set[str] = set()
    for path in files:
        project = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        names |= {canonicalize_name(Requirement(r).name) for r in reqs}
    return names


def _imports() -> dict[str, set[str]]:
    """Top-level module -> the files that import it, over every Python file of the checkout."""
    found: dict[str, set[str]] = {}
    for folder in _SCANNED:
        for path in (_ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    found.setdefault(module.partition(".")[0], set()).add(path.relative_to(_ROOT).as_posix())
    return found


def _first_party() -> set[str]:
    local = {"blackjack_rl"}
    for folder in _SCANNED:
        local |= {p.stem for p in (_ROOT / folder).rglob("*.py")}
        local |= {p.parent.name for p in (_ROOT / folder).rglob("__init__.py")}  # packages, e.g. the taskset's
    return local


def test_every_imported_package_is_named_by_the_project():
    """A package that a module or test imports must be named by pyproject (core or an extra), not
    arrive by luck as another's requirement or by a hand install: a fresh environment made from
    the project's files would then miss it (as TRL's jmespath once did)."""
    declared = _declared_distributions()
    providers = packages_distributions()
    local = _first_party()
    unnamed = {}
    for module, files in sorted(_imports().items()):
        if module in sys.stdlib_module_names or module in local or module == "__future__":
            continue
        dists = providers.get(module) or [module]  # not installed here: the module's own name
        if not {canonicalize_name(d) for d in dists} & declared:
            unnamed[module] = (dists, sorted(files)[:3])
    assert not unnamed, f"imported, but no requirement of the project names it: {unnamed}"


def test_the_test_command_installs_every_extra():
    """scripts/test.sh installs every extra into its fresh environment, but the two it says why it
    leaves out; an extra that quietly drops out of it would leave its tests skipped."""
    script = (_ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    extras = set(tomllib.loads((_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"])
    (installed,) = re.findall(r'pip install (?:--[a-z-]+ )*-e "\.\[([a-z,-]+)\]"', script)
    # wandb needs an account and the network; atroposlib is installed without its requirements
    assert extras - set(installed.split(",")) == {"wandb", "atropos"}
    assert re.search(r'pip install (--[a-z-]+ )*--no-deps "atroposlib==0\.4\.0"', script)
    assert "venv --clear" in script
