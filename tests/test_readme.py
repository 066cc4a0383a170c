"""Every code block of README.md runs, so the README cannot drift from the code.

Python and shell blocks are executed on the CPU, each in a fresh process, in a scratch
directory holding what the README presumes a user has there: `.venv/bin` (this
interpreter's), `ds_config.json` (a DeepSpeed JSON), `./my-llama` (a tiny LLaMA config
directory) and `notes.txt`. A running scheduler and a tier manager registered with it as
node "node0" are found the way a user's would be: $TIERSTACK_SCHEDULER and
$TIERSTACK_TIER_MANAGER. JSON blocks are loaded as tierstack configs.

An HTML comment right before a block tells this test how to run it, in view of anyone
reading the README's source:

    <!-- readme-test
    skip: why this block cannot run here (printed)
    requires: promtool, curl         (skipped, saying so, when a program is missing)
    replace: OLD => NEW               (tiny sizes and scratch paths: {tmp} {shm} {port})
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tierstack.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
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
    line: int
    lang: str
    code: str
    skip: str = ""
    requires: list[str] = field(default_factory=list)
    replace: list[tuple[str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"README.md:{self.line}:{self.lang}"


def readme_blocks() -> list[Block]:
    """The fenced blocks of README.md with a language, each with its readme-test comment."""
    lines = README.read_text().splitlines()
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
                block = Block(start, lang, "\n".join(code) + "\n")
                for entry in marker or []:
                    key, _, value = entry.partition(":")
                    if key == "skip":
                        block.skip = value.strip()
                    elif key == "requires":
                        block.requires = [v.strip() for v in value.split(",")]
                    elif key == "replace":
                        old, _, new = value.strip().partition(" => ")
                        block.replace.append((old, new))
                    else:
                        raise AssertionError(f"README.md:{start}: unknown readme-test key {key!r}")
                blocks.append(block)
            marker = None
        elif line.strip():
            marker = None  # a marker belongs to the block right after it
        i += 1
    return blocks


BLOCKS = readme_blocks()


def test_the_readme_has_code_to_run_and_says_why_it_skips_any():
    langs = [b.lang for b in BLOCKS]
    assert langs.count("python") >= 3 and langs.count("bash") >= 4
    skipped = [b for b in BLOCKS if b.skip]
    assert all(len(b.skip) > 20 for b in skipped)  # a reason, not a shrug
    assert len(skipped) <= 3, [b.name for b in skipped]


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


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The directory a README block runs in, with what the README presumes is there."""
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    (tmp_path / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    (tmp_path / "my-llama").mkdir()
    (tmp_path / "my-llama" / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "notes.txt").write_text(README.read_text())
    return tmp_path


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "bash")],
                         ids=lambda b: b.name)
def test_readme_block_runs(block: Block, services, workdir: Path, tmp_path: Path):
    if block.skip:
        pytest.skip(f"{block.name}: {block.skip}")
    missing = [tool for tool in block.requires if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{block.name}: needs {', '.join(missing)}, not installed here")
    shm = Path("/dev/shm") / f"tierstack-readme-{tmp_path.name}"
    shm.mkdir(mode=0o700)
    values = {"tmp": str(tmp_path / "scratch"), "shm": str(shm), "port": str(_free_port())}
    code = block.code
    for old, new in block.replace:
        assert old in code, f"{block.name}: readme-test replaces {old!r}, which the block lacks"
        code = code.replace(old, new.format(**values))
    env = {**os.environ, **services, "COLUMNS": "200"}
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
