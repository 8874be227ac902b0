"""The error every mistake in a config or on the command line raises."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config value or command-line option that cannot be used; the message names the key. The command
    prints it as one line and exits with status 2."""
