"""Every figure the docs show, by name, formatted from bench/results: a page asks for
``{{ e2e.fire }}`` and ``python -m timer_bench render`` writes the figure into it
(:mod:`timer_bench.pages`).

Each results file also gives ``NAME.source`` (the sentence a page cites its figures with:
command, date, store, settings, machine) and ``NAME.label`` (the same, short). The names are
the results files' with ``_`` for ``-``: ``scale_out.fire_4``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from timer_bench import kit, render
from timer_bench.kit import count, ms, per_s, times

Figures = dict[str, str]


def _shared(machine: dict[str, Any]) -> str:
    load = machine.get("load_average_start")
    busy = f"load average {load[0]} at the start" if load else "shared with other work"
    return f"{machine['nproc']} cores ({machine['cpu']}), {busy}"


def _day(document: dict[str, Any]) -> str:
    return str(document["date"]).split(" ")[0]


#: When SQLite's default became ``synchronous=FULL`` (commit 100de62): a run on SQLite
#: before it, at the defaults of its day, ran at ``NORMAL``, a tuned setting now.
SQLITE_FULL_SINCE = "2026-11-26 23:51"
NORMAL_NOW_TUNED = "`synchronous=NORMAL`, tuned: the default is now `FULL`"


def sqlite_at_normal(document: dict[str, Any]) -> bool:
    """Whether a run on SQLite committed at ``NORMAL`` rather than today's default."""
    return str(document["date"]) < SQLITE_FULL_SINCE


def _at(document: dict[str, Any]) -> str:
    """``at``: the settings a run on SQLite had, in a phrase."""
    return f"at {NORMAL_NOW_TUNED}" if sqlite_at_normal(document) else "at the defaults"


def _sources(document: dict[str, Any], command: str, setup: str, short: str) -> Figures:
    """``source``: command, date, what ran with which settings, and the machine, in full;
    ``label``: what ran and where, short enough for a parenthesis."""
    machine = document["machine"]
    where = kit.describe_machine(machine, versions=("sqlite", "postgres", "nats_server"))
    return {
        "source": (
            f"Measured on {_day(document)} (`python -m timer_bench {command}`): {setup}. "
            f"Machine: {where}; a virtual machine shared with other work."
        ),
        "label": f"{short}; {_shared(machine)}, {_day(document)}",
        "date": _day(document),
        "machine": _shared(machine),
    }


def e2e(d: dict[str, Any]) -> Figures:
    r, service = d["results"], d["service"]
    fire = r["fire"][str(service["default_batch_size"])]
    steady, storm, catchup, scale = r["steady"], r["storm"], r["catchup"], r["scale"]
    raw_fire = r["yardsticks"]["raw_pipeline"][str(service["yardstick_batch"])]
    setup = (
        f"one `timer-service` process on SQLite (WAL, "
        f"{NORMAL_NOW_TUNED if sqlite_at_normal(d) else 'the default `synchronous=FULL`'}), "
        f"`TIMER_BATCH_SIZE={service['batch_size']}`, "
        f"`TIMER_COMMAND_BATCH_SIZE={service['command_batch_size']}`, a `nats-server` with "
        f"file storage on the same machine, {service['rounds']} alternated rounds"
    )
    return {
        **_sources(d, "e2e", setup, f"one service on SQLite {_at(d)}"),
        "at": _at(d),
        "schedule": per_s(r["schedule"]["per_s"]),
        "schedule_vs_raw": times(r["schedule"]["vs_raw"]),
        "raw_schedule": per_s(r["yardsticks"]["raw_schedule"]["per_s"]),
        "fire": per_s(fire["per_s"]),
        "fire_vs_raw": times(fire["vs_raw"]),
        "raw_fire": per_s(raw_fire["per_s"]),
        "fire_cpu": f"{fire['cpu_us_per_timer']:.0f} us",
        "steady_rate": per_s(steady["rate_per_s"]),
        "steady_p50": f"{render.late(steady['reached_lateness']['p50_ms'])} ms",
        "steady_p99": f"{render.late(steady['reached_lateness']['p99_ms'])} ms",
        "readable_p50": f"{ms(steady['readable_lateness']['p50_ms'])} ms",
        "readable_p99": f"{ms(steady['readable_lateness']['p99_ms'])} ms",
        "storm_timers": count(storm["timers"]),
        "storm_s": f"{storm['fire_all_s']:.1f} s",
        "catchup_overdue": count(catchup["overdue"]),
        "catchup_stored": count(catchup["stored"]),
        "catchup_s": f"{catchup['drain_s']:.1f} s",
        "catchup_rate": per_s(catchup["per_s"]),
        "catchup_rss": f"{catchup['peak_rss_mb']:.0f} MiB",
        "poll_small": f"{scale['small']['empty_poll_us'] / 1000:.2f} ms",
        "poll_big": f"{scale['big']['empty_poll_us'] / 1000:.2f} ms",
        "small_stored": count(scale["small"]["stored"]),
        "big_stored": count(scale["big"]["stored"]),
        "big_schedule": per_s(scale["big"]["per_s"]),
    }


