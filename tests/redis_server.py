"""The ``redis_url`` fixture: a throwaway redis-server for the whole session.

It runs Debian's ``redis-server`` binary on 127.0.0.1 at a free port, without persistence, in a
temporary folder (``kvcache.peers.redis_server.local_redis``), and is stopped at the end of the
session. Tests that use it skip only when redis-server is not installed (``make setup-test``
installs it).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def redis_url():
    from kvcache.peers.redis_server import local_redis

    with local_redis() as url:
        if url is None:
            pytest.skip("redis-server is not installed (make setup-test installs Debian's redis-server)")
        yield url
