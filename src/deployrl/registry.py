"""Registries by name: advantage estimators, aggregations, discrepancy signals, cutoff laws.

An unknown name fails with the list of valid names and the closest match; registering a
name twice is refused, so a plug-in cannot silently replace a built-in. A closed vocabulary of
a setting (a schedule, a dynamic-sampling mode) is a `Choice` enum: its members are the names a
config holds, each with its meaning, and the module that defines it is the only one that tells
the names apart.
"""

from __future__ import annotations

import difflib
import enum
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


def unknown_name_error(kind: str, name: str, valid: list[str]) -> ValueError:
    """The error for a name that is not one of `valid`, with the closest suggestion."""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}.{hint} Valid names: {', '.join(sorted(valid))}.")


class Registry(Generic[T]):
    """A mapping from names to objects of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str):
        """Decorator that registers its target under `name`."""

        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise unknown_name_error(self.kind, name, list(self._items))
        return self._items[name]

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)


class Choice(str, enum.Enum):
    """A closed vocabulary of a setting. A member is the plain name a config holds (a `str`) with
    its meaning, `help`: ``CONSTANT = "constant", "the peak rate after warmup"``."""

    help: str

    def __new__(cls, name: str, help: str = ""):
        member = str.__new__(cls, name)
        member._value_ = name
        member.help = help
        return member

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> list[str]:
        return [member.value for member in cls]

    @classmethod
    def get(cls, kind: str, name: str) -> "Choice":
        """The member called `name`; an unknown name fails as a registry's does, `kind` naming the setting."""
        if name not in cls.names():
            raise unknown_name_error(kind, name, cls.names())
        return cls(name)

    @classmethod
    def described(cls) -> str:
        """'name (meaning), ...' for help texts and docs."""
        return ", ".join(f"{m.value} ({m.help})" if m.help else m.value for m in cls)
