"""Integrations of kombu-pgskip with frameworks: :mod:`kombu_pgskip.contrib.django`."""
