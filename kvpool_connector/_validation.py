"""One way to turn a pydantic ``ValidationError`` into the one line an operator reads."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails

__all__ = ["FieldErrors", "field_problems"]


def field_problems(exc: ValidationError, prefix: str = "", *, show_input: bool = False) -> str:
    """``"<prefix><field>: <problem>[ (got <value>)]"`` for every invalid field, joined by ``; ``.

    Args:
        exc: the error pydantic raised.
        prefix: what names the field where the operator sets it, e.g.
            ``"kv_connector_extra_config.yuanrong_"``; nested locations are joined with ``.``.
        show_input: append the rejected value (``repr``).
    """
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        got = f" (got {err.get('input')!r})" if show_input else ""
        parts.append(f"{prefix}{loc}: {err['msg']}{got}")
    return "; ".join(parts)


class FieldErrors(ValueError):
    """A ``ValueError`` whose message is ``field_problems(exc, prefix, show_input=True)`` and
    which keeps pydantic's errors (``errors``: each field's ``loc``, ``type``, ``ctx``,
    ``input``) for a tool that explains each one (``kvpool-config``'s fixes)."""

    def __init__(self, exc: ValidationError, prefix: str) -> None:
        super().__init__(field_problems(exc, prefix, show_input=True))
        self.errors: list[ErrorDetails] = exc.errors()
