"""A real ``redis-server`` for the tests: started on a free loopback port in a temporary folder, stopped after.

``redis_server`` (module scope) is the shared server; ``RedisServer`` starts private ones (a test that kills its
server). Tests that need one are skipped, with the reason, when the ``redis-server`` binary or the ``redis``
package is missing (CI: ``apt-get install -y redis-server``; ``pip install 'redis>=5'``). The process itself is
``experiments.redis_process.RedisProcess``.
"""

from __future__ import annotations

import uuid

import pytest

from experiments.redis_process import RedisProcess, redis_unavailable_reason


def skip_reason() -> str | None:
    """Why redis tests cannot run here (None when they can)."""
    return redis_unavailable_reason()


class RedisServer(RedisProcess):
    """A started :class:`RedisProcess` (no persistence, no eviction unless ``extra`` says so); skips the test
    when a server cannot run here. ``stop`` then ``start`` restarts it at the same address; ``close`` ends it."""

    def __init__(self, *extra: str) -> None:
        reason = skip_reason()
        if reason:
            pytest.skip(reason)
        super().__init__(*extra)
        self.start()

    def client(self):
        """A new ``redis.Redis`` client on this server."""
        import redis

        return redis.Redis.from_url(self.url)


def new_namespace(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.close()
