"""Every plan of a run predicts its step within the band: the main job (`tierstack train`:
a real scheduler daemon, a real tier manager registered with it, real training on the CPU)
with its blocks' state pinned to NVMe, as `make run` pins it, and the scheduler re-planning
on the disk bandwidth the tier manager measures while the job trains.

The band itself (0.8-1.25) is a figure, measured by `tierstack train` on a quiet machine
(docs/bench; issue 36): on a shared 2-core machine one step in seven ran outside it. This
test holds each plan to a band 1.2x wider each way (0.67-1.5), which still fails the outliers the band
was made for (a 17.35 s prediction of a 10.6 s step, a 0.38x re-plan)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tierstack.worker.plans.keeper import BAND

LOADED = (BAND[0] / 1.2, BAND[1] * 1.2)  # 0.67-1.5: see the docstring

PLAN_LINE = re.compile(r"^plan v(\d+): predicted ([\d.]+) s, measured ([\d.]+) s "
                       r"\(median of (\d+) steps\), ([\d.]+)x \((.*)\)$")


def test_every_plan_of_a_run_predicts_its_measured_step_within_the_band(tmp_path):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        # make run's placement: every block's parameters and optimizer state out of the
        # CPU pool between uses, so each step reads and writes the disk.
        "train": {"params": {"device": "nvme", "max_in_cpu": 0},
                  "optimizer_state": {"device": "nvme", "max_in_cpu": 0}},
        # Reports twice a second and a drift held for 1.5 s re-plans: the probe's idle-disk
        # bandwidth is off from what the disk gives a training job, so re-plans come.
        "scheduler": {"report_interval_seconds": 0.5, "replan_after_seconds": 1.5},
    }))
    out = subprocess.run(
        [sys.executable, "-m", "tierstack.cli", "train", "--config", str(config), "--layers", "4",
         "--dim", "192", "--heads", "4", "--seq-len", "64", "--batch-size", "8", "--steps", "18",
         "--log-every", "100", "--nvme-path", str(tmp_path / "nvme")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    plans = [PLAN_LINE.match(line).groups() for line in out.stdout.splitlines()
             if PLAN_LINE.match(line)]
    # The trace's plan always; re-plans come when the disk's bandwidth in the run drifts
    # from the probe's for 1.5 s, which a quiet machine's 2 s run may never do (CI once
    # ran all 18 steps in 2 s): whatever plans the run made are held to the band.
    # tests/worker/test_plan_keeper.py makes a re-plan happen and checks it.
    assert plans and plans[0][5] == "trace", out.stdout
    for version, predicted, measured, steps, ratio, reason in plans:
        assert int(steps) >= 1
        assert LOADED[0] <= float(predicted) / float(measured) <= LOADED[1], (
            f"plan v{version} ({reason}) predicted {predicted} s for a measured {measured} s "
            f"step (median of {steps})\n" + out.stdout[-3000:])
