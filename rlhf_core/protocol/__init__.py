"""DataProto: the data contract between the controller and its workers.

``dataproto`` holds the batch and its operations, ``wire`` its pickle-free wire format,
``columns`` the column and row helpers both use, ``errors`` what they raise, and
``verl_compat`` the part of verl's surface that only ported code uses. Import from here.
"""

from rlhf_core.protocol.columns import object_column, union_numpy_dict, union_tensor_dict
from rlhf_core.protocol.dataproto import (AUTO_PADDING_KEY, DataProto, DataProtoConfig, DataProtoFuture,
                                          DataProtoItem, collate_fn, pad_dataproto_to_divisor, unpad_dataproto)
from rlhf_core.protocol.errors import (BatchSizeMismatchError, ChunkSizeError, DataProtoError, DataProtoTypeError,
                                       MissingKeyError, UnionConflictError, UnsupportedObjectError)
from rlhf_core.protocol.verl_compat import fold_batch_dim, list_of_dict_to_dict_of_list, unfold_batch_dim, union_two_dict

__all__ = [
    "DataProto", "DataProtoItem", "DataProtoFuture", "DataProtoError", "BatchSizeMismatchError",
    "UnionConflictError", "ChunkSizeError", "DataProtoTypeError", "UnsupportedObjectError", "MissingKeyError",
    "union_tensor_dict", "union_numpy_dict", "pad_dataproto_to_divisor", "unpad_dataproto", "AUTO_PADDING_KEY",
    "DataProtoConfig", "object_column", "fold_batch_dim", "unfold_batch_dim", "union_two_dict",
    "list_of_dict_to_dict_of_list", "collate_fn",
]
