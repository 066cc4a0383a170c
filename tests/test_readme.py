"""Every code block of README.md and docs/ runs, so the documentation cannot drift from the code.

Python and shell blocks are executed on the CPU, each in a fresh process, in a scratch
directory holding what a fresh clone has (`examples/`, `.venv`: this interpreter's).
README blocks run with nothing started for them: no daemon, no $TIERSTACK_TIER_MANAGER
(what they need they start themselves, as a new user's would). Blocks of docs/ may also
presume `ds_config.json` (a DeepSpeed JSON), `./my-llama` (a tiny LLaMA config directory),
`notes.txt`, and a running scheduler with a tier manager registered with it as node
"node0", found as a user's would be: $TIERSTACK_SCHEDULER and $TIERSTACK_TIER_MANAGER
(the guides say to start them first). JSON blocks are loaded as tierstack configs.

An HTML comment right before a block tells this test how to run it, in view of anyone
reading the source:

    <!-- readme-test
    skip: why this block cannot run here (printed)
    requires: promtool, curl         (skipped, saying so, when a program is missing)
    replace: OLD => NEW               (tiny sizes and scratch paths: {tmp} {shm} {port})
    run-by: tests/deploy/test_x.py    (that test runs the block as written: it needs root, an sshd)
    -->
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tierstack.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
BLOCK_SECONDS = 240

DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
             "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                   "offload_optimizer": {"device": "cpu"}}}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "vocab_size": 256, "max_position_embeddings": 64}


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    skip: str = ""
    requires: list[str] = field(default_factory=list)
    replace: list[tuple[str, str]] = field(default_factory=list)
    run_by: str = ""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.lang}"

    @property
    def in_readme(self) -> bool:
        return self.path == README


def readme_blocks(path: Path = README) -> list[Block]:
    """The fenced blocks of a page with a language, each with its readme-test comment."""
    lines = path.read_text().splitlines()
    blocks, marker, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!-- readme-test"):
            body = []
            i += 1
            while not lines[i].startswith("-->"):
                body.append(lines[i])
                i += 1
            marker = body
        elif line.startswith("```"):
            lang, start, code = line[3:].strip(), i + 1, []
            i += 1
            while not lines[i].startswith("```"):
                code.append(lines[i])
                i += 1
            if lang:
                block = Block(path, start, lang, "\n".join(code) + "\n")
                for entry in marker or []:
                    key, _, value = entry.partition(":")
                    if key == "skip":
                        block.skip = value.strip()
                    elif key == "requires":
                        block.requires = [v.strip() for v in value.split(",")]
                    elif key == "run-by":
                        block.run_by = value.strip()
                    elif key == "replace":
                        old, _, new = value.strip().partition(" => ")
                        block.replace.append((old, new))
                    else:
                        raise AssertionError(f"{path}:{start}: unknown readme-test key {key!r}")
                blocks.append(block)
            marker = None
        elif line.strip():
            marker = None  # a marker belongs to the block right after it
        i += 1
    return blocks


BLOCKS = [b for page in [README, *DOCS] for b in readme_blocks(page)]


def test_the_readme_has_code_to_run_and_says_why_it_skips_any():
    readme = [b for b in BLOCKS if b.in_readme]
    assert [b.lang for b in readme].count("python") >= 1
    assert [b.lang for b in readme].count("bash") >= 3
    assert len([b for b in readme if b.skip]) <= 1, [b.name for b in readme if b.skip]
    assert all(len(b.skip) > 20 for b in BLOCKS if b.skip)  # a reason, not a shrug


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """A scheduler and a tier manager registered with it as node0 (small pools)."""
    from tierstack.config import SchedulerConfig
    from tierstack.services.scheduler.embedded import EmbeddedScheduler
    from tierstack.services.tier_manager.embedded import EmbeddedTierManager

    root = tmp_path_factory.mktemp("readme-services")
    shm = Path("/dev/shm") / f"tierstack-readme-{os.getpid()}"
    shm.mkdir(mode=0o700)
    tm = load_config({"tier_manager": {
        "cpu_pool": {"size": "64MiB", "shm_dir": str(shm)},
        "nvme_pool": {"paths": [str(root / "nvme")], "size": "512MiB"},
        "manifest_path": str(root / "manifest.sqlite"), "node_id": "node0",
        "metrics": {"http_listen": "127.0.0.1:0"}}}).tier_manager
    try:
        with EmbeddedScheduler(SchedulerConfig()) as scheduler:
            tm.scheduler_address = scheduler.address
            with EmbeddedTierManager(tm) as daemon:
                yield {"TIERSTACK_SCHEDULER": scheduler.address,
                       "TIERSTACK_TIER_MANAGER": daemon.address}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _workdir(tmp_path: Path, block: Block) -> Path:
    """The directory a block runs in: what a fresh clone has, and for docs/ pages what
    their guides presume is there too."""
    workdir = tmp_path / "clone"
    workdir.mkdir()
    # The venv itself (its pyvenv.cfg too: `.venv/bin/python` must be the venv's python).
    (workdir / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (workdir / "examples").symlink_to(ROOT / "examples")
    if not block.in_readme:
        (workdir / "ds_config.json").write_text(json.dumps(DS_CONFIG))
        (workdir / "my-llama").mkdir()
        (workdir / "my-llama" / "config.json").write_text(json.dumps(TINY_LLAMA))
        (workdir / "notes.txt").write_text(README.read_text())
    return workdir


def _fresh_user_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a user who started nothing: no tierstack service addresses, a
    default socket nobody listens on, a state directory of their own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TIERSTACK_TIER_MANAGER", "TIERSTACK_SCHEDULER")}
    env["TIERSTACK_TIER_MANAGER"] = f"unix:{tmp_path}/nobody-listens-here.sock"
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return env


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "bash")],
                         ids=lambda b: b.name)
def test_readme_block_runs(block: Block, request, tmp_path: Path):
    if block.skip:
        pytest.skip(f"{block.name}: {block.skip}")
    if block.run_by:  # that test must exist and read the block from this page, not a copy
        runner = ROOT / block.run_by
        assert runner.is_file(), f"{block.name}: run-by {block.run_by}, which does not exist"
        assert "readme_blocks" in runner.read_text(), f"{block.run_by} does not read {block.path.name}"
        pytest.skip(f"{block.name}: run as written by {block.run_by}")
    missing = [tool for tool in block.requires if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{block.name}: needs {', '.join(missing)}, not installed here")
    # Unique across xdist workers too (tmp_path's name is per worker, truncated: two
    # blocks of one page run on two workers gave one name).
    shm = Path(tempfile.mkdtemp(prefix="tierstack-readme-", dir="/dev/shm"))
    values = {"tmp": str(tmp_path / "scratch"), "shm": str(shm), "port": str(_free_port())}
    code = block.code
    for old, new in block.replace:
        assert old in code, f"{block.name}: readme-test replaces {old!r}, which the block lacks"
        code = code.replace(old, new.format(**values))
    workdir = _workdir(tmp_path, block)
    if block.in_readme:  # as a new user runs it: nothing started for it
        env = {**_fresh_user_env(tmp_path), "COLUMNS": "200"}
    else:
        env = {**os.environ, **request.getfixturevalue("services"), "COLUMNS": "200"}
    if block.lang == "python":
        cmd = [sys.executable, "-c", code]
    else:  # background jobs the block started die with it, even when it fails half-way
        cmd = ["bash", "-c", "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + code]
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{block.name} ran over {BLOCK_SECONDS} s:\n{out[-4000:]}") from None
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert proc.returncode == 0, f"{block.name} failed ({proc.returncode}):\n{code}\n---\n{out[-4000:]}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.name)
def test_readme_config_is_a_valid_config(block: Block):
    load_config(json.loads(block.code))
