"""The figures of a run as a table (Markdown, printed) and as PNG charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The table's broker columns, in order.
BROKERS = ("pgskip", "rabbitmq", "rabbitmq-confirm", "redis", "redis-fsync", "sqlalchemy")
#: The brokers of the throughput charts, in order (pgskip-async beside pgskip).
CHART_BROKERS = (
    "pgskip",
    "pgskip-async",
    "rabbitmq",
    "rabbitmq-confirm",
    "redis",
    "redis-fsync",
    "sqlalchemy",
)
#: The peers pgskip's figure is divided by in the table's ratio columns.
RATIO_PEERS = ("rabbitmq", "rabbitmq-confirm", "redis", "redis-fsync")
NAMES = {
    "pgskip": "pgskip",
    "pgskip-async": "pgskip (async-commit publisher)",
    "pgskip-apply_async_in": "pgskip apply_async_in",
    "rabbitmq": "RabbitMQ",
    "rabbitmq-confirm": "RabbitMQ confirms",
    "redis": "Redis",
    "redis-fsync": "Redis fsync",
    "sqlalchemy": "SQLAlchemy",
}
COLORS = {
    "pgskip": "#336791",
    "pgskip-async": "#6a9bc3",
    "pgskip-apply_async_in": "#6a9bc3",
    "rabbitmq": "#ff6600",
    "rabbitmq-confirm": "#a34400",
    "redis": "#d82c20",
    "redis-fsync": "#7a1710",
    "sqlalchemy": "#777777",
}


def _get(d: Any, *path: Any) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if unit == "ms":
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"
    if unit == "MB":
        return f"{v:.1f}"
    return f"{v:,.0f}"


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return "-"
    return f"{a / b:.2f}x"


def _first_run(section: Any) -> dict[str, Any]:
    runs = _get(section, "runs") or [{}]
    return runs[0] or {}


def rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per figure: measure, unit, one column per broker (:data:`BROKERS`), pgskip's
    ratio to each of :data:`RATIO_PEERS` (rates only), target, met."""
    r = data.get("results", {})
    out: list[list[str]] = []

    def row(label: str, unit: str, vals: dict[str, Any], target: str = "", met: str = "") -> None:
        p = vals.get("pgskip")
        rated = unit not in ("ms", "MB", "msgs")
        out.append(
            [
                label,
                unit,
                *(_fmt(vals.get(b), unit) for b in BROKERS),
                *(_ratio(p, vals.get(b)) if rated else "-" for b in RATIO_PEERS),
                target,
                met,
            ]
        )

    def single(label: str, unit: str, value: str, target: str, met: str = "") -> None:
        """A pgskip-only row whose value is text."""
        empty = len(BROKERS) - 1 + len(RATIO_PEERS)
        out.append([label, unit, value, *(["-"] * empty), target, met])

    def yes(ok: bool | None) -> str:
        return "-" if ok is None else ("yes" if ok else "no")

    for key, label in (("threads4", "-P threads -c 4"), ("prefork2", "-P prefork -c 2")):
        vals = {b: _get(r, "worker_side", key, b, "median", "rate") for b in BROKERS}
        p, rb = vals.get("pgskip"), vals.get("rabbitmq")
        row(
            f"1. Celery worker side, {label}",
            "tasks/s",
            vals,
            ">= 1.0x RabbitMQ",
            yes(None if p is None or rb is None else p >= rb),
        )
    for key, label in (
        ("threads4_acks_late", "acks_late, prefetch multiplier 1"),
        ("threads4_defaults", "Celery's defaults (remote control on)"),
    ):
        vals = {b: _get(r, "worker_side", key, b, "median", "rate") for b in BROKERS}
        if any(v is not None for v in vals.values()):
            row(f"1. Celery worker side, -P threads -c 4, {label}", "tasks/s", vals)
    vals = {b: _get(r, "end_to_end", b, "median", "rate") for b in BROKERS}
    p, rc, rf = vals.get("pgskip"), vals.get("rabbitmq-confirm"), vals.get("redis-fsync")
    row(
        "1. Celery end to end, durable publish",
        "tasks/s",
        vals,
        ">= 1.5x RabbitMQ confirms and >= 1.5x Redis fsync",
        yes(None if p is None or rc is None or rf is None else p >= 1.5 * rc and p >= 1.5 * rf),
    )
    a = _get(r, "end_to_end", "pgskip-async", "median", "rate")
    row(
        "1. Celery end to end, pgskip async-commit publisher (opt-in)",
        "tasks/s",
        {"pgskip": a, "rabbitmq": vals.get("rabbitmq"), "redis": vals.get("redis")},
    )
    pub = {b: _get(r, "end_to_end", b, "median", "publish_rate") for b in BROKERS}
    row("1. apply_async calls/s during end to end", "calls/s", pub)
    routed = _get(r, "end_to_end_exchange", "pgskip", "median", "rate")
    if routed is not None:
        row(
            "1. Celery end to end, durable publish through the queue's exchange (publish_routed)",
            "tasks/s",
            {"pgskip": routed, "rabbitmq": vals.get("rabbitmq"), "redis": vals.get("redis")},
        )
    vals = {b: _get(r, "end_to_end_defaults", b, "median", "rate") for b in BROKERS}
    if any(v is not None for v in vals.values()):
        row(
            "1. Celery end to end, durable, worker with Celery's defaults (remote control on)",
            "tasks/s",
            vals,
        )
    for q, limit in (("p50_ms", 4.0), ("p99_ms", 15.0)):
        lat = {b: _get(r, "latency", b, "median", q) for b in BROKERS}
        p, rc = lat.get("pgskip"), lat.get("rabbitmq-confirm")
        target, ok = f"<= {limit:g} ms", None if p is None else p <= limit
        if q == "p50_ms":
            # The median is also held to RabbitMQ's with publisher confirms, like for like.
            target += " and <= 1.3x RabbitMQ confirms"
            ok = None if ok is None or rc is None else ok and p <= 1.3 * rc
        row(f"2. latency apply_async -> start, {q[:3]}", "ms", lat, target, yes(ok))
        a = _get(r, "latency", "pgskip-async", "median", q)
        if a is not None:
            row(
                f"2. latency apply_async -> start, {q[:3]}, pgskip async-commit publisher (opt-in)",
                "ms",
                {"pgskip": a, "rabbitmq": lat.get("rabbitmq"), "redis": lat.get("redis")},
            )
        spin = {b: _get(r, "latency", f"spin:{b}", "median", q) for b in BROKERS}
        if any(v is not None for v in spin.values()):
            p3 = spin.get("pgskip")
            row(
                f"2. latency apply_async -> start, {q[:3]}, publisher busy-waits",
                "ms",
                spin,
                f"<= {limit:g} ms",
                yes(None if p3 is None else p3 <= limit),
            )
        p2 = _get(r, "latency", "pgskip-apply_async_in", "median", q)
        row(
            f"2. latency apply_async_in commit -> start, {q[:3]}",
            "ms",
            {"pgskip": p2},
            f"<= {limit:g} ms",
            yes(None if p2 is None else p2 <= limit),
        )
    cons = {b: _get(r, "raw_kombu", b, "median", "consume_rate") for b in BROKERS}
    ceiling = _get(r, "raw_sql", "dequeue100_batch_ack_1c", "rate")
    p, rb = cons.get("pgskip"), cons.get("rabbitmq")
    met = None
    if p is not None and rb is not None and ceiling:
        met = p >= rb and p >= 0.5 * ceiling
    row(
        "3. raw kombu consume + ack, prefetch 100",
        "msg/s",
        cons,
        f">= RabbitMQ and >= 0.5x SQL ceiling ({_fmt(ceiling)})",
        yes(met),
    )
    pubs = {b: _get(r, "raw_kombu", b, "median", "publish_rate") for b in BROKERS}
    # Beside it the INSERT ceilings of both clients (the transport publishes through libpq);
    # the goal for one publish is its ratio to the floor, the row after.
    ins_psycopg = _get(r, "raw_sql", "insert_1c", "rate")
    ins_libpq = _get(r, "raw_sql", "insert_1c_libpq", "rate")
    row(
        "4. raw kombu publish, one durable commit each",
        "msg/s",
        pubs,
        f"(INSERT ceiling: {_fmt(ins_libpq)} libpq, {_fmt(ins_psycopg)} psycopg)",
    )
    pb = _get(r, "publish_breakdown", "median") or {}
    over = pb.get("apply_async_over_floor")
    if over is not None:
        single(
            "4. one durable apply_async / a bare INSERT of the same payload, autocommit",
            "x",
            f"{over:.2f}x ({pb.get('floor_apply_async_us')} / "
            f"{pb.get('floor_insert_autocommit_us')} us)",
            "<= 1.2x",
            yes(over <= 1.2),
        )
    row(
        "4. raw kombu publish, pgskip async-commit (opt-in)",
        "msg/s",
        {"pgskip": _get(r, "raw_kombu", "pgskip-async", "median", "publish_rate")},
    )
    bulk = _get(r, "raw_kombu", "bulk_publish", "median", "publish_many_rate")
    row(
        "4. bulk publish: publish_many, 1,000 per durable commit",
        "msg/s",
        {"pgskip": bulk},
        ">= 20,000",
        yes(None if bulk is None else bulk >= 20_000),
    )
    row(
        "4. bulk publish: Celery apply_many, 1,000 tasks per durable commit",
        "tasks/s",
        {"pgskip": _get(r, "raw_kombu", "bulk_publish", "median", "apply_many_rate")},
    )
    procs = _get(r, "scaling", "procs") or []
    for k in procs:
        vals = {b: _get(r, "scaling", b, str(k), "median", "rate") for b in BROKERS}
        row(f"5. scaling: {k} worker process(es), threads -c 4", "tasks/s", vals)
    mem = {b: _get(_first_run(_get(r, "memory", b)), "growth_mb") for b in BROKERS}
    n = {b: _get(_first_run(_get(r, "memory", b)), "tasks") for b in BROKERS}
    row(
        "6. worker RSS growth, countdown=3600 tasks ("
        + ", ".join(f"{NAMES[b]} {v:,}" for b, v in n.items() if v)
        + ")",
        "MB",
        mem,
        "flat",
    )
    held = {b: _get(_first_run(_get(r, "memory", b)), "waiting_in_broker") for b in BROKERS}
    if any(v is not None for v in held.values()):
        row("6. of those, still waiting in the broker at the end", "msgs", held)
    for key, how in (
        ("steady_state", ""),
        ("steady_state_naptime10s", ", autovacuum_naptime 10s"),
        ("steady_state_keep_completed_off", ", keep_completed=False (acks delete)"),
        (
            "steady_state_keep_completed_off_naptime10s",
            ", keep_completed=False, autovacuum_naptime 10s",
        ),
    ):
        st = _first_run(_get(r, key))
        if not st.get("messages"):
            continue
        single(
            f"7. steady state{how}: max table+indexes",
            "MB",
            _fmt(st.get("max_total_mb"), "MB"),
            f"{st['messages']:,} messages, {st.get('pruning', '')}",
        )
        ps, pe = (
            _get(st, "probe_start", "fetch100_ms_p50"),
            _get(st, "probe_end", "fetch100_ms_p50"),
        )
        single(
            f"7. steady state{how}: fetch of 100, p50 at start -> end",
            "ms",
            f"{_fmt(ps, 'ms')} -> {_fmt(pe, 'ms')}",
            "equal",
        )
    return out


