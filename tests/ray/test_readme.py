"""The README's runnable blocks, run as written from a fresh copy of the repository.

A fenced block whose info string is ``bash runnable`` or ``python runnable`` is a path a
newcomer follows: its commands run in order, in one copy of the tracked files, each as its
own process (bash blocks line by line, a python block as one script). The only change is
the tiny setting: every ``raytrain-ext train`` gets ``run.max_steps`` appended, so CI pays
seconds, not minutes. Each command must exit 0 and print no traceback; what the commands
leave (an export whose tokenizer is the run's, prepared shards, the report) is checked.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.helpers.cli import clean_env

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```(bash|python) runnable\n(.*?)^```", re.S | re.M)
TINY = "run.max_steps=8"


def runnable_blocks(readme: str) -> List[Tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall(readme)]


def bash_commands(body: str) -> List[str]:
    """One command per logical line: continuations joined, comments dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", body)
    commands = []
    for line in joined.splitlines():
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def fresh_copy(target: Path) -> Path:
    """The repository's tracked and untracked-but-not-ignored files, as a clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def tiny(command: str) -> str:
    return f"{command} {TINY}" if command.startswith("raytrain-ext train") else command


def test_runnable_blocks_are_found():
    blocks = runnable_blocks((REPO / "README.md").read_text())
    assert [lang for lang, _ in blocks] == ["bash", "python", "bash"]
    assert bash_commands("a \\\n  b  # note\n# only a comment\nc\n") == ["a b", "c"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the tracked files")
def test_the_readmes_runnable_commands_run_as_written_from_a_fresh_copy(tmp_path):
    from transformers import AutoTokenizer

    clone = fresh_copy(tmp_path / "clone")
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    ran = []
    for lang, body in runnable_blocks((clone / "README.md").read_text()):
        steps = bash_commands(body) if lang == "bash" else [body]
        for step in steps:
            argv = ["bash", "-c", tiny(step)] if lang == "bash" else [sys.executable, "-c", step]
            done = subprocess.run(
                argv, cwd=clone, env=env, capture_output=True, text=True, timeout=300
            )
            output = done.stdout + done.stderr
            assert done.returncode == 0, f"{step}\n{output[-3000:]}"
            assert "Traceback" not in output, f"{step}\n{output[-3000:]}"
            ran.append((step, done.stdout))
    assert len(ran) == 7

    exported = clone / "out" / "sft-tiny"
    trained_with = AutoTokenizer.from_pretrained(clone / "configs" / "data" / "tiny-tokenizer")
    loaded = AutoTokenizer.from_pretrained(exported)
    text = "A small boat finds the weights. first word ?"
    assert loaded(text)["input_ids"] == trained_with(text)["input_ids"]
    assert loaded.eos_token == trained_with.eos_token
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == trained_with.eos_token_id
    assert (clone / "runs" / "sft-tiny" / "report.md").is_file()
    assert (clone / "data" / "sft-tiny" / "index.json").is_file()
    # the SFT config names no objective: chat records train with sft by default
    for run_name, objective in (("sft-tiny", "sft"), ("dpo-tiny", "dpo"), ("sft-prepared", "sft")):
        summary = json.loads((clone / "runs" / run_name / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["steps_completed"] == 8, run_name
        assert summary["objective"] == objective, run_name
