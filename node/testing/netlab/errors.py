"""The lab's one exception: a topology it cannot build, or a namespace operation that failed."""


class NetlabError(Exception):
    """The simulated internet could not be described, built, changed or used."""
