"""KV events: the store's cache, published in vLLM's KV-event schema so routers outside kvboost can follow it.

llm-d's KV-cache manager, NVIDIA Dynamo's KV router and SGLang's router consume the events vLLM publishes
(``vllm/distributed/kv_events.py``): msgpack-encoded event batches over a ZMQ PUB socket, each message three frames
``(topic, seq, payload)`` with ``seq`` an 8-byte big-endian sequence number counted from 0 by each publisher, and a
replay buffer of the last ``buffer_steps`` batches served on a ROUTER socket. This module is kvboost's own
implementation of that wire contract (written from vLLM 0.33.0's definitions, no code of it):

- **Batch**: a msgpack array ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch`` is ``array_like``, and
  msgspec writes every field of an ``array_like`` struct): ``ts`` a float64 Unix time, ``data_parallel_rank`` an
  int (0 unless configured).
- **Events**, ``encoding="map"`` (default; vLLM since PR #42892, e.g. 0.33.0): tagged maps, the tag first under
  ``"type"``, then the fields in vLLM's declaration order; fields without a default always present (``None`` as
  nil), defaulted fields only when set (msgspec's ``omit_defaults``)::

      {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p | None, "token_ids": [...],
       "block_size": n, "lora_id": None, "medium": "memory", "lora_name": None, "extra_keys": [k | None]}
      {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "disk"}
      {"type": "AllBlocksCleared"}

  ``encoding="array"``: the positional layout of vLLM before #42892 (msgspec ``array_like=True, tag=True``), the
  tag first, then the fields in the same order, all of them, through ``extra_keys`` (the later optional fields,
  ``group_idx`` on, kvboost does not fill; msgspec decoders default missing trailing fields and ignore extra ones)::

      ["BlockStored", [h], p | None, [...], n, None, "memory", None, [k | None] | None]
      ["BlockRemoved", [h, ...], "disk"]
      ["AllBlocksCleared"]

- **Replay**: a client (a DEALER socket) sends ``[b"", start_seq]`` to the ROUTER; it answers every buffered batch with ``seq >= start_seq`` as ``[b"", topic, seq, payload]`` and ends with
  ``[b"", b"", seq=-1 (8 bytes, signed), b""]``.

How kvboost's cache maps onto the schema. kvboost's unit is a **chunk** (a run of tokens the chunker chose; fixed
``chunk_size`` tokens or variable with the separator chunker), keyed by a prefix-chained hash (``kvboost.hashing``).
Routers index fixed blocks of their own size (llm-d re-chunks an event's tokens into its ``blockSize`` and chains
them from the parent's; Dynamo indexes blocks of its ``kv_block_size``), so by default kvboost publishes **fixed
blocks** (:meth:`KVEventSink.blocks_of`), ``kv_events.block_size`` tokens each (unset: the KV pool's ``kv.block_size``,
16, which is also vLLM's and llm-d's default; set it to the router's):

- one ``BlockStored`` per entry that lands in a tier: its full blocks from the prompt start (an entry starts at a
  multiple of the block size when its ancestors are whole blocks; one that does not, or holds fewer tokens than a
  block, is not published: a block across it would need its parent's tokens); ``block_hashes`` = block ``j``'s hash
  (the hash of block ``j-1``'s name and its tokens, block ``-1`` being the parent key: a block is named by its
  parent and its tokens as vLLM's are, so chunks sharing leading blocks share their hashes); ``parent_block_hash``
  = the parent entry's last block (``None`` for a prompt's first chunk, whose parent is the tenant's root key); a
  block a medium already holds for another entry is not published again (the event then starts after it, its
  parent the last shared block), and is removed when its last holder leaves; ``token_ids`` = the blocks' tokens (tokens after the last full
  block are not published, as vLLM publishes full blocks only); ``block_size`` = the block size; ``lora_id`` /
  ``lora_name`` are ``None`` (no adapters). ``block_size: chunk`` publishes one block per chunk instead (what
  kvboost's own router reads exactly; a router of another block size mis-reads it).
- **content-only entries** (KV computed with repair, ``exact=False``: it serves content hits only and is no
  prompt's prefix) are **not published**: as a block without parent a router would read it as a prompt's first
  block, a false prefix hit; nor are their removals.
- ``medium``: the tier that took or dropped the entry, in the consumers' vocabulary (:data:`MEDIA`,
  :func:`tier_medium`): ``GPU`` (the first tier: the KV pool, the engine's working cache), ``CPU`` (a memory tier
  below it), ``DISK``, ``EXTERNAL`` (Redis, shared by the replicas). A key can be in several media at once (a
  write-through copy below); two tiers of one kind publish one medium (a counting consumer stays exact).
- ``extra_keys`` (one element per block): ``(salt_tag(salt),)`` on a first block stored under a tenant salt
  (``cache_salt``), where vLLM carries ``cache_salt`` in its first block's extra keys: a keyed hash of the salt,
  never the salt (:func:`salt_tag` says why); otherwise ``None``.
- ``hash(key)``: ``block_hash="int"`` (default): the key's digest as a big-endian integer, low 64 bits (what vLLM
  does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); ``"bytes"``: the whole digest. A key that is not hex is
  hashed with SHA-256 first. :func:`external_hash` is the mapping.
- ``BlockRemoved`` when an entry leaves a tier (evicted, demoted to the next tier, removed, promoted out of a lower
  tier), naming the blocks published for it. When the store is cleared: a ``BlockRemoved`` for every block held,
  then ``AllBlocksCleared``; when a publisher attaches to a store: ``AllBlocksCleared`` and a ``BlockStored`` for
  every entry it already holds (a disk tier's records after a restart).

What a subscriber does (:class:`KVEventSubscriber`, :class:`KVEventIndex`): apply batches in ``seq`` order; on a gap
(a late join, ZMQ's slow joiner, a PUB ``hwm`` drop) ask the replay socket for the missing ones; when ``seq`` goes
back, the engine restarted (a new publisher counts from 0 again): ask the replay socket for the new stream from 0 and
apply it; it opens with ``AllBlocksCleared`` and the restarted store's entries, so the index is rebuilt. (A restart
whose first batch seen has a ``seq`` above the old stream's last looks like a gap; a subscriber that knows the engine
went away, e.g. from its health endpoint, should reset ``last_seq`` to -1 itself.) The index so rebuilt equals the
store's own (:func:`store_index`), which ``tests/test_kv_events.py`` checks; ``tests/test_kv_event_consumers.py``
checks consumers written from llm-d's and Dynamo's rules against the engine's store.

Publishing never blocks the engine: :meth:`ZmqEventPublisher.publish` appends to a bounded queue that a publisher
thread drains (encoding, sending, buffering for replay). When the queue is full the oldest batch is dropped,
``dropped`` counts it and the publisher keeps it for the sink (vLLM's queue blocks instead; its PUB socket drops
beyond ``hwm``). The next store operation then resyncs: a ``BlockRemoved`` for every block a lost batch removed and
for every block published as held, ``AllBlocksCleared``, and the snapshot. llm-d only logs ``AllBlocksCleared``
(``pkg/kvevents/pool.go``), so the removals are what bring it back to the store's state. Gaps this cannot close: a
batch the PUB socket drops beyond ``hwm`` (unseen by the publisher: a subscriber must ask the replay socket on the
gap in ``seq``, which llm-d does not do), and a restarted engine's blocks of the previous process (the new
publisher does not know them; a consumer that ignores ``AllBlocksCleared`` keeps them until they are evicted or the
pod is forgotten, e.g. by llm-d's pod reconciler).

Consumers: llm-d's vLLM adapter (``llm-d-kv-cache``, ``pkg/kvevents/engineadapter/vllm_adapter.go``) decodes events
positionally (msgpack ``array``): give it ``encoding: array``. It reads the pod and model from the topic
``kv@<pod>@<model>`` (kvboost-server sets that topic when none is given, ``kvboost.serving.cli``), and it does not
read ``extra_keys``, so it scores tenants' salted blocks like the open tenant's (routing only: the engine's cache
stays salted).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEGMENT_ONLY_EXTRA = "kvboost:segment_only"
#: prefix of the published form of a tenant salt (:func:`salt_tag`)
SALT_TAG_PREFIX = "kvboost-salt:"
#: where the key of :func:`salt_tag` comes from when ``kv_events.salt_key`` is unset
SALT_KEY_ENV = "KVBOOST_KV_EVENTS_KEY"
#: interfaces that mean "every interface" in a bound endpoint
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
ENCODINGS = ("map", "array")
BLOCK_HASHES = ("int", "bytes")


# ---------------------------------------------------------------------------------------------- events
@dataclass
class BlockStored:
    """Blocks (kvboost: chunks) that landed in ``medium``; fields and their order as vLLM's ``BlockStored``."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


