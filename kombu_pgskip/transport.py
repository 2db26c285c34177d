"""kombu transport for PostgreSQL: messages are rows, fetched with ``FOR UPDATE SKIP LOCKED``.

Features
========
* Type: virtual
* Supports direct, topic and fanout exchanges, with exchanges and bindings stored in the database
  so that every process routes through the bindings of every other (Celery remote control and
  events, Flower)
* Supports queue expiry (``x-expires``), auto-delete queues and no-ack consumption
* Supports priority 0-9 (9 first, AMQP order), clamped to a queue's ``x-max-priority``
* Supports TTL (``expiration`` / ``x-message-ttl``)
* Supports at-least-once delivery: a message leaves the table only when acknowledged

Connection string
=================
.. code-block::

    pgskip://user:password@host:5432/dbname?sslmode=require
    pgskip+postgresql://user:password@host1,host2/dbname?target_session_attrs=read-write

The query string holds libpq options. The password never appears in logs or ``repr``.
``broker_transport = "kombu_pgskip.transport:Transport"`` works too if ``kombu_pgskip`` cannot be
imported before the URL is parsed.

A message's life
================
``pending -> running`` when a consumer fetches it (one statement, ``UPDATE ... FROM (SELECT ...
FOR UPDATE SKIP LOCKED)``, up to the consumer's free prefetch credit); ``running -> completed`` on
ack (deleted instead with ``keep_completed=False``); ``running -> pending`` on requeue, on
channel close, or when its consumer's lease runs out (``redelivered`` is then true);
``running -> failed`` on reject without requeue or after ``max_attempts`` deliveries. A message
whose ``eta`` is more than ``eta_threshold`` seconds away is stored as ``scheduled`` and promoted
to ``pending`` when due, so workers do not hold it; Celery's ``inspect scheduled`` lists it all
the same (:mod:`kombu_pgskip.control`).

Every consumer has a lease (a row in ``consumers``) that a heartbeat thread renews every
``lease_seconds / 3``, on a connection that also holds a session-level advisory lock for as long
as the process lives. A process that dies loses the lock with its session: any live worker's
sweeper (every ``sweep_interval``, and when a worker starts) puts its consumers' rows back to
``pending`` 2 s later. A consumer that hangs but stays connected stops renewing, and after
``lease_seconds`` the sweeper does the same. Acks are fenced by
(consumer, delivery token, unique to each delivery): an ack from a consumer that lost its lease,
or of an earlier delivery of the same message, changes nothing.
Acks wait for the consumer's next fetch and are written by the same statement (or on their
own, at the latest by the heartbeat thread): a crash before that can only cause a redelivery.

Workers wake at commit through LISTEN/NOTIFY, with a poll every ``polling_interval`` as fallback.
The transport is asynchronous: a Celery worker runs its event loop (the LISTEN socket and a
self-pipe woken by acks are watched by kombu's hub), so it keeps answering remote control and
sending heartbeats while every prefork process is busy.

Routing
=======
Exchanges and bindings are rows (``exchanges``, ``bindings``), so a message published in one
process reaches queues bound in another: a publish to a named exchange is one statement that
finds the bound queues (direct: equal routing key; topic: pattern match; fanout: all) and inserts
a row into each. Queues declared with ``x-expires`` are deleted, with their messages and
bindings, once no live consumer used them for that long (live workers' sweepers, or pg_cron,
call ``<schema>.expire_queues()``), and no publish writes to them after that; ``auto_delete``
queues go when their last consumer cancels. No-ack consumers take rows with
``DELETE ... RETURNING``. See docs/celery-compatibility.md.

Database errors
===============
Every error of the server is classified by its SQLSTATE, in one place
(``kombu_pgskip.exceptions.classify``), on every path (fetch, ack, publish, LISTEN, lease):

* **transient**: ``TransientDatabaseError``, an ``OperationalError`` in ``connection_errors``:
  kombu and Celery reconnect and retry, and a worker rides it out (its fetched and unacked
  messages return to the queue, redelivered). A connection that went away (libpq gives no
  SQLSTATE); class 08; class 40 but 40002 (serialization failure 40001, deadlock 40P01);
  class 53 (disk full, out of memory, too many connections); 55P03 (``lock_timeout``);
  class 57 but 57P04 (``statement_timeout`` and ``pg_cancel_backend()``: 57014;
  ``pg_terminate_backend()`` and shutdowns: 57P01-57P03; ``idle_session_timeout``: 57P05);
  58000 and 58030 (the server's system and I/O errors); 25P03 and 25P04 (idle-in-transaction
  and transaction timeouts); 26000 (a prepared statement gone); 72000 (snapshot too old).
* **what to do**: ``SchemaNotInstalled`` (42P01, 3F000), ``SchemaOutdated`` (42883),
  ``PermissionDenied`` (42501), ``ReadOnlyDatabase`` (25006), ``AuthenticationFailed``
  (28000, 28P01): not retried; the message says what to run.
* **the rest**: ``PersistentDatabaseError``, not a connection error (42xxx, 22xxx, 23xxx,
  54xxx, 57P04, 58P01, XX000 ...): retrying would fail the same way, so kombu does not retry
  it; it is raised with the SQLSTATE, what it means and what to do, and a Celery worker logs
  it as an error (and stops, where it comes with a fetch's reply) instead of reconnecting for
  ever.

Both keep psycopg's class for the SQLSTATE (a transient 40P01 is also a
``psycopg.errors.DeadlockDetected``), except that a ``PersistentDatabaseError`` is never an
``OperationalError``. In ``apply_async_in`` nothing is retried: the error reaches the caller,
whose transaction it aborted, with its driver's class.

Transport options
=================
============================  =========  ==========================================================
option                        default    meaning
============================  =========  ==========================================================
``schema``                    "pgskip"   schema holding the tables (``pgskip migrate`` installs it)
``polling_interval``          1.0        seconds between polls when no notification arrives
``listen``                    True       use LISTEN/NOTIFY; False = poll only (PgBouncer
                                         transaction pooling)
``lease_seconds``             30.0       a consumer silent this long is dead; its rows return
``sweep_interval``            10.0       how often each worker sweeps dead consumers' rows
``max_attempts``              20         deliveries before a message goes to ``failed``
``eta_threshold``             2.0        ETAs further away than this wait in the database
``fetch_limit``               100        most messages fetched in one statement
``fetch_max_bytes``           16777216   payload bytes after which a fetch takes no further
                                         message (it always takes one, however large): one
                                         fetch's result, all in memory at once, holds less
                                         than this plus one message. A fetch that stops
                                         short is followed by another while prefetch credit
                                         remains
``max_message_size``          67108864   bytes of encoded message accepted by publish
                                         (at most 268435456)
``connect_timeout``           10         seconds to wait for a connection
``check_schema``              True       refuse to run against a missing or outdated schema
``synchronous_acks``          False      False: fetches and acks run on a connection of their
                                         own with ``synchronous_commit = off`` (a server crash
                                         can redeliver, never lose); True behind PgBouncer in
                                         transaction pooling
``async_fetch``               True       fetch on a connection of its own (the statement
                                         prepared once, with a generic plan); inside Celery's
                                         event loop without blocking the loop (rows are
                                         delivered when the reply arrives). False: on the
                                         consumer connection, waiting for the reply
``durable_publish``           True       False: publishes commit with ``synchronous_commit =
                                         off`` (faster; a PostgreSQL crash can lose publishes
                                         acknowledged in the last ~0.6 s; opt-in only)
``notify_after_commit``       True       a durable publish sends its NOTIFY in a transaction
                                         of its own, behind the insert's in the same round
                                         trip, so concurrent publishers' commits are not
                                         serialised by PostgreSQL's cluster-wide NOTIFY lock
                                         (two transaction ids per publish); apply_async_in and
                                         apply_many_in on Django, on a SQLAlchemy Session and
                                         in kombu_pgskip.transaction() send theirs after the
                                         caller's commit, one statement for all.
                                         False: the NOTIFY in the insert's transaction (one id)
``xmin_horizon_warning``      300.0      log a WARNING naming the session, prepared transaction
                                         or replication slot that has held the database's xmin
                                         horizon this many seconds (dead rows cannot be
                                         vacuumed meanwhile); 0 disables (see health.py)
``prepared_statements``       True       let psycopg prepare frequent statements; False behind
                                         PgBouncer in transaction pooling (before 1.21, or
                                         without ``max_prepared_statements``)
``fetch_cooldown``            0.002      a notification's fetch waits until this many seconds
                                         after the previous fetch was sent (in Celery's event
                                         loop and in a blocking ``drain_events``), so while
                                         tasks stream in one fetch takes the messages of that
                                         moment together; an idle worker fetches at once.
                                         0: every notification fetches
``fetch_cooldown_max``        0.02       the cooldown grows towards this while notified
                                         fetches come back empty (other workers on the queue
                                         took the message) and shrinks back to
                                         ``fetch_cooldown`` while they take rows; at or below
                                         ``fetch_cooldown``: a fixed cooldown
``keep_completed``            True       an ack marks its message ``completed`` (kept until the
                                         prune job's ``completed_retention``). False: an ack
                                         deletes it; failed messages are kept either way
============================  =========  ==========================================================

Any other key is refused with a ``ConfigurationError`` that names it and the closest option,
except the keys kombu and Celery put into every transport's options (the retry policy:
``max_retries``, ``interval_start``, ``interval_step``, ``interval_max``, ...; see
``kombu_pgskip.options.KOMBU_OPTIONS``) and other kombu transports' options
(``visibility_timeout``, ``confirm_publish``, ...), which do nothing here and are named in a
WARNING once per process.
"""

