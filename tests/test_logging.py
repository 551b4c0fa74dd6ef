"""MetricsLogger (common/logging_utils.py): a resumed run's steps appear once, in metrics.jsonl and in TensorBoard."""

import json
import os

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.logging_utils import MetricsLogger


def tensorboard_values(out: str) -> list[tuple[int, float]]:
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def test_a_resumed_run_s_steps_replace_the_stopped_run_s_in_metrics_and_tensorboard(tmp_path):
    """Stopped after step 4, resumed from the checkpoint of step 2: steps 3 and 4 run again. TensorBoard kept the
    stopped run's 3 and 4 beside the new ones."""
    out = str(tmp_path)
    first = MetricsLogger(out, 0, {})
    for step in (1, 2, 3, 4):
        first.log(step, {"train/loss": float(step)})
    first.close()
    resumed = MetricsLogger(out, 0, {}, resume_step=2)
    for step in (3, 4):
        resumed.log(step, {"train/loss": 10.0 * step})
    resumed.close()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [(r["step"], r["train/loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert tensorboard_values(out) == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
