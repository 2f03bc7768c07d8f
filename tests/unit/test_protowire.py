"""The protobuf varint both decoders of the project read: values, and every way it is malformed."""

from __future__ import annotations

import pytest

from timeslice._protowire import MalformedMessage, read_varint


@pytest.mark.parametrize(
    ("data", "value", "end"),
    [
        (b"\x00", 0, 1),
        (b"\x01", 1, 1),
        (b"\x7f", 127, 1),
        (b"\x80\x01", 128, 2),
        (b"\xac\x02", 300, 2),
        (b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 2**64 - 1, 10),
    ],
)
def test_values(data: bytes, value: int, end: int) -> None:
    assert read_varint(data, 0) == (value, end)


def test_reads_from_a_position_and_says_where_it_ended() -> None:
    assert read_varint(b"\x08\x96\x01\x10", 1) == (150, 3)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "truncated"),
        (b"\x80", "truncated"),
        (b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x02", "does not fit in 64 bits"),
        (b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
    ],
)
def test_malformed(data: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        read_varint(data, 0)
