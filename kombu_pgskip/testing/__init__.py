"""Helpers for tests and demos of applications that use kombu-pgskip; never for production.

Nothing in the broker imports this package, and nothing here is needed to run a worker or to
publish. :mod:`kombu_pgskip.testing.embedded` holds :class:`~.embedded.EmbeddedPostgres`, a
throwaway local PostgreSQL cluster (initdb + pg_ctl) that trusts every local connection
without a password.
"""
