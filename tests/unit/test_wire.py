"""The servers' strict codec (timeslice.wire): what betterproto2 would read leniently is refused,
typed, before a handler runs; a good message and unknown fields still read. Whole RPCs are
fuzzed in tests/fuzz/test_fuzz_rpcs.py."""

from __future__ import annotations

from typing import Any

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from timeslice.errors import ErrorKind
from timeslice.wire import MAX_DEPTH, MalformedMessage, StrictProtoCodec, validate
from timeslice_proto.timeslice.v1 import (
    Directive,
    DirectiveKind,
    GroupStatus,
    OpenSessionRequest,
    QueueEntry,
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _number(message_type: type, name: str) -> int:
    number: int = message_type._betterproto.meta_by_field_name[name].number  # type: ignore[attr-defined]
    return number


def _field(message_type: type, name: str, wire: int, body: bytes) -> bytes:
    return _varint(_number(message_type, name) << 3 | wire) + body


def _len(body: bytes) -> bytes:
    return _varint(len(body)) + body


def test_a_good_message_reads_and_unknown_fields_are_skipped() -> None:
    good = bytes(OpenSessionRequest(job_id="job-a", ttl_seconds=30, client_pid=7))
    unknown_field = _varint(99 << 3 | 2) + _len(b"from a newer client")
    message = StrictProtoCodec().decode(good + unknown_field, OpenSessionRequest)
    assert (message.job_id, message.ttl_seconds, message.client_pid) == ("job-a", 30, 7)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        # ttl_seconds = 2**32 + 5: betterproto2 would mask it to 5.
        (_field(OpenSessionRequest, "ttl_seconds", 0, _varint(2**32 + 5)), "ttl_seconds"),
        # A string field with a varint in it.
        (_field(OpenSessionRequest, "job_id", 0, _varint(1)), "wrong wire type"),
        (_field(OpenSessionRequest, "job_id", 2, _len(b"\xff\xfe")), "not valid UTF-8"),
        (_field(OpenSessionRequest, "job_id", 2, _varint(10) + b"abc"), "truncated"),
        (_varint(1 << 3 | 3), "wire type 3"),  # a group: not supported
        (_varint(0), "field number 0"),
        (b"\x08" + b"\xff" * 11, "longer than 10 bytes"),  # past 64 bits
    ],
)
def test_what_a_lenient_parser_would_read_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        validate(data, OpenSessionRequest)


def test_an_enum_value_the_schema_does_not_name_is_refused() -> None:
    named = bytes(Directive(directive_id="d", kind=DirectiveKind.CHECKPOINT))
    validate(named, Directive)
    with pytest.raises(MalformedMessage, match="kind"):
        validate(_field(Directive, "kind", 0, _varint(999)), Directive)


def test_nested_messages_are_checked_and_depth_is_bounded() -> None:
    bad_entry = _field(QueueEntry, "job_id", 2, _len(b"\xff"))
    with pytest.raises(MalformedMessage, match="UTF-8"):
        validate(_field(GroupStatus, "queue", 2, _len(bad_entry)), GroupStatus)
    good_entry = bytes(QueueEntry(job_id="j"))
    validate(_field(GroupStatus, "queue", 2, _len(good_entry)), GroupStatus)
    with pytest.raises(MalformedMessage, match=f"deeper than {MAX_DEPTH}"):
        validate(b"", GroupStatus, depth=MAX_DEPTH + 1)


def _refusal(codec: StrictProtoCodec, data: bytes, message_type: Any) -> GRPCError:
    with pytest.raises(GRPCError) as caught:
        codec.decode(data, message_type)
    return caught.value


def test_the_codec_answers_typed_errors_with_the_reason() -> None:
    codec = StrictProtoCodec(max_message_bytes=64)
    big = _refusal(codec, bytes(OpenSessionRequest(job_id="x" * 100)), OpenSessionRequest)
    assert (big.status, big.details) == (Status.RESOURCE_EXHAUSTED, ErrorKind.RESOURCE_EXHAUSTED)
    assert big.message is not None and "the limit is 64" in big.message
    bad = _refusal(codec, _field(OpenSessionRequest, "job_id", 0, b"\x01"), OpenSessionRequest)
    assert (bad.status, bad.details) == (Status.INVALID_ARGUMENT, ErrorKind.INVALID_ARGUMENT)
    assert bad.message is not None and bad.message.startswith("malformed OpenSessionRequest:")
    with pytest.raises(ValueError):
        StrictProtoCodec(max_message_bytes=0)