HEADER = [
    "measure",
    "unit",
    *(NAMES[b] for b in BROKERS),
    *(f"pgskip/{NAMES[b]}" for b in RATIO_PEERS),
    "target",
    "met",
]

#: The figures :func:`ratios` divides: (key, unit, path under ``results`` to the per-broker
#: measurements, prefix of the broker's key there, figure in each ``median``).
RATIO_MEASURES: tuple[tuple[str, str, tuple[str, ...], str, str], ...] = (
    ("end_to_end.rate", "tasks/s", ("end_to_end",), "", "rate"),
    ("end_to_end.publish_rate", "calls/s", ("end_to_end",), "", "publish_rate"),
    ("latency.p50_ms", "ms", ("latency",), "", "p50_ms"),
    ("latency.p99_ms", "ms", ("latency",), "", "p99_ms"),
    ("latency.spin.p50_ms", "ms", ("latency",), "spin:", "p50_ms"),
    ("latency.spin.p99_ms", "ms", ("latency",), "spin:", "p99_ms"),
    ("worker_side.threads4.rate", "tasks/s", ("worker_side", "threads4"), "", "rate"),
    ("worker_side.prefork2.rate", "tasks/s", ("worker_side", "prefork2"), "", "rate"),
    (
        "worker_side.threads4_acks_late.rate",
        "tasks/s",
        ("worker_side", "threads4_acks_late"),
        "",
        "rate",
    ),
    ("raw_kombu.publish_rate", "msg/s", ("raw_kombu",), "", "publish_rate"),
    ("raw_kombu.consume_rate", "msg/s", ("raw_kombu",), "", "consume_rate"),
)
#: (numerator, denominator) of each ratio: pgskip's durable publish against the durable peers
#: and against the peers that return before the disk, and the async-commit publisher against
#: the latter.
RATIO_PAIRS = (
    ("pgskip", "rabbitmq-confirm"),
    ("pgskip", "redis-fsync"),
    ("pgskip", "rabbitmq"),
    ("pgskip", "redis"),
    ("pgskip-async", "rabbitmq"),
    ("pgskip-async", "redis"),
)


