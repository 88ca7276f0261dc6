"""Frames on the pipe from the sandbox to the grader: a JSON header line, then a payload.

The runner inside the sandbox (:mod:`fa_lab.grading.runner`) writes, with
:func:`write_frame`, one header line of JSON holding ``"size"``, the number of payload
bytes that follow it. The grader reads the pipe with :class:`FrameReader`, which
keeps at most the payload that its ``payload_limit`` allows for each header (more
is read and dropped: the frame says how much) and stops at the first header that
is not a JSON object of at most :data:`MAX_HEADER` bytes with a valid size.

Only the standard library is imported here (the runner has no torch).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

MAX_HEADER = 64 * 1024


class ChannelBroken(ValueError):
    """The bytes on the pipe are not frames (or more than the reader accepts in all)."""


@dataclass
class Frame:
    """One frame: its header, and its payload (None when it was over the limit and dropped)."""

    header: dict
    payload: bytes | None
    size: int


def write_frame(fd: int, header: dict, payload=b"") -> None:
    """Write one frame on ``fd``. payload: bytes, or a binary file read in chunks."""
    if isinstance(payload, bytes):
        size, chunks = len(payload), [payload]
    else:
        size, chunks = os.fstat(payload.fileno()).st_size, iter(lambda: payload.read(1 << 20), b"")
    _write_all(fd, json.dumps({**header, "size": size}).encode() + b"\n")
    written = 0
    for chunk in chunks:
        chunk = chunk[:size - written]  # a file that grows while it is sent cannot break the frame
        _write_all(fd, chunk)
        written += len(chunk)
    if written < size:  # a file that shrank: pad, so that the next header starts where it is expected
        _write_all(fd, bytes(size - written))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Parse frames from the bytes fed to it, within limits.

    payload_limit(header): the most payload bytes kept for a frame with that header.
    total_limit: the most bytes kept over all frames (headers and kept payloads); past it, ChannelBroken.
    """

    def __init__(self, payload_limit: Callable[[dict], int], total_limit: int):
        self.payload_limit = payload_limit
        self.total_limit = total_limit
        self.kept = 0
        self._buffer = bytearray()
        self._frame: Frame | None = None  # the frame whose payload is being read
        self._left = 0  # its payload bytes still to come
        self._keep = False

    def feed(self, data: bytes) -> list[Frame]:
        """The frames completed by ``data``; raises ChannelBroken."""
        done = []
        view = memoryview(data)
        while view:
            if self._frame is None:
                view = self._read_header(view)
                if self._frame is not None and self._left == 0:
                    done.append(self._finish())
                continue
            take = view[:self._left]
            if self._keep:
                self._buffer += take
            self._left -= len(take)
            view = view[len(take):]
            if self._left == 0:
                done.append(self._finish())
        return done

    def _read_header(self, view: memoryview) -> memoryview:
        data = bytes(view[:MAX_HEADER + 1 - len(self._buffer)])
        end = data.find(b"\n")
        if end < 0:
            if len(self._buffer) + len(data) > MAX_HEADER:
                raise ChannelBroken("a frame header is longer than allowed")
            self._buffer += data
            return view[len(data):]
        line = bytes(self._buffer) + data[:end]
        self._buffer = bytearray()
        if len(line) > MAX_HEADER:
            raise ChannelBroken("a frame header is longer than allowed")
        try:
            header = json.loads(line)
        except (ValueError, RecursionError):
            raise ChannelBroken("a frame header is not JSON") from None
        if not isinstance(header, dict) or type(header.get("size")) is not int or header["size"] < 0:
            raise ChannelBroken("a frame header has no valid size")
        size = header["size"]
        self._keep = size <= self.payload_limit(header)
        self.kept += len(line) + (size if self._keep else 0)
        if self.kept > self.total_limit:
            raise ChannelBroken("the sandbox sent more than the grader accepts in all")
        self._frame, self._left = Frame(header, None, size), size
        return view[end + 1:]

    def _finish(self) -> Frame:
        frame = self._frame
        if self._keep:
            frame.payload = bytes(self._buffer)
        self._buffer, self._frame, self._keep = bytearray(), None, False
        return frame
