"""The ``fortunes`` source: fortune files (strfile format) the tests write, read through the registered loader,
checked before any work, and prepared as one task of a multi-task run."""

from __future__ import annotations

import json

import pytest

from mergeflow.config import validate_params
from mergeflow.errors import ConfigError
from mergeflow.preflight import check_paths
from mergeflow.schema.sources import get_source

# Per genre, its entries: the overstruck word (underlined by backspaces, as fortune files do) prints as "this".
GENRES = {
    "computers": ["The computer is down, reboot the server", "Unix is a four letter word", "Bugs in\nthe code today"],
    "food": ["Eat your soup before it gets cold", "Bread and cheese make a meal", "Too   much cake is\tnever enough"],
    "people": ["Nobody ____\b\b\b\bthis side is happy", "Everyone likes a good story", "one", "Some people talk"],
}


def write_fortunes(root, genres=GENRES):
    """Fortune files in ``root`` as Debian installs them: ``<genre>`` with ``%`` lines between entries, beside
    its strfile index ``<genre>.dat`` and a ``<genre>.u8`` link (neither is a genre)."""
    root.mkdir(parents=True, exist_ok=True)
    for genre, entries in genres.items():
        (root / genre).write_text("\n%\n".join(entries) + "\n%\n")
        (root / f"{genre}.dat").write_bytes(b"\x00\x00\x00\x02")
        (root / f"{genre}.u8").symlink_to(root / genre)
    return root


def _load(options, seed=0):
    source = get_source("fortunes")
    dataset, info = source.loader.load(source.parse(options), seed=seed)
    return dataset, info


def _params(options):
    return validate_params({"data": {"source": "fortunes", "fortunes": options}, "model": {"arch": "transformers"}})


def test_fortunes_are_labelled_with_their_genre_as_printed_on_one_line(tmp_path):
    root = str(write_fortunes(tmp_path / "fortunes"))
    dataset, info = _load({"root": root, "genres": ["people", "computers"]})
    assert info["class_names"] == ["computers", "people"] and info["num_classes"] == 2
    assert info["source"] == "fortunes" and info["modality"] == "text"
    assert dataset["text"] == [
        "The computer is down, reboot the server",
        "Unix is a four letter word",
        "Bugs in the code today",
        "Nobody this side is happy",  # "one" has fewer than min_words (3) words
        "Everyone likes a good story",
        "Some people talk",
    ]
    assert dataset["y"] == [0, 0, 0, 1, 1, 1]


def test_without_genres_the_largest_are_read_and_words_bound_the_entries(tmp_path):
    root = str(write_fortunes(tmp_path / "fortunes"))
    _, info = _load({"root": root, "largest": 2})
    assert info["class_names"] == ["computers", "food"]  # 3 entries each kept; people's "one" is too short
    dataset, info = _load({"root": root, "min_words": 1, "max_words": 5, "largest": 2})
    assert info["class_names"] == ["computers", "people"]  # 1 and 4 entries of at most 5 words; food none
    assert max(len(text.split()) for text in dataset["text"]) <= 5 and "one" in dataset["text"]


def test_max_examples_is_a_seeded_subset_in_file_order(tmp_path):
    root = str(write_fortunes(tmp_path / "fortunes", {g: [f"{g} entry number {i}" for i in range(40)] for g in GENRES}))
    options = {"root": root, "max_examples": 30}
    first, _ = _load(options, seed=1)
    assert first["text"] == _load(options, seed=1)[0]["text"] and first.num_rows == 30
    assert first["text"] != _load(options, seed=2)[0]["text"]
    everything = _load({"root": root})[0]["text"]
    assert [everything.index(text) for text in first["text"]] == sorted(everything.index(t) for t in first["text"])


def test_what_the_options_name_is_checked_before_any_work_in_one_line_naming_the_key(tmp_path):
    root = str(write_fortunes(tmp_path / "fortunes"))
    for options, key, why in [
        ({"root": str(tmp_path / "nowhere")}, "data.fortunes.root", "apt-get install fortunes"),
        ({"root": root, "genres": ["people", "poetry"]}, "data.fortunes.genres", "no genre 'poetry'"),
    ]:
        params = validate_params(
            {"data": {"source": "fortunes", "fortunes": options}, "model": {"arch": "transformers"}}
        )
        with pytest.raises(ConfigError) as error:
            check_paths(params)
        assert len(error.value.lines) == 1 and f": {key}: " in error.value.lines[0] and why in error.value.lines[0]
    for options, key in [({"genres": ["food", "food"]}, "data.fortunes.genres"), ({"max_words": 2}, "max_words")]:
        with pytest.raises(ConfigError, match=key):
            _params(options)


def test_a_fortunes_task_is_prepared_relabelled_beside_another_task(tmp_path):
    from tasks.data import plan_prepare, prepare

    root = str(write_fortunes(tmp_path / "fortunes", {g: [f"{g} entry number {i}" for i in range(30)] for g in GENRES}))
    fortunes = {"source": "fortunes", "fortunes": {"root": root}}
    params = validate_params(
        {
            "data": {**fortunes, "validation_fraction": 0.1},
            "tasks": {"genre": {}, "people": {"labels": {0: 0, 1: 0, 2: 1}}},
            # The tasks share the pretrained model's tokenizer (the prepare step does not read it).
            "model": {"arch": "transformers", "transformers": {"pretrained": str(tmp_path / "model")}},
        }
    )
    steps = plan_prepare(params)
    assert [step.name for step in steps] == ["prepare/genre", "prepare/people"]
    assert {"mergeflow/data/fortunes.py", "mergeflow/schema/sources/fortunes.py"} <= set(steps[0].code)
    for step in steps:
        sizes = prepare(step.params, tmp_path, tmp_path, {})
        assert sum(sizes.values()) == 90
    infos = {
        task: json.loads((tmp_path / f"data/prepared/tasks/{task}/text/info.json").read_text())
        for task in ("genre", "people")
    }
    assert infos["genre"]["class_names"] == ["computers", "food", "people"]
    assert infos["people"]["class_names"] == ["computers+food", "people"] and infos["people"]["num_classes"] == 2
    assert (tmp_path / "data/prepared/tasks/people/text/test.parquet").is_file()
