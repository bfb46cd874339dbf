"""fedprivacy.data: loaders give the documented shapes, partitions are exact and seeded, bad data fails clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from harness import pums_file
from sklearn.linear_model import LogisticRegression

from fedprivacy.data import (
    ClientData,
    Dataset,
    central_split,
    load_client,
    load_clients,
    load_dataset,
    loaders,
    partition,
    partition_rows,
    synthetic_optimum,
)
from fedprivacy.data.partition import iid_shards
from fedprivacy.errors import InputError


def row_id_dataset(n: int = 300, num_classes: int = 3) -> Dataset:
    """Feature 0 is the row number, so any client's rows can be traced back."""
    labels = (np.arange(n) * 7 % num_classes).astype(np.int64)
    return Dataset(
        features=np.arange(n, dtype=np.float32).reshape(-1, 1),
        labels=labels,
        feature_names=("row",),
        num_classes=num_classes,
        name="rows",
        groups=np.arange(n) % 4 + 10,
        group_name="site",
    )


def client_rows(client: ClientData) -> tuple[np.ndarray, np.ndarray]:
    return client.train.features[:, 0].astype(int), client.test.features[:, 0].astype(int)


# --- PUMS -----------------------------------------------------------------------------------


def test_pums_natural_clients_are_the_seven_pumas_with_their_counts() -> None:
    path = pums_file("fulton_pums5_full.csv")
    table = pd.read_csv(path)
    assert len(table) == 25_766
    counts = table.groupby("puma").size()
    employed = table.groupby("puma")["employed"].sum()

    clients = load_clients("pums", path, scheme="natural", seed=0)

    assert [c.client_id for c in clients] == [str(p) for p in range(1101, 1108)]
    for client in clients:
        puma = int(client.client_id)
        assert len(client.train) + len(client.test) == counts[puma]
        assert client.train.labels.sum() + client.test.labels.sum() == employed[puma]
        assert set(client.train.groups) | set(client.test.groups) == {puma}
        assert len(client.test) == round(0.2 * counts[puma])
        assert client.num_examples == len(client.train)


def test_pums_features_follow_the_seed_definitions() -> None:
    path = pums_file("fulton_pums5_full.csv")
    table = pd.read_csv(path)

    full = load_dataset("pums", path)
    base = load_dataset("pums", path, extended=False)

    assert full.features.shape == (25_766, 15) and full.features.dtype == np.float32
    assert base.features.shape == (25_766, 10)
    assert full.num_classes == 2 and full.group_name == "puma"
    assert full.features.min() >= 0 and full.features.max() <= 1
    names = list(full.feature_names)
    column = {name: full.features[:, i] for i, name in enumerate(names)}
    np.testing.assert_array_equal(column["collegedegree"], (table["educ"] >= 13).to_numpy())
    np.testing.assert_array_equal(column["blackfemale"], ((table["black"] == 1) & (table["sex"] == 1)).to_numpy())
    np.testing.assert_allclose(column["age/100"], table["age"].to_numpy() / 100, rtol=1e-6)
    np.testing.assert_array_equal(full.labels, table["employed"].to_numpy())
    np.testing.assert_array_equal(base.features, full.features[:, :10])


def test_pums_age_bands_replace_linear_age_with_one_indicator_per_band() -> None:
    path = pums_file("fulton_pums5_full.csv")
    age = pd.read_csv(path)["age"].to_numpy()
    linear = load_dataset("pums", path)
    banded = load_dataset("pums", path, age="bands")

    names = list(banded.feature_names)
    bands = [n for n in names if "age" in n]
    assert bands == [
        "age<25",
        "25<=age<35",
        "35<=age<45",
        "45<=age<55",
        "55<=age<62",
        "62<=age<67",
        "67<=age<75",
        "age>=75",
    ]
    assert banded.features.shape == (25_766, 15 - 1 + 8)
    indicators = banded.features[:, [names.index(b) for b in bands]]
    assert set(np.unique(indicators)) == {0.0, 1.0}
    np.testing.assert_array_equal(indicators.sum(axis=1), 1.0)  # every person in exactly one band
    np.testing.assert_array_equal(
        indicators[:, names.index("62<=age<67") - names.index("age<25")], (age >= 62) & (age < 67)
    )
    np.testing.assert_array_equal(indicators[:, 0], age < 25)
    np.testing.assert_array_equal(indicators[:, -1], age >= 75)
    others = [n for n in names if n not in bands]
    assert others == [n for n in linear.feature_names if n != "age/100"]
    np.testing.assert_array_equal(
        banded.features[:, [names.index(n) for n in others]],
        linear.features[:, [list(linear.feature_names).index(n) for n in others]],
    )
    with pytest.raises(InputError, match="pums-age"):
        load_dataset("pums", path, age="cubic")