from __future__ import annotations

import os
import threading
from functools import cached_property
from typing import Any

import psycopg
from kombu.transport import virtual

from .background import Background
from .channel import Channel, QoS
from .channel import Channel as PgChannel  # ``Channel`` is shadowed in Transport's body
from .control import install as extend_remote_control
from .dispatch import Dispatcher
from .exceptions import TransientDatabaseError
from .options import Options
from .store import Store
from .urls import build_url, mask_url, to_conninfo


class Transport(virtual.Transport):
    """The ``pgskip://`` transport: kombu's connection-level calls, translated.

    Publishing and declaring go through :attr:`store`; consuming is the
    :attr:`dispatcher`'s (blocking ``drain_events`` or Celery's event loop); a
    :class:`~kombu_pgskip.background.Background` thread keeps the consumers' leases.
    """

    Channel = Channel

    can_parse_url = True
    default_port = 5432
    driver_type = "pgskip"
    driver_name = "psycopg"
    polling_interval = 1.0

    implements = virtual.Transport.implements.extend(
        # Celery's worker then runs its event loop (as with Redis and RabbitMQ): the consumer
        # thread never blocks on a busy prefork pool, so remote control, heartbeats and events
        # keep flowing while every pool process is busy.
        asynchronous=True,
        # Producer.batch(): many publishes, one INSERT (Channel.create_publish_batch).
        batch_publish=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = (
        *virtual.Transport.connection_errors,
        # Server errors that pass (see "Database errors" above). An OperationalError like
        # ConnectionFailed, listed for the reader; psycopg's own OperationalError stays, for a
        # connection lost where nothing classified it.
        TransientDatabaseError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    channel_errors = virtual.Transport.channel_errors

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = Options.from_transport_options(dict(client.transport_options or {}))
        super().__init__(client, **kwargs)
        self.polling_interval = self.options.polling_interval
        self.url = self._client_url(client)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._consumers: list[PgChannel] = []
        self._background: Background | None = None
        self.dispatcher = Dispatcher(self)
        # In a Celery worker, `inspect scheduled` lists the ETAs stored in the database too.
        extend_remote_control()

    def __repr__(self) -> str:
        return f"<pgskip Transport {mask_url(self.url)}>"

    @staticmethod
    def _client_url(client: Any) -> str:
        hostname = client.hostname or "localhost"
        if "://" in hostname:
            url = hostname
        else:
            url = build_url(
                hostname=hostname,
                port=client.port,
                userid=client.userid,
                password=client.password,
                virtual_host=client.virtual_host,
            )
        to_conninfo(url)  # raises InvalidURL with a message that says what is expected
        return url

    @cached_property
    def store(self) -> Store:
        """Publishing, declarations, operators' queries: every commit is durable (unless
        ``durable_publish`` is False: then commits return before the WAL flush)."""
        return Store(
            self.url,
            schema=self.options.schema,
            check=self.options.check_schema,
            asynchronous_commit=not self.options.durable_publish,
            notify_after_commit=self.options.notify_after_commit,
            **self.options.connect_kwargs,
        )

    @cached_property
    def consumer_store(self) -> Store:
        """Fetches, acks, requeues and leases, on a connection of their own.

        Unless ``synchronous_acks`` is set, these commit asynchronously: losing one in a
        PostgreSQL crash can only make a message run again (its row is still ``pending`` or
        ``running`` and the sweeper returns it), never lose it; publishes stay durable.
        """
        return Store(
            self.url,
            schema=self.options.schema,
            check=self.options.check_schema,
            asynchronous_commit=not self.options.synchronous_acks,
            keep_completed=self.options.keep_completed,
            **self.options.connect_kwargs,
        )

    def driver_version(self) -> str:
        return psycopg.__version__

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": "localhost"}

    # -- connection lifecycle -------------------------------------------------------------------

    def _after_fork(self) -> None:
        """In a forked child: the parent's sockets and thread are not ours."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._background = None
            self.dispatcher.after_fork()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            background, self._background = self._background, None
            if background is not None and self._pid == os.getpid():
                background.stop()
            self.dispatcher.close()
            self.store.close()
            if "consumer_store" in self.__dict__:
                self.consumer_store.close()

    def track_consumer(self, channel: PgChannel) -> None:
        """``channel`` registered its consumer: keep its lease (starting the thread)."""
        with self._lock:
            if channel not in self._consumers:
                self._consumers.append(channel)
            if self._background is None or not self._background.is_alive():
                self._background = Background(
                    self.url,
                    self.options,
                    self.consumer_channels,
                    on_limits=self.dispatcher.limits_known,
                )
                self._background.start()

    def forget_consumer(self, channel: PgChannel) -> None:
        with self._lock:
            if channel in self._consumers:
                self._consumers.remove(channel)

    def consumer_channels(self) -> list[PgChannel]:
        """The channels whose leases are to be renewed."""
        with self._lock:
            return [c for c in self._consumers if c._registered and not c.closed]

    # -- consuming --------------------------------------------------------------------------------

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Deliver the next batch of messages, waiting up to ``timeout`` seconds for one."""
        self._after_fork()
        self.dispatcher.drain(timeout)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Deliver from the worker's event loop instead of blocking ``drain_events`` calls."""
        self._after_fork()
        self.dispatcher.register(loop)

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        self.dispatcher.leave_loop()


__all__ = ["Channel", "Options", "QoS", "Transport", "mask_url"]
