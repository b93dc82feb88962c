"""The ``model`` section: ``arch`` and the options of the family that builds it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, create_model, field_validator, model_validator

from mergeflow.config.section import Section
from mergeflow.errors import ConfigError
from mergeflow.schema.deprecation import deprecated
from mergeflow.schema.families import DECLARED as FAMILY_DECLARATIONS
from mergeflow.schema.families import FamilyDeclaration, family_of_arch


class _ModelSection(Section):
    """The model: ``arch`` names a member of a registered family (:mod:`mergeflow.schema.families`)."""

    arch: str = "mlp"

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, raw: Any) -> Any:
        """A family's old name (``hf``) as ``model.arch`` or as its section, with a one-line notice; an
        old section's keys go over the new one's (``-S model.hf.pretrained=…`` over a file that says
        ``model.transformers``)."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        for family in FAMILY_DECLARATIONS.values():
            for old in family.aliases:
                notice = f"model.arch {old!r} is now {family.archs[0]!r} (and model.{old} is model.{family.name})"
                if raw.get("arch") == old:
                    raw["arch"] = family.archs[0]
                    deprecated(notice)
                if old in raw:
                    section = raw.pop(old)
                    if isinstance(section, dict) and isinstance(raw.get(family.name), dict):
                        section = raw[family.name] | section
                    raw[family.name] = section
                    deprecated(notice)
        return raw

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, arch: str) -> str:
        try:
            family_of_arch(arch)
        except ConfigError as error:
            raise ValueError(str(error).removeprefix("model.arch: ")) from None
        return arch

    @property
    def family(self) -> FamilyDeclaration:
        """The declaration of the family that builds ``arch``."""
        return family_of_arch(self.arch)

    @property
    def options(self) -> BaseModel:
        """The chosen family's options (section ``model.<family>``, or keys of ``model`` itself)."""
        return self.family.options(self)


def _model_config() -> type[_ModelSection]:
    """The ``model`` section: ``arch``, the keys of a family declared with ``inline_options`` (the MLPs'
    ``widths``), and a section ``model.<name>`` per other family with options, each its ``Options``."""
    inline = tuple(family.Options for family in FAMILY_DECLARATIONS.values() if family.inline_options)
    sections = {
        family.name: (family.Options, family.Options())
        for family in FAMILY_DECLARATIONS.values()
        if not family.inline_options and family.Options.model_fields
    }
    # The inline options' classes first: pydantic orders the fields from the last base, so ``arch`` leads.
    return create_model(
        "ModelConfig", __base__=(*inline, _ModelSection), __module__=__name__, __doc__=_ModelSection.__doc__, **sections
    )


ModelConfig = _model_config()
