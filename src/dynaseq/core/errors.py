"""User-facing errors.

Library code raises :class:`DynaseqError` (or a subclass) for bad input: a missing file,
a malformed config, a corrupt checkpoint. The CLI turns it into one line on stderr and a
non-zero exit; it never shows a traceback for these.
"""


class DynaseqError(Exception):
    """Bad input from the user: the message is shown as is, on one line."""


class ConfigError(DynaseqError):
    """A config file or override that does not fit the typed config."""


class CheckpointError(DynaseqError):
    """A run directory without a usable checkpoint, or a truncated/corrupt one."""