def test_pums_sample_partitions_by_another_column() -> None:
    path = pums_file("fulton_pums5_sample100.csv")
    clients = load_clients("pums", path, scheme="natural", by="sex", extended=False)
    assert [c.client_id for c in clients] == ["0", "1"]
    assert sum(len(c.train) + len(c.test) for c in clients) == 100


# --- digits, synthetic, csv -----------------------------------------------------------------


def test_digits_is_the_embedded_default() -> None:
    flat = load_dataset("digits")
    images = load_dataset("digits", images=True)
    assert flat.features.shape == (1797, 64) and flat.features.dtype == np.float32
    assert flat.labels.dtype == np.int64 and set(flat.labels) == set(range(10)) and flat.num_classes == 10
    assert flat.features.min() == 0 and flat.features.max() == 1
    assert images.features.shape == (1797, 1, 8, 8)
    np.testing.assert_array_equal(images.features.reshape(1797, 64), flat.features)


def test_central_split_is_stratified_and_seeded() -> None:
    digits = load_dataset("digits")
    split = central_split(digits, seed=0)
    assert (len(split.train), len(split.test)) == (1438, 359)
    test_share = np.bincount(split.test.labels, minlength=10) / np.bincount(digits.labels, minlength=10)
    assert np.all(np.abs(test_share - 0.2) < 0.02)
    again, other = central_split(digits, seed=0), central_split(digits, seed=1)
    np.testing.assert_array_equal(split.test.features, again.test.features)
    assert not np.array_equal(split.test.features, other.test.features)


def test_synthetic_optimum_is_recovered_by_logistic_regression() -> None:
    data = load_dataset("synthetic", num_examples=20_000, num_features=5, seed=3)
    w_star = synthetic_optimum(5, 3)
    fit = LogisticRegression(C=1e6, fit_intercept=False).fit(data.features, data.labels)
    w = fit.coef_[0]
    assert w @ w_star / (np.linalg.norm(w) * np.linalg.norm(w_star)) > 0.995
    assert np.linalg.norm(w - w_star) / np.linalg.norm(w_star) < 0.1


def test_synthetic_is_seeded() -> None:
    a = load_dataset("synthetic", num_examples=50, seed=1)
    b = load_dataset("synthetic", num_examples=50, seed=2)
    np.testing.assert_array_equal(a.labels, load_dataset("synthetic", seed=1, num_examples=50).labels)
    assert not np.array_equal(a.features, b.features)
    assert not np.allclose(synthetic_optimum(10, 1), synthetic_optimum(10, 2))


