"""A grpclib channel that does not reuse a connection grpclib itself has closed.

grpclib (0.4.9, pinned) closes a connection whose peer stopped answering keepalive pings by
closing its transport and dropping it from the connection object; the channel only counts the
connection as lost once asyncio reports the close. For plain TCP that is the next loop pass;
for TLS, after the TLS shutdown (up to its timeout), and with unsent data, once the buffer
drains. A call made in between fails with ``AttributeError: 'Connection' object has no
attribute '_transport'`` (a clean-clone run saw it: a status call to a replica that had just
woken from SIGSTOP). :class:`LiveChannel` connects anew instead.

It also reads the error kind servers send as status details (:mod:`timeslice.status_details`)
unless told another codec: every channel of ours between our own processes is one. And it
names why a connection failed (:mod:`timeslice._connection_errors`): a failed connect raises
the typed :class:`~timeslice.errors.ConnectionFailed` instead of asyncio's ``OSError``, and a
plaintext connection the server closed before sending a byte (a TLS server hanging up on a
plaintext client; grpclib says "Connection lost") is kept in :attr:`LiveChannel.problem`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from grpclib.client import Channel, Handler
from grpclib.encoding.base import StatusDetailsCodecBase
from grpclib.protocol import H2Protocol

from timeslice._connection_errors import diagnose, hung_up_before_answering
from timeslice.errors import ConnectionFailed
from timeslice.status_details import KIND_CODEC

if TYPE_CHECKING:
    from timeslice.tls import TlsFiles


class LiveChannel(Channel):
    """A :class:`grpclib.client.Channel` that treats a closing connection as lost and decodes
    the error kind from status details (``GRPCError.details``)."""

    def __init__(
        self, *args: Any, status_details_codec: StatusDetailsCodecBase = KIND_CODEC, **kwargs: Any
    ) -> None:
        super().__init__(*args, status_details_codec=status_details_codec, **kwargs)
        self.problem: ConnectionFailed | None = None
        """Why the last connection failed, or ended before the server answered, if it did
        (:meth:`timeslice._transport.Transport.map_error` reports it over "Connection lost")."""

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 in brackets) or ``unix:path``, as errors name it."""
        if self._path is not None:
            return f"unix:{self._path}"
        host = f"[{self._host}]" if ":" in (self._host or "") else self._host
        return f"{host}:{self._port}"

    def _tls_files(self) -> TlsFiles | None:
        """The TLS files connections use (``None``: plaintext)."""
        return None

    async def _connect(self) -> H2Protocol:
        """Make one connection (grpclib's own way; :class:`~timeslice.tls.TlsChannel` its)."""
        return await super()._create_connection()

    async def _create_connection(self) -> H2Protocol:
        # Cleared before, not after: the server may end the new connection (a refusal right
        # after the TLS handshake) before this coroutine resumes.
        self.problem = None
        try:
            protocol = await self._connect()
        except ConnectionFailed as exc:
            self.problem = exc
            raise
        except Exception as exc:
            problem = diagnose(exc, self.address, self._tls_files())
            if problem is None:
                raise
            self.problem = problem
            raise problem from exc
        return protocol

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        if self._ssl is None and self._path is None:
            self._watch_hang_up(protocol)
        return protocol

    def _watch_hang_up(self, protocol: H2Protocol) -> None:
        """Name a plaintext connection the server closed before sending anything: a gRPC
        server sends its HTTP/2 settings as soon as it accepts; a TLS server waits for a
        TLS hello and hangs up on our HTTP/2 preface."""
        received = protocol.data_received
        lost = protocol.connection_lost
        heard = False

        def data_received(data: bytes) -> None:
            nonlocal heard
            heard = True
            received(data)

        def connection_lost(exc: BaseException | None) -> None:
            if not heard:
                self.problem = hung_up_before_answering(self.address)
            lost(exc)

        protocol.data_received = data_received  # type: ignore[method-assign]
        protocol.connection_lost = connection_lost  # type: ignore[method-assign]

    @property
    def _connected(self) -> bool:
        protocol = self._protocol
        return (
            protocol is not None
            and not cast(Handler, protocol.handler).connection_lost
            and not protocol.processor.connection.is_closing()
        )
