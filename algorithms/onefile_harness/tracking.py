"""--track: every update's metrics of every run, streamed to TensorBoard or Weights & Biases."""

import dataclasses
import json
import math
import os

from .plan import RunPlan
from .stats import point_label


class Tracker:
    """Every update's metrics of every run, streamed from the host as each chunk arrives, with
    the config first and the summary last. Imported only when asked for."""

    def __init__(self, job, plan: RunPlan):
        self.kind = job.args.track
        config = {**dataclasses.asdict(job.config), "sweep": job.sweep}
        if self.kind == "tensorboard":
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(os.path.join(job.run_dir, "tensorboard"))
            self.writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "))
        else:
            import wandb

            self.run = wandb.init(
                project=job.args.wandb_project or job.algo.name,
                name=os.path.basename(os.path.normpath(job.run_dir)),
                dir=job.run_dir,
                config=config,
            )
        self.labels = [
            f"{point_label(point) + ' ' if point else ''}seed{seed}"
            for point in plan.points
            for seed in range(plan.num_seeds)
        ]

    def log(self, metrics: dict) -> None:
        """metrics: {name: [points, seeds, updates]}; logged at each update's env steps."""
        names = [name for name in metrics if name not in ("env_steps", "wall_seconds")]
        for update in range(metrics["env_steps"].shape[-1]):
            step = int(metrics["env_steps"][0, 0, update])
            values = {
                f"{name}/{label}": float(metrics[name].reshape(-1, metrics[name].shape[-1])[run, update])
                for name in names
                for run, label in enumerate(self.labels)
            }
            values = {tag: value for tag, value in values.items() if math.isfinite(value)}
            if self.kind == "tensorboard":
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)
            else:
                self.run.log(values, step=step)

    def finish(self, summary: dict) -> None:
        if self.kind == "tensorboard":
            self.writer.add_text("summary", "    " + json.dumps(summary, indent=2).replace("\n", "\n    "))
            self.writer.close()
        else:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float | str)})
            self.run.finish()