def handlers_pythons(d: dict[str, Any]) -> Figures:
    settings, interpreters = d["settings"], d["interpreters"]
    this, other = interpreters["this"], interpreters["other"]
    setup = (
        f"`python -m timer_bench handlers` (`Timer(SqliteTimerStore(...), handler=noop)`, "
        f"{settings['jobs']:,} due timers) at its default settings on this machine's Python "
        f"{this['python']} (SQLite {this['sqlite']}) and on Debian's Python {other['python']} "
        f"(SQLite {other['sqlite']}), with and without eager task starts, "
        f"{settings['rounds']} alternated rounds"
    )
    return {
        **_sources(d, "handlers-pythons", setup, "the handler path on SQLite, by Python"),
        "table": render.handlers_pythons_table(d),
        "other_vs_this": times(d["other_vs_this"]),
        "eager_vs_lazy": times(d["eager_vs_lazy"]),
        "this_python": this["python"],
        "other_python": other["python"],
    }


def scale_out(d: dict[str, Any]) -> Figures:
    s, settings = d["summary"], d["settings"]
    setup = (
        f"1, 2 and 4 `timer-service` processes sharing one PostgreSQL database (`fsync` and "
        f"`synchronous_commit` on) and one `nats-server`, all on one machine, "
        f"`TIMER_BATCH_SIZE={settings['batch_size']}`, {settings['timers']:,} timers a path, "
        f"{settings['rounds']} rounds"
    )
    out = {**_sources(d, "scale-out", setup, "PostgreSQL, services and NATS on one machine")}
    for n, paths in s["rates"].items():
        for path, figure in paths.items():
            out[f"{path}_{n}"] = per_s(
                figure["median"] if isinstance(figure, dict) else kit.median(figure)
            )
    for path, figure in s["vs_raw"].items():
        out[f"{path}_vs_raw"] = times(figure["median"])
    for n, paths in s["cpu_vs_one"].items():
        for path, figure in paths.items():
            out[f"{path}_cpu_{n}_vs_1"] = times(figure["median"])
    rows = [
        (n if n != "raw" else "raw pipelines (yardstick)", out[f"schedule_{n}"], out[f"fire_{n}"])
        for n in s["rates"]
    ]
    out["table"] = kit.markdown_table(
        "instances | schedule path, commands/s | fire path, timers/s", rows, "lrr"
    )
    return out


def scale_out_steady(d: dict[str, Any]) -> Figures:
    settings = d["settings"]
    setup = (
        f"{settings['rate_per_s']:,} timers/s for {settings['seconds']:.0f} s through "
        "`TIMER_COMMANDS`, each due 1-2 s ahead, by 1, 2 and 4 `timer-service` processes on "
        "one PostgreSQL database, all on one machine"
    )
    out = {
        **_sources(d, "scale-out-steady", setup, "PostgreSQL, services and NATS on one machine"),
        "rate": per_s(settings["rate_per_s"]),
    }
    rows = []
    for n, one in d["instances"].items():
        reached, readable = one["reached_lateness"], one["readable_lateness"]
        out[f"p99_{n}"] = f"{ms(reached['p99_ms'])} ms"
        rows.append(
            (
                n,
                f"{ms(reached['p50_ms'])} / {ms(reached['p99_ms'])} ms",
                f"{ms(readable['p50_ms'])} / {ms(readable['p99_ms'])} ms",
            )
        )
    out["table"] = kit.markdown_table(
        "instances | fired after `dueAt`, p50 / p99 | read by a consumer, p50 / p99",
        rows,
        "lrr",
    )
    return out


