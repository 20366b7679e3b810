"""The byte formats under the checkpoints: safetensors files written, parsed and read.

- ``header``: the one header writer and parser, the one ``TensorEntry``, the header limit.
- ``writer``: a file written tensor by tensor, device tensors through host chunks.
- ``tensorfile``: positioned reads of a file's tensors, verified chunk by chunk.
- ``index``: every tensor of a safetensors file or directory, read by element range.
- ``image``: files laid out in host memory and written without the page cache.
- ``checksum``: chunked checksums of a tensor's bytes.

Nothing here knows what a checkpoint is (``checkpoint`` is the protocol on top).
"""

from .header import MAX_HEADER_BYTES, Header, TensorEntry, header_bytes, read_header
from .index import SafetensorsCheckpoint

__all__ = [
    "MAX_HEADER_BYTES",
    "Header",
    "SafetensorsCheckpoint",
    "TensorEntry",
    "header_bytes",
    "read_header",
]
