"""polygate.serve: the gateway server, OpenAI-compatible over HTTP (SPEC §8.5).

``polygate serve`` runs it from the command line; :func:`open_server` runs it inside
a trio program (tests, embedding)::

    async with polygate.serve.open_server(settings, port=0) as server:
        ...  # an OpenAI client with base_url=server.base_url
        await server.shutdown()  # drain: finish calls in flight, then stop

The server maps HTTP to a :class:`polygate.Session` and back; every gateway decision
(admission, hedging, retries, deadlines, statistics) is the session's.  Needs the
``serve`` extra (prometheus-client, for ``/metrics``).
"""

from ._server import Server as Server
from ._server import ServerStatistics as ServerStatistics
from ._server import open_server as open_server

__all__ = ["Server", "ServerStatistics", "open_server"]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
