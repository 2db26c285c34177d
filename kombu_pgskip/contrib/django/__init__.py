"""kombu-pgskip for Django: an app whose migrations install and upgrade the pgskip schema.

Add ``"kombu_pgskip.contrib.django"`` to ``INSTALLED_APPS``; then ``manage.py migrate``
installs the schema in the database that Django's ``connection`` and ``apply_async_in`` use,
and the test runner's database gets it too. The guide is ``docs/django.md``.

What the app reads from Django's settings (as Celery's Django support reads its own, with
``app.config_from_object("django.conf:settings", namespace="CELERY")``):

``CELERY_BROKER_TRANSPORT_OPTIONS["schema"]``
    The schema (default ``pgskip``); the other options are checked as the broker checks them.
``PGSKIP_DATABASE``
    The alias in ``DATABASES`` of the database the schema lives in (default ``"default"``),
    which must use the PostgreSQL backend.

How the schema reaches the database:

* the app's migration ``kombu_pgskip.0001_initial`` brings it to the version of the installed
  kombu-pgskip (:func:`kombu_pgskip.migrate` on Django's connection); it is not atomic, so the
  migration files that build indexes concurrently run outside a transaction, as they must;
* every later ``manage.py migrate`` brings an installed schema to the version of the installed
  kombu-pgskip before Django's migrations run (a ``pre_migrate`` receiver): upgrading the
  package and running ``manage.py migrate``, as after any upgrade, upgrades the schema, with no
  new Django migration. A ``migrate`` that unapplies migrations leaves the schema alone.

Reversing ``0001_initial`` is refused: the schema holds the queued messages, and the app never
drops it (the error says how to remove it by hand).
"""
