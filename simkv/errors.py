"""Errors raised where input enters simkv (config, trace, CLI)."""


class InputError(Exception):
    """Bad input: the CLI prints `error: <message>` and exits 2.

    The message names the file, key or row and what would be valid.
    """