@dataclass
class BlockRemoved:
    """Blocks that left ``medium``."""

    block_hashes: list[Any]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    """Every block of this publisher's cache is gone (every medium)."""


@dataclass
class KVEventBatch:
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


#: per event class: (fields always encoded, fields encoded only when not None), in vLLM's declaration order
_LAYOUT = {
    "BlockStored": (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
                    ("extra_keys",)),
    "BlockRemoved": (("block_hashes", "medium"), ()),
    "AllBlocksCleared": ((), ()),
}  # fmt: skip
_CLASSES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def _event_obj(event: Any, encoding: str) -> Any:
    tag = type(event).__name__
    required, optional = _LAYOUT[tag]
    if encoding == "map":
        out: dict[str, Any] = {"type": tag}
        for name in required:
            out[name] = getattr(event, name)
        for name in optional:
            if getattr(event, name) is not None:
                out[name] = getattr(event, name)
        return out
    return [tag, *(getattr(event, name) for name in required + optional)]  # msgspec's array_like omits nothing


def encode_batch(batch: KVEventBatch, encoding: str = "map") -> bytes:
    """msgpack bytes of ``batch`` in vLLM's layout (see the module docstring)."""
    import msgpack

    if encoding not in ENCODINGS:
        raise ValueError(f"kv_events.encoding must be one of {ENCODINGS}, got {encoding!r}")
    obj = [float(batch.ts), [_event_obj(e, encoding) for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(obj, use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes, either encoding (events as maps or as tagged arrays)."""
    import msgpack

    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, raw_events = obj[0], obj[1]
    rank = obj[2] if len(obj) > 2 else None
    events = []
    for raw in raw_events:
        if isinstance(raw, dict):
            tag = raw["type"]
            known = {f.name for f in fields(_CLASSES[tag])}
            kwargs = {k: v for k, v in raw.items() if k in known}
        else:
            tag = raw[0]
            names = [f.name for f in fields(_CLASSES[tag])]
            kwargs = dict(zip(names, raw[1:]))
        events.append(_CLASSES[tag](**kwargs))
    return KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)


def external_hash(key: str, block_hash: str = "int") -> int | bytes:
    """The block hash published for kvboost key ``key``: its digest (hex) as bytes, or SHA-256 of a non-hex key;
    ``"int"``: the low 64 bits of that, big-endian (as vLLM's ``maybe_convert_block_hash``)."""
    try:
        digest = bytes.fromhex(key)
    except ValueError:
        digest = hashlib.sha256(key.encode()).digest()
    if block_hash == "bytes":
        return digest
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def salt_tag(salt: str, key: bytes | str) -> str:
    """The published form of a tenant salt: ``kvboost-salt:`` + the first 128 bits of HMAC-SHA256(``key``, salt).

    Why a keyed hash. The salt is what keeps tenants apart (``kvboost.serving.tenancy``): a request's own
    ``cache_salt`` is a secret its sender chose, and on a deployment without API keys it is the whole salt, so
    publishing it would let anyone who reads the socket send requests under another tenant's salt and time its
    prefix hits. A router needs equality only (two first blocks of one tenant carry the same extra key, of two
    tenants different ones), which a keyed hash keeps; without the key the salt cannot be recovered nor a guessed
    salt checked (an unkeyed hash of a low-entropy ``cache_salt`` could be)."""
    key_bytes = key.encode() if isinstance(key, str) else bytes(key)
    return SALT_TAG_PREFIX + hmac.new(key_bytes, salt.encode(), hashlib.sha256).hexdigest()[:32]


def events_salt_key(configured: str | None) -> bytes:
    """The key of :func:`salt_tag`: ``kv_events.salt_key``, else ``$KVBOOST_KV_EVENTS_KEY``, else a random key of
    this process (equality within this publisher's stream only: a router that matches a request's salt itself,
    or the salts of several replicas, needs one key set on all of them)."""
    key = configured or os.environ.get(SALT_KEY_ENV)
    return key.encode() if key else secrets.token_bytes(32)


#: tokens per published block when ``kv_events.block_size`` is unset and the store has no KV pool tier: kvboost's
#: pool default (``kvboost.kv.pool.DEFAULT_BLOCK_SIZE``), also vLLM's default ``--block-size`` and llm-d's default
#: ``blockSize``
DEFAULT_EVENT_BLOCK_SIZE = 16


def check_block_size(block_size: Any) -> None:
    """``kv_events.block_size``: a positive integer, ``"chunk"`` (one block per kvboost chunk) or None (the pool's)."""
    if block_size is None or block_size == "chunk":
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"kv_events.block_size must be a positive integer, 'chunk' or null, got {block_size!r}")


# ---------------------------------------------------------------------------------------------- config
@dataclass
class KVEventsConfig:
    """The engine's ``kv_events`` option (vLLM's ``KVEventsConfig`` fields, plus ``encoding`` and ``block_hash``).

    ``enabled``: off by default (vLLM's ``enable_kv_cache_events`` is accepted as its alias). ``publisher``:
    ``"zmq"``, ``"null"``, or an object with ``publish(batch)`` and ``shutdown()`` (tests). ``endpoint``: the PUB
    address (bound when it has ``*``, ``::``, ``ipc://`` or ``inproc://``, connected otherwise, as vLLM does);
    ``host``: the interface a bound TCP endpoint with a wildcard host listens on, loopback by default (the events
    carry every cached prompt's token ids, unauthenticated): ``"*"`` (or an address) binds elsewhere, with a
    warning; ``replay_endpoint``: the ROUTER address (None: no replay), bound on ``host`` likewise;
    ``salt_key``: the key of the tenant salts' published form (:func:`salt_tag`, :func:`events_salt_key`);
    ``topic``: the first frame of every message;
    ``buffer_steps``: batches kept for replay; ``hwm``: the PUB socket's high-water mark; ``max_queue_size``:
    batches waiting for the publisher thread before the oldest is dropped."""

    enabled: bool = False
    publisher: Any = "zmq"
    endpoint: str = "tcp://*:5557"
    host: str = "127.0.0.1"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    encoding: str = "map"
    block_hash: str = "int"
    data_parallel_rank: int = 0
    salt_key: str | None = None
    block_size: int | str | None = None
    media: dict[str, str] | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | KVEventsConfig | None) -> KVEventsConfig:
        if isinstance(options, KVEventsConfig):
            return options
        options = dict(options or {})
        if "enable_kv_cache_events" in options:
            options["enabled"] = options.pop("enable_kv_cache_events")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown kv_events option(s) {unknown}; accepted: {known}")
        config = cls(**options)
        if config.encoding not in ENCODINGS:
            raise ValueError(f"kv_events.encoding must be one of {ENCODINGS}, got {config.encoding!r}")
        if config.block_hash not in BLOCK_HASHES:
            raise ValueError(f"kv_events.block_hash must be one of {BLOCK_HASHES}, got {config.block_hash!r}")
        if isinstance(config.publisher, str) and config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events.publisher must be zmq or null, got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if int(getattr(config, name)) < 1:
                raise ValueError(f"kv_events.{name} must be >= 1")
        check_block_size(config.block_size)
        if config.media is not None:
            config.media = dict(config.media)
            unknown_media = sorted(set(config.media) - set(MEDIA))
            if unknown_media:
                raise ValueError(f"kv_events.media: unknown tier kind(s) {unknown_media}; accepted: {sorted(MEDIA)}")
        return config

    def build_publisher(self) -> Any:
        """The publisher this config names (None when disabled or ``null``)."""
        if not self.enabled or self.publisher == "null":
            return None
        if not isinstance(self.publisher, str):
            return self.publisher
        return ZmqEventPublisher(
            self.endpoint, host=self.host, replay_endpoint=self.replay_endpoint, topic=self.topic,
            buffer_steps=self.buffer_steps,
            hwm=self.hwm, max_queue_size=self.max_queue_size, encoding=self.encoding,
            data_parallel_rank=self.data_parallel_rank,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------- publisher
def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_address(endpoint: str, host: str = "127.0.0.1") -> str:
    """The address a bound endpoint listens on: a TCP endpoint's wildcard host (``tcp://*:5557``,
    ``tcp://0.0.0.0:*``) replaced by ``host``; other endpoints as given. Logs a warning when the result listens
    beyond loopback (the events are unauthenticated)."""
    if endpoint.startswith("tcp://"):
        where, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if sep and where in _WILDCARDS:
            where = host if host not in _WILDCARDS else "*"
            if ":" in where and not where.startswith("["):
                where = f"[{where}]"
            endpoint = f"tcp://{where}:{port}"
        if not _is_loopback(where):
            log.warning("kv_events: publishing on %s, beyond loopback and unauthenticated: whoever reaches it reads "
                        "every cached prompt's token ids (bind loopback, or restrict the port)", endpoint)  # fmt: skip
    return endpoint


class ZmqEventPublisher:
    """PUB socket + ROUTER replay socket, driven by one daemon thread; ``publish`` never blocks.

    Frames on PUB: ``(topic, seq, payload)``; ``seq`` is assigned in publishing order by the thread, from 0.
    ``dropped``: batches dropped because the queue was full (oldest first); ``published``: batches sent."""

    SHUTDOWN_TIMEOUT = 2.0

    def __init__(self, endpoint: str = "tcp://*:5557", *, host: str = "127.0.0.1", replay_endpoint: str | None = None,
                 topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 encoding: str = "map", data_parallel_rank: int = 0) -> None:  # fmt: skip
        import zmq

        self.encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._queue: deque[KVEventBatch] = deque()
        self._max_queue = int(max_queue_size)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=int(buffer_steps))
        self.dropped = 0
        self.published = 0
        self._lost: list[KVEventBatch] = []  # dropped since the last take_dropped (the sink's resync reads them)
        self._queued = 0
        self._next_seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(int(hwm))
        self._pub.setsockopt(zmq.LINGER, 0)
        if _binds(endpoint):
            self._pub.bind(bind_address(endpoint, host))
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (int(buffer_steps) + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(bind_address(replay_endpoint, host))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvboost-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch``; when the queue is full the oldest queued batch is dropped (counted in ``dropped``)."""
        if not self._running:
            return
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        with self._lock:
            if len(self._queue) >= self._max_queue:
                self._lost.append(self._queue.popleft())
                self.dropped += 1
            self._queue.append(batch)
            self._queued += 1
        self._wake.set()

    def pending(self) -> int:
        return len(self._queue)

    @property
    def topic(self) -> str:
        """The first frame of every message."""
        return self._topic.decode()

    def take_dropped(self) -> list[KVEventBatch]:
        """The batches dropped since the last call (oldest first), forgotten here: a resync re-sends their
        removals (:meth:`KVEventSink.clear_events`)."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch sent (-1: none yet)."""
        return self._next_seq - 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every batch published so far was sent (or dropped); False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self.published + self.dropped < self._queued:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None:
                while dict(poller.poll(0)).get(self._replay):
                    try:
                        self._serve_replay()
                    except Exception:  # a malformed request must not stop publishing
                        log.exception("kv_events: replay request failed")
            with self._lock:
                batch = self._queue.popleft() if self._queue else None
            if batch is None:
                if not self._running:
                    break
                self._wake.wait(0.02)
                self._wake.clear()
                continue
            try:
                payload = encode_batch(batch, self.encoding)
                seq = self._next_seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self._next_seq += 1
            except Exception:
                with self._lock:
                    self._lost.append(batch)
                self.dropped += 1
                log.exception("kv_events: publishing a batch failed")
            else:
                self.published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3:
            log.warning("kv_events: invalid replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))  # type: ignore[union-attr]

    def shutdown(self) -> None:
        """Send what is queued (up to ``SHUTDOWN_TIMEOUT`` seconds), stop the thread, close the sockets."""
        if not self._running:
            return
        self.flush(self.SHUTDOWN_TIMEOUT)
        self._running = False
        self._wake.set()
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        self._pub.close(linger=500)  # the last batches leave the socket (a restart's subscribers see the spill)
        if self._replay is not None:
            self._replay.close(linger=0)


# ---------------------------------------------------------------------------------------------- the store's side
#: the ``medium`` published for a tier, by tier kind (``kvboost.cache.store.KVStore.tier_names`` without ``#i``).
#: Spelled as the consumers spell them: vLLM's ``MEDIUM_GPU = "GPU"`` / ``MEDIUM_CPU = "CPU"``
#: (``vllm/distributed/kv_events.py``); Dynamo's ``StorageTier::from_kv_medium`` (``lib/kv-router/src/protocols.rs``)
#: reads ``GPU``, ``CPU`` (``CPU_PINNED``), ``DISK`` and ``EXTERNAL`` and counts any other name as GPU-resident;
#: llm-d lower-cases the medium into its device tier and weights ``gpu`` 1.0 and ``cpu`` 0.8 by default
#: (``pkg/kvcache/backend.go``), any other name 1.0 unless configured (``disk``, ``external`` are configurable).
#: - the first tier (the KV pool, or a memory tier): ``GPU``, the engine's working cache, as vLLM calls its primary
#:   block pool whatever the device;
#: - a memory tier below it (the host copy tier, ``kv.host_bytes``): ``CPU``, vLLM's CPU offload;
#: - ``disk``: ``DISK`` (Dynamo's disk tier; vLLM's newer ``STORAGE`` only in some Dynamo versions);
#: - ``redis``, shared by every replica on one namespace: ``EXTERNAL`` (Dynamo's shared external tier).
#: ``kv_events.media`` overrides per kind (e.g. ``{"disk": "STORAGE"}``).
MEDIA = {"memory": "GPU", "memory_below": "CPU", "disk": "DISK", "redis": "EXTERNAL"}


def tier_medium(tier_name: str, media: Mapping[str, str] | None = None) -> str:
    """The published medium of the store's tier ``tier_name`` (``memory``, ``memory#1``, ``disk``, ``redis#2``)."""
    table = {**MEDIA, **(media or {})}
    kind, _, index = tier_name.partition("#")
    if kind == "memory" and index and int(index) > 0:
        return table["memory_below"]
    return table.get(kind, kind.upper())


class KVEventSink:
    """Turns the store's movements (per tier: keys that arrived, keys that left) into event batches.

    ``hasher`` (optional) tells which parent keys are a tenant's root (``Hasher.salt_of_root``): such an entry is a
    prompt's first chunk (``parent_block_hash=None``, the salt's :func:`salt_tag` in ``extra_keys``).
    ``block_size``: publish each prefix entry as fixed blocks of this many tokens (the router's block size); None:
    the KV pool's block size once a store attaches (:meth:`bind_store`; :data:`DEFAULT_EVENT_BLOCK_SIZE` without a
    pool tier); ``"chunk"``: one block per kvboost chunk (see the module docstring). ``media``: overrides of
    :data:`MEDIA`.

    State: per key, the block hashes published for it and the media they were published in (entries never
    published, content-only or unaligned, publish no removal); per medium, how many entries hold each block (a block
    is stored once, when it first arrives, and removed when the last entry holding it leaves: chunks that share
    leading blocks publish them once)."""

    def __init__(self, publisher: Any, *, block_hash: str = "int", hasher: Any = None,
                 salt_key: bytes | str | None = None, block_size: int | str | None = None,
                 media: Mapping[str, str] | None = None) -> None:  # fmt: skip
        check_block_size(block_size)
        self.publisher = publisher
        self.block_hash = block_hash
        self.hasher = hasher
        #: tokens per published block; None: one block per chunk ("chunk"); resolved from the store when "auto"
        self.block_size: int | None = None if block_size == "chunk" else (
            DEFAULT_EVENT_BLOCK_SIZE if block_size is None else int(block_size))  # fmt: skip
        self._auto_block_size = block_size is None
        self._store: Any = None  # the store that attached this sink (its books name a parent's last block)
        self.media = dict(media or {})
        self._salt_key = events_salt_key(salt_key) if not isinstance(salt_key, bytes) else salt_key
        self.batches = 0  # batches emitted (handed to the publisher)
        self.events = 0  # events in them
        self.resyncs = 0  # fresh snapshots sent after the publisher dropped batches
        self._dropped_seen = 0
        # key -> (block hashes, how many tiers of each medium hold them: two tiers of one kind share a medium)
        self._published: dict[str, tuple[tuple[Any, ...], Counter[str]]] = {}
        # medium -> block hash -> how many (entry, tier) pairs hold it: a block is published when it first arrives in
        # a medium and removed when the last holder leaves, so consumers that keep sets (llm-d) stay exact
        self._held: dict[str, Counter[Any]] = {}

    def bind_store(self, store: Any) -> None:
        """Called when ``store`` attaches this sink: an unset ``block_size`` becomes the store's KV pool block size
        (the engine's ``kv.block_size``), when the first tier is the pool."""
        self._store = store
        pool = getattr(store, "pool", None)
        if self._auto_block_size and getattr(pool, "block_size", None):
            self.block_size = int(pool.block_size)

    @classmethod
    def from_config(cls, config: KVEventsConfig, publisher: Any, *, hasher: Any = None) -> KVEventSink:
        """The sink of an engine's ``kv_events`` config (``config.build_publisher()`` gives ``publisher``)."""
        return cls(publisher, block_hash=config.block_hash, hasher=hasher, salt_key=config.salt_key,
                   block_size=config.block_size, media=config.media)  # fmt: skip

    def published_salt(self, salt: str) -> str | None:
        """What a first block carries for ``salt`` in ``extra_keys`` (:func:`salt_tag`; None for the open
        tenant's empty salt, which has nothing to hide)."""
        return salt_tag(salt, self._salt_key) if salt else None

    def hash_of(self, key: str) -> int | bytes:
        return external_hash(key, self.block_hash)

    def medium(self, tier_name: str) -> str:
        return tier_medium(tier_name, self.media)

    def blocks_of(self, entry: Any) -> tuple[list[Any], list[int], int] | None:
        """``(block hashes, their tokens, block size)`` published for ``entry``, or None when it is published as no
        prefix block: a content-only entry (repaired KV, ``exact=False``: it is no prompt's prefix, and a consumer
        would read a block without parent as a prompt's first block), or, with ``block_size`` B, an entry that does
        not start on a multiple of B (a block across its start would need its parent's tokens) or holds fewer than
        B tokens. A block is named by its parent block and its tokens, as vLLM's are: block ``j``'s name is the
        SHA-256 of (block ``j-1``'s name, its tokens), block ``-1`` being the entry's parent key. Two chunks that
        share leading blocks (a prompt's short tail, then a longer chunk; two prompts with one template header)
        thus publish the same hashes for them. Tokens after the last full block are not published (as vLLM
        publishes full blocks only)."""
        if not entry.exact:
            return None
        tokens = [int(t) for t in entry.token_ids]
        size = self.block_size
        if size is None:
            return [self.hash_of(entry.key)], tokens, len(tokens)
        if int(entry.start) % size or len(tokens) < size:
            return None
        count = len(tokens) // size
        names: list[str] = []
        previous = str(entry.parent_key)
        for j in range(count):
            piece = ",".join(map(str, tokens[j * size : (j + 1) * size]))
            previous = hashlib.sha256(f"{previous}|{piece}".encode()).hexdigest()
            names.append(previous)
        return [self.hash_of(n) for n in names], tokens[: count * size], size

    def parent_block(self, parent_key: str) -> Any:
        """The hash a child of ``parent_key`` names as its parent: that entry's last published block (its own
        key's hash with one block per chunk). From what this stream published, else from the store's books (a
        snapshot may reach a child before its parent); when the parent publishes no block, the hash of its key,
        which no consumer knows (it skips the child, as it must: the chain is broken there)."""
        if self.block_size is None:
            return self.hash_of(parent_key)
        known = self._published.get(parent_key)
        if known is not None:
            return known[0][-1]
        parent = self._store.peek_meta(parent_key) if self._store is not None else None
        blocks = self.blocks_of(parent) if parent is not None else None
        return blocks[0][-1] if blocks else self.hash_of(parent_key)

    def stored_event(self, entry: Any, tier_name: str) -> BlockStored | None:
        """The ``BlockStored`` of ``entry`` arriving in tier ``tier_name`` (None: nothing to publish). Blocks that
        medium already holds for another entry (shared leading blocks) are counted, not published again: the
        event carries the entry's remaining blocks, its parent the last shared one."""
        blocks = self.blocks_of(entry)
        if blocks is None:
            return None
        hashes, tokens, size = blocks
        medium = self.medium(tier_name)
        known, media = self._published.setdefault(entry.key, (tuple(hashes), Counter()))
        media[medium] += 1
        held = self._held.setdefault(medium, Counter())
        shared = 0
        while shared < len(known) and held[_hashable(known[shared])] > 0:
            shared += 1
        held.update(_hashable(h) for h in known)
        if shared == len(known):
            return None
        salt = None
        parent: Any = entry.parent_key
        if shared:
            parent_hash: Any = known[shared - 1]
        else:
            if parent is not None and self.hasher is not None:
                salt = getattr(self.hasher, "salt_of_root", lambda _k: None)(parent)
            parent_hash = None if parent is None or salt is not None else self.parent_block(parent)
        per_block = size if self.block_size is not None else len(tokens)
        rest = list(known[shared:])
        extra = [(self.published_salt(salt),) if salt else None] + [None] * (len(rest) - 1)
        return BlockStored(block_hashes=rest, parent_block_hash=parent_hash,
                           token_ids=tokens[shared * per_block :], block_size=size, medium=medium,
                           extra_keys=extra)  # fmt: skip

    def removed_event(self, keys: list[str], tier_name: str) -> BlockRemoved | None:
        """The ``BlockRemoved`` of ``keys`` leaving tier ``tier_name``: the blocks published for them there that no
        other entry in that medium still holds."""
        medium = self.medium(tier_name)
        held = self._held.setdefault(medium, Counter())
        hashes: list[Any] = []
        for key in keys:
            known = self._published.get(key)
            if known is None or known[1][medium] <= 0:
                continue
            for h in known[0]:
                h = _hashable(h)
                held[h] -= 1
                if held[h] <= 0:
                    del held[h]
                    hashes.append(h)
            known[1][medium] -= 1
            if not +known[1]:
                del self._published[key]
        return BlockRemoved(block_hashes=hashes, medium=medium) if hashes else None

    def clear_events(self, *, lost: bool = False) -> list[Any]:
        """What a clear (and a snapshot: ``AllBlocksCleared`` first) publishes: a ``BlockRemoved`` for every block
        this stream published and still counts as held, with ``lost`` (a resync after dropped batches) also for
        every block a lost batch removed, then ``AllBlocksCleared``. The removals are for consumers that ignore
        ``AllBlocksCleared`` (llm-d only logs it, ``pkg/kvevents/pool.go``): they still end with what the store
        holds, since the snapshot that follows stores again every block held. Lost ``BlockStored`` need nothing.
        Nothing is published as held afterwards."""
        drained = getattr(self.publisher, "take_dropped", None) if lost else None
        removed: dict[Any, list[Any]] = {}
        for batch in drained() if callable(drained) else []:
            for event in batch.events:
                if isinstance(event, BlockRemoved):
                    removed.setdefault(event.medium, []).extend(event.block_hashes)
        for medium, held in self._held.items():
            removed.setdefault(medium, []).extend(held)
        self._published.clear()
        self._held.clear()
        events: list[Any] = [BlockRemoved(block_hashes=hs, medium=m) for m, hs in removed.items() if hs]
        return [*events, AllBlocksCleared()]

    def emit(self, events: list[Any]) -> None:
        if not events:
            return
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        self.batches += 1
        self.events += len(events)

    def needs_resync(self) -> bool:
        """True once after the publisher dropped batches (subscribers then need a fresh snapshot)."""
        dropped = int(getattr(self.publisher, "dropped", 0))
        if dropped != self._dropped_seen:
            self._dropped_seen = dropped
            self.resyncs += 1
            return True
        return False

    def stats(self) -> dict[str, int]:
        """Counters for ``/metrics``: batches and events emitted, snapshots resent, and the publisher's own
        (``published`` / ``dropped`` batches, ``pending`` in its queue) where it keeps them."""
        pending = getattr(self.publisher, "pending", None)
        return {"batches": self.batches, "events": self.events, "resyncs": self.resyncs,
                "published": int(getattr(self.publisher, "published", self.batches)),
                "dropped": int(getattr(self.publisher, "dropped", 0)),
                "pending": int(pending()) if callable(pending) else 0}  # fmt: skip

    def shutdown(self) -> None:
        self.publisher.shutdown()


# ---------------------------------------------------------------------------------------------- the subscriber's side
@dataclass
class KVEventIndex:
    """What a router rebuilds from the events: per medium, the block hashes resident there, each with the number
    of stores not yet removed (two tiers of one kind publish one medium: a block leaves it when both dropped it)."""

    media: dict[str, Counter[Any]] = field(default_factory=dict)
    batches: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
            elif isinstance(event, BlockStored):
                self.media.setdefault(event.medium, Counter()).update(_hashable(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.media.get(event.medium)
                if held is not None:
                    held.subtract(_hashable(h) for h in event.block_hashes)
                    self.media[event.medium] = held = +held  # a removal of what was never stored: no negative
                    if not held:
                        del self.media[event.medium]

    def as_dict(self) -> dict[str, set[Any]]:
        return {medium: set(+hashes) for medium, hashes in self.media.items() if +hashes}


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def store_index(store: Any, block_hash: str = "int", sink: KVEventSink | None = None) -> dict[str, set[Any]]:
    """The store's own index as the events describe it: per medium, the block hashes of the entries its tiers hold
    (as ``sink``, default the store's own or a plain one, publishes them: :meth:`KVEventSink.blocks_of`)."""
    sink = sink or getattr(store, "events", None) or KVEventSink(None, block_hash=block_hash, salt_key=b"-")
    out: dict[str, set[Any]] = {}
    for name, tier in zip(store.tier_names, store.tiers):
        for key in tier.keys():  # noqa: SIM118 (a tier, not a dict)
            entry = tier.peek_meta(key)
            blocks = sink.blocks_of(entry) if entry is not None else None
            if blocks is not None:
                out.setdefault(sink.medium(name), set()).update(_hashable(h) for h in blocks[0])
    return out


class KVEventSubscriber:
    """A SUB socket (and optionally a DEALER on the replay socket) that applies batches to a :class:`KVEventIndex`
    in sequence order: a gap is filled from the replay buffer; a sequence number going back is a restarted
    publisher (its stream opens with ``AllBlocksCleared`` and a snapshot). Not thread-safe; call :meth:`poll`."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "") -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RECONNECT_IVL, 20)  # a restarted publisher is found again quickly
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = self._ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(replay_endpoint)
        self.index = KVEventIndex()
        self.last_seq = -1
        self.restarts = 0
        self.replayed = 0

    def request_replay(self, start_seq: int, timeout_ms: int = 2000) -> list[tuple[int, KVEventBatch]]:
        """The buffered batches from ``start_seq`` on (not applied)."""
        if self.replay is None:
            return []
        self.replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while self.replay.poll(timeout_ms):
            frames = self.replay.recv_multipart()
            _, _topic, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                break
            out.append((int.from_bytes(seq_bytes, "big"), decode_batch(payload)))
        return out

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.index.apply(batch)
        self.last_seq = seq

    def handle(self, seq: int, payload: bytes) -> None:
        """One live message: apply it, after what the replay buffer has for a gap before it."""
        if seq <= self.last_seq:  # a new publisher (engine restart) counts from 0: read its stream from the start
            self.restarts += 1
            self.last_seq = -1
        if seq > self.last_seq + 1:  # a gap (or a late join): the replay buffer has the batches in between
            for rseq, rbatch in self.request_replay(self.last_seq + 1):
                if self.last_seq < rseq < seq:
                    self.replayed += 1
                    self._apply(rseq, rbatch)
        self._apply(seq, decode_batch(payload))

    def poll(self, timeout_ms: int = 100, *, until_seq: int | None = None, max_wait_s: float = 10.0) -> int:
        """Receive and apply what arrives (waiting up to ``timeout_ms`` for each message); with ``until_seq``, keep
        going until that sequence number is applied or ``max_wait_s`` passes. Returns the messages applied."""
        applied = 0
        deadline = time.monotonic() + max_wait_s
        while time.monotonic() < deadline:
            if until_seq is not None and self.last_seq >= until_seq and not self.sub.poll(0):
                break
            if not self.sub.poll(timeout_ms):
                if until_seq is None:
                    break
                continue
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            self.handle(int.from_bytes(seq_bytes, "big"), payload)
            applied += 1
        return applied

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)

