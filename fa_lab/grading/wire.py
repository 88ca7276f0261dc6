"""The reply format: what a graded function returned, as bytes the grader can check before use.

A reply is plain data: dicts with string keys, lists, strings, numbers, booleans,
None and CPU tensors (what :func:`fa_lab.grading.harness.encode` leaves). :func:`dump`
writes it as::

    8 bytes: n, the header's length (little-endian)
    n bytes: JSON {"value": ..., "tensors": [{"dtype", "shape", "offset", "nbytes"}, ...]}
             where each tensor in the value is {"__tensor__": its index in "tensors"}
    the tensors' bytes, each one contiguous, end to end in the order of "tensors"

:func:`loads` runs in the grader on bytes from the sandbox. It never unpickles and
checks everything before it builds a tensor: the total size, the header's size
(:data:`MAX_HEADER`) and nesting, each dtype (a fixed list), shape and byte count, and that the
tensors lie end to end and fill the rest exactly (so no two share bytes, and all the tensors together
take no more memory than the reply); strings are cut to :data:`MAX_STRING` characters. A reply that breaks a rule raises
:class:`BadReply`. The tensors it returns are plain, fresh CPU tensors.

Only the standard library and torch are imported here.
"""
from __future__ import annotations

import io
import json
import math
import struct

import torch

DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
MAX_HEADER = 1 << 20  # bytes of JSON: numbers and messages (tensors lie outside it)
MAX_DEPTH = 8  # lists and dicts within each other (harness.encode makes at most 3)
MAX_DIMS = 8
MAX_SIZE = 1 << 40  # elements along one dimension (an empty tensor's other sizes stay bounded too)
MAX_STRING = 20_000
_LENGTH = struct.Struct("<Q")
_TENSOR = "__tensor__"


class BadReply(ValueError):
    """The bytes are not a reply that keeps to the format and its limits."""


def dump(value, stream) -> None:
    """Write the reply ``value`` (plain data and tensors) to the binary ``stream``, each tensor's
    bytes straight from its memory (a large output is not copied again). A tensor of a dtype
    outside :data:`DTYPES` becomes a string that says so."""
    tensors, specs, offset = [], [], 0

    def plain(item):
        nonlocal offset
        if isinstance(item, torch.Tensor) and str(item.dtype).removeprefix("torch.") not in DTYPES:
            return f"<a tensor of dtype {item.dtype} and shape {tuple(item.shape)}>"
        if isinstance(item, torch.Tensor):
            data = item.detach().to("cpu").contiguous()
            specs.append({"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                          "offset": offset, "nbytes": data.numel() * data.element_size()})
            tensors.append(data)
            offset += specs[-1]["nbytes"]
            return {_TENSOR: len(specs) - 1}
        if isinstance(item, (list, tuple)):
            return [plain(x) for x in item]
        if isinstance(item, dict):
            return {str(key): plain(x) for key, x in item.items()}
        return item

    header = json.dumps({"value": plain(value), "tensors": specs}).encode()
    stream.write(_LENGTH.pack(len(header)) + header)
    for data in tensors:
        if data.numel():
            stream.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))


def dumps(value) -> bytes:
    """The reply ``value`` as bytes (see :func:`dump`)."""
    stream = io.BytesIO()
    dump(value, stream)
    return stream.getvalue()


def loads(data: bytes, limit: int):
    """The reply in ``data`` (at most ``limit`` bytes), validated; raises :class:`BadReply`."""
    if len(data) > limit:
        raise BadReply(f"the reply has {len(data)} bytes, more than the {limit} allowed")
    if len(data) < _LENGTH.size:
        raise BadReply("the reply is truncated")
    (length,) = _LENGTH.unpack_from(data)
    if length > min(MAX_HEADER, len(data) - _LENGTH.size):
        raise BadReply("the reply's header is truncated or larger than allowed")
    try:
        header = json.loads(data[_LENGTH.size:_LENGTH.size + length])
    except (ValueError, RecursionError) as exc:
        raise BadReply(f"the reply's header is not JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"value", "tensors"} or not isinstance(header["tensors"], list):
        raise BadReply("the reply's header does not have the expected keys")
    blob = memoryview(data)[_LENGTH.size + length:]
    tensors, end = [], 0
    for spec in header["tensors"]:
        tensor, end = _tensor(spec, blob, end)
        tensors.append(tensor)
    if end != len(blob):
        raise BadReply("the reply holds bytes that belong to no tensor")
    return _value(header["value"], tensors, 0)


def _tensor(spec, blob: memoryview, start: int) -> tuple[torch.Tensor, int]:
    """The tensor ``spec`` describes, whose bytes must begin at ``start`` of ``blob``; and where they end."""
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "offset", "nbytes"}:
        raise BadReply("a tensor's description does not have the expected keys")
    dtype, shape, offset, nbytes = spec["dtype"], spec["shape"], spec["offset"], spec["nbytes"]
    if dtype not in DTYPES:
        raise BadReply(f"a tensor has an unsupported dtype {str(dtype)[:40]!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(n) is int and 0 <= n <= MAX_SIZE for n in shape)):
        raise BadReply("a tensor's shape is not a list of sizes")
    dtype = DTYPES[dtype]
    if (type(offset) is not int or type(nbytes) is not int or offset != start
            or nbytes != math.prod(shape) * dtype.itemsize or offset + nbytes > len(blob)):
        raise BadReply("a tensor's bytes do not match its shape and dtype, or do not follow the previous "
                       "tensor's within the reply")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), offset
    raw = torch.frombuffer(bytearray(blob[offset:offset + nbytes]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape), offset + nbytes


def _value(item, tensors: list[torch.Tensor], depth: int):
    if depth > MAX_DEPTH:
        raise BadReply("the reply is nested too deeply")
    if isinstance(item, dict):
        if set(item) == {_TENSOR}:
            index = item[_TENSOR]
            if type(index) is not int or not 0 <= index < len(tensors):
                raise BadReply("the reply refers to a tensor it does not hold")
            return tensors[index]
        return {key[:MAX_STRING]: _value(x, tensors, depth + 1) for key, x in item.items()}
    if isinstance(item, list):
        return [_value(x, tensors, depth + 1) for x in item]
    if isinstance(item, str):
        return item[:MAX_STRING]
    return item  # JSON leaves only numbers, booleans and None here
