"""Numeric ranges declared beside the schema's fields, and lookups of fields by dotted key.

Why in the field's metadata: the bounds sit next to the default and type they
constrain (``max_steps: int = positive(40)``), so a new key states its range where it
is declared; :mod:`raytrain_ext.config.validate` checks every declared range, and the
loader finds a key's choice enum here to word its error.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from functools import lru_cache
from typing import Any, Iterator, List, Optional, Tuple, Type

from raytrain_ext.typed_config.choice import Choice

RANGE = "range"


@dataclasses.dataclass(frozen=True)
class Range:
    """``lo`` (excluded when ``lo_open``) up to ``hi`` (excluded when ``hi_open``).

    ``finite`` also refuses infinity (a timeout or a rate of ``inf`` is never meant);
    ``wording`` replaces the bounds in the message where a bound has a meaning
    (``-1 (none/unlimited) or >= 0``).  ``None`` always passes: OmegaConf already
    refuses null for a field that is not ``Optional``.
    """

    lo: float
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    finite: bool = False
    wording: str = ""

    def bounds(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"in {left}{self.lo:g}, {self.hi:g}{right}"

    def holds(self, value: float) -> bool:
        """Written so that NaN fails every comparison, hence every range."""
        above = value > self.lo if self.lo_open else value >= self.lo
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below and not (self.finite and math.isinf(value))

    def problem(self, key: str, value: Any) -> Optional[str]:
        """The message for a value outside the range, naming the key and the fix; else None."""
        if value is None or self.holds(value):
            return None
        return (
            f"{key}: must be {self.wording or self.bounds()}, got {value}. "
            f"Set {key} to a value {self.bounds()}."
        )


def positive(default: Any, *, null: str = "") -> Any:
    """A field that must be > 0 and finite; ``null`` says what null means where it is allowed."""
    wording = f"> 0 or null ({null})" if null else "a positive finite number"
    return _bounded(default, Range(0, lo_open=True, finite=True, wording=wording))


def at_least(lo: float, default: Any, *, wording: str = "") -> Any:
    """A field that must be >= ``lo``; ``wording`` explains a sentinel such as -1."""
    return _bounded(default, Range(lo, wording=wording))


def minus_one_or_more(default: int) -> Any:
    """A count or rank where -1 means unlimited (a failure budget) or none (a chaos rank)."""
    return at_least(-1, default, wording="-1 (none/unlimited) or >= 0")


def within(lo: float, hi: float, default: Any, *, hi_open: bool = False) -> Any:
    """A field in ``[lo, hi]`` (``[lo, hi)`` when ``hi_open``)."""
    return _bounded(default, Range(lo, hi, hi_open=hi_open))


def _bounded(default: Any, bounds: Range) -> Any:
    return dataclasses.field(default=default, metadata={RANGE: bounds})


@lru_cache(maxsize=None)
def leaf_fields(schema: type, prefix: str = "") -> Tuple[Tuple[str, Any, Any], ...]:
    """``(dotted key, dataclasses.Field, resolved type)`` of every non-section field."""
    hints = typing.get_type_hints(schema)
    leaves: List[Tuple[str, Any, Any]] = []
    for f in dataclasses.fields(schema):
        key, kind = prefix + f.name, hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            leaves.extend(leaf_fields(kind, key + "."))
        else:
            leaves.append((key, f, kind))
    return tuple(leaves)


def declared_ranges(schema: type) -> Iterator[Tuple[str, Range]]:
    for key, f, _ in leaf_fields(schema):
        if RANGE in f.metadata:
            yield key, f.metadata[RANGE]


def choice_of(schema: type, key: str) -> Optional[Type[Choice]]:
    """The enum a key is declared with (``Optional`` or not), or None if its values are not
    a closed set."""
    for name, _, kind in leaf_fields(schema):
        if name != key:
            continue
        members = [k for k in typing.get_args(kind) if k is not type(None)]
        kind = members[0] if typing.get_origin(kind) is typing.Union and len(members) == 1 else kind
        if isinstance(kind, type) and issubclass(kind, Choice):
            return kind
    return None
