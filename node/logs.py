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
import threading
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


class RateLimit(logging.Filter):
    """Repeated lines are shown `burst` times per `window_s`; the rest are counted and the
    next one shown says how many were held back (`suppressed=N`). Two warnings repeat when
    they share the logger, the level, the format string and the head of the first argument
    (so "manifest rejected (not_newer): ..." collapses, other reasons do not); two INFO
    lines repeat only when their whole text is the same (a peer's "published round 7" and
    "round 8" are both news; the same refusal every few seconds is not)."""

    def __init__(self, burst: int = 3, window_s: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._seen: dict[tuple, list] = {}  # key -> [window start, shown, held back]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or record.levelno >= logging.CRITICAL:
            return True
        key = _repeat_key(record)
        now = self.clock()
        slot = self._seen.get(key)
        if slot is None or now - slot[0] > self.window_s:
            held = slot[2] if slot else 0
            if len(self._seen) > 1024:  # bounded whatever the messages are
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if held:
                record.suppressed = held
            return True
        if slot[1] < self.burst:
            slot[1] += 1
            return True
        slot[2] += 1
        return False


def _repeat_key(record: logging.LogRecord) -> tuple:
    if record.levelno < logging.WARNING:
        return record.name, record.levelno, record.getMessage()[:300]
    first = ""
    if isinstance(record.args, tuple) and record.args:
        first = str(record.args[0]).split(":", 1)[0][:60]
    return record.name, record.levelno, str(record.msg)[:200], first


LIBRARY_LOGGERS = ("libp2p", "multiaddr", "trio", "urllib3", "httpx", "transformers",
                   "filelock", "asyncio", "huggingface_hub", "py.warnings", "torch")
LIBRARY_ROOTS = {name.split(".", 1)[0] for name in LIBRARY_LOGGERS}
_chosen_levels: dict[str, int] = {}  # `node.library_log_levels`, set by setup_logging


def route_library_logs() -> None:
    """Send every library's records through our handler: drop handlers libraries installed
    on their own loggers (transformers adds one; py-libp2p's import sets `libp2p` to
    propagate nowhere, so its records went to Python's bare last-resort printer) and make
    them propagate to the root. Called again after the heavy imports."""
    for noisy in LIBRARY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # py-libp2p logs every failed dial/stream of a departed peer at ERROR with a dump of the
    # connection; our p2p layer reports and counts those failures itself.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("swarm_node"):
            continue
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
        if name.split(".", 1)[0] in LIBRARY_ROOTS and "." in name \
                and logger.level != logging.NOTSET:
            # a module's own level (py-libp2p sets INFO on some) must not override the
            # library's level set in setup_logging. Only where one is set: each setLevel
            # clears every logger's cache (~800 library loggers once the model is loaded)
            logger.setLevel(logging.NOTSET)
    for name, level in _chosen_levels.items():  # chosen for diagnosis: over the above
        logging.getLogger(name).setLevel(level)


def setup_logging(level: str = "INFO", json_lines: bool = False, stream=None,
                  library_levels: dict[str, str] | None = None) -> None:
    """Configure the root logger once: our lines at `level`, noisy libraries at WARNING
    (py-libp2p at CRITICAL) but for `library_levels` (logger name -> level, for
    diagnosis), every library and Python warning through our formatter, repeated warnings
    limited."""
    _chosen_levels.clear()
    _chosen_levels.update({name: logging.getLevelName(lv.upper())
                           for name, lv in (library_levels or {}).items()})
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else PlainFormatter())
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)
    route_library_logs()
    _route_uncaught(logging.getLogger("swarm_node.uncaught"))


def _route_uncaught(logger: logging.Logger) -> None:
    """Uncaught exceptions in threads (trio's, the worker's) become one log line."""
    def hook(args) -> None:
        if args.exc_type is SystemExit:
            return
        logger.error("uncaught %s in thread %s: %s", args.exc_type.__name__,
                     getattr(args.thread, "name", "?"), args.exc_value,
                     exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    threading.excepthook = hook