def backlog(d: dict[str, Any]) -> Figures:
    where = (
        "one `timer-service` on SQLite"
        if d["store"] == "sqlite"
        else f"{d['instances']} `timer-service` processes on one PostgreSQL database"
    )
    at = "at the defaults"
    if d["store"] == "sqlite" and sqlite_at_normal(d):
        where, at = f"{where} at {NORMAL_NOW_TUNED}", "otherwise at the defaults"
    setup = f"{d['timers']:,} timers all overdue when {where} started, {at}"
    return {
        **_sources(d, f"backlog-{d['store']}", setup, where),
        "timers": count(d["timers"]),
        "instances": str(d["instances"]),
        "drain_s": f"{d['drain_s']:.0f} s",
        "rate": per_s(d["per_s"]),
        "rss": f"{max(d['peak_rss_mib']):.0f} MiB",
    }


def large(d: dict[str, Any]) -> Figures:
    """``p99_<instances>x_<rate>`` (and ``fired_...``, ``purge_...``) of each steady run on the
    large table; ``empty_p99`` of the run on an empty one."""
    where = (
        "one `timer-service` on SQLite"
        if d["store"] == "sqlite"
        else "`timer-service` processes on one PostgreSQL database"
    )
    setup = (
        f"{d['pending']:,} pending timers over {d['tenants']:,} tenants and {d['reached']:,} "
        f"fired ones past the retention, {where} at the defaults, new timers each due 1-2 s "
        "after it was sent"
    )
    out = {
        **_sources(d, f"large-{d['store']}", setup, f"{d['pending']:,} pending, {where}"),
        "pending": count(d["pending"]),
        "reached": count(d["reached"]),
        "bytes_per_timer": f"{d['sizes']['bytes_per_timer']:,.0f} bytes",
        "schedule_vs_empty": times(d["schedule"]["large_vs_empty"]),
        "rss": f"{max(max(r['peak_rss_mib']) for r in d['steady']):.0f} MiB",
    }
    for r in d["steady"]:
        key = f"{r['instances']}x_{r['rate_per_s']}"
        if r["table"] == "empty":
            out["empty_p99"] = f"{ms(r['reached_lateness']['p99_ms'])} ms"
            continue
        out[f"p99_{key}"] = f"{ms(r['reached_lateness']['p99_ms'])} ms"
        out[f"rate_{key}"] = per_s(r["rate_per_s"])
        out[f"fired_{key}"] = f"{r['fired']:,} of {r['sent']:,}"
        out[f"purge_{key}"] = times(r.get("purge_in_stream_vs_fire", r["purge_vs_fire"]))
    out["table"] = kit.markdown_table(
        "steady run | fired | lateness p50 / p99 / max | retention purge vs fire rate "
        "(in the stream; over the kit's window) | "
        "peak RSS | load",
        render.large_steady_rows(d),
        "lrrrrr",
    )
    if d["store"] == "postgres":
        out.update(sizing(d))
        purge = purge_ms_per_row(d)
        if purge is not None:
            out["purge_ms_per_row"] = f"{purge:.2f} ms"
    return out


#: The sizing table's grid and the lines it draws (assumptions, stated with the table).
SIZING_PENDING = (10_000_000, 100_000_000, 1_000_000_000)
SIZING_RATES = (1_000, 10_000, 100_000)
RETENTION_DAYS = 7
RETENTION_BATCH = 500  # the worker's retention batch (at most; results without mean_rows)
ONE_SERVER_CORES = 16  # a large but ordinary PostgreSQL server
UNPARTITIONED_BYTES = 2**40  # past this one table's vacuum and purge take hours: partition
ONE_SERVER_BYTES = 4 * 2**40  # what one server's disk holds comfortably
STREAM_CORES = 1.0  # a JetStream stream is served by its leader: about one core


def purge_ms_per_row(d: dict[str, Any]) -> float | None:
    """PostgreSQL's time per fired timer the retention purge deleted (its sampled batches)."""
    purges = [
        plan["mean_ms"] / max(plan.get("mean_rows", RETENTION_BATCH), 1)
        for r in d["steady"]
        for plan in r.get("plans", [])
        if "DELETE FROM timer_schedules" in plan["query"]
    ]
    return kit.median(purges) if purges else None


def _bytes(value: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value / 2**20:,.0f} MiB"


