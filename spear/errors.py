"""The one exception type users see.

Everything that is the user's to fix (a bad path, a shape that does not fit, a
checkpoint that does not match its config) raises :class:`SpearError` with a
message naming the rule and the value seen. The CLI prints it as one line.
"""


class SpearError(Exception):
    """A problem with the user's inputs, files or settings (not a bug in spear)."""