def ratios(data: dict[str, Any]) -> dict[str, Any]:
    """pgskip's figures over each peer's (:data:`RATIO_PAIRS`), per measure of
    :data:`RATIO_MEASURES` that both sides have, keyed ``"pgskip/redis-fsync"`` and so on;
    ``higher_is_better`` tells how to read them (false for latencies). ``publish_floor``: one
    durable pgskip ``apply_async`` over a bare INSERT and its commit of the same payload."""
    r = data.get("results", {})
    out: dict[str, Any] = {}
    for key, unit, path, prefix, figure in RATIO_MEASURES:
        section = _get(r, *path)
        if not isinstance(section, dict):
            continue
        entry: dict[str, Any] = {}
        for a, b in RATIO_PAIRS:
            va = _get(section, prefix + a, "median", figure)
            vb = _get(section, prefix + b, "median", figure)
            if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and vb:
                entry[f"{a}/{b}"] = round(va / vb, 3)
        if entry:
            out[key] = {"unit": unit, "higher_is_better": unit != "ms", **entry}
    pb = _get(r, "publish_breakdown", "median") or {}
    if pb.get("apply_async_over_floor") is not None:
        out["publish_floor"] = {
            "apply_async_us": pb.get("floor_apply_async_us"),
            "insert_autocommit_us": pb.get("floor_insert_autocommit_us"),
            "insert_then_commit_us": pb.get("floor_insert_then_commit_us"),
            "apply_async/floor": pb.get("apply_async_over_floor"),
        }
    return out


