"""Run the benchmark suite: ``python -m bench.run [--short|--full] [--only NAME,...] [--out DIR]``.

Measurements (``--only`` takes these names, comma-separated):

  raw_sql            PostgreSQL ceilings: durable INSERT, SKIP LOCKED dequeue of 100 (batched
                     vs per-row acks, 1 and 4 clients), pgskip's own fetch/ack statements
  raw_kombu          kombu publish (durable) and consume+ack with prefetch 100, per broker
  publish_breakdown  where one durable pgskip apply_async spends its time, and its ratio to
                     a bare psycopg INSERT + commit of the same payload (the floor)
  worker_side        Celery: backlog first, then the worker starts (-P threads -c 4 and
                     -P prefork -c 2; and -P threads -c 4 with task_acks_late and
                     worker_prefetch_multiplier 1, and with Celery's defaults: remote
                     control, gossip, mingle and heartbeats on)
  end_to_end         Celery: one publisher, idle worker, publish to task start
  end_to_end_defaults  the same with the worker as it runs out of the box (remote control,
                     gossip, mingle and heartbeats on; the other measurements turn them off)
  end_to_end_exchange  end to end for pgskip with each apply_async naming the queue's
                     exchange and routing key (routed through the bindings by
                     publish_routed; the others publish to the default exchange, which
                     pgskip does not route)
  latency            Celery: apply_async (and apply_async_in) to task start, idle worker
  scaling            Celery worker side with 1, 2, 4, 8 worker processes
  memory             worker RSS while tasks with a one-hour countdown arrive
  steady_state       messages through pgskip with pruning: table size and fetch latency

Brokers: pgskip, pgskip-async (publisher with synchronous_commit=off), rabbitmq (no
publisher confirms), rabbitmq-confirm (publisher confirms, persistent messages), redis (as
configured on 6379), redis-fsync (a redis-server of the run's own with appendonly yes and
appendfsync always), sqlalchemy. ``--brokers`` restricts them. raw_kombu, worker_side,
end_to_end and latency measure the durable peers (rabbitmq-confirm, redis-fsync) beside the
others. Figures are printed as a table and written to ``DIR/results-<mode>-<time>.json`` (and
``DIR/latest-<mode>.json``, with pgskip's ratios to each peer under ``ratios``) with PNG charts
beside. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import report
from .brokers import BenchEnv, Broker
from .common import REPO, Mode, code_state, log, machine_info, median, wait_quiet

ALL = (
    "raw_sql",
    "raw_kombu",
    "publish_breakdown",
    "worker_side",
    "end_to_end",
    "end_to_end_defaults",
    "end_to_end_exchange",
    "latency",
    "scaling",
    "memory",
    "steady_state",
)
CELERY_BROKERS = ("pgskip", "rabbitmq", "redis", "sqlalchemy")
#: The peers configured to have a publish on disk when it returns, as pgskip's durable publish.
DURABLE_PEERS = ("rabbitmq-confirm", "redis-fsync")
#: Brokers of the worker side: each with a worker of its own (the scaling curve and memory
#: keep to CELERY_BROKERS).
WORKER_SIDE_BROKERS = (
    "pgskip",
    "rabbitmq",
    "rabbitmq-confirm",
    "redis",
    "redis-fsync",
    "sqlalchemy",
)
#: Brokers of raw kombu and end to end: pgskip's two publishers, and every peer.
PUBLISH_BROKERS = ("pgskip", "pgskip-async", *WORKER_SIDE_BROKERS[1:])
# Staying small: (result key, autovacuum_naptime, keep_completed).
STEADY_STATES = (
    ("steady_state", None, True),
    ("steady_state_naptime10s", "10s", True),
    ("steady_state_keep_completed_off", None, False),
    ("steady_state_keep_completed_off_naptime10s", "10s", False),
)


def _numeric_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys: dict[str, None] = {}
    for r in runs:
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                keys[k] = None
    return {k: median(r.get(k) for r in runs if isinstance(r.get(k), (int, float))) for k in keys}


class Runner:
    def __init__(self, mode: Mode, env: BenchEnv, only: set[str], brokers: set[str] | None) -> None:
        self.mode = mode
        self.env = env
        self.only = only
        self.want_brokers = brokers
        self.results: dict[str, Any] = {}
        self.errors: list[dict[str, str]] = []
        self.waited = 0.0

    def broker(self, name: str) -> Broker | None:
        if self.want_brokers is not None and name not in self.want_brokers:
            return None
        b = self.env.brokers.get(name)
        return b if b is not None and b.available else None

    def quiet(self) -> dict[str, float]:
        """Wait for a quiet machine; the short mode spends at most ``quiet_budget`` s in all."""
        budget = self.mode.quiet_budget
        max_wait = self.mode.load_wait
        if budget is not None:
            max_wait = max(0.0, min(max_wait, budget - self.waited))
        seen = wait_quiet(max_wait, self.mode.load_sample)
        self.waited += seen["waited_s"]
        return seen

    def repeat(
        self, what: str, fn: Callable[[], dict[str, Any]], runs: int | None = None
    ) -> dict[str, Any]:
        """Run ``fn`` ``runs`` times (after waiting for a quiet machine); keep runs and medians."""
        out: dict[str, Any] = {"runs": []}
        for _ in range(runs or self.mode.runs):
            load = self.quiet()
            t0 = time.monotonic()
            try:
                res = fn()
            except Exception as exc:
                log(f"{what}: ERROR {exc!r}")
                self.errors.append(
                    {"what": what, "error": repr(exc), "trace": traceback.format_exc()}
                )
                res = {"error": repr(exc)}
            res["load"] = load
            res["wall_s"] = round(time.monotonic() - t0, 1)
            out["runs"].append(res)
        out["median"] = _numeric_medians(out["runs"])
        return out

    # -- the measurements ------------------------------------------------------------------

    def raw_sql(self) -> None:
        from .raw import sample_payload, sql_ceilings

        pg = self.broker("pgskip") or self.env.brokers.get("pgskip")
        raw_url = self.env.raw_db_url()
        if pg is None or not pg.available or raw_url is None:
            self.results["raw_sql"] = {"unavailable": "PostgreSQL did not start"}
            return
        payload = sample_payload(pg)
        runs = []
        for r in range(self.mode.runs):
            log(f"raw SQL ceilings, run {r + 1}/{self.mode.runs}")
            runs.append(
                sql_ceilings(
                    raw_url,
                    payload,
                    seconds=self.mode.sql_seconds,
                    prefill=self.mode.sql_prefill,
                    quiet=self.quiet,
                    short=self.mode.name == "short",
                )
            )
        names = [k for k, v in runs[0].items() if isinstance(v, dict)]
        self.results["raw_sql"] = {
            name: {
                "rate": median(run[name]["rate"] for run in runs if name in run),
                "clients": runs[0][name]["clients"],
                "runs": [run.get(name) for run in runs],
            }
            for name in names
        }
        self.results["raw_sql"]["payload_bytes"] = runs[0]["payload_bytes"]
        self.results["raw_sql"]["seconds_each"] = self.mode.sql_seconds

    def raw_kombu(self) -> None:
        from .raw import kombu_publish_consume

        out: dict[str, Any] = {}
        for name in PUBLISH_BROKERS:
            b = self.broker(name)
            if b is None:
                continue
            log(f"raw kombu publish/consume: {name}")
            cap = self.mode.raw_consume_cap
            out[name] = self.repeat(
                f"raw_kombu {name}",
                lambda b=b, cap=cap: kombu_publish_consume(
                    b,
                    seconds=self.mode.raw_seconds,
                    consume_cap=cap,
                    consume=b.name != "pgskip-async",
                ),
            )
        pg = self.broker("pgskip")
        if pg is not None:
            from .raw import bulk_publish

            log("bulk publish (publish_many, apply_many): pgskip")
            out["bulk_publish"] = self.repeat(
                "bulk_publish", lambda: bulk_publish(pg, seconds=self.mode.raw_seconds)
            )
        self.results["raw_kombu"] = out

    def publish_breakdown(self) -> None:
        from .celery_bench import publish_breakdown

        # pgskip's own breakdown: it compares the durable publish with the async-commit one
        # of the same server, whether or not --brokers names pgskip-async.
        pg, pga = self.broker("pgskip"), self.env.brokers.get("pgskip-async")
        if pg is None or pga is None or not pga.available:
            return
        log("publish breakdown (pgskip apply_async)")
        n = 500 if self.mode.name == "short" else 3000
        self.results["publish_breakdown"] = self.repeat(
            "publish_breakdown",
            lambda: publish_breakdown(pg, pga, self.env.raw_db_url() or "", n=n),
        )

    def worker_side(self) -> None:
        from .celery_bench import worker_side

        out: dict[str, Any] = {}
        # The last: the worker as it runs out of the box (remote control, gossip, mingle and
        # heartbeats on), which the others turn off for every broker.
        for pool, conc, acks_late, defaults in (
            ("threads", 4, False, False),
            ("prefork", 2, False, False),
            ("threads", 4, True, False),
            ("threads", 4, False, True),
        ):
            key = f"{pool}{conc}" + ("_acks_late" if acks_late else "")
            key += "_defaults" if defaults else ""
            out[key] = {}
            for name in WORKER_SIDE_BROKERS:
                b = self.broker(name)
                # With Celery's defaults: pgskip, RabbitMQ and Redis as they are.
                if b is None or (defaults and (b.slow or name in DURABLE_PEERS)):
                    continue
                n = self.mode.backlog_slow if b.slow else self.mode.backlog
                late = ", acks_late, prefetch multiplier 1" if acks_late else ""
                late += ", Celery's defaults" if defaults else ""
                log(f"worker side -P {pool} -c {conc}{late}: {name} ({n} tasks)")
                run = functools.partial(
                    worker_side,
                    b,
                    pool=pool,
                    concurrency=conc,
                    n=n,
                    timeout=self.mode.worker_timeout,
                    acks_late=acks_late,
                    celery_defaults=defaults,
                )
                out[key][name] = self.repeat(f"worker_side {key} {name}", run)
        self.results["worker_side"] = out

    def end_to_end(self) -> None:
        from .celery_bench import end_to_end

        out: dict[str, Any] = {}
        for name in PUBLISH_BROKERS:
            b = self.broker(name)
            if b is None:
                continue
            n = self.mode.e2e_tasks_slow if b.slow else self.mode.e2e_tasks
            log(f"end to end: {name} ({n} tasks)")
            out[name] = self.repeat(
                f"end_to_end {name}",
                lambda b=b, n=n: end_to_end(b, n=n, timeout=self.mode.worker_timeout),
            )
        self.results["end_to_end"] = out

    def end_to_end_defaults(self) -> None:
        from .celery_bench import end_to_end

        out: dict[str, Any] = {}
        for name in ("pgskip", "rabbitmq", "redis"):
            b = self.broker(name)
            if b is None:
                continue
            n = self.mode.e2e_tasks
            log(f"end to end, Celery's default worker: {name} ({n} tasks)")
            out[name] = self.repeat(
                f"end_to_end_defaults {name}",
                lambda b=b, n=n: end_to_end(
                    b, n=n, timeout=self.mode.worker_timeout, celery_defaults=True
                ),
            )
        self.results["end_to_end_defaults"] = out

    def end_to_end_exchange(self) -> None:
        from .celery_bench import end_to_end

        b = self.broker("pgskip")
        if b is None:
            return
        n = self.mode.e2e_tasks
        log(f"end to end through the queue's exchange: pgskip ({n} tasks)")
        self.results["end_to_end_exchange"] = {
            "pgskip": self.repeat(
                "end_to_end_exchange pgskip",
                lambda: end_to_end(b, n=n, timeout=self.mode.worker_timeout, via_exchange=True),
            )
        }

    def latency(self) -> None:
        from .latency import latency

        out: dict[str, Any] = {}
        configs = [
            ("pgskip", "pgskip", False, False),
            ("pgskip-apply_async_in", "pgskip", True, False),
            ("pgskip-async", "pgskip-async", False, False),
            ("rabbitmq", "rabbitmq", False, False),
            ("rabbitmq-confirm", "rabbitmq-confirm", False, False),
            ("redis", "redis", False, False),
            ("redis-fsync", "redis-fsync", False, False),
            ("sqlalchemy", "sqlalchemy", False, False),
            # The publisher busy-waits between samples: no publisher wake-up in the figure.
            ("spin:pgskip", "pgskip", False, True),
            ("spin:rabbitmq", "rabbitmq", False, True),
            ("spin:rabbitmq-confirm", "rabbitmq-confirm", False, True),
            ("spin:redis", "redis", False, True),
            ("spin:redis-fsync", "redis-fsync", False, True),
        ]
        for key, name, in_txn, spin in configs:
            b = self.broker(name)
            if b is None:
                continue
            samples = self.mode.latency_samples // (4 if b.slow else 1)
            log(f"latency: {key} ({samples} samples)")
            res = self.repeat(
                f"latency {key}",
                lambda b=b, s=samples, t=in_txn, sp=spin: latency(
                    b, samples=s, gap=self.mode.latency_gap, in_transaction=t, spin=sp
                ),
            )
            out[key] = res
        self.results["latency"] = out

    def scaling(self) -> None:
        from .celery_bench import worker_side

        out: dict[str, Any] = {
            "pool": "threads",
            "concurrency": 4,
            "procs": list(self.mode.scaling_procs),
        }
        names = self.mode.scaling_brokers or CELERY_BROKERS
        for name in names:
            b = self.broker(name)
            if b is None:
                continue
            out[name] = {}
            for k in self.mode.scaling_procs:
                n = (self.mode.backlog_slow * 2) if b.slow else self.mode.scaling_backlog
                log(f"scaling: {name} with {k} worker processes ({n} tasks)")
                out[name][str(k)] = self.repeat(
                    f"scaling {name} {k}",
                    lambda b=b, k=k, n=n: worker_side(
                        b,
                        pool="threads",
                        concurrency=4,
                        n=n,
                        timeout=self.mode.worker_timeout,
                        processes=k,
                    ),
                    runs=1 if self.mode.name == "short" else None,
                )
        self.results["scaling"] = out

    def memory(self) -> None:
        from .memory import memory

        out: dict[str, Any] = {}
        for name in CELERY_BROKERS:
            b = self.broker(name)
            if b is None:
                continue
            n = self.mode.memory_tasks_slow if b.slow else self.mode.memory_tasks
            log(f"memory: {name} ({n} tasks, countdown 3600)")
            out[name] = self.repeat(
                f"memory {name}",
                lambda b=b, n=n: memory(b, n=n, settle=self.mode.memory_settle),
                runs=1,
            )
        self.results["memory"] = out

    def steady_state(self) -> None:
        from .raw import sample_payload
        from .steady_state import steady_state

        pg = self.broker("pgskip")
        if pg is None:
            return
        payload = sample_payload(pg)
        for key, naptime, kept in STEADY_STATES:
            how = "" if naptime is None else f" with autovacuum_naptime = {naptime}"
            how += "" if kept else " and keep_completed=False (acks delete)"
            log(f"steady state{how}: {self.mode.steady_messages} messages through pgskip")

            def one(naptime: str | None = naptime, kept: bool = kept) -> dict[str, Any]:
                return steady_state(
                    pg,
                    payload,
                    messages=self.mode.steady_messages,
                    retention=self.mode.steady_retention,
                    autovacuum_naptime=naptime,
                    keep_completed=kept,
                )

            self.results[key] = self.repeat(key, one, runs=1)

    def run(self) -> None:
        for name in ALL:
            if name in self.only:
                t0 = time.monotonic()
                try:
                    getattr(self, name)()
                except Exception as exc:
                    log(f"{name}: ERROR {exc!r}")
                    self.errors.append(
                        {"what": name, "error": repr(exc), "trace": traceback.format_exc()}
                    )
                log(f"{name} took {time.monotonic() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.splitlines()[0]
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--short", action="store_true", help="one run each, small sizes (< 3 min)")
    group.add_argument("--full", action="store_true", help="medians of 3 runs, full sizes")
    parser.add_argument("--only", default="", help="comma-separated measurement names")
    parser.add_argument(
        "--brokers",
        default="",
        help="comma-separated broker names (pgskip, pgskip-async, rabbitmq, rabbitmq-confirm, "
        "redis, redis-fsync, sqlalchemy)",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(
        "--load-wait", type=float, default=None, help="max seconds to wait for a quiet machine"
    )
    args = parser.parse_args(argv)

    mode = Mode("full" if args.full else "short")
    if args.load_wait is not None:
        mode.load_wait = args.load_wait
    only = {s.strip() for s in args.only.split(",") if s.strip()} or set(ALL)
    unknown = only - set(ALL)
    if unknown:
        parser.error(f"unknown measurement(s) {sorted(unknown)}; choose from {', '.join(ALL)}")
    brokers = {s.strip() for s in args.brokers.split(",") if s.strip()} or None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = time.time()
    log(f"mode {mode.name}; measurements: {', '.join(n for n in ALL if n in only)}")
    meta: dict[str, Any] = {
        "mode": mode.name,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": machine_info(),
        "code": code_state(),
        "steady_retention_s": mode.steady_retention,
        "sizes": {k: v for k, v in vars(mode).items() if k != "name"},
        "loadavg_at_start": [round(x, 2) for x in __import__("os").getloadavg()],
    }
    with BenchEnv(want=brokers) as env:
        meta["postgres"] = env.pg_settings
        meta["brokers"] = {
            n: {"label": b.label, "available": b.available, "reason": b.reason, "url": _safe(b.url)}
            for n, b in env.brokers.items()
        }
        runner = Runner(mode, env, only, brokers)
        try:
            runner.run()
        except KeyboardInterrupt:
            log("interrupted: writing what was measured")
    meta["duration_s"] = round(time.time() - started, 1)
    meta["loadavg_at_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    data: dict[str, Any] = {"meta": meta, "results": runner.results, "errors": runner.errors}
    data["ratios"] = report.ratios(data)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    path = out_dir / f"results-{mode.name}-{stamp}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    (out_dir / f"latest-{mode.name}.json").write_text(json.dumps(data, indent=1, default=str))
    print(report.table(data))
    try:
        charts = report.charts(data, out_dir)
        log(f"charts: {', '.join(str(c) for c in charts)}")
    except Exception as exc:
        log(f"charts not drawn: {exc!r}")
    log(f"figures written to {path} ({meta['duration_s']} s)")
    return 0


def _safe(url: str | None) -> str | None:
    if url is None:
        return None
    from kombu_pgskip.urls import mask_url

    return mask_url(url)


if __name__ == "__main__":
    sys.exit(main())
