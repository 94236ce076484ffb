"""The base of every closed set of values a config key accepts.

Why enums: a field annotated with one of them is checked by OmegaConf while YAML files and
``key=value`` overrides are merged, so a typo fails before Ray starts, and the allowed
values are written once, where the section that reads them declares them.

Why ``StrEnum`` members named by their own value: code compares config values with plain
strings, looks them up in dicts keyed by strings and formats them into messages.  A
``StrEnum`` member equals, hashes and formats as its value, and :class:`Choice` makes its
``repr`` the value's too.  OmegaConf accepts a member's name or its value and writes the
*name* when a config becomes YAML or a plain dict (``enum_to_str``), so name and value
must be the same string: each enum is declared with members named by their values, or
built by :func:`choice_from_values` where the values come from a registry or are not
identifiers (``1f1b``); a type checker sees those as a ``Choice`` without named members,
and no code names one of their members (a registry key is looked up, not spelled).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Tuple, Type, cast


class Choice(StrEnum):
    """Base of the choice enums: a member reads, compares and prints as its plain value."""

    def __repr__(self) -> str:
        """Messages format values with ``!r`` (``got 'zero'``); keep them free of enum noise."""
        return repr(self.value)

    @classmethod
    def values(cls) -> Tuple[str, ...]:
        """The allowed spellings, in declaration order (for messages and CLI choices)."""
        return tuple(member.value for member in cls)


def choice_from_values(name: str, module: str, doc: str, *values: str) -> Type[Choice]:
    """An enum of ``module`` whose members are named by their values, built at run time
    (for values a registry holds, or that are not identifiers)."""
    members = [(value, value) for value in values]
    enum = Choice(name, members, module=module, qualname=name)  # type: ignore[call-arg]
    enum.__doc__ = doc
    return cast(Type[Choice], enum)
