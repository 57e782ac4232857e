"""Bad command-line input, reported the one way every ``kv-offload`` subcommand reports it."""


class UsageError(Exception):
    """Bad input: printed as one line on stderr (nothing on stdout), exit code 2."""