def test_synthetic_blocks_are_the_one_shot_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn in blocks of rows, the data are exactly the definition's one (n, d) draw: x ~ N(0, I)
    in float64, then y ~ Bernoulli(sigmoid(x · w*)) from the same stream, x stored as float32."""
    n, d, seed = 1_000, 7, 4
    rng = np.random.default_rng([seed, 0])
    x = rng.normal(size=(n, d))
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-x @ synthetic_optimum(d, seed)))).astype(np.int64)
    for block in (64, 999, 4096):  # several blocks, a last block of one row, one block
        monkeypatch.setattr(loaders, "SYNTHETIC_BLOCK_ROWS", block)
        data = loaders.load_synthetic(None, n, d, seed)
        assert data.features.dtype == np.float32
        assert data.features.tobytes() == x.astype(np.float32).tobytes()
        np.testing.assert_array_equal(data.labels, y)


def test_csv_features_default_to_the_headers_other_columns(tmp_path: Path) -> None:
    """The feature columns come from the header, never from the cells: a text column is refused
    (saying how to leave it out) rather than dropped, so no record can change the model's input."""
    path = tmp_path / "clinic.csv"
    table = pd.DataFrame(
        {
            "site": ["a"] * 6 + ["b"] * 4,
            "x1": np.arange(10.0),
            "note": ["free text"] * 10,
            "x2": np.arange(10) % 3,
            "y": [0, 1] * 5,
        }
    )
    table.to_csv(path, index=False)
    with pytest.raises(InputError, match="column note='free text': not a number .*name the feature columns"):
        load_dataset("csv", path, label="y", client_column="site", num_classes=2)
    table.drop(columns="note").to_csv(tmp_path / "numbers.csv", index=False)
    data = load_dataset("csv", tmp_path / "numbers.csv", label="y", client_column="site", num_classes=2)
    assert data.feature_names == ("x1", "x2") and data.num_classes == 2
    assert data.name == "csv:numbers.csv"
    chosen = load_dataset("csv", path, label="y", features=["x2"], num_classes=2)
    assert chosen.features.shape == (10, 1)

    options = dict(scheme="natural", by="site", label="y", features=["x1", "x2"], num_classes=2)
    clients = load_clients("csv", path, **options)
    assert [(c.client_id, len(c.train) + len(c.test)) for c in clients] == [("a", 6), ("b", 4)]


def test_one_record_cannot_change_the_csv_feature_columns(tmp_path: Path) -> None:
    """A column of True/False, or half numbers, used to be kept or dropped as a feature by its cells:
    one record (`Ture`, or one more number) changed every client's model input. Now the same
    columns are read whatever the records, and an unreadable cell refuses the file."""
    rows = "x,flag,y\n" + "".join(f"{i},{'True' if i % 2 else 'False'},{i % 2}\n" for i in range(20))
    (tmp_path / "d.csv").write_text(rows)
    (tmp_path / "added.csv").write_text(rows + "3,Ture,1\n")
    for name in ("d.csv", "added.csv"):  # True/False is no number: refused as a deployed node would leave it out
        with pytest.raises(InputError, match="column flag=(False|'False'): True/False .*write 1 and 0"):
            load_dataset("csv", tmp_path / name, label="y", num_classes=2)
    assert load_dataset("csv", tmp_path / "d.csv", label="y", features=["x"], num_classes=2).feature_names == ("x",)
    half = "x,z,y\n" + "".join(f"{i},{i if i % 2 else 'txt'},{i % 2}\n" for i in range(20))
    (tmp_path / "half.csv").write_text(half)
    with pytest.raises(InputError, match="column z='txt'"):
        load_dataset("csv", tmp_path / "half.csv", label="y", num_classes=2)
    assert load_dataset("csv", tmp_path / "half.csv", label="y", features=["x"], num_classes=2).features.shape == (
        20,
        1,
    )


def test_loads_are_cached_and_shared_arrays_are_read_only() -> None:
    first = load_dataset("synthetic", num_examples=40, seed=5)
    assert load_dataset("synthetic", num_examples=40, seed=5) is first
    assert not first.features.flags.writeable
    assert first.subset(np.arange(3)).features.flags.writeable


# --- partitions -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "size"])
def test_partitions_cover_every_row_exactly_once(scheme: str) -> None:
    data = row_id_dataset()
    clients = partition(data, scheme, num_partitions=5, seed=0)
    assert [c.client_id for c in clients] == ["0", "1", "2", "3", "4"]
    rows = np.concatenate([np.concatenate(client_rows(c)) for c in clients])
    np.testing.assert_array_equal(np.sort(rows), np.arange(len(data)))
    for client in clients:
        train, test = client_rows(client)
        np.testing.assert_array_equal(data.labels[train], client.train.labels)
        np.testing.assert_array_equal(data.labels[test], client.test.labels)
        assert len(test) == round(0.2 * (len(train) + len(test)))


@pytest.mark.parametrize("scheme", ["natural", "iid", "dirichlet", "size"])
def test_partitions_are_deterministic_per_seed(scheme: str) -> None:
    data = row_id_dataset()
    count = 4 if scheme == "natural" else 5
    first, again, other = ([client_rows(c) for c in partition(data, scheme, count, seed=s)] for s in (0, 0, 1))
    for (train_a, test_a), (train_b, test_b) in zip(first, again, strict=True):
        np.testing.assert_array_equal(train_a, train_b)
        np.testing.assert_array_equal(test_a, test_b)
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(first, other, strict=True))