def sizing(d: dict[str, Any]) -> Figures:
    """Past one machine, on paper: from the bytes a stored timer takes and the CPU a fired one
    costs (services, PostgreSQL, nats-server) at the heaviest steady run on the large table."""
    heaviest = max(
        (r for r in d["steady"] if r["table"] == "large"),
        key=lambda r: (r["rate_per_s"], r["instances"]),
    )
    cpu = heaviest["cpu_ms_per_timer"]
    per_timer = d["sizes"]["bytes_per_timer"]
    purge = purge_ms_per_row(d) or 0.0
    rows = []
    for pending in SIZING_PENDING:
        for rate in SIZING_RATES:
            fired = rate * RETENTION_DAYS * 86_400
            stored = (pending + fired) * per_timer
            db_cores = rate * (cpu["database"] + purge) / 1000
            service_cores = rate * cpu["services"] / 1000
            nats_cores = rate * cpu["nats-server"] / 1000
            if db_cores <= ONE_SERVER_CORES / 2 and stored <= UNPARTITIONED_BYTES:
                layout = "one PostgreSQL"
            elif db_cores <= ONE_SERVER_CORES / 2 and stored <= ONE_SERVER_BYTES:
                layout = "one PostgreSQL, fired rows partitioned by day (retention drops them)"
            else:
                servers = max(db_cores / (ONE_SERVER_CORES / 2), stored / ONE_SERVER_BYTES)
                layout = f"tenants sharded over {max(2, round(servers + 0.5)):,} databases"
            streams = max(1, round(nats_cores / STREAM_CORES + 0.5))
            rows.append(
                (
                    count(pending),
                    per_s(rate),
                    _bytes(stored),
                    f"{service_cores:,.1f} / {db_cores:,.1f} / {nats_cores:,.1f}",
                    layout,
                    "one stream" if streams == 1 else f"{streams:,} streams by tenant",
                )
            )
    return {
        "sizing_table": kit.markdown_table(
            "pending timers | firings | stored (pending + fired kept) | cores: services / "
            "PostgreSQL / nats-server | database layout | JetStream",
            rows,
            "rrrrll",
        ),
        "sizing_basis": (
            f"{per_timer:,.0f} bytes a stored timer (table and indexes, at "
            f"{count(d['pending'])} pending); per fired timer at a steady "
            f"{per_s(heaviest['rate_per_s'])} with {heaviest['instances']} service(s): "
            f"{cpu['services']:.3f} ms CPU in the services, {cpu['database']:.3f} ms in "
            f"PostgreSQL (and {purge:.2f} ms more to purge it, row by row), "
            f"{cpu['nats-server']:.3f} ms in nats-server; fired timers kept "
            f"{RETENTION_DAYS} days; one PostgreSQL while it needs at most {ONE_SERVER_CORES // 2} "
            f"of a {ONE_SERVER_CORES}-core server, one table up to {_bytes(UNPARTITIONED_BYTES)}, "
            f"partitions up to {_bytes(ONE_SERVER_BYTES)}; a stream per {STREAM_CORES:g} core "
            "of nats-server"
        ),
    }


def compare(d: dict[str, Any]) -> Figures:
    systems = render.compare_systems(d)
    on = {
        key: f"{name} on {'SQLite' if key in render.SQLITE else 'PostgreSQL'}"
        for key, name, _ in systems
    }
    pending = d["settings"].get("pending", 0)
    setup = (
        ", ".join(on.values())
        + (f", {pending:,} future jobs stored in each table first" if pending else "")
        + f", in turn in each of {d['settings']['rounds']} rounds"
    )
    command = "compare-pending" if pending else "compare"
    out = {
        **_sources(d, command, setup, "; ".join(on.values())),
        "table": render.compare_tables(d),
        "settings": render.compare_settings(d),
    }
    for key, name, _ in systems:
        s, prefix = d["systems"][key], key.replace("-", "_")
        out[f"{prefix}_name"] = name
        out[f"{prefix}_schedule"] = per_s(s["schedule_per_s"]["median"])
        out[f"{prefix}_fire"] = per_s(s["fire_per_s"]["median"])
        out[f"{prefix}_p99"] = f"{render.late(s['lateness.p99_ms']['median'])} ms"
    for figure, v in render.timer_vs_pgqueuer(d).items():
        out[f"timer_postgres_vs_pgqueuer_{figure.removesuffix('_per_s')}"] = times(v["median"])
    return out


