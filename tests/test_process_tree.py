"""tierstack.process_tree on real processes."""

from __future__ import annotations

import subprocess
import sys

from tierstack.process_tree import alive, children, kill_tree, process_tree


def test_kill_tree_ends_a_child_in_a_session_of_its_own_before_it_returns():
    """An embedded daemon runs in its own session, out of reach of its starter's group."""
    starter = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "d = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        "print(d.pid, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    daemon = int(starter.stdout.readline())
    kill_tree(starter.pid)
    starter.wait(timeout=10)
    assert not alive(daemon)


def test_process_tree_lists_a_grandchild_after_its_parent():
    starter = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "d = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(d.pid, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(starter.stdout.readline())
        assert children(starter.pid) == [grandchild]
        assert process_tree(starter.pid) == [starter.pid, grandchild]
        assert alive(grandchild)
    finally:
        kill_tree(starter.pid)
        starter.wait(timeout=10)
    assert not alive(grandchild) and not alive(starter.pid)
    assert children(starter.pid) == []
