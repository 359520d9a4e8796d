"""The README's Quick tour as a new user meets it after `make demo`: in a shell whose PATH lacks the venv,
the tour's first command is not found until the user does what the text above it says (and what `make demo`
prints at its end)."""

import os
import re
import subprocess

import pytest

from conftest import ROOT

ACTIVATE = "source .venv/bin/activate"


def _shell(command):
    """``command`` in bash at the repository root, with a PATH of system directories only."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not os.path.isfile(os.path.join(p, "trainrun-data")))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=dict(env, PATH=path), capture_output=True,
                          text=True, timeout=60)


def test_the_tour_says_how_to_get_its_commands_on_path():
    if not os.path.isfile(os.path.join(ROOT, ".venv", "bin", "activate")):
        pytest.skip("the suite does not run from the repository's .venv (make test makes it)")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        tour = fh.read().split("## Quick tour", 1)[1]
    intro, block = tour.split("```", 2)[:2]
    first = next(line for line in block.splitlines() if line.strip() and not line.startswith("#"))
    program = first.split()[0]
    assert program == "trainrun-data" and _shell(f"{program} --help").returncode == 127    # command not found
    hints = re.findall(r"`([^`]+)`", intro)
    assert ACTIVATE in hints and f".venv/bin/{program}" in hints, intro
    p = _shell(f"{ACTIVATE} && {program} --help")
    assert p.returncode == 0 and "Build and check trainrun's binary datasets" in p.stdout, p.stderr
    assert _shell(f".venv/bin/{program} --help").returncode == 0
    with open(os.path.join(ROOT, "scripts", "demo.sh"), encoding="utf-8") as fh:
        last = fh.read().rstrip().splitlines()[-2:]          # what make demo prints last
    assert all(line.startswith("echo ") for line in last) and ACTIVATE in last[0], last


def _tour_block():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return fh.read().split("## Quick tour", 1)[1].split("```", 2)[1]


def test_the_tour_after_make_demo_writes_nothing_the_demo_wrote():
    """`make demo` then the tour's commands as printed: no tour command writes where the demo wrote (its
    dataset, its run), so the tour's first command is not refused ("already holds ...; pass --overwrite")."""
    import yaml
    block = _tour_block()
    written = re.findall(r"--output[ =](\S+)", block) + re.findall(r"run\.output_dir=(\S+)", block)
    with open(os.path.join(ROOT, "configs", "gpt2-tiny.yaml"), encoding="utf-8") as fh:   # its runs without --set
        written.append(os.path.normpath(os.path.join("configs", yaml.safe_load(fh)["run"]["output_dir"])))
    assert "data/stdlib" in written and "runs/gpt2-tiny" in written, written
    with open(os.path.join(ROOT, "scripts", "demo.sh"), encoding="utf-8") as fh:
        demo = dict(re.findall(r"^(RUN|DATA)=(\S+)$", fh.read(), re.M))
    assert set(demo) == {"RUN", "DATA"}, demo
    for theirs in demo.values():
        for ours in written:
            assert not (ours == theirs or ours.startswith(theirs + "/") or theirs.startswith(ours + "/")), \
                (ours, theirs)
