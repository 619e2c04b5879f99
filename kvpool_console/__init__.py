"""kvpool console: the Textual fleet console and its one-shot modes."""
