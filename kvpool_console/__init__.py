"""kvpool console: the Textual fleet console and its one-shot modes."""

__all__: list[str] = []
