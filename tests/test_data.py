"""Tests of mergeflow.data: sources, splits, flwr-datasets partitions and parquet storage."""

from __future__ import annotations

import datasets
import numpy as np
import pandas as pd
import pytest

from mergeflow.data.digits import load_digits_source
from mergeflow.data.errors import DataError
from mergeflow.data.linreg import make_linreg
from mergeflow.data.partition import PARTITION_METHODS, partition_dataset, partition_stats, plot_partition_stats
from mergeflow.data.pinwheel import make_pinwheel
from mergeflow.data.rows import make_dataset
from mergeflow.data.split import split_dataset, standardize
from mergeflow.data.storage import load_dataset_file, save_dataset, to_arrays
from mergeflow.data.table import load_table_source
from mergeflow.data.wine import load_wine_source
from mergeflow.errors import ConfigError, MergeflowError
from mergeflow.schema.sources import SOURCES, get_source


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    """Keep any ``datasets.load_dataset`` cache inside the test's tmp directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def digits():
    return load_digits_source()


def _labels(ds):
    return np.asarray(ds.with_format("numpy")["y"])


def load_source(name, *, seed=0, options=None):
    """A registered source read by name, as the prepare step reads it: its options validated, then loaded."""
    source = get_source(name)
    return source.loader.load(source.parse(options), seed=seed)


# --- sources -------------------------------------------------------------------------


def test_digits_source(digits):
    ds, info = digits
    x, y = to_arrays(ds, info)
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.9
    assert y.dtype == np.int64 and sorted(set(y.tolist())) == list(range(10))
    assert info["task"] == "classification" and info["num_classes"] == 10
    assert info["input_shape"] == [1, 8, 8] and len(info["class_names"]) == 10


def test_wine_source():
    ds, info = load_wine_source()
    x, y = to_arrays(ds, info)
    assert x.shape == (178, 13) and info["input_shape"] == [13]
    assert np.bincount(y).tolist() == [59, 71, 48] and info["num_classes"] == 3
    assert x[:, 12].max() > 1000  # raw (unstandardised) proline feature


def test_known_rows_match_the_sources():
    def rows(name, **options):
        source = get_source(name)
        return source.known_rows(source.parse(options))

    assert rows("digits") == 1797 and rows("wine") == 178
    assert rows("pinwheel") == 5000 and rows("pinwheel", clusters=3, per_cluster=7) == 21
    assert rows("linreg", n=123) == 123 == load_source("linreg", options={"n": 123})[0].num_rows
    known = {name for name, source in SOURCES.items() if source.known_rows(source.parse()) is not None}
    assert known == {"digits", "wine", "pinwheel", "linreg"}
    with pytest.raises(ValueError, match="bogus"):
        load_source("pinwheel", options={"bogus": 1})


def test_pinwheel_shape_and_determinism():
    ds, info = make_pinwheel(seed=3)
    x, y = to_arrays(ds, info)
    assert x.shape == (5000, 2) and info["input_shape"] == [2] and info["num_classes"] == 5
    assert np.bincount(y).tolist() == [1000] * 5
    again, _ = make_pinwheel(seed=3)
    other, _ = make_pinwheel(seed=4)
    assert np.array_equal(to_arrays(again, info)[0], x)
    assert not np.allclose(to_arrays(other, info)[0], x)
    # the arms point in different directions: per-cluster mean angles are spread around the circle
    angles = sorted(np.arctan2(x[y == k, 1].mean(), x[y == k, 0].mean()) for k in range(5))
    assert np.min(np.diff(angles)) > 0.8


def test_linreg_has_known_truth():
    ds, info = make_linreg(n=2000, dim=4, noise_std=0.3, seed=1)
    x, y = to_arrays(ds, info)
    w = np.asarray(info["true_weights"])
    assert x.shape == (2000, 4) and y.dtype == np.float32 and w.shape == (4,)
    assert info["task"] == "regression" and info["num_classes"] is None
    assert info["noise_std"] == 0.3 and info["prior_std"] == 1.0
    residual = y - x @ w
    assert abs(residual.std() - 0.3) < 0.03 and abs(residual.mean()) < 0.03


def test_a_source_loads_by_name_and_refuses_an_unknown_name_or_option():
    ds, info = load_source("pinwheel", seed=2, options={"clusters": 3, "per_cluster": 10})
    assert ds.num_rows == 30 and info["num_classes"] == 3
    assert np.array_equal(to_arrays(ds, info)[0], to_arrays(make_pinwheel(3, 10, seed=2)[0], info)[0])
    with pytest.raises(ConfigError, match="data.source: data source 'mnistish' is unknown"):
        load_source("mnistish")
    with pytest.raises(ValueError, match=r"linreg\.seed"):
        load_source("linreg", options={"seed": 1})
    assert issubclass(DataError, ValueError) and issubclass(DataError, MergeflowError)


# --- Hugging Face / local files ----------------------------------------------------------


def _table(n=30):
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        {
            "a": rng.normal(size=n),
            "b": rng.integers(0, 5, size=n),
            "species": np.array(["setosa", "virginica", "versicolor"])[np.arange(n) % 3],
            "site": np.array(["north", "south"])[np.arange(n) % 2],
        }
    )


def test_table_csv_maps_string_labels(tmp_path):
    df = _table()
    path = tmp_path / "t.csv"
    df.to_csv(path, index=False)
    ds, info = load_table_source("csv", data_files=str(path), label_column="species", group_column="site")
    x, y = to_arrays(ds, info)
    assert info["class_names"] == ["setosa", "versicolor", "virginica"] and info["num_classes"] == 3
    assert y[:3].tolist() == [0, 2, 1]
    assert x.shape == (30, 2) and info["input_shape"] == [2]  # "a", "b"; the group is not a feature
    assert np.allclose(x[:, 0], df["a"].to_numpy(), atol=1e-6)
    assert ds["group"][:2] == ["north", "south"]


def test_table_parquet_list_features_and_regression(tmp_path):
    df = pd.DataFrame({"img": [[float(i), i + 0.5, 1.0, 2.0] for i in range(8)], "s": range(8), "t": range(8)})
    path = tmp_path / "t.parquet"
    df.to_parquet(path)
    ds, info = load_source(
        "table",
        options={
            "path": "parquet",
            "data_files": [str(path)],
            "label_column": "t",
            "task": "regression",
            "feature_columns": ["img", "s"],
            "input_shape": [5],
        },
    )
    x, y = to_arrays(ds, info)
    assert x.shape == (8, 5) and x[3].tolist() == [3.0, 3.5, 1.0, 2.0, 3.0]
    assert y.dtype == np.float32 and info["task"] == "regression" and info["num_classes"] is None


def test_table_noncontiguous_int_labels_are_remapped(tmp_path):
    path = tmp_path / "t.csv"
    pd.DataFrame({"f": range(6), "label": [3, 7, 3, 9, 7, 9]}).to_csv(path, index=False)
    ds, info = load_table_source("csv", data_files=str(path))
    assert _labels(ds).tolist() == [0, 1, 0, 2, 1, 2] and info["class_names"] == ["3", "7", "9"]


def test_table_missing_column_and_file_raise(tmp_path):
    path = tmp_path / "t.csv"
    _table().to_csv(path, index=False)
    expected = "^data.table.label_column: no column 'target' in the table; columns: a, b, species, site$"
    with pytest.raises(DataError, match=expected):
        load_table_source("csv", data_files=str(path), label_column="target")
    with pytest.raises(DataError, match="data.table.feature_columns: no column 'zz'"):
        load_table_source("csv", data_files=str(path), label_column="species", feature_columns=["a", "zz"])
    with pytest.raises(DataError, match="data.table.group_column: no column 'region'"):
        load_table_source("csv", data_files=str(path), label_column="species", group_column="region")
    with pytest.raises(DataError, match="nope.csv"):
        load_table_source("csv", data_files=str(tmp_path / "nope.csv"))
    with pytest.raises(DataError, match="species"):  # a string column cannot be a feature
        load_table_source("csv", data_files=str(path), label_column="a", task="regression")


# --- split / standardize ------------------------------------------------------------------


def test_split_fractions_stratification_and_determinism(digits):
    ds, info = digits
    splits = split_dataset(ds, info, test_fraction=0.2, server_fraction=0.1, seed=5)
    sizes = {k: v.num_rows for k, v in splits.items()}
    assert sizes == {"train": 1797 - 360 - 180, "test": 360, "server": 180}
    full = np.bincount(_labels(ds)) / 1797
    for split in splits.values():
        share = np.bincount(_labels(split), minlength=10) / split.num_rows
        assert np.abs(share - full).max() < 0.01  # stratified
    rows = [np.sort(to_arrays(s, info)[0].reshape(s.num_rows, -1), axis=0) for s in splits.values()]
    assert sum(len(r) for r in rows) == 1797
    again = split_dataset(ds, info, test_fraction=0.2, server_fraction=0.1, seed=5)
    other = split_dataset(ds, info, test_fraction=0.2, server_fraction=0.1, seed=6)
    assert to_arrays(again["test"], info)[0].tobytes() == to_arrays(splits["test"], info)[0].tobytes()
    assert to_arrays(other["test"], info)[0].tobytes() != to_arrays(splits["test"], info)[0].tobytes()
    assert "server" not in split_dataset(ds, info, test_fraction=0.2, seed=5)


def test_validation_split_is_held_out_and_leaves_test_and_server_as_they_were(digits):
    ds, info = digits
    plain = split_dataset(ds, info, test_fraction=0.2, server_fraction=0.1, seed=5)
    splits = split_dataset(ds, info, test_fraction=0.2, server_fraction=0.1, validation_fraction=0.15, seed=5)
    assert {k: v.num_rows for k, v in splits.items()} == {
        "train": 1797 - 360 - 180 - 270,
        "test": 360,
        "server": 180,
        "validation": 270,
    }
    for name in ("test", "server"):
        assert to_arrays(splits[name], info)[0].tobytes() == to_arrays(plain[name], info)[0].tobytes()
    rows = {name: {x.tobytes() for x in to_arrays(split, info)[0]} for name, split in splits.items()}
    assert not rows["validation"] & (rows["train"] | rows["test"] | rows["server"])
    assert rows["validation"] | rows["train"] == {x.tobytes() for x in to_arrays(plain["train"], info)[0]}
    share = np.bincount(_labels(splits["validation"]), minlength=10) / 270
    assert np.abs(share - np.bincount(_labels(ds)) / 1797).max() < 0.01  # stratified


def test_split_keeps_row_order_and_falls_back_unstratified():
    x = np.arange(20, dtype=np.float32)[:, None]
    y = np.array([0] * 19 + [1])  # class 1 has a single member: no stratification possible
    ds = make_dataset(x, y)
    info = {"task": "classification", "num_classes": 2, "input_shape": [1]}
    splits = split_dataset(ds, info, test_fraction=0.25, seed=0)
    train_x = to_arrays(splits["train"], info)[0][:, 0]
    assert splits["test"].num_rows == 5 and splits["train"].num_rows == 15
    assert np.all(np.diff(train_x) > 0)  # original order kept
    with pytest.raises(DataError, match="no training rows"):
        split_dataset(ds, info, test_fraction=0.6, server_fraction=0.4)


def test_standardize_uses_training_statistics():
    ds, info = load_wine_source()
    splits = split_dataset(ds, info, test_fraction=0.3, seed=0)
    const = make_dataset(np.ones((4, 13)), np.zeros(4, dtype=np.int64))
    out, stats = standardize({**splits, "const": const})
    x_train = to_arrays(out["train"], info)[0]
    assert np.allclose(x_train.mean(axis=0), 0, atol=1e-4) and np.allclose(x_train.std(axis=0), 1, atol=1e-3)
    raw_test = to_arrays(splits["test"], info)[0]
    expected = (raw_test - np.asarray(stats["mean"])) / np.asarray(stats["std"])
    assert np.allclose(to_arrays(out["test"], info)[0], expected, atol=1e-4)
    assert np.array_equal(_labels(out["test"]), _labels(splits["test"]))
    assert len(stats["mean"]) == 13
    zero_std, _ = standardize({"train": const})
    assert np.allclose(to_arrays(zero_std["train"], info)[0], 0.0)  # std 0 -> 1, no NaN


# --- partitioning ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train(digits):
    ds, info = digits
    return split_dataset(ds, info, test_fraction=0.2, seed=0)["train"]


def _histograms(parts, info):
    return np.asarray(partition_stats(parts, info)["label_histograms"])


def test_iid_partition_equal_sizes_and_seeded(train, digits):
    info = digits[1]
    parts = partition_dataset(train, method="iid", num_clients=4, seed=1)
    sizes = [p.num_rows for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == train.num_rows
    hist = _histograms(parts, info)
    assert hist.min() > 0  # every client sees every class
    again = partition_dataset(train, method="iid", num_clients=4, seed=1)
    other = partition_dataset(train, method="iid", num_clients=4, seed=2)
    assert _labels(again[0]).tolist() == _labels(parts[0]).tolist()
    assert _labels(other[0]).tolist() != _labels(parts[0]).tolist()


def test_dirichlet_partition_is_skewed_and_seeded(train, digits):
    info = digits[1]
    parts = partition_dataset(train, method="dirichlet", num_clients=5, alpha=0.1, seed=0)
    skewed = _histograms(parts, info)
    iid = _histograms(partition_dataset(train, method="iid", num_clients=5, seed=0), info)

    def max_share(h):
        return (h.max(axis=0) / h.sum(axis=0)).mean()  # how much one client dominates each class

    assert max_share(skewed) > 0.6 > max_share(iid)
    assert skewed.sum() == train.num_rows
    again = _histograms(partition_dataset(train, method="dirichlet", num_clients=5, alpha=0.1, seed=0), info)
    other = _histograms(partition_dataset(train, method="dirichlet", num_clients=5, alpha=0.1, seed=1), info)
    assert np.array_equal(again, skewed) and not np.array_equal(other, skewed)


def test_pathological_partition_has_k_classes_per_client(train, digits):
    stats = partition_stats(
        partition_dataset(train, method="pathological", num_clients=10, classes_per_client=3, seed=0), digits[1]
    )
    assert stats["classes_per_client"] == [3] * 10
    assert stats["total"] == sum(stats["sizes"]) == sum(map(sum, stats["label_histograms"]))


def test_natural_partition_by_group():
    x = np.arange(12, dtype=np.float32)[:, None]
    groups = ["b", "a", "c"] * 4
    ds = make_dataset(x, np.zeros(12, dtype=np.float32), groups)
    parts = partition_dataset(ds, method="natural", num_clients=3)
    assert [sorted(set(p["group"])) for p in parts] == [["a"], ["b"], ["c"]]
    assert [p.num_rows for p in parts] == [4, 4, 4]
    with pytest.raises(DataError, match=r"num_clients is 2 .* 3 distinct groups"):
        partition_dataset(ds, method="natural", num_clients=2)
    with pytest.raises(DataError, match="regression"):
        partition_dataset(ds, method="dirichlet", num_clients=3)  # float targets: regression


def test_replicated_partition_gives_every_client_the_whole_split(train):
    parts = partition_dataset(train, method="replicated", num_clients=3)
    assert [p.num_rows for p in parts] == [train.num_rows] * 3
    assert all(_labels(p).tolist() == _labels(train).tolist() for p in parts)
    regression = make_dataset(np.zeros((2, 1)), np.array([0.5, 1.5], dtype=np.float32))
    assert len(partition_dataset(regression, method="replicated", num_clients=5)) == 5  # more clients than rows


def test_partition_errors(train):
    tiny = make_dataset(np.zeros((6, 1)), np.array([0, 0, 0, 1, 1, 1]))
    with pytest.raises(DataError, match="empty client"):
        partition_dataset(tiny, method="iid", num_clients=8)
    with pytest.raises(DataError, match="empty client 1; .*partition.alpha"):  # Dirichlet gives client 1 no rows
        partition_dataset(train, method="dirichlet", num_clients=10, alpha=0.001, seed=1)
    with pytest.raises(DataError, match="min_partition_size"):
        partition_dataset(train, method="dirichlet", num_clients=10, alpha=0.01, min_partition_size=100)
    with pytest.raises(DataError, match="unknown partition method"):
        partition_dataset(train, method="shards", num_clients=2)
    with pytest.raises(DataError, match="group"):
        partition_dataset(train, method="natural", num_clients=2)
    assert PARTITION_METHODS == ("iid", "dirichlet", "pathological", "natural", "replicated")


def test_regression_stats_and_plots(tmp_path, train, digits):
    ds, info = make_linreg(n=100, dim=2)
    parts = partition_dataset(ds, method="iid", num_clients=3)
    stats = partition_stats(parts, info)
    assert stats["total"] == 100 and len(stats["target_mean"]) == 3 and "label_histograms" not in stats
    y0 = to_arrays(parts[0], info)[1]
    assert stats["target_mean"][0] == pytest.approx(float(y0.mean()), abs=1e-5)
    for name, s in [
        ("reg.png", stats),
        ("cls.png", partition_stats(partition_dataset(train, method="dirichlet", num_clients=4, seed=0), digits[1])),
    ]:
        plot_partition_stats(s, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / name).stat().st_size > 5000


# --- storage ------------------------------------------------------------------------------------


def test_save_load_round_trip_is_byte_identical(tmp_path, train, digits):
    info = digits[1]
    part = partition_dataset(train, method="dirichlet", num_clients=3, seed=0)[1]  # a select()-ed view
    first, second = tmp_path / "a" / "p.parquet", tmp_path / "b.parquet"
    save_dataset(part, first)
    loaded = load_dataset_file(first)
    x0, y0 = to_arrays(part, info)
    x1, y1 = to_arrays(loaded, info)
    assert np.array_equal(x0, x1) and np.array_equal(y0, y1) and x1.shape == (part.num_rows, 1, 8, 8)
    assert loaded.features == part.features
    save_dataset(loaded, second)
    assert first.read_bytes() == second.read_bytes()
    assert sorted(p.name for p in first.parent.iterdir()) == ["p.parquet"]  # no temp file left behind
    with pytest.raises(DataError, match="missing.parquet"):
        load_dataset_file(tmp_path / "missing.parquet")


def test_to_arrays_respects_selection_and_task():
    ds = make_dataset(np.arange(12).reshape(6, 2), np.arange(6, dtype=np.int64))
    view = ds.select([4, 1])
    x, y = to_arrays(view, {"task": "classification", "input_shape": [2, 1]})
    assert x.shape == (2, 2, 1) and x[:, :, 0].tolist() == [[8, 9], [2, 3]] and y.tolist() == [4, 1]
    _, y_reg = to_arrays(view, {"task": "regression", "input_shape": [2]})
    assert y_reg.dtype == np.float32
