"""The message base class and the type registry used by the codec.

Every bus message is a pydantic model with a class-level `TYPE` tag and `VERSION`. The codec
writes both into the envelope and refuses a message whose version it does not know, so a
mixed-version mesh fails loudly instead of misreading fields.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class Message(BaseModel):
    """A bus message. Subclasses set TYPE (unique) and VERSION (bump on incompatible change)."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1


class Struct(BaseModel):
    """A nested (non-top-level) part of a message."""

    model_config = ConfigDict(extra="forbid")


MESSAGE_TYPES: dict[str, type[Message]] = {}


def register(cls: type[Message]) -> type[Message]:
    """Class decorator: make a message type known to the codec."""
    if not cls.TYPE:
        raise TypeError(f"{cls.__name__} has no TYPE")
    if cls.TYPE in MESSAGE_TYPES and MESSAGE_TYPES[cls.TYPE] is not cls:
        raise TypeError(f"duplicate message TYPE {cls.TYPE!r}")
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls
