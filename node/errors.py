"""Root exception for node-side faults that an operator must see as a clear message."""


class NodeError(Exception):
    """A fault with a message meant for the operator (printed without a traceback)."""


class ConfigError(NodeError):
    """Bad configuration: names the key, the value and what was expected."""


class IdentityError(NodeError):
    """The key file is missing, unreadable, of the wrong type or too widely readable."""
