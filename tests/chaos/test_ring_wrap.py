"""The ring going round under a stream (``bench/ring_wrap.py``, which measures fetch latency and
what each ``rotate()`` call did): every message is taken once and completed, the ring moves on.
The latencies are printed, not asserted."""

from __future__ import annotations

import psycopg

from bench.ring_wrap import run


def test_a_stream_goes_through_the_ring_and_every_message_completes(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE pgskip.jobs_rotation SET slot_rows = 5000, slots = 3")
    out = run(db_url, messages=30_000, rate=4_000)
    print("\n", {k: v for k, v in out.items() if k != "slow_rotations"})
    assert out["messages"] >= 30_000
    assert out["fetches"] > 0 and out["fetch_ms_max"] > 0
    # 30,000 messages through 3 slots of 5,000 ids (the producer inserts 15,000 at once): the
    # ring came round, and completed messages of the slot it came back to (kept a day) went to
    # jobs_kept.
    assert out["wraps"] >= 2
    assert out["moved"] > 0
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT status::text, count(*) FROM pgskip.jobs GROUP BY 1").fetchall()
    # Nothing lost or taken twice: the consumers stopped at the target, the rest still waits.
    assert dict(left).get("completed") == out["messages"]
    assert set(dict(left)) <= {"completed", "pending"}
