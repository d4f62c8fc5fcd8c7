"""Reading protobuf's wire format by hand, where a message's bytes as sent matter: the
feeder finds a request's params in them (server/wire.py `field_bytes`), the client
finds its batches' fields in a response (client/responses.py `scan_py`, the reference
of its compiled scan). protobuf parses everything else.

Each reader takes a byte view, a position and the end it may not pass, and returns what
it read with the position after it; `Unreadable` for bytes a parser would reject or
that these readers leave to protobuf (a varint past its end or over 64 bits, field
number 0, groups, invalid wire types).
"""

from __future__ import annotations

VARINT, I64, LEN, I32 = 0, 1, 2, 5  # the wire types these readers take


class Unreadable(Exception):
    """Bytes the readers do not take (see the module's docstring)."""


def varint(mv: memoryview, pos: int, end: int) -> tuple[int, int]:
    """A base-128 varint (at most 10 bytes, at most 64 bits) and the position after it."""
    v = 0
    for i in range(10):
        if pos >= end:
            break
        b = mv[pos]
        pos += 1
        if i == 9 and b > 1:
            break
        v |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return v, pos
    raise Unreadable


def key(mv: memoryview, pos: int, end: int) -> tuple[int, int, int]:
    """A field's key: its number, its wire type and the position after it."""
    k, pos = varint(mv, pos, end)
    if k > 0xFFFFFFFF or k >> 3 == 0:
        raise Unreadable
    return k >> 3, k & 7, pos


def span(mv: memoryview, pos: int, end: int) -> tuple[int, int, int]:
    """A length-delimited field's bytes past its length: where, how many, and the
    position after them."""
    n, pos = varint(mv, pos, end)
    if n > end - pos:
        raise Unreadable
    return pos, n, pos + n


def skip(mv: memoryview, pos: int, end: int, wire: int) -> int:
    """The position after a field's value of wire type `wire`."""
    if wire == VARINT:
        return varint(mv, pos, end)[1]
    if wire in (I64, I32):
        size = 8 if wire == I64 else 4
        if end - pos < size:
            raise Unreadable
        return pos + size
    if wire == LEN:
        return span(mv, pos, end)[2]
    raise Unreadable  # groups, invalid wire types