def test_natural_partition_follows_the_group_column() -> None:
    data = row_id_dataset(n=40)
    clients = partition(data, "natural")
    assert [c.client_id for c in clients] == ["10", "11", "12", "13"]
    for client in clients:
        rows = np.concatenate(client_rows(client))
        assert set(data.groups[rows]) == {int(client.client_id)}


def test_size_skew_grows_with_the_client_index() -> None:
    data = row_id_dataset(n=1000)
    for skew in ("linear", "square", "exponential"):
        sizes = [len(c.train) + len(c.test) for c in partition(data, "size", 4, seed=0, skew=skew)]
        assert sizes == sorted(sizes) and sizes[-1] > 2 * sizes[0] and sum(sizes) == 1000


def test_small_alpha_skews_labels_more_than_iid() -> None:
    data = row_id_dataset(n=900)

    def label_spread(clients: list[ClientData]) -> float:
        shares = [np.bincount(np.concatenate([c.train.labels, c.test.labels]), minlength=3) for c in clients]
        shares = [s / s.sum() for s in shares]
        return float(np.std(shares, axis=0).mean())

    skewed, iid = partition(data, "dirichlet", 5, seed=0, alpha=0.1), partition(data, "iid", 5)
    assert label_spread(skewed) > 3 * label_spread(iid)


def test_load_client_matches_load_clients() -> None:
    every = load_clients("synthetic", scheme="dirichlet", num_partitions=4, seed=7, num_examples=400)
    for i, expected in enumerate(every):
        one = load_client(i, "synthetic", scheme="dirichlet", num_partitions=4, seed=7, num_examples=400)
        assert one.client_id == expected.client_id
        np.testing.assert_array_equal(one.train.features, expected.train.features)
        np.testing.assert_array_equal(one.test.labels, expected.test.labels)


@pytest.mark.parametrize(
    "recipe",
    [
        {"scheme": "dirichlet", "num_partitions": 4, "seed": 7},
        {"scheme": "iid", "num_partitions": 5, "seed": 1, "validation_fraction": 0.25},
        {"scheme": "size", "num_partitions": 6, "seed": 3, "skew": "exponential"},  # a client of 1 row left out
    ],
)
def test_the_evaluation_union_is_every_splittable_clients_test_rows_in_order(recipe) -> None:
    """`load_evaluation_union` (a simulation server's central set) equals the clients' own `test`
    sets, those of `load_clients(..., drop_too_small=True)`, concatenated in client order."""
    from fedprivacy.data.partition import load_evaluation_union

    every = load_clients("synthetic", num_examples=400, drop_too_small=True, **recipe)
    if recipe["scheme"] == "size":
        assert len(every) < recipe["num_partitions"]
    union = load_evaluation_union("synthetic", num_examples=400, **recipe)
    np.testing.assert_array_equal(union.features, np.concatenate([c.test.features for c in every]))
    np.testing.assert_array_equal(union.labels, np.concatenate([c.test.labels for c in every]))
    assert (union.num_classes, union.feature_names) == (every[0].test.num_classes, every[0].test.feature_names)


def test_a_client_split_once_for_the_union_is_not_split_again_and_stays_its_own() -> None:
    """The union's splits serve the clients loaded next (the fast engine and a simulation server
    ask for both); a client loaded from the cache is the one `load_clients` gives, and the cached
    rows cannot be written through."""
    from fedprivacy.data.partition import _cached_split, load_evaluation_union

    recipe = {"num_examples": 300, "scheme": "dirichlet", "num_partitions": 5, "seed": 11, "validation_fraction": 0.2}
    _cached_split.cache_clear()
    load_evaluation_union("synthetic", **recipe)
    assert _cached_split.cache_info().misses == 5
    loaded = [load_client(i, "synthetic", **recipe) for i in range(5)]
    assert _cached_split.cache_info().misses == 5 and _cached_split.cache_info().hits == 5
    for own, every in zip(loaded, load_clients("synthetic", **recipe), strict=True):
        np.testing.assert_array_equal(own.train.features, every.train.features)
        np.testing.assert_array_equal(own.test.labels, every.test.labels)
    partitioning = (load_dataset("synthetic", num_examples=300), "dirichlet", 5, 11, None, 0.5, "linear")
    train, fit = _cached_split(partitioning, 0, 0.2, 0.2)  # client 0's, as cached
    assert _cached_split.cache_info().hits == 6 and train.size and fit.size
    assert not train.flags.writeable and not fit.flags.writeable
    loaded[0].train.features[:] = 0  # a client's arrays are its own copies
    assert load_client(0, "synthetic", **recipe).train.features.any()