def ratio_rows(data: dict[str, Any]) -> list[list[str]]:
    """:func:`ratios` as table rows: measure, unit, one column per pair of :data:`RATIO_PAIRS`."""
    body = []
    for key, entry in ratios(data).items():
        if key == "publish_floor":
            continue
        body.append(
            [
                key,
                entry["unit"],
                *(
                    f"{v:.2f}x" if isinstance(v := entry.get(f"{a}/{b}"), float) else "-"
                    for a, b in RATIO_PAIRS
                ),
            ]
        )
    return body


def ceilings_rows(data: dict[str, Any]) -> list[list[str]]:
    r = _get(data, "results", "raw_sql") or {}
    labels = {
        "insert_1c": "single-row INSERT, durable commit, 1 connection",
        "insert_1c_libpq": "single-row INSERT, durable commit, 1 connection, libpq directly",
        "insert_1c_async_commit": "single-row INSERT, synchronous_commit=off, 1 connection",
        "insert_4c": "single-row INSERT, durable commit, 4 connections",
        "dequeue100_batch_ack_1c": "SKIP LOCKED dequeue of 100 + one ack statement, 1 client",
        "dequeue100_batch_ack_4c": "SKIP LOCKED dequeue of 100 + one ack statement, 4 clients",
        "dequeue100_row_ack_1c": "SKIP LOCKED dequeue of 100 + one ack per row, 1 client",
        "dequeue100_row_ack_4c": "SKIP LOCKED dequeue of 100 + one ack per row, 4 clients",
        "dequeue100_row_ack_1c_async_commit": (
            "dequeue 100 + ack per row, synchronous_commit=off, 1 client"
        ),
        "pgskip_publish_statement_1c": (
            "pgskip's publish statement (INSERT + NOTIFY, Store.publish), 1 connection"
        ),
        "pgskip_publish_statement_4c": (
            "pgskip's publish statement (INSERT + NOTIFY, Store.publish), 4 connections"
        ),
        "pgskip_store_fetch100_batch_ack_1c": (
            "pgskip's fetch + ack statements, batch of 100, 1 client"
        ),
        "pgskip_store_fetch100_batch_ack_4c": (
            "pgskip's fetch + ack statements, batch of 100, 4 clients"
        ),
    }
    return [
        [labels.get(k, k), _fmt(v.get("rate"))]
        for k, v in r.items()
        if isinstance(v, dict) and "rate" in v
    ]


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
    return "\n".join(lines)


