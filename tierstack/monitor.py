"""`deepspeed.monitor`: the figures of each step, written where the config asks (train.monitor).

An event is DeepSpeed's tuple `(name, value, step)`, e.g. ("Train/Samples/train_loss",
2.31, 64) — the step axis is samples trained, as DeepSpeed's engine writes it.
`MonitorMaster.write_events` hands each event to every monitor the config enables, on rank
0 only (DeepSpeed's rule):

- TensorBoard: torch.utils.tensorboard's SummaryWriter in output_path/job_name, one
  scalar per event, flushed after each batch of events. It needs the tensorboard package;
  without it one WARNING line says so and the other monitors go on.
- CSV: output_path/job_name/<name with '/' as '_'>.csv, a `step,<last part of the name>`
  header, then `step,value` per event (DeepSpeed's files, line for line).
- wandb: wandb.init(project, group, entity=team) once, then wandb.log({name: value},
  step=step); without the wandb package, one WARNING line.

`engine.monitor` of an engine from tierstack.initialize is a MonitorMaster, so a script
can write its own events next to the engine's (DeepSpeed scripts do:
`engine.monitor.write_events([("Train/eval_loss", loss, engine.global_samples)])`).
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any, Iterable

from tierstack.config import CsvMonitorConfig, MonitorConfig, TensorBoardConfig, WandbConfig

log = logging.getLogger(__name__)

Event = tuple[str, float, int]


def _rank() -> int:
    """This rank in the job's process group (0 without one: a single rank)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _log_dir(output_path: str, job_name: str) -> Path:
    return Path(output_path or "") / job_name


class TensorBoardMonitor:
    """Events as TensorBoard scalars (torch.utils.tensorboard)."""

    def __init__(self, config: TensorBoardConfig) -> None:
        self.enabled = False
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("tensorboard.enabled: the tensorboard package is not installed, so no event "
                        "files are written (pip install tensorboard); training goes on")
            return
        self.log_dir = _log_dir(config.output_path, config.job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.enabled = True

    def write_events(self, events: Iterable[Event]) -> None:
        if self.writer is None:
            return
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class CsvMonitor:
    """Events as one CSV file per name, as DeepSpeed's csv_monitor writes them."""

    def __init__(self, config: CsvMonitorConfig) -> None:
        self.enabled = True
        self.log_dir = _log_dir(config.output_path, config.job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._started: set[str] = set()

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(self.log_dir / f"{filename}.csv", "a+", newline="") as f:
                writer = csv.writer(f)
                if filename not in self._started:  # a header on the run's first row
                    self._started.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        return None


class WandbMonitor:
    """Events to Weights & Biases (wandb.log), where wandb is installed."""

    def __init__(self, config: WandbConfig) -> None:
        self.enabled = False
        try:
            import wandb
        except ImportError:
            log.warning("wandb.enabled: the wandb package is not installed, so nothing is logged to "
                        "Weights & Biases (pip install wandb); training goes on")
            return
        self._wandb = wandb
        wandb.init(project=config.project, group=config.group or None, entity=config.team or None)
        self.enabled = True

    def write_events(self, events: Iterable[Event]) -> None:
        if not self.enabled:
            return
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        return None


class MonitorMaster:
    """Every monitor the config enables, written together on rank 0 (DeepSpeed's MonitorMaster)."""

    def __init__(self, config: MonitorConfig | None = None) -> None:
        config = config if config is not None else MonitorConfig()
        self.enabled = config.writes_events
        self.tb_monitor = self.csv_monitor = self.wandb_monitor = None
        if _rank() != 0:
            return
        if config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(config.tensorboard)
        if config.csv_monitor.enabled:
            self.csv_monitor = CsvMonitor(config.csv_monitor)
        if config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(config.wandb)

    @property
    def monitors(self) -> list[Any]:
        return [m for m in (self.tb_monitor, self.csv_monitor, self.wandb_monitor) if m is not None]

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Each (name, value, step) to every enabled monitor (rank 0 only)."""
        events = [(str(name), float(value), int(step)) for name, value, step in event_list]
        if not events or _rank() != 0:
            return
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        """Flush and close the files (the engine's close does it)."""
        for monitor in self.monitors:
            monitor.close()


csvMonitor = CsvMonitor  # DeepSpeed's spelling

__all__ = ["CsvMonitor", "Event", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]
