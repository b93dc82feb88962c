"""Split a training set across federated clients with flwr-datasets partitioners."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mergeflow.data.errors import DataError
from mergeflow.data.storage import arrow_table

if TYPE_CHECKING:  # flwr-datasets and matplotlib load where they are used: planning a run needs neither
    import datasets
    from flwr_datasets.partitioner.partitioner import Partitioner

PARTITION_METHODS = ("iid", "dirichlet", "pathological", "natural", "replicated")
REGRESSION_METHODS = ("iid", "natural", "replicated")


def _is_regression(ds: datasets.Dataset) -> bool:
    import datasets

    feature = ds.features["y"]
    return isinstance(feature, datasets.Value) and feature.dtype.startswith("float")


def _partitioner(
    train: datasets.Dataset,
    method: str,
    num_clients: int,
    seed: int,
    alpha: float,
    classes_per_client: int,
    min_partition_size: int,
    partition_by: str,
) -> tuple[Partitioner, datasets.Dataset]:
    """The flwr-datasets partitioner for ``method`` and the dataset to assign to it."""
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        PathologicalPartitioner,
    )

    if method == "iid":
        shuffled = train.shuffle(seed=seed).flatten_indices(keep_in_memory=True)
        return IidPartitioner(num_partitions=num_clients), shuffled
    if method == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_clients,
            partition_by=partition_by,
            alpha=alpha,
            seed=seed,
            min_partition_size=min_partition_size,
            self_balancing=False,
        ), train
    if method == "pathological":
        return PathologicalPartitioner(
            num_partitions=num_clients,
            partition_by=partition_by,
            num_classes_per_partition=classes_per_client,
            seed=seed,
            class_assignment_mode="first-deterministic",
        ), train
    if "group" not in train.column_names:
        raise DataError("natural partitioning needs a 'group' column; set data.options.group_column")
    num_groups = len(train.unique("group"))
    if num_groups != num_clients:
        raise DataError(
            f"natural partitioning: partition.num_clients is {num_clients} but the data "
            f"has {num_groups} distinct groups; they must be equal"
        )
    return NaturalIdPartitioner(partition_by="group"), train


def partition_dataset(
    train: datasets.Dataset,
    *,
    method: str,
    num_clients: int,
    seed: int = 0,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_partition_size: int = 0,
    partition_by: str = "y",
) -> list[datasets.Dataset]:
    """Split ``train`` into ``num_clients`` client datasets.

    ``method``: ``"iid"`` (seeded shuffle, then equal shards), ``"dirichlet"`` (label
    skew with concentration ``alpha``), ``"pathological"`` (``classes_per_client``
    classes each), ``"natural"`` (one client per value of the ``"group"`` column) or ``"replicated"``
    (every client holds all of ``train``). ``partition_by`` is the label column used by the two label-skew methods.
    Regression data allows only ``"iid"``, ``"natural"`` and ``"replicated"``.
    """
    if method not in PARTITION_METHODS:
        raise DataError(f"unknown partition method {method!r}; choose one of {', '.join(PARTITION_METHODS)}")
    if num_clients < 1:
        raise DataError(f"partition.num_clients must be at least 1, got {num_clients}")
    if method != "replicated" and num_clients > train.num_rows:
        raise DataError(
            f"partition.num_clients is {num_clients} but there are only {train.num_rows} training "
            "rows: the partition would leave an empty client"
        )
    if method not in REGRESSION_METHODS and _is_regression(train):
        raise DataError(
            f"partition method {method!r} needs class labels; regression data allows "
            f"only {', '.join(REGRESSION_METHODS)}"
        )
    if method == "replicated":  # no flwr-datasets partitioner shares rows; nothing to split
        return [train] * num_clients
    partitioner, data = _partitioner(
        train,
        method,
        num_clients,
        seed,
        alpha,
        classes_per_client,
        min_partition_size,
        partition_by,
    )
    partitioner.dataset = data
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The specified min_partition_size")
        try:
            parts = [partitioner.load_partition(i) for i in range(num_clients)]
        except ValueError as exc:
            if method == "dirichlet" and "max number of attempts" in str(exc):
                raise DataError(
                    f"dirichlet partitioning could not give every client at least "
                    f"{min_partition_size} rows (alpha={alpha}, {num_clients} clients, "
                    f"{train.num_rows} rows); lower partition.min_partition_size or "
                    "partition.num_clients, or raise partition.alpha"
                ) from exc
            raise DataError(f"{method} partitioning failed: {exc}") from exc
    for k, part in enumerate(parts):
        if part.num_rows == 0:
            raise DataError(
                f"partition produced an empty client {k}; lower partition.num_clients or raise partition.alpha"
            )
    return parts


def partition_stats(parts: list[datasets.Dataset], info: dict[str, Any]) -> dict[str, Any]:
    """Client sizes and label histograms (classification) or target mean/std (regression)."""
    targets = [arrow_table(p).column("y").to_numpy() for p in parts]
    sizes = [len(t) for t in targets]
    stats: dict[str, Any] = {"num_clients": len(parts), "sizes": sizes, "total": sum(sizes)}
    if info["task"] != "regression":  # class labels (a causal LM keeps its texts' labels for partitions)
        num_classes = int(info["num_classes"])
        histograms = [np.bincount(t, minlength=num_classes).tolist() for t in targets]
        stats["label_histograms"] = histograms
        stats["classes_per_client"] = [sum(c > 0 for c in h) for h in histograms]
        stats["class_names"] = info.get("class_names")
    else:
        stats["target_mean"] = [float(np.mean(t)) for t in targets]
        stats["target_std"] = [float(np.std(t)) for t in targets]
    return stats


def combine_partition_stats(by_task: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One set of statistics for the clients of several tasks (in task order), each task's classes named
    ``<task>:<class>``: a client's histogram counts its own task's classes, zeros elsewhere."""
    names: list[str] = []
    for task, stats in by_task.items():
        classes = stats.get("class_names") or [str(c) for c in range(len(stats["label_histograms"][0]))]
        names += [f"{task}:{name}" for name in classes]
    histograms, offset = [], 0
    for stats in by_task.values():
        width = len(stats["label_histograms"][0])
        for counts in stats["label_histograms"]:
            histograms.append([0] * offset + list(counts) + [0] * (len(names) - offset - width))
        offset += width
    sizes = [size for stats in by_task.values() for size in stats["sizes"]]
    return {
        "num_clients": len(sizes),
        "sizes": sizes,
        "total": sum(sizes),
        "label_histograms": histograms,
        "classes_per_client": [sum(c > 0 for c in h) for h in histograms],
        "class_names": names,
    }


