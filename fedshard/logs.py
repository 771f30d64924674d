"""fedshard's log lines where Flower's are, with Flower's format and level.

Every module of the library logs through :mod:`logging` under its own name (``fedshard.*``),
so that a project can still tune or silence the library (``logging.getLogger("fedshard")
.setLevel(logging.WARNING)``). Importing :mod:`fedshard` gives those records to the handlers of
Flower's logger (``flwr``, :mod:`flwr.common.logger`) as well: they are printed by Flower's
console handler in Flower's format (``INFO :      ...``, ``WARNING :   ...``), at the level
Flower shows (``FLWR_LOG_LEVEL``), and reach the ServerApp's log that ``flwr log`` streams.
They also propagate to the root logger as Flower's own lines do (a project's root handlers, a
test's ``caplog``), and no handler gets a record twice. Without this, a project that configures
no logging of its own would print fedshard's warnings as bare lines through Python's
last-resort handler and drop its INFO lines altogether.
"""

from __future__ import annotations

import logging

__all__ = ["LIBRARY_LOGGER", "ToFlower", "route_to_flower"]

#: The parent logger of every fedshard module.
LIBRARY_LOGGER = "fedshard"


class ToFlower(logging.Handler):
    """Gives each record that Flower's logger would show to that logger's own handlers (its
    console handler, and whatever a program added to it), except those that already get it
    through the root logger."""

    def emit(self, record: logging.LogRecord) -> None:
        flower = logging.getLogger("flwr")
        if not flower.isEnabledFor(record.levelno):
            return
        shared = set(logging.getLogger().handlers) if flower.propagate else set()
        for handler in flower.handlers:
            if handler not in shared and record.levelno >= handler.level:
                handler.handle(record)


def route_to_flower() -> None:
    """Give the ``fedshard`` logger one :class:`ToFlower` handler and, unless the project set
    one, Flower's logger's level (idempotent)."""
    library = logging.getLogger(LIBRARY_LOGGER)
    if not any(isinstance(h, ToFlower) for h in library.handlers):
        library.addHandler(ToFlower())
    if library.level == logging.NOTSET:
        library.setLevel(logging.getLogger("flwr").level or logging.INFO)
