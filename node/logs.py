"""Logging: one line per meaningful event, plain text or JSON (`node.log_json`)."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and any `extra` fields."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._skip:
                doc[key] = value if isinstance(value, (str, int, float, bool, type(None))) \
                    else repr(value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str = "INFO", json_lines: bool = False, stream=None) -> None:
    """Configure the root logger once: our lines at `level`, noisy libraries at WARNING."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        fmt = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                                "%H:%M:%S")
        fmt.converter = time.localtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("multiaddr", "trio", "urllib3", "httpx", "transformers", "filelock",
                  "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # py-libp2p logs every failed dial/stream of a departed peer at ERROR with a dump of the
    # connection; our p2p layer reports and counts those failures itself.
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
