"""Logging: one line per meaningful event, plain text or JSON (`node.log_json`).

Every record becomes exactly one line, whatever it holds: newlines in messages are escaped
and a traceback is folded into the same line, so logs stay greppable and a JSON log is one
object per line. Structured fields go in `extra` (`log.info("published", extra={"batch":
3})`) or through `event(log, "batch_published", n=8)`; both show up as `key=value` in plain
text and as keys in JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's structured fields: everything passed through `extra`."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


def _scalar(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _fields(record).items():
            doc.setdefault(key, _scalar(value))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """`2026-11-30 02:10:00.123 INFO    swarm_node.trainer: msg key=value ...`, one line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        line = f"{ts}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: " \
               f"{record.getMessage()}"
        fields = " ".join(f"{k}={_scalar(v)}" for k, v in _fields(record).items())
        if fields:
            line += " " + fields
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info)
        return _one_line(line)


def event(logger: logging.Logger, name: str, message: str = "", level: int = logging.INFO,
          **fields: Any) -> None:
    """Log one named event with structured fields (`event=name` plus `fields`)."""
    logger.log(level, message or name, extra={"event": name, **fields})


def setup_logging(level: str = "INFO", json_lines: bool = False, stream=None) -> None:
    """Configure the root logger once: our lines at `level`, noisy libraries at WARNING."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("multiaddr", "trio", "urllib3", "httpx", "transformers", "filelock",
                  "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # py-libp2p logs every failed dial/stream of a departed peer at ERROR with a dump of the
    # connection; our p2p layer reports and counts those failures itself.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
