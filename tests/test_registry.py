"""The one registry shape: names and aliases, "did you mean", strict options, implementations imported on use."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
from pydantic import BaseModel, ConfigDict

from mergeflow.errors import ConfigError
from mergeflow.registry import Member, NoOptions, Registry


class _Loose(BaseModel):
    x: int = 0


@dataclass(frozen=True)
class _Declared(Member):
    name: str
    implementation: str = ""
    aliases: tuple[str, ...] = ()
    Options: type[BaseModel] = NoOptions


def test_a_member_is_found_by_name_or_alias_and_an_unknown_name_gets_a_suggestion(capsys):
    members: Registry[_Declared] = Registry("widget", "model.widget")
    members.declare(_Declared("sparkle", aliases=("glitter",)))
    assert members.lookup("sparkle") is members.lookup("glitter") is members["sparkle"]
    assert "model.widget 'glitter' is now 'sparkle'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"model.widget: widget 'sparkel' is unknown \(did you mean 'sparkle'\?\)"):
        members.lookup("sparkel")
    with pytest.raises(ValueError, match="'glitter' is registered twice"):
        members.declare(_Declared("glitter"))


def test_options_must_forbid_extra_keys():
    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    members: Registry[_Declared] = Registry("widget")
    members.declare(_Declared("strict", Options=Strict))
    with pytest.raises(ValueError, match="must forbid extra keys"):
        members.declare(_Declared("loose", Options=_Loose))


def test_an_implementation_is_imported_when_loaded_and_not_before(tmp_path, monkeypatch):
    (tmp_path / "lazy_member_impl.py").write_text("def run():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    member = _Declared("lazy", "lazy_member_impl:run")
    assert member.module == "lazy_member_impl" and "lazy_member_impl" not in sys.modules
    assert member.load()() == 42
    with pytest.raises(ImportError, match="has no 'missing'"):
        _Declared("wrong", "lazy_member_impl:missing").load()
    with pytest.raises(ImportError, match="no implementation"):
        _Declared("none").load()