def test_an_evaluation_union_of_no_splittable_client_is_refused_by_name() -> None:
    from fedprivacy.data.partition import load_evaluation_union

    with pytest.raises(InputError, match="partitioning='iid'.*no client with enough rows"):  # 2 rows each: 1 to fit
        load_evaluation_union("synthetic", num_examples=4, scheme="iid", num_partitions=2, validation_fraction=0.25)


@pytest.mark.parametrize(("rows", "clients"), [(10, 3), (1797, 7), (200, 200), (1001, 10)])
def test_iid_shards_are_flwr_datasets_iid_partitions(rows: int, clients: int) -> None:
    """The direct computation gives exactly the rows of flwr-datasets' IidPartitioner."""
    import datasets
    from flwr_datasets.partitioner import IidPartitioner

    order = np.random.default_rng(3).permutation(rows)
    partitioner = IidPartitioner(clients)
    partitioner.dataset = datasets.Dataset.from_dict({"row": order})
    expected = [np.asarray(partitioner.load_partition(i)["row"]) for i in range(clients)]
    got = iid_shards(order, clients)
    assert [name for name, _ in got] == [str(i) for i in range(clients)]
    for (_, mine), theirs in zip(got, expected, strict=True):
        assert np.array_equal(mine, theirs)


def test_partition_rows_are_cached_and_read_only() -> None:
    data = row_id_dataset()
    parts = partition_rows(data, "iid", 3, 0)
    assert partition_rows(data, "iid", 3, 0) is parts
    assert not parts[0][1].flags.writeable


def test_zero_test_fraction_keeps_every_row_for_training() -> None:
    clients = partition(row_id_dataset(), "iid", 3, test_fraction=0)
    assert [len(c.test) for c in clients] == [0, 0, 0]
    assert sum(c.num_examples for c in clients) == 300


# --- bad data and bad options: one InputError naming the file, column or client ---------------


def write(tmp_path: Path, text: str, name: str = "bad.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def message(excinfo: pytest.ExceptionInfo[InputError]) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(InputError) as excinfo:
        load_dataset("pums", tmp_path / "nowhere.csv")
    assert "nowhere.csv" in message(excinfo) and "no such file" in message(excinfo)


def test_missing_pums_column_names_the_column_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "puma,sex,age\n1101,1,40\n")
    with pytest.raises(InputError) as excinfo:
        load_dataset("pums", path)
    assert "column" in message(excinfo) and "'married'" in message(excinfo) and str(path) in message(excinfo)


def test_a_missing_column_is_refused_under_the_run_config_key_that_named_it(tmp_path: Path) -> None:
    """partition-by, label-column and feature-columns name the columns a simulation reads: the
    refusal names that key (a column the loader needs of its own stays `column`)."""
    path = write(tmp_path, "x,y,site\n1.0,0,a\n2.0,1,b\n")
    cases = [
        ({"label": "y", "client_column": "region"}, "partition-by", "region"),
        ({"label": "label"}, "label-column", "label"),
        ({"label": "y", "features": ["x", "z"]}, "feature-columns", "z"),
    ]
    for options, field, column in cases:
        with pytest.raises(InputError) as excinfo:
            load_dataset("csv", path, num_classes=2, **options)
        assert excinfo.value.field == field and excinfo.value.value == column, message(excinfo)
    pums = write(tmp_path, "puma,sex,age\n1101,1,40\n")
    with pytest.raises(InputError) as excinfo:
        load_dataset("pums", pums, client_column="county")
    assert excinfo.value.field == "column"  # PUMS's own columns come first: 'married' is missing