def handlers(d: dict[str, Any]) -> Figures:
    settings, sqlite = d["settings"], d["sqlite"]
    setup = (
        f"`Timer(SqliteTimerStore(...), handler=noop)` beside a hand-written loop on the same "
        f"file, {settings['jobs']:,} due timers, batches of {settings['batch']:,}, "
        f"{settings['rounds']} alternated rounds"
    )
    out = {
        **_sources(d, "handlers", setup, "the handler path on SQLite"),
        "timer": per_s(sqlite["timer"]["median_per_s"]),
        "raw": per_s(sqlite["raw"]["median_per_s"]),
        "store_loop": per_s(sqlite["store_loop"]["median_per_s"]),
        "timer_vs_raw": times(sqlite["timer"]["vs_raw"]),
        "store_loop_vs_raw": times(sqlite["store_loop"]["vs_raw"]),
        "jobs": count(settings["jobs"]),
    }
    if "timer_tuned" in sqlite:
        out["timer_tuned"] = per_s(sqlite["timer_tuned"]["median_per_s"])
        out["timer_tuned_vs_raw"] = times(sqlite["timer_tuned"]["vs_raw"])
    if "timer_batch" in sqlite:
        out["timer_batch"] = per_s(sqlite["timer_batch"]["median_per_s"])
        out["timer_batch_vs_raw"] = times(sqlite["timer_batch"]["vs_raw"])
    if "raw_envelopes" in sqlite:
        out["raw_envelopes"] = per_s(sqlite["raw_envelopes"]["median_per_s"])
        out["raw_envelopes_vs_raw"] = times(sqlite["raw_envelopes"]["vs_raw"])
        out["timer_batch_vs_raw_envelopes"] = times(sqlite["timer_batch"]["vs_raw_envelopes"])
    if "baseline" in d:
        base = d["baseline"]
        out["baseline_ref"] = d["settings"]["baseline_ref"]
        out["timer_vs_baseline"] = times(base["timer_child"]["vs_timer_baseline"])
    if "postgres" in d:
        pg = d["postgres"]
        out["pg_timer"] = per_s(pg["timer"]["median_per_s"])
        out["pg_pgqueuer"] = per_s(pg["pgqueuer"]["median_per_s"])
        out["pg_vs_pgqueuer"] = times(pg["timer"]["vs_pgqueuer"])
        if "timer_tuned" in pg:
            out["pg_timer_tuned"] = per_s(pg["timer_tuned"]["median_per_s"])
            out["pg_tuned_vs_pgqueuer"] = times(pg["timer_tuned"]["vs_pgqueuer"])
    return out


def isolation(d: dict[str, Any]) -> Figures:
    settings, results = d["settings"], d["results"]
    storm, unacked = settings["storm"], settings["unacked"]
    setup = (
        f"`Timer(SqliteTimerStore(...), handler=...)` at its defaults, one tenant's "
        f"{storm['timers']:,} timers due at one instant (its handler awaiting "
        f"{storm['call_s'] * 1000:.0f} ms a call) beside a quiet tenant's due "
        f"{storm['quiet_after_s']:g} s later; and `Timer(SqliteTimerStore(...), "
        f"broker.publisher)` on a `nats-server`, one publish never acknowledged beside "
        f"{unacked['others']} timers of {unacked['tenants']} other tenants due over "
        f"{unacked['over_s']:g} s; {settings['rounds']} alternated rounds"
    )
    out = _sources(d, "isolation", setup, "Timer on SQLite at its defaults")

    def taken(case: str, key: str, side: str = "current") -> list[float]:
        return [float(one[key]) for one in results.get(case, {}).get(side, [])]

    def seconds(values: list[float], pick: Callable[[list[float]], float]) -> str:
        if not values:
            return "-"
        value = pick(values)
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"

    for side, prefix in (("current", ""), ("baseline", "baseline_")):
        quiet = taken("storm", "quiet_late_s", side)
        out[f"{prefix}storm_quiet_late"] = seconds(quiet, kit.median)
        out[f"{prefix}storm_quiet_late_worst"] = seconds(quiet, max)
        out[f"{prefix}storm_drained"] = seconds(taken("storm", "storm_drained_s", side), kit.median)
        out[f"{prefix}unacked_late_p50"] = seconds(taken("unacked", "late_p50_s", side), kit.median)
        out[f"{prefix}unacked_late_worst"] = seconds(taken("unacked", "late_max_s", side), max)
    out["baseline_ref"] = str(settings.get("baseline_ref"))
    return out


def _one_worker(d: dict[str, Any]) -> str:
    return "one worker on SQLite" + (f" at {NORMAL_NOW_TUNED}" if sqlite_at_normal(d) else "")


