"""kvpool console: the Textual fleet console and its one-shot modes.

It is used through its command, ``kvpool-console`` (:mod:`kvpool_console.cli`). The package root
exports nothing on purpose: importing it must not load Textual, which the one-shot modes
(``status``, ``health``, ``flush``) never need. Public modules: :mod:`~kvpool_console.cli`
(``main``), :mod:`~kvpool_console.app` (``KVPoolConsole``, for the demo and the benchmarks),
:mod:`~kvpool_console.source` (where the fleet comes from), :mod:`~kvpool_console.model` and
:mod:`~kvpool_console.alerts` (the view model and alert rules behind the TUI and
``status --json``), :mod:`~kvpool_console.signals` (SIGHUP and SIGTERM as an orderly exit, also
for the demo), and the :mod:`~kvpool_console.screens` and :mod:`~kvpool_console.widgets`
packages; modules named ``_*`` are private.
"""

__all__: list[str] = []