def table(data: dict[str, Any]) -> str:
    meta = data.get("meta", {})
    parts = [
        f"\nkombu-pgskip benchmark, mode {meta.get('mode')}, {meta.get('started')}, "
        f"{meta.get('duration_s')} s; "
        f"medians of {1 if meta.get('mode') == 'short' else 3} run(s)\n",
        _md(HEADER, rows(data)),
        "\nPostgreSQL ceilings (rows/s, same cluster, fsync on):\n",
        _md(["SQL", "rows/s"], ceilings_rows(data)),
    ]
    body = ratio_rows(data)
    if body:
        parts.append(
            "\npgskip's figure over each peer's (RabbitMQ confirms and Redis fsync have a "
            "publish on disk when it returns, as pgskip; RabbitMQ and Redis do not). For rates "
            "above 1.00x is pgskip ahead, for ms below 1.00x is:\n"
        )
        parts.append(_md(["measure", "unit", *(f"{a}/{b}" for a, b in RATIO_PAIRS)], body))
    pb = _get(data, "results", "publish_breakdown", "median")
    if pb:
        parts.append(
            "\nOne durable pgskip apply_async, microseconds: "
            f"total {pb.get('sync_total_us')}, in SQL {pb.get('sync_sql_us')} "
            f"(with synchronous_commit=off {pb.get('async_sql_us')}), "
            f"to_row {pb.get('sync_to_row_us')}, "
            f"the same apply_async to memory:// {pb.get('celery_kombu_memory_us')}; "
            f"the publish statement alone {pb.get('statement_sync_us')} "
            f"(async commit {pb.get('statement_async_us')})"
        )
        if pb.get("apply_async_over_floor") is not None:
            parts.append(
                "Floor of one durable publish (interleaved with the same apply_async, "
                f"{_fmt(pb.get('floor_calls'))} calls each, "
                f"{_fmt(pb.get('floor_payload_bytes'))}-byte payload), microseconds: "
                f"apply_async {pb.get('floor_apply_async_us')}, bare psycopg INSERT in "
                f"autocommit {pb.get('floor_insert_autocommit_us')}, INSERT then COMMIT "
                f"{pb.get('floor_insert_then_commit_us')}; apply_async / floor = "
                f"{pb['apply_async_over_floor']:.2f}x"
            )
    for e in data.get("errors", []):
        parts.append(f"ERROR in {e.get('what')}: {e.get('error')}")
    return "\n".join(parts) + "\n"


# -- charts -----------------------------------------------------------------------------------


