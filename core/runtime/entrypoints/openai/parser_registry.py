"""A registry of parser classes by name, for the ``--tool-call-parser`` and ``--reasoning-parser`` flags."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

P = TypeVar("P", bound=type)


class ParserRegistry(Generic[P]):
    """Subclasses of ``base`` by name; ``kind`` names them in errors ("tool call parser")."""

    def __init__(self, base: P, kind: str) -> None:
        self.base, self.kind = base, kind
        self._classes: dict[str, P] = {}

    def register(self, name: str) -> Callable[[P], P]:
        """Class decorator: make a parser available under ``name``."""

        def wrap(cls: P) -> P:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{self.kind} {name!r} must subclass {self.base.__name__}, got {cls!r}")
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"a {self.kind} named {name!r} is already registered ({self._classes[name].__qualname__})")
            cls.name = name
            self._classes[name] = cls
            return cls

        return wrap

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> P:
        """The class registered as ``name``; ValueError listing the valid names otherwise."""
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}") from None
