"""The bytes of a parameter-server message: a JSON header and raw tensor bytes, never a pickle.

    [4-byte header length][header JSON][tensor 0 bytes][tensor 1 bytes]...

The header carries the request's fields and, for each tensor, its name, dtype and shape, so
the receiver rebuilds tensors straight from the buffer. A process outside the job that sends
garbage gets a clear error, not code execution.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)}

MAX_DIM = 1 << 40  # elements: far beyond any message's bytes
MAX_DIMS = 64


class WireError(ValueError):
    """A message that is not a well-formed loom parameter-server message."""


def encode(fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    """``fields`` (JSON values) and ``tensors`` as one message."""
    tensors = tensors or {}
    parts, layout = [], []
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise WireError(f"cannot send tensor '{name}' of dtype {tensor.dtype}")
        data = tensor.detach().contiguous().cpu()
        parts.append(data.reshape(-1).view(torch.uint8).numpy())  # joined below: the bytes are copied once
        layout.append([name, dtype, list(data.shape)])
    header = json.dumps({"fields": fields, "tensors": layout}).encode()
    return b"".join([struct.pack("<I", len(header)), header, *parts])


def decode(message: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The fields and tensors of a message from ``encode``; ``WireError`` for anything else."""
    try:
        (length,) = struct.unpack_from("<I", message)
        if 4 + length > len(message):
            raise ValueError(f"its header of {length} bytes runs past the end of the message")
        header = json.loads(message[4 : 4 + length])
        fields, layout = header["fields"], header["tensors"]
    except RecursionError:
        raise WireError("not a parameter-server message (its header is nested too deeply)") from None
    except (struct.error, ValueError, KeyError, TypeError) as error:
        raise WireError(f"not a parameter-server message ({error})") from error
    if not isinstance(layout, list):
        raise WireError(f"not a parameter-server message (its tensors are {type(layout).__name__}, not a list)")
    tensors, offset = {}, 4 + length
    buffer = memoryview(message)
    for entry in layout:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[2], list)):
            raise WireError(f"a tensor entry must be [name, dtype, shape], not {str(entry)[:60]}")
        name, dtype, shape = entry
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise WireError(f"tensor '{name}' has an unknown dtype {dtype!r}")
        size = _DTYPES[dtype].itemsize * _numel(shape)
        if offset + size > len(message):
            raise WireError(f"tensor '{name}' runs past the end of the message")
        raw = torch.frombuffer(bytearray(buffer[offset : offset + size]), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(_DTYPES[dtype]).reshape(shape)
        offset += size
    return fields, tensors


def _numel(shape: list[int]) -> int:
    """Elements in ``shape``; no dimension so large that torch could not lay it out, even beside a 0."""
    n = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0 or d > MAX_DIM:
            raise WireError(f"bad tensor shape {str(shape)[:60]}")
        n *= d
    if len(shape) > MAX_DIMS or math.prod(max(d, 1) for d in shape) > MAX_DIM:
        raise WireError(f"bad tensor shape {str(shape)[:60]}")
    return n
