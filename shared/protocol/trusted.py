"""Building protocol structs on the per-step hot path without re-validating them.

The scheduler builds one CachedRequestData per running request and one RequestDelta per
sampled request every step, the worker one SampledTokens per sampled request. Their values
come from the service's own state, already valid by construction, so pydantic's validation
(microseconds each, and a Python loop per element for packed int lists) buys nothing there; at
64 running requests it was most of the scheduler step's host time.
`model_construct` is no faster for such small models. A `TrustedBuilder` fills the instance
dict directly (defaults precomputed once; default factories still called per instance, so no
two messages share a mutable default) and sets the same bookkeeping attributes
`model_construct` sets. Only for values the caller guarantees valid: anything from the bus is
validated by the codec as usual. Equality with validated construction is a unit test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_new = object.__new__
_set = object.__setattr__


class TrustedBuilder(Generic[M]):
    def __init__(self, cls: type[M]) -> None:
        self.cls = cls
        self.defaults: dict[str, Any] = {}
        self.factories: dict[str, Callable[[], Any]] = {}
        self.required: frozenset[str] = frozenset(
            name for name, field in cls.model_fields.items() if field.is_required()
        )
        for name, field in cls.model_fields.items():
            if field.default_factory is not None:
                self.factories[name] = field.default_factory  # type: ignore[assignment]
            elif not field.is_required():
                self.defaults[name] = field.default

    def __call__(self, **values: Any) -> M:
        if not self.required <= values.keys():
            missing = sorted(self.required.difference(values))
            raise TypeError(f"{self.cls.__name__} needs {missing}")
        data = self.defaults.copy()
        for name, factory in self.factories.items():
            if name not in values:
                data[name] = factory()
        data.update(values)
        obj = _new(self.cls)
        _set(obj, "__dict__", data)
        _set(obj, "__pydantic_fields_set__", set(values))
        _set(obj, "__pydantic_extra__", None)
        _set(obj, "__pydantic_private__", None)
        return obj
