"""What a DataProto raises about a batch's contents: every error names the field, what was
expected and what was found."""

from __future__ import annotations


class DataProtoError(ValueError, AssertionError):
    """Base class of every error this module raises about a batch's contents. It is an
    ``AssertionError`` too: verl signals these misuses with ``assert``, and code written
    against verl that catches ``AssertionError`` must still catch ours."""


class BatchSizeMismatchError(DataProtoError):
    """Two columns of one batch describe different numbers of rows."""


class UnionConflictError(DataProtoError):
    """``union`` found the same key on both sides with different contents."""


class ChunkSizeError(DataProtoError):
    """A batch cannot be split into the requested number of equal chunks."""


class DataProtoTypeError(DataProtoError, TypeError):
    """A field has the wrong Python/numpy/torch type."""


class UnsupportedObjectError(DataProtoTypeError):
    """An object column or meta value holds a type the pickle-free wire cannot carry."""


class MissingKeyError(DataProtoError, KeyError):
    """A named key is not in the batch (a ``KeyError`` and, as in verl, an assertion)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""

