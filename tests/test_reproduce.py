"""`mergeflow reproduce`: each reproduction is declared once (name, default preset, runner), and the command line
offers exactly those."""

from __future__ import annotations

import pytest
from conftest import ROOT

from flows.reproduction_registry import REPRODUCTIONS
from mergeflow.errors import ConfigError


def test_every_declared_reproduction_has_its_preset_and_runner():
    assert list(REPRODUCTIONS) == [
        *("linear-gaussian", "pinwheel", "alignment", "federated", "participation", "merges", "averaging-laws"),
        *("robustness", "privacy"),
    ]
    for name, reproduction in REPRODUCTIONS.items():
        assert (ROOT / reproduction.preset).is_file(), name
        assert callable(reproduction.load()), name
    assert REPRODUCTIONS["participation"].load() is REPRODUCTIONS["federated"].load()


def test_the_command_line_offers_the_declared_reproductions(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    assert "{" + ",".join(REPRODUCTIONS) + "}" in capsys.readouterr().out


def test_an_unknown_reproduction_gets_a_did_you_mean(tmp_path):
    from flows.reproduce import reproduce

    with pytest.raises(ConfigError, match=r"reproduce: reproduction 'merge' is unknown \(did you mean 'merges'\?\)"):
        reproduce("merge", tmp_path)
