"""A grpclib channel that does not reuse a connection grpclib itself has closed.

grpclib (0.4.9, pinned) closes a connection whose peer stopped answering keepalive pings by
closing its transport and dropping it from the connection object; the channel only counts the
connection as lost once asyncio reports the close. For plain TCP that is the next loop pass;
for TLS, after the TLS shutdown (up to its timeout), and with unsent data, once the buffer
drains. A call made in between fails with ``AttributeError: 'Connection' object has no
attribute '_transport'`` (a clean-clone run saw it: a status call to a replica that had just
woken from SIGSTOP). :class:`LiveChannel` connects anew instead.
"""

from __future__ import annotations

from typing import cast

from grpclib.client import Channel, Handler


class LiveChannel(Channel):
    """A :class:`grpclib.client.Channel` that treats a closing connection as lost."""

    @property
    def _connected(self) -> bool:
        protocol = self._protocol
        return (
            protocol is not None
            and not cast(Handler, protocol.handler).connection_lost
            and not protocol.processor.connection.is_closing()
        )
