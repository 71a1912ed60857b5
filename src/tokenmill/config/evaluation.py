"""The ``[eval]`` section: task scores during training, through EleutherAI's lm-evaluation-harness
(applied in ``train/tasks.py``; the validation loss is ``train.eval_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenmill.config.field import F

__all__ = ["EvalConfig"]


@dataclass
class EvalConfig:
    """Task scores during training (lm-evaluation-harness, `pip install 'tokenmill[eval]'`)."""

    tasks: str = F(
        "",
        "lm-eval tasks scored during training, comma-separated (e.g. 'hellaswag,arc_easy', or the names of the "
        "tasks in eval.include_path); empty = none. Scored every eval.tasks_every_steps steps and at the end, "
        "with the run's tokenizer; each score is logged as tasks/TASK/METRIC (metrics.jsonl, TensorBoard, W&B), "
        "shown in the progress line and put in summary.json; the time counts as evaluation (outside the "
        "steady-state tokens/s). One process or DDP (each rank scores its share of the documents), not a sharded "
        "model (FSDP, TP, PP).",
    )
    tasks_limit: int = F(0, "Documents scored per task at each evaluation (lm-eval's --limit); 0 = all of them.",
                         ge=0)
    tasks_every_steps: int = F(0, "Score the eval.tasks every N steps (0 = only at the end).", ge=0)
    include_path: Optional[str] = F(
        None,
        "A folder of your own lm-eval task YAML files (lm-eval's --include-path; several: comma-separated), whose "
        "task names eval.tasks may use.",
        path="list",
    )
