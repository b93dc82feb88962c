"""Cache keys from the import graph: an edited module re-keys every step that imports it, even
transitively, and no other; the stage registry's DVC deps are the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
from code_copies import copy_code
from conftest import PIPELINE, ROOT, pipeline_params

from mergeflow.import_graph import import_closure, third_party_versions
from tasks.stages import STAGES

# The tests' pipeline with more merges: two sparsifying methods and a searched one (a step per candidate).
MORE_MERGES = [
    f"merge.methods=[{','.join([*PIPELINE['merge']['methods'], 'ties', 'della', 'della_search'])}]",
    "merge.options.della_search={method: della, density: [0.3, 0.5]}",
    "data.validation_fraction=0.2",
]
# ... and the federated stage's other axes: an entry with a robust rule and a server optimizer, and a
# label-flipping attacker (a data attack: its client updates run the attack).
MORE_FEDERATED = [
    f"federated.algorithms=[{','.join([*PIPELINE['federated']['algorithms'], 'fedavg_robust'])}]",
    "federated.options.fedavg_robust={algorithm: fedavg, aggregator: median, server: {optimizer: adam, lr: 0.1}}",
    "federated.attack={clients: 1, kind: label_flip}",
]


def _plan(raw: dict) -> list:
    from mergeflow.config import validate_params
    from tasks.runner import _waves
    from tasks.steps import resolve

    params = validate_params(raw)
    return [
        step for stage in STAGES for phase in stage.phases for wave in _waves(resolve(phase)(params)) for step in wave
    ]


@pytest.fixture(scope="module")
def planned():
    from mergeflow.config import apply_overrides

    return _plan(apply_overrides(pipeline_params(), MORE_MERGES + MORE_FEDERATED))


def _keys(steps, code_root: Path, workspace: Path, monkeypatch) -> dict[str, str]:
    import tasks.steps

    monkeypatch.setattr(tasks.steps, "project_root_of_code", lambda: code_root)
    return {step.name: tasks.steps.step_key(step, workspace) for step in steps}


def _edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# an edit\n")


ALL_ENTRIES = {*PIPELINE["federated"]["algorithms"], "fedavg_robust", "summary"}


@pytest.mark.parametrize(
    "module, stages, members",
    [
        # the holes of the hand-kept lists: federated training, Fisher's training and models, seeds, track
        ("mergeflow/training.py", None, None),
        # a step module reads its siblings' outputs through tasks/layout.py, not their code: evaluate and track
        # import no merge and no federated algorithm, align and merge no training step
        ("mergeflow/federated/local.py", {"federated"}, ALL_ENTRIES),
        ("mergeflow/seeding.py", {"pretrain", "finetune", "centralized", "fisher", "federated"}, None),
        ("tasks/tracking.py", {"track"}, None),
        # keys per member: a method's module re-keys its merges only (evaluate and track then re-run on the
        # merged models they read, their inputs), a shared helper the merges of the methods that import it
        ("mergeflow/merge/della.py", {"merge"}, {"della", "della_search"}),
        ("mergeflow/merge/ties.py", {"merge"}, {"ties"}),
        ("mergeflow/merge/sparsify.py", {"merge"}, {"ties", "della", "della_search"}),
        ("mergeflow/merge/average.py", {"merge"}, {"average", "fisher"}),  # fisher averages what it does not cover
        # an algorithm's module re-keys its rounds only (and the summary, which asks every algorithm for its
        # stability warning); evaluate and track then re-run on the files they read
        ("mergeflow/federated/fedprox.py", {"federated"}, {"fedprox", "summary"}),
        ("mergeflow/federated/bayes_admm.py", {"federated"}, {"bayes_admm", "summary"}),
        ("mergeflow/federated/fedavg.py", {"federated"}, {"fedavg", "fedprox", "fedavg_robust", "summary"}),
        # the server-side members: the robust rule and the server optimizer of the entry that runs them
        ("mergeflow/federated/robust.py", {"federated"}, {"fedavg_robust"}),
        ("mergeflow/federated/server_opt.py", {"federated"}, {"fedavg_robust"}),
        # a data attack: every entry's client updates of the attacker
        ("mergeflow/federated/attacks.py", {"federated"}, ALL_ENTRIES - {"summary"}),
        # a source's declaration and loader key the prepare step of its runs only
        ("mergeflow/data/digits.py", {"prepare"}, None),
        ("mergeflow/schema/sources/digits.py", {"prepare"}, None),
        ("mergeflow/data/text.py", set(), None),
        ("mergeflow/data/table.py", set(), None),
        ("mergeflow/schema/sources/wordnet.py", set(), None),
    ],
)
def test_an_edit_re_keys_exactly_the_steps_that_import_it(module, stages, members, planned, tmp_path, monkeypatch):
    code_root = copy_code(tmp_path / "code")
    before = _keys(planned, code_root, tmp_path, monkeypatch)
    _edit(code_root / module)
    after = _keys(planned, code_root, tmp_path, monkeypatch)
    changed = {name for name in before if before[name] != after[name]}
    importers = {step.name for step in planned if module in step.code}
    assert changed == importers  # every importer, transitively, and nothing else
    assert {name.split("/")[0] for name in changed} == stages if stages is not None else changed
    if members is not None:  # the second part of a step's name: the merge or federated entry whose steps run it
        assert {name.split("/")[1] for name in changed} == members
    if module.startswith("mergeflow/merge/"):  # a search's candidates run the method, not the choice among them
        assert "merge/della_search" not in changed
    # the server-side members run in the server steps alone, a data attack in its attacker's client updates
    kinds = {name.rpartition("/")[2] for name in changed}
    if module.endswith(("/robust.py", "/server_opt.py")):
        assert kinds == {"server"}
    if module.endswith("/attacks.py"):
        assert len(kinds) == 1 and kinds.pop().startswith("client_")
    if module == "mergeflow/training.py":  # every federated client update and every Fisher
        assert {s.name for s in planned if s.name.startswith(("federated/", "fisher/"))} <= changed


def test_adding_a_source_re_keys_no_step_of_the_default_pipeline(tmp_path, monkeypatch):
    from blobs_source import DECLARATION, FILES, add_blobs

    from mergeflow.schema.sources import SOURCES

    code_root = copy_code(tmp_path / "code")
    before = _keys(_plan(pipeline_params()), code_root, tmp_path, monkeypatch)
    add_blobs(code_root)  # its two modules in the tree, and its declaration registered here, as it would be
    exec(compile(FILES[DECLARATION], DECLARATION, "exec"), {"__name__": "mergeflow.schema.sources.blobs"})
    try:
        assert "blobs" in SOURCES
        assert _keys(_plan(pipeline_params()), code_root, tmp_path, monkeypatch) == before
    finally:
        SOURCES.pop("blobs")


def test_a_run_on_one_source_is_keyed_by_its_loader_and_options_not_by_the_others():
    from mergeflow.config import validate_params
    from tasks.data import plan_prepare

    table = {"data": {"source": "table", "table": {"path": "csv", "data_files": "t.csv"}}}
    text = {"data": {"source": "text", "text": {"path": "csv"}}, "model": {"arch": "transformers"}}
    for raw, reads in ((table, {"table"}), (text, {"table", "text"})):  # the text source reads a table
        (prepare,) = plan_prepare(validate_params(raw))
        loaders = {path.removeprefix("mergeflow/data/").removesuffix(".py") for path in prepare.code}
        assert loaders & {"digits", "wine", "pinwheel", "linreg", "table", "text", "wordnet"} == reads
        keys = set(prepare.params["data"])
        assert raw["data"]["source"] in keys and not keys & {"digits", "wordnet", "tokenizer"}
        assert ("standardize" in keys) == (raw is table)  # text is tokenized: the feature policies go unread


def test_steps_that_an_edit_of_seeding_leaves_alone_never_derive_a_seed(planned):
    for step in planned:
        if "mergeflow/seeding.py" not in step.code:
            assert not any("derive_seed" in (ROOT / path).read_text() for path in step.code), step.name


def test_the_closure_follows_lazy_imports_parent_packages_and_lazily_served_names(tmp_path):
    (tmp_path / "pkg/sub").mkdir(parents=True)
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/sub/__init__.py").write_text("def __getattr__(name):\n    ...\n")  # PEP 562, like mergeflow.data
    (tmp_path / "pkg/sub/one.py").write_text("from . import two\n")
    (tmp_path / "pkg/sub/two.py").write_text("from ..leaf import x\n")
    (tmp_path / "pkg/sub/three.py").write_text("")
    (tmp_path / "pkg/leaf.py").write_text("import numpy\nx = 1\n")
    (tmp_path / "main.py").write_text("def run():\n    from pkg.sub import served_lazily\n")
    (tmp_path / "other.py").write_text("import pkg.sub.one\n")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain/__init__.py").write_text("")
    (tmp_path / "plain/a.py").write_text("from . import b\n")
    (tmp_path / "plain/b.py").write_text("def f():\n    from pkg.leaf import x\n")
    (tmp_path / "plain/c.py").write_text("")
    (tmp_path / "uses_plain.py").write_text("import plain.a\n")
    assert import_closure("uses_plain", tmp_path) == (
        "pkg/__init__.py",
        "pkg/leaf.py",
        "plain/__init__.py",
        "plain/a.py",
        "plain/b.py",
        "uses_plain.py",
    )  # plain/c.py is imported by nobody
    # a name the package serves lazily could be in any of its modules: all of them count
    lazy = {"pkg/__init__.py", "pkg/leaf.py"} | {f"pkg/sub/{name}.py" for name in ("__init__", "one", "two", "three")}
    assert set(import_closure("main", tmp_path)) == {"main.py"} | lazy
    # however the lazy package is reached: as a module object, under another name, by a star import
    for index, statement in enumerate(("from pkg import sub", "import pkg.sub as s", "from pkg.sub import *")):
        (tmp_path / f"reach{index}.py").write_text(statement + "\n")
        assert set(import_closure(f"reach{index}", tmp_path)) == {f"reach{index}.py"} | lazy, statement
    # a package and a module of the same name: Python imports the package, and so does the walk
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup/__init__.py").write_text("")
    (tmp_path / "dup.py").write_text("")
    (tmp_path / "uses_dup.py").write_text("import dup\n")
    assert import_closure("uses_dup", tmp_path) == ("dup/__init__.py", "uses_dup.py")


def test_records_and_runs_note_third_party_versions():
    import torch

    assert (
        third_party_versions()["torch"] == torch.__version__.split("+")[0]
        or third_party_versions()["torch"] == torch.__version__
    )
    assert "numpy" in third_party_versions()


def test_the_library_imports_neither_the_orchestration_layers_nor_prefect_or_mlflow():
    import ast

    for path in sorted((ROOT / "mergeflow").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        closure = import_closure(module, ROOT)
        assert not [p for p in closure if p.startswith(("tasks/", "flows/"))], module
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] in ("prefect", "mlflow", "prefect_dask")], path


def test_import_cycles_are_the_strongly_connected_modules(tmp_path):
    from mergeflow.import_graph import import_cycles

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text("from pkg import a\n")  # a package importing its own module: no circle
    (tmp_path / "pkg/a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg/b.py").write_text("def f():\n    from pkg import c\n")  # function-level imports count
    (tmp_path / "pkg/c.py").write_text("import pkg.a\n")
    (tmp_path / "pkg/d.py").write_text("from pkg import e\n")
    (tmp_path / "pkg/e.py").write_text("from pkg.d import x\n")
    (tmp_path / "pkg/f.py").write_text("import pkg.a\n")
    assert import_cycles(tmp_path, ("pkg",)) == [("pkg.a", "pkg.b", "pkg.c"), ("pkg.d", "pkg.e")]


def test_the_code_has_no_import_circle():
    from mergeflow.import_graph import import_cycles

    assert import_cycles(ROOT, ("mergeflow", "tasks", "flows")) == []
