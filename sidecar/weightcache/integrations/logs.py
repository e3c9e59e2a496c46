"""The adapters' log lines, shown wherever the engine shows its own.

vLLM configures only its own logger tree (``vllm``, not propagating to the
root, and only once its arguments are parsed, after plugins load), so records
of ``weightcache.*`` loggers below WARNING would be dropped and WARNINGs
would reach stderr unformatted. :func:`follow_engine_logging` forwards every
``weightcache`` record to the engine's logger when it is emitted, so the
engine's handlers, format and level (vLLM's default: INFO) apply, whenever
they are configured. SGLang configures the root logger, which ``weightcache``
propagates to already.
"""

from __future__ import annotations

import logging

ADAPTER_LOGGER = "weightcache"


class _Forward(logging.Handler):
    """Hands each record to another logger's handlers (as if logged there)."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(self.target).handle(record)


def follow_engine_logging(engine_logger: str) -> None:
    """Forward ``weightcache`` records to ``engine_logger``; idempotent.

    Left alone if the process gave ``weightcache`` handlers of its own.
    """
    ours = logging.getLogger(ADAPTER_LOGGER)
    if ours.handlers:
        return
    ours.addHandler(_Forward(engine_logger))
    ours.setLevel(logging.INFO)  # the engine's handlers apply its own level
    ours.propagate = False  # once, through the engine's handlers
