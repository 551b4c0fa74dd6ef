"""Metrics logging on rank 0: a JSONL file always, tensorboard when installed, wandb when asked; progress reports,
which name the phase a run is waiting on.

Metric names follow TRL's namespaces (`train/loss`, `objective/kl`, `rewards/accuracies`, ...) so runs can be
compared with other libraries. wandb runs offline unless WANDB_API_KEY is set.
"""

import contextlib
import json
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:  # torch is imported where it is used
    import torch


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

            # purge_step: TensorBoard also drops the events of the steps this run writes again (a resumed run's after
            # its checkpoint, every step of a fresh run in a reused folder), which it would show beside the new ones.
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=resume_step + 1)
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
        peak = gpu_peak_memory_gib()
        if peak is not None:
            metrics["perf/gpu_peak_memory_gib"] = peak
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


def gpu_peak_memory_gib() -> float | None:
    """The most GPU memory this process has held in tensors so far (torch.cuda.max_memory_allocated), None off GPUs:
    logged with every step, so a run's memory can be set against the plan's (common/memory_plan.py)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / 2**30


def progress(total: int, rank: int, desc: str, initial: int = 0):
    """A tqdm bar on rank 0 in a terminal; a line every ~5% of the way in a log file; silent on other ranks. The
    latest bar is the one `phase` names its phases in."""
    global _bar
    if rank == 0 and not sys.stderr.isatty():
        _bar = LineProgress(total, desc, initial)
    else:
        _bar = tqdm(total=total, initial=initial, desc=desc, disable=rank != 0, dynamic_ncols=True)
    _bar.base_desc = desc
    return _bar


class LineProgress:
    """What a progress bar writes to a file: whole lines every `every` steps and at the end, no carriage returns
    (a bar's redraws would make a log one long line)."""

    def __init__(self, total: int, desc: str, initial: int = 0, every: int | None = None):
        self.total, self.desc, self.n, self.postfix = total, desc, initial, ""
        self.every = every or max(1, total // 20)
        self.start = time.time()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n // self.every > (self.n - n) // self.every or self.n == self.total:
            postfix = f", {self.postfix}" if self.postfix else ""
            print(f"{self.desc}: {self.n}/{self.total} after {time.time() - self.start:.0f} s{postfix}",
                  file=sys.stderr, flush=True)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_description_str(self, desc: str) -> None:
        """Nothing: a phase redrawn in a log file would be a line per phase; a slow one gets its own line."""

    def close(self) -> None:
        pass


def print_rank0(rank: int, *args) -> None:
    if rank == 0:
        print(*args, flush=True)


# A phase that takes this many times its median so far, and at least SLOW_SECONDS, gets a log line of its own (a
# reward of 0.02 s against a median of 0.005 s is no stall, and a line for it would teach readers to skip them).
SLOW_FACTOR = 4
SLOW_SECONDS = 5.0

_bar = None  # the latest progress bar
_phases = []  # the phases under way, outermost first
_durations = {}  # phase -> the seconds each time it ran took


@contextlib.contextmanager
def phase(name: str):
    """Name `name` ("generate", "reward", "checkpoint", ...) as the phase the run is waiting on, in its progress bar
    ("ppo [make_experience > reward]: 3/100"), and say so in one line when it takes more than SLOW_FACTOR times its
    median so far (after three runs of it) and at least SLOW_SECONDS: a stall is then visible long before any
    deadline ends it."""
    _phases.append(name)
    _show_phases()
    start = time.time()
    try:
        yield
    finally:
        _phases.pop()
        _show_phases()
    took, past = time.time() - start, _durations.setdefault(name, [])
    if len(past) >= 3 and took > max(SLOW_FACTOR * statistics.median(past), SLOW_SECONDS):
        tqdm.write(f"{name} took {took:.1f} s, {took / statistics.median(past):.0f} times its median so far "
                   f"({statistics.median(past):.1f} s)", file=sys.stderr)
    past.append(took)


def _show_phases() -> None:
    if _bar is not None:
        _bar.set_description_str(f"{_bar.base_desc} [{' > '.join(_phases)}]" if _phases else _bar.base_desc)


@contextlib.contextmanager
def timed(timings: dict, name: str):
    """timings[name] = the seconds the `with` block took, a phase (`phase`) named after it: "time/generate" is
    "generate"."""
    start = time.time()
    with phase(name.removeprefix("time/")):
        yield
    timings[name] = time.time() - start


def batch_means(per_micro_batch: list[tuple[dict, "torch.Tensor"]]) -> tuple[dict, dict]:
    """Means over a whole batch of metrics each micro-batch gave as means over its own action mask: a mean over
    responses (objective/kl) weighed by the micro-batch's responses, any other by its tokens (a plain mean of means
    would weigh a token of a micro-batch of short responses more). Returns the means and each one's weight."""
    import torch

    means, weights = {}, {}
    for key in per_micro_batch[0][0] if per_micro_batch else []:
        counts = torch.tensor([float((mask.sum(-1) > 0).sum() if key == "objective/kl" else mask.sum())
                               for _, mask in per_micro_batch])
        values = torch.stack([metrics[key].detach().float().cpu() for metrics, _ in per_micro_batch])
        means[key], weights[key] = (values * counts).sum() / counts.sum().clamp(min=1), counts.sum().item()
    return means, weights


def mean_over_ranks(ranks: list[dict]) -> dict:
    """The workers' metrics averaged over their ranks, each weighed by its "weights" entry where a rank gives one
    (the tokens or responses it averaged over), so that each token counts alike on any rank."""
    import torch

    weights = [rank.pop("weights", {}) for rank in ranks]
    out = {}
    for key in ranks[0]:
        values = torch.stack([torch.as_tensor(rank[key], dtype=torch.float) for rank in ranks])
        counts = torch.tensor([float(w.get(key, 1.0)) for w in weights])
        out[key] = (values * counts).sum() / counts.sum() if counts.sum() > 0 else values.mean()
    return out
