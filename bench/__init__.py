"""Side-by-side benchmarks of kombu-pgskip, RabbitMQ, Redis and kombu's SQLAlchemy transport.

Run ``python -m bench.run --short`` (under three minutes) or ``python -m bench.run --full``.
They print figures and write them as JSON and PNG charts; they assert nothing.
"""