def otel(d: dict[str, Any]) -> Figures:
    v, hooks = d["variants"], d["hooks_us"]
    setup = (
        f"{d['settings']['timers']:,} overdue timers fired by a `TimerWorker` from "
        f"{d['settings']['store']} through a local `nats-server`, OpenTelemetry's SDK exporting "
        f"to a sink, {d['settings']['rounds']} alternated rounds"
    )
    base = hooks["no instrumentation"]
    return {
        **_sources(d, "otel", setup, _one_worker(d)),
        "sdk_rate": times(v["sdk"]["rate_vs_off"]),
        "sdk_cpu": times(v["sdk"]["cpu_vs_off"]),
        "traced_cpu": times(v["sdk-traced"]["cpu_vs_off"]),
        "spans_cpu": times(v["sdk-timer-spans"]["cpu_vs_off"]),
        "off_cpu_us": f"{v['off']['cpu_us']:.0f} us",
        "sdk_hooks_us": f"{hooks['`sdk`, untraced timers'] - base:.1f} us",
        "off_hooks_us": f"{hooks['`off` (Prometheus)'] - base:.1f} us",
    }


def fairness(d: dict[str, Any]) -> Figures:
    s, settings = d["storm"], d["settings"]
    setup = (
        f"a `TimerWorker` on {settings['store']}, a storm of {settings['storm']:,} timers of one "
        f"tenant and {settings['quiet']} of another due at the same time"
    )
    return {
        **_sources(d, "fairness", setup, _one_worker(d)),
        "storm": count(settings["storm"]),
        "quiet_max": f"{s['quiet_max_s']:.2f} s",
        "storm_drained": f"{s['storm_drained_s']:.1f} s",
    }


def faults(d: dict[str, Any]) -> Figures:
    """``table``: each scenario's completion as a share of the baseline's (after a chaos
    fault, during a pressure one: what the public benchmark publishes for each), time to
    recover, lateness after the fault and checks, beside that benchmark's published figure of
    the same scenario for each of its systems."""
    shape, published = d["shape"], d["published"]
    systems = published["systems"]

    def theirs(value: float | None) -> str:
        return "no figure" if value is None else f"{value:.0%}"

    header = " | ".join(
        [
            "scenario",
            "Timer: of the baseline's completion, after (chaos) or during (pressure)",
            "time to recover",
            "late p50 / p99 after (ms)",
            "checks",
            *(f"{system} (theirs)" for system in systems),
        ]
    )
    rows = []
    for (name, result), row in zip(d["results"].items(), render.faults_rows(d), strict=True):
        share = result["recovery"] if result["kind"] == "chaos" else result["during"]
        rows.append(
            (
                row[0],
                f"**{share:.0%}**",
                row[4],
                row[6],
                row[7],
                *(theirs(v) for v in published["recovery"].get(name, [None] * len(systems))),
            )
        )
    setup = (
        f"`timer-service` on PostgreSQL (two services where a scenario kills one) with a "
        f"`nats-server`, {shape['rate']} timers a second over {kit.TENANTS} tenants; phases "
        f"of {shape['baseline_s']:g} s baseline, {shape['fault_s']:g} s fault, "
        f"{shape['recovery_s']:g} s recovery"
    )
    return {
        **_sources(d, "faults", setup, "services on PostgreSQL, faults and pressure"),
        "table": kit.markdown_table(header, rows, "lrrrl" + "r" * len(systems)),
        "published_source": published["source"],
        "published_machine": published["machine"],
    }


PAGES: dict[str, Callable[[dict[str, Any]], Figures]] = {
    "e2e": e2e,
    "handlers-pythons": handlers_pythons,
    "scale-out": scale_out,
    "scale-out-steady": scale_out_steady,
    "backlog-sqlite": backlog,
    "backlog-postgres": backlog,
    "large-sqlite": large,
    "large-postgres": large,
    "compare": compare,
    "compare-pending": compare,
    "otel": otel,
    "fairness": fairness,
    "handlers": handlers,
    "faults": faults,
    "isolation": isolation,
}


def figures(results: Path = kit.RESULTS) -> Figures:
    """Every figure of every results file the docs use, as ``file.figure`` -> text."""
    out: Figures = {}
    for name, make in PAGES.items():
        prefix = name.replace("-", "_")
        for key, text in make(kit.read_result(name, results)).items():
            out[f"{prefix}.{key}"] = text
    return out
