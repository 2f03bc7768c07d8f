"""The error kind in ``grpc-status-details-bin``: our hand encoding against Google's classes."""

from __future__ import annotations

import pytest
from google.protobuf import any_pb2  # type: ignore[import-untyped]
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpclib.const import Status

from timeslice.errors import (
    ErrorKind,
    GroupFaulted,
    NotHolder,
    SessionExpired,
    TimeSliceError,
    error_from_status,
)
from timeslice.status_details import DOMAIN, KIND_CODEC, decode, encode


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_round_trips(kind: ErrorKind) -> None:
    data = KIND_CODEC.encode(Status.FAILED_PRECONDITION, "plain words", kind)
    assert KIND_CODEC.decode(Status.FAILED_PRECONDITION, "plain words", data) is kind


def test_google_classes_read_what_we_write() -> None:
    """Any gRPC client (grpcio's ``grpc_status``, Go's ``status``) reads the kind."""
    data = encode(
        Status.FAILED_PRECONDITION, "job j does not hold g at epoch 3", ErrorKind.NOT_HOLDER
    )
    status = status_pb2.Status.FromString(data)
    assert status.code == Status.FAILED_PRECONDITION.value
    assert status.message == "job j does not hold g at epoch 3"
    [detail] = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert (info.reason, info.domain) == ("NOT_HOLDER", DOMAIN)


def test_we_read_what_google_classes_write_and_skip_the_rest() -> None:
    """Other details (a RetryInfo first) and ErrorInfo metadata do not hide the kind."""
    status = status_pb2.Status(code=Status.FAILED_PRECONDITION.value, message="gone")
    retry = any_pb2.Any()
    retry.Pack(error_details_pb2.RetryInfo())
    foreign = any_pb2.Any()
    foreign.Pack(error_details_pb2.ErrorInfo(reason="QUOTA", domain="example.com"))
    ours = any_pb2.Any()
    ours.Pack(
        error_details_pb2.ErrorInfo(
            reason="SESSION_EXPIRED", domain=DOMAIN, metadata={"session": "0123456789abcdef"}
        )
    )
    status.details.extend([retry, foreign, ours])
    assert decode(status.SerializeToString()) is ErrorKind.SESSION_EXPIRED


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x1a\x05abc",  # a detail that claims more bytes than follow
        b"\xff" * 12,  # a varint that never ends
        encode(Status.ABORTED, "x", ErrorKind.GROUP_FAULTED).replace(
            b"GROUP_FAULTED", b"NEW_KIND_1234"
        ),
        encode(Status.ABORTED, "x", ErrorKind.GROUP_FAULTED).replace(
            DOMAIN.encode(), b"other.domain!"
        ),
    ],
)
def test_anything_else_decodes_to_none(data: bytes) -> None:
    """Never raises (grpclib would fail the call with it): the status code decides."""
    assert decode(data) is None


def test_encoding_anything_but_a_kind_is_a_bug() -> None:
    with pytest.raises(TypeError):
        KIND_CODEC.encode(Status.INTERNAL, "x", ["not", "a", "kind"])


@pytest.mark.parametrize("error", [NotHolder("a"), SessionExpired("b"), GroupFaulted("c")])
def test_shared_status_codes_come_back_as_the_class_sent(error: TimeSliceError) -> None:
    """NOT_HOLDER and SESSION_EXPIRED share FAILED_PRECONDITION: only the detail tells them
    apart; the message is the plain text, no ``[kind]`` prefix."""
    grpc = error.to_grpc()
    assert grpc.message == error.message
    sent = KIND_CODEC.encode(grpc.status, grpc.message, grpc.details)
    back = error_from_status(
        grpc.status, grpc.message, KIND_CODEC.decode(grpc.status, grpc.message, sent)
    )
    assert type(back) is type(error) and back.message == error.message


def test_without_details_the_status_code_decides_and_text_is_not_parsed() -> None:
    back = error_from_status(Status.FAILED_PRECONDITION, "[session_expired] looks like one")
    assert type(back) is NotHolder
    assert back.message == "[session_expired] looks like one"
