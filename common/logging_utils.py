"""Metrics logging on rank 0: a JSONL file always, tensorboard when installed, wandb when asked; a progress bar.

Metric names follow TRL's namespaces (`train/loss`, `objective/kl`, `rewards/accuracies`, ...) so runs can be
compared with other libraries. wandb runs offline unless WANDB_API_KEY is set.
"""

import json
import os
import time

from tqdm import tqdm


class MetricsLogger:
    """Write {step, metrics} to <out>/metrics.jsonl (+ tensorboard, + wandb). No-op on ranks other than 0."""

    def __init__(self, out_dir: str, rank: int, config: dict, use_wandb: bool = False, project: str = "rlhf",
                 run_name: str | None = None, resume_step: int = 0):
        self.active = rank == 0
        if not self.active:
            return
        os.makedirs(out_dir, exist_ok=True)
        # A fresh run starts its metrics over; a resumed one keeps those up to its checkpoint and drops the steps
        # it is about to run again, so every step appears once.
        path = os.path.join(out_dir, "metrics.jsonl")
        kept = []
        if resume_step and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= resume_step]
        self.file = open(path, "w")
        self.file.writelines(kept)
        self.tb = self.wandb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        except ImportError:
            pass
        if use_wandb:
            import wandb

            os.environ.setdefault("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=project, name=run_name, config=config, dir=out_dir)

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.file.flush()
        if self.tb:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if not self.active:
            return
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def progress(total: int, rank: int, desc: str, initial: int = 0):
    """A tqdm bar on rank 0, a silent stand-in elsewhere."""
    return tqdm(total=total, initial=initial, desc=desc, disable=rank != 0, dynamic_ncols=True)


def print_rank0(rank: int, *args) -> None:
    if rank == 0:
        print(*args, flush=True)
