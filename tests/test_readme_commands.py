"""The README's commands, as a newcomer runs them: on a fresh copy of the repository, after `./run.sh`, inside the
environment it created (the README says to activate it), each command of the README's bash blocks that runs on a CPU
in about a minute exits 0. Training commands get a short-run override (`--training.steps`); the rest run as written.

Every command is either run here or listed in NOT_ON_A_CPU_IN_A_MINUTE with its reason, so a command added to the
README is run (or classified) by this test.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, env

SHORT_STEPS = "4"
# Commands of the README that this test does not run, each with why (matched by prefix).
NOT_ON_A_CPU_IN_A_MINUTE = {
    "./test.sh": "the suite this test belongs to",
    "pip install": "installs packages (the test extras hold them already)",
    "NGPU=2 ./run.sh": "two GPUs",
    "NNODES=2": "two nodes of GPUs",
    "tensorboard": "a server: it runs until stopped",
    "python bench/": "GPU benchmarks",
}


def readme_commands() -> list[str]:
    """Every command line of README.md's bash blocks, in order: continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                commands.append(" ".join(line.split()))
    return commands


def runnable(command: str) -> bool:
    return not any(command.startswith(prefix) for prefix in NOT_ON_A_CPU_IN_A_MINUTE)


def short(command: str) -> list[str]:
    """The command as argv, training runs cut to SHORT_STEPS steps."""
    argv = shlex.split(command)
    trains = argv[0] == "./run.sh" and not {"--help", "--print-config"} & set(argv)
    if trains and "--training.steps" in argv:
        argv[argv.index("--training.steps") + 1] = SHORT_STEPS
    elif trains:
        argv += ["--training.steps", SHORT_STEPS]
    return argv


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh copy of the repository (the files git tracks or would add) sharing this checkout's environment, where
    the README's first command, `./run.sh`, has trained the default recipe."""
    path = tmp_path_factory.mktemp("readme") / "nsa-titan"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, path / name)
    (path / ".venv").symlink_to(REPO / ".venv")
    (path / "prompts.txt").write_text("def main(\nclass Parser:\n")  # the file `--prompts-file prompts.txt` reads
    assert readme_commands()[0] == "./run.sh"
    run(path, "./run.sh")
    return path


def run(path: Path, command: str) -> None:
    """Run `command` in `path` as a user of the activated environment would; it must exit 0."""
    venv = path / ".venv"
    environment = {**env(), "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
                   "OMP_NUM_THREADS": "1"}
    done = subprocess.run(short(command), cwd=path, env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_every_readme_command_is_run_or_classified():
    skipped = [command for command in readme_commands() if not runnable(command)]
    assert {prefix for prefix in NOT_ON_A_CPU_IN_A_MINUTE if any(c.startswith(prefix) for c in skipped)} == set(
        NOT_ON_A_CPU_IN_A_MINUTE), "a prefix that no README command has any more: drop it"
    assert "python scripts/generate.py runs/debug --prompt \"def main(\" --max-new-tokens 200" in readme_commands()


@pytest.mark.parametrize("command", [c for c in readme_commands()[1:] if runnable(c)])
def test_readme_command_runs_as_written(clone, command):
    run(clone, command)
