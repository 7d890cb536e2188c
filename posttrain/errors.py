"""Errors shared by modules that cannot import each other (the config imports the registries)."""


class ConfigError(ValueError):
    """A recipe or override is invalid; the message says which key and what is allowed."""