def charts(data: dict[str, Any], out_dir: Path, dpi: int = 90) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = data.get("results", {})
    mode = _get(data, "meta", "mode")
    made: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        made.append(path)

    def bars(ax: Any, groups: list[tuple[str, dict[str, Any]]], keys: list[str]) -> None:
        width = 0.8 / max(1, len(keys))
        for j, key in enumerate(keys):
            xs, ys = [], []
            for i, (_, vals) in enumerate(groups):
                v = vals.get(key)
                if isinstance(v, (int, float)):
                    xs.append(i + j * width)
                    ys.append(v)
            b = ax.bar(xs, ys, width, label=NAMES.get(key, key), color=COLORS.get(key))
            ax.bar_label(b, fmt="%.0f", fontsize=7)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels([g for g, _ in groups], fontsize=8)

    # 1. Celery throughput
    if r.get("worker_side") or r.get("end_to_end"):
        keys = list(CHART_BROKERS)
        groups = [
            (
                "worker side\nthreads -c 4",
                {b: _get(r, "worker_side", "threads4", b, "median", "rate") for b in keys},
            ),
            (
                "worker side\nprefork -c 2",
                {b: _get(r, "worker_side", "prefork2", b, "median", "rate") for b in keys},
            ),
            (
                "end to end\n(one publisher)",
                {b: _get(r, "end_to_end", b, "median", "rate") for b in keys},
            ),
        ]
        fig, ax = plt.subplots(figsize=(8, 4))
        bars(ax, groups, keys)
        ax.set_ylabel("tasks/s")
        ax.set_title(f"Celery 5.7, no-op task ({mode} mode)")
        ax.legend(fontsize=7)
        save(fig, "celery_throughput.png")

    # 2. Latency
    if r.get("latency"):
        keys = [
            k
            for k in (
                "pgskip",
                "pgskip-apply_async_in",
                "pgskip-async",
                "rabbitmq",
                "rabbitmq-confirm",
                "redis",
                "redis-fsync",
                "spin:pgskip",
                "spin:rabbitmq",
                "spin:rabbitmq-confirm",
                "spin:redis",
                "spin:redis-fsync",
                "sqlalchemy",
            )
            if k in r["latency"]
        ]
        fig, ax = plt.subplots(figsize=(max(8.0, 0.8 * len(keys)), 4))
        for q, off, hatch in (("p50_ms", -0.2, ""), ("p99_ms", 0.2, "//")):
            ys = [_get(r, "latency", k, "median", q) or 0 for k in keys]
            b = ax.bar(
                [i + off for i in range(len(keys))],
                ys,
                0.4,
                hatch=hatch,
                color=[COLORS.get(k.removeprefix("spin:")) for k in keys],
                label=q[:3],
                edgecolor="white",
            )
            ax.bar_label(b, fmt="%.1f", fontsize=7)
        ax.set_yscale("log")
        ax.axhline(4, color="green", ls="--", lw=0.8)
        ax.axhline(15, color="green", ls=":", lw=0.8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(
            [
                NAMES.get(k, NAMES.get(k.removeprefix("spin:"), k) + "\n(busy-wait)").replace(
                    " (", "\n("
                )
                for k in keys
            ],
            fontsize=6,
        )
        ax.set_ylabel("ms (log), publish to task start")
        ax.set_title("Latency on an idle worker: p50 (plain), p99 (hatched); targets 4 / 15 ms")
        save(fig, "latency.png")

    # 3/4. Raw kombu against the SQL ceilings
    if r.get("raw_kombu"):
        keys = list(CHART_BROKERS)
        groups = [
            (
                "publish (durable)",
                {b: _get(r, "raw_kombu", b, "median", "publish_rate") for b in keys},
            ),
            (
                "consume + ack\nprefetch 100",
                {b: _get(r, "raw_kombu", b, "median", "consume_rate") for b in keys},
            ),
        ]
        fig, ax = plt.subplots(figsize=(10, 4))
        bars(ax, groups, keys)
        for name, style, label in (
            ("insert_1c", "--", "SQL: durable single-row INSERT"),
            ("dequeue100_batch_ack_1c", "-.", "SQL: dequeue 100 + batched ack, 1 client"),
            ("dequeue100_row_ack_1c", ":", "SQL: dequeue 100 + ack per row, 1 client"),
        ):
            v = _get(r, "raw_sql", name, "rate")
            if v:
                ax.axhline(v, ls=style, color="black", lw=0.8, label=f"{label} ({v:,.0f})")
        ax.set_yscale("log")
        ax.set_ylabel("messages/s (log)")
        ax.set_title("kombu without Celery, against PostgreSQL's own ceilings")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        save(fig, "raw_kombu.png")

    # 5. Scaling
    if r.get("scaling") and r["scaling"].get("procs"):
        procs = r["scaling"]["procs"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for b in BROKERS:
            if b in r["scaling"]:
                ys = [_get(r, "scaling", b, str(k), "median", "rate") for k in procs]
                ax.plot(
                    procs,
                    [y if y is not None else float("nan") for y in ys],
                    "o-",
                    label=NAMES[b],
                    color=COLORS[b],
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(procs)
        ax.set_xticklabels([str(k) for k in procs])
        ax.set_xlabel("worker processes (each -P threads -c 4), 2 cores")
        ax.set_ylabel("tasks/s (worker side)")
        ax.set_title("Scaling")
        ax.legend(fontsize=7)
        save(fig, "scaling.png")

    # 6. Memory
    if r.get("memory"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for b in BROKERS:
            run = _first_run(_get(r, "memory", b))
            series = run.get("series") or []
            if series:
                ax.plot(
                    [t for t, _ in series],
                    [m for _, m in series],
                    label=f"{NAMES[b]} ({run.get('tasks'):,} tasks)",
                    color=COLORS[b],
                )
        ax.set_xlabel("seconds since the first countdown=3600 publish")
        ax.set_ylabel("worker RSS, MB (process tree)")
        ax.set_title("Worker memory while one-hour-countdown tasks arrive")
        ax.legend(fontsize=7)
        save(fig, "memory.png")

    # 7. Steady state
    st = _first_run(_get(r, "steady_state"))
    if st.get("samples"):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        xs = [s["processed"] for s in st["samples"]]
        for key, label in (
            ("total_mb", "table + indexes + TOAST"),
            ("table_mb", "table"),
            ("indexes_mb", "indexes"),
        ):
            a1.plot(xs, [s[key] for s in st["samples"]], label=label)
        a1.set_xlabel("messages through the queue")
        a1.set_ylabel("MB")
        a1.set_title(
            f"jobs table size, pruned every 2 s (retention "
            f"{_get(data, 'meta', 'steady_retention_s') or '?'} s)",
            fontsize=8,
        )
        a1.legend(fontsize=7)
        curve = st.get("fetch_curve") or []
        a2.plot([c[0] for c in curve], [c[1] for c in curve], ".-")
        a2.set_xlabel("messages through the queue")
        a2.set_ylabel("fetch of 100, p50 ms (2 consumers)")
        a2.set_ylim(bottom=0)
        a2.set_title("fetch latency along the way", fontsize=8)
        save(fig, "steady_state.png")
    return made


def _deep_update(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Replace measurements (dicts with ``runs``) one by one; keep the ones ``new`` lacks."""
    for key, value in new.items():
        old = into.get(key)
        if isinstance(old, dict) and isinstance(value, dict) and "runs" not in value:
            _deep_update(old, value)
        else:
            into[key] = value


def merge(paths: list[Path]) -> dict[str, Any]:
    """Several runs' JSON as one: a later file's measurements replace an earlier one's, one
    measurement (broker, pool, ...) at a time."""
    data: dict[str, Any] = {"meta": {}, "results": {}, "errors": []}
    for path in paths:
        part = json.loads(path.read_text())
        if not data["meta"]:
            data["meta"] = dict(part.get("meta", {}))
        _deep_update(data["results"], part.get("results", {}))
        data["errors"] += part.get("errors", [])
        data["meta"].setdefault("merged_from", []).append(
            {
                "file": path.name,
                "measurements": sorted(part.get("results", {})),
                "started": _get(part, "meta", "started"),
                "code": _get(part, "meta", "code"),
            }
        )
    return data


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.report RUN.json [LATER.json ...] [--charts DIR] [--dpi N]``.

    Prints the table of one run, or of several merged (a later run's measurements replace an
    earlier one's), and redraws the charts into DIR.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.report")
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--charts", type=Path, default=None)
    parser.add_argument("--dpi", type=int, default=90)
    args = parser.parse_args(argv)
    data = merge(args.json) if len(args.json) > 1 else json.loads(args.json[0].read_text())
    print(table(data))
    if args.charts is not None:
        args.charts.mkdir(parents=True, exist_ok=True)
        for path in charts(data, args.charts, dpi=args.dpi):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
