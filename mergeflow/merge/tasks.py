"""Merging the models of several tasks: the bodies are merged, each task keeps its own head.

The setting of task arithmetic, TIES and FusionBench: one base fine-tuned on K tasks, each with a classification
head of its own label set. The merge method runs on the body's tensors only (with each client's Fisher and Grams
restricted to them, computed by the client's own model on its own data); a task's head is its own clients' heads
(:func:`mergeflow.heads.task_head`: one client's bit for bit), never averaged with another task's: their classes
differ, and so may their shapes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pydantic import BaseModel

from mergeflow.heads import assemble, body_of, split_head, task_head
from mergeflow.merge.engine import MergeResult, State, run_merge


def merge_tasks(
    method: str,
    states: Sequence[State],
    tasks: Sequence[str],
    head: Collection[str],
    *,
    base: State | None = None,
    weights: Sequence[float] | None = None,
    fishers: Sequence[State] | None = None,
    grams: Sequence[State] | None = None,
    options: BaseModel | None = None,
) -> tuple[dict[str, dict], MergeResult]:
    """Merge the bodies of ``states`` (client ``k`` fine-tuned on ``tasks[k]``) with ``method``; each task's model
    is the merged body with its own clients' head (``head``: the head's state-dict keys).

    Returns every task's state dict (in the order of first appearance in ``tasks``) and the body merge's result
    (its curves and summary).
    """
    bodies, heads = zip(*(split_head(state, head) for state in states), strict=True)
    result = run_merge(
        method,
        list(bodies),
        base=body_of(base, head) if base is not None else None,
        weights=weights,
        fishers=[body_of(f, head) for f in fishers] if fishers is not None else None,
        grams=[body_of(g, head) for g in grams] if grams is not None else None,
        options=options,
    )
    sizes = list(weights) if weights is not None else [1.0] * len(states)
    merged = {}
    for task in dict.fromkeys(tasks):
        own = [k for k, name in enumerate(tasks) if name == task]
        merged[task] = assemble(result.state, task_head([heads[k] for k in own], [sizes[k] for k in own]))
    return merged, result
