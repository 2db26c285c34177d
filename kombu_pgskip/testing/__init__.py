"""Helpers for tests and demos of applications that use kombu-pgskip; never for production.

Nothing in the broker imports this package, and nothing here is needed to run a worker or to
publish. :mod:`kombu_pgskip.testing.embedded` holds :class:`~.embedded.EmbeddedPostgres`, a
throwaway local PostgreSQL cluster (initdb + pg_ctl) that trusts every local connection
without a password; :mod:`kombu_pgskip.testing.databases` holds
:class:`~.databases.ThrowawayServer`, which makes migrated throwaway databases on such a cluster
or on an existing server: what the fixtures of the pytest plugin (the top-level module
``_kombu_pgskip_pytest``, docs/testing.md) run.
"""