def _class_colors(num_classes: int) -> np.ndarray:
    """Distinct colours for up to 20 classes, a continuous colormap beyond."""
    from matplotlib import colormaps

    if num_classes <= 10:
        return colormaps["tab10"](np.arange(num_classes))
    if num_classes <= 20:
        return colormaps["tab20"](np.arange(num_classes))
    return colormaps["viridis"](np.linspace(0.0, 1.0, num_classes))


def plot_partition_stats(stats: dict[str, Any], path: str | Path) -> None:
    """Save a PNG: label counts per client as stacked bars, or client sizes for regression."""
    from matplotlib.figure import Figure

    from mergeflow.plots import save_figure

    clients = np.arange(stats["num_clients"])
    fig = Figure(figsize=(8, max(3.0, 0.3 * len(clients) + 1.5)))
    ax = fig.add_subplot()
    if "label_histograms" in stats:
        counts = np.asarray(stats["label_histograms"]).reshape(len(clients), -1)
        names = stats.get("class_names") or [f"class {c}" for c in range(counts.shape[1])]
        left = np.zeros(len(clients))
        colors = _class_colors(counts.shape[1])
        for c in range(counts.shape[1]):
            ax.barh(clients, counts[:, c], left=left, label=str(names[c]), color=colors[c])
            left += counts[:, c]
        ax.set_title("Label distribution per client")
        ax.legend(
            title="class",
            fontsize="small",
            ncol=max(1, -(-counts.shape[1] // 20)),
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
        )
    else:
        ax.barh(clients, stats["sizes"], label="rows")
        ax.set_title("Rows per client")
        ax.legend()
    ax.set_xlabel("rows")
    ax.set_ylabel("client")
    ax.set_yticks(clients)
    ax.invert_yaxis()
    save_figure(fig, path, dpi=100)