def test_non_numeric_value_names_column_value_row_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "x,y\n1.0,0\nabc,1\n2.0,1\n")
    with pytest.raises(InputError) as excinfo:
        load_dataset("csv", path, label="y", features=["x"], num_classes=2)
    text = message(excinfo)
    assert "column x" in text and "'abc'" in text and "data row 2" in text and "bad.csv" in text


def test_empty_cell_names_column_and_row(tmp_path: Path) -> None:
    path = write(tmp_path, "x,z,y\n1,5,0\n2,6,1\n3,,1\n")
    with pytest.raises(InputError) as excinfo:
        load_dataset("csv", path, label="y", num_classes=2)
    text = message(excinfo)
    assert "column z=''" in text and "empty or NaN value" in text and "data row 3" in text and "bad.csv" in text


def test_infinite_value_names_column_and_row(tmp_path: Path) -> None:
    path = write(tmp_path, "x,y\n1,0\ninf,1\n")
    with pytest.raises(InputError, match="column x=inf: infinite value \\(data row 2 of .*bad.csv\\)"):
        load_dataset("csv", path, label="y", num_classes=2)


def test_a_feature_named_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="features=\\['x', 'x'\\]: names a column twice"):
        load_dataset("csv", write(tmp_path, "x,y\n1,0\n2,1\n"), label="y", features=["x", "x"], num_classes=2)


def test_no_feature_column_or_a_value_beyond_float32_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "site,y\na,0\nb,1\n")
    with pytest.raises(InputError, match="bad.csv has no column besides the label 'y' and the client column"):
        load_dataset("csv", path, label="y", client_column="site", num_classes=2)
    path = write(tmp_path, "x,y\n1,0\n1e39,1\n")  # finite as float64, inf as float32
    with pytest.raises(InputError, match="column x=1e\\+39: beyond float32 \\(data row 2"):
        load_dataset("csv", path, label="y", num_classes=2)


def test_pums_value_outside_0_1_names_the_row(tmp_path: Path) -> None:
    source = pums_file("fulton_pums5_sample100.csv").read_text().splitlines()
    header = source[0].replace('"', "").split(",")
    cells = source[1].split(",")
    cells[header.index("sex")] = "2"
    path = write(tmp_path, "\n".join([source[0], source[2], ",".join(cells)]) + "\n", "pums.csv")
    with pytest.raises(InputError) as excinfo:
        load_dataset("pums", path)
    text = message(excinfo)
    assert "column sex=2" in text and "must be 0 or 1" in text and "data row 2" in text


def test_the_number_of_classes_must_be_declared_not_read_from_the_labels(tmp_path: Path) -> None:
    path = write(tmp_path, "x,y\n1,0\n2,1\n3,1\n")
    with pytest.raises(InputError) as excinfo:
        load_dataset("csv", path, label="y")
    assert message(excinfo).startswith("num-classes=0: ") and "bad.csv" in message(excinfo)
    assert "one record could decide it" in message(excinfo)


def test_no_record_decides_the_number_of_classes(tmp_path: Path) -> None:
    """The only record of the largest class, removed or joined by one with a larger label: the
    class count (and so the model's shape) stays the declared one, or the file is refused."""
    full = load_dataset("csv", write(tmp_path, "x,y\n1,0\n2,1\n3,2\n", "full.csv"), label="y", num_classes=5)
    removed = load_dataset("csv", write(tmp_path, "x,y\n1,0\n2,1\n", "removed.csv"), label="y", num_classes=5)
    one_class = load_dataset("csv", write(tmp_path, "x,y\n1,1\n2,1\n", "one.csv"), label="y", num_classes=5)
    assert full.num_classes == removed.num_classes == one_class.num_classes == 5
    with pytest.raises(InputError, match="label column y=5: .*added.csv: example 3's label is outside \\[0, 5\\)"):
        load_dataset("csv", write(tmp_path, "x,y\n1,0\n2,1\n3,2\n4,5\n", "added.csv"), label="y", num_classes=5)


def test_fractional_label_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "x,y\n1,0\n2,0.5\n")
    with pytest.raises(InputError, match="label column y=0.5: labels must be integers"):
        load_dataset("csv", path, label="y")


