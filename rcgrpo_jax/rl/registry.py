"""Name -> declaration tables for the RL step's pluggable parts (advantage estimators, policy
objectives), filled by decorators where each part is defined and read by the name a config
gives.

A name is registered once: the compiled-step cache keys a program by the names (and the declared
settings) it was built from, so a name must always mean the same function in a process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

D = TypeVar("D")


class Registry(Mapping[str, D], Generic[D]):
    """Read like a dict of name -> declaration; `add` is the only way in."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # what the names name, for the error messages ("objective", ...)
        self._items: dict[str, D] = {}

    def add(self, name: str, declaration: D) -> D:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = declaration
        return declaration

    def __getitem__(self, name: str) -> D:
        if name not in self._items:
            raise ValueError(f"{self.kind} {name!r}; expected one of {', '.join(self._items)}")
        return self._items[name]

    def __contains__(self, name: object) -> bool:  # Mapping's would catch only a KeyError
        return name in self._items

    def get(self, name: str, default: D | None = None) -> D | None:
        return self._items.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)