def test_client_with_one_row_names_the_client_and_only_it_fails(tmp_path: Path) -> None:
    path = write(tmp_path, "site,x,y\na,1,0\na,2,1\na,3,0\nb,4,1\n")
    options = dict(name="csv", path=path, scheme="natural", by="site", label="y", num_classes=2)
    with pytest.raises(InputError) as excinfo:
        load_clients(**options)
    assert message(excinfo).startswith("client b=1: row(s) in its partition") and "at least 2" in message(excinfo)
    with pytest.raises(InputError, match="client b=1"):
        load_client(1, **options)
    assert load_client(0, **options).client_id == "a"  # the other clients still load
    assert [c.client_id for c in load_clients(**options, drop_too_small=True)] == ["a"]


def test_client_column_with_empty_values_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "site,x,y\na,1,0\na,2,1\n,3,0\n")
    with pytest.raises(InputError, match="site.*empty values"):
        load_clients("csv", path, scheme="natural", by="site", label="y", num_classes=2)


def test_too_many_partitions_for_the_rows() -> None:
    with pytest.raises(InputError, match="num-partitions=200.*300 rows"):
        partition(row_id_dataset(), "iid", 200)


def test_exponential_skew_too_steep_names_the_client() -> None:
    with pytest.raises(InputError, match="num-partitions=10.*exponential size skew"):
        partition(row_id_dataset(n=60), "size", 10, skew="exponential")


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: load_dataset("mnist"), "dataset='mnist'.*digits, pums, csv, synthetic"),
        (lambda: load_dataset("digits", colour=True), "option=\\['colour'\\].*images"),
        (lambda: load_dataset("digits", "/tmp/x.csv"), "path=.*built in"),
        (lambda: load_dataset("pums"), "path=None.*pums dataset needs"),
        (lambda: load_dataset("synthetic", num_examples=1), "num_examples=1"),
        (lambda: partition(row_id_dataset(), "random", 3), "partition-scheme='random'.*natural, iid"),
        (lambda: partition(row_id_dataset(), "iid"), "num-partitions=None"),
        (lambda: partition(row_id_dataset(), "size", 3, skew="cubic"), "skew='cubic'"),
        (lambda: partition(row_id_dataset(), "dirichlet", 3, alpha=0), "alpha=0"),
        (lambda: partition(row_id_dataset(), "iid", 3, test_fraction=1.0), "test-fraction=1.0"),
        (lambda: partition(row_id_dataset(), "natural", 3), "num-partitions=3.*site value: 4; .*num-supernodes=4"),
        (lambda: partition(row_id_dataset(), "natural", by="city"), "partition-by='city'.*'site'"),
        (lambda: load_clients("digits", scheme="natural"), "partition-by=None.*without a client column"),
    ],
)
def test_bad_options_name_the_field(call, pattern: str) -> None:  # noqa: ANN001
    with pytest.raises(InputError, match=pattern):
        call()


def test_the_pums_class_count_does_not_depend_on_the_records(tmp_path: Path) -> None:
    """`employed` is binary by definition: two classes even in a file where nobody is employed, so
    removing the one employed record of a file cannot change the model's shape (or refuse the run)."""
    table = pd.read_csv(pums_file("fulton_pums5_full.csv"), nrows=40)
    table["employed"] = 0
    table.loc[7, "employed"] = 1
    with_one, without = tmp_path / "one.csv", tmp_path / "none.csv"
    table.to_csv(with_one, index=False)
    table.drop(index=7).to_csv(without, index=False)
    assert load_dataset("pums", with_one).num_classes == load_dataset("pums", without).num_classes == 2


def test_a_whole_float_seed_splits_as_its_integer_whatever_the_cache_holds() -> None:
    """The split's seed is the checked one (`integer_at_least`), so the cache cannot make a call's
    outcome depend on what ran before it."""
    from fedprivacy.data.partition import _cached_split

    recipe = {"num_examples": 120, "scheme": "iid", "num_partitions": 3}
    _cached_split.cache_clear()
    cold = load_client(1, "synthetic", seed=3.0, **recipe)
    _cached_split.cache_clear()
    np.testing.assert_array_equal(cold.train.features, load_client(1, "synthetic", seed=3, **recipe).train.features)
    with pytest.raises(InputError, match="seed"):
        load_client(1, "synthetic", seed=3.5, **recipe)
