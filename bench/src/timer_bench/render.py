"""bench/README.md's figures, rendered from bench/results: each results file has a block
between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` that ``python -m
timer_bench render`` rewrites (``--check``: exit 1 if any is stale), and the docs' tables
come from the same functions (:mod:`timer_bench.figures`)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from timer_bench import kit
from timer_bench.kit import count, markdown_table, median, ms, per_s, spread, times

README = kit.RESULTS.parent / "README.md"
#: A results block of the README: its opening marker, its name, its text, its closing marker.
MARKERS = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def machine_line(document: dict[str, Any], *versions: str) -> str:
    return f"Machine: {kit.describe_machine(document['machine'], versions=versions)}."


def checks_line(checks: list[dict[str, Any]] | dict[str, bool]) -> str:
    if isinstance(checks, dict):
        checks = [{"check": name, "ok": ok} for name, ok in checks.items()]
    failed = [c["check"] for c in checks if not c["ok"]]
    line = f"{len(checks) - len(failed)} of {len(checks)} correctness checks passed"
    return line + (f"; failed: {', '.join(failed)}." if failed else ".")


# -- end to end ------------------------------------------------------------------------------


def _taken(result: dict[str, Any], cpu: str = "") -> str:
    """The rate of the round shown, with every round's rate, and its CPU per item."""
    rounds = result.get("rounds_per_s")
    shown = per_s(result["per_s"])
    shown += f" ({' / '.join(count(x) for x in rounds)})" if rounds else ""
    return shown + (f", {result[f'cpu_us_per_{cpu}']} us CPU a {cpu}" if cpu else "")


def _ratio(result: dict[str, Any]) -> str:
    return f"**{result['vs_raw']}** ({' / '.join(map(str, result.get('rounds_vs_raw', [])))})"


def e2e_block(document: dict[str, Any]) -> str:
    r, service = document["results"], document["service"]
    (batch, fire), schedule = next(iter(r["fire"].items())), r["schedule"]
    raw_schedule, raw_fire = r["yardsticks"]["raw_schedule"], r["yardsticks"]["raw_pipeline"]
    steady, storm, catchup = r["steady"], r["storm"], r["catchup"]
    rows = [
        (f"**fire path (batch {batch}) / raw pipeline**", _ratio(fire)),
        ("**schedule path / raw pipeline**", _ratio(schedule)),
        ("yardstick: raw fetch -> upsert -> ack", _taken(raw_schedule, "command")),
        (
            "yardstick: raw select -> publish -> mark",
            _taken(raw_fire[str(service["yardstick_batch"])], "timer"),
        ),
        (f"schedule path: {schedule['commands']:,} commands", _taken(schedule, "command")),
        (f"fire path: {fire['timers']:,} timers", _taken(fire, "timer")),
    ]
    for key, what in (("reached_lateness", "fired"), ("readable_lateness", "read")):
        late = steady[key]
        rows.append(
            (
                f"steady {steady['rate_per_s']:,}/s, {what} after `dueAt`, p50 / p99 / max",
                f"{late['p50_ms']} / {late['p99_ms']} / {late['max_ms']} ms",
            )
        )
    rows += [
        (
            f"storm of {storm['timers']:,}: all fired / all readable",
            f"{storm['fire_all_s']} / {storm['all_readable_s']} s",
        ),
        (
            f"catch-up: {catchup['overdue']:,} overdue of {catchup['stored']:,}",
            f"{catchup['drain_s']} s ({per_s(catchup['per_s'])}), "
            f"peak RSS {catchup['peak_rss_mb']} MiB",
        ),
    ]
    for s in r["scale"].values():
        rows.append((f"{s['stored']:,} stored: {s['commands']:,} commands", _taken(s)))
        rows.append(
            (
                f"{s['stored']:,} stored: idle poll / find_due of a batch",
                f"{s['empty_poll_us']} / {s['find_due_us']} us",
            )
        )
    head = (
        f"Run: `python -m timer_bench e2e` ({document['mode']}) on {document['date']}, "
        f"{document['seconds']} s; `TIMER_BATCH_SIZE={service['batch_size']}`, "
        f"`TIMER_COMMAND_BATCH_SIZE={service['command_batch_size']}`, polling "
        f"{service['polling_interval_ms']} ms; {service['rounds']} alternated rounds (yardstick "
        "then service), the round with the median ratio shown, each round's ratio in brackets."
    )
    return "\n\n".join(
        [
            head,
            markdown_table("measure | value", rows, "lr"),
            checks_line(document["checks"]) + " " + machine_line(document, "sqlite", "nats_server"),
        ]
    )


# -- PostgreSQL ------------------------------------------------------------------------------


def _range(figure: dict[str, float] | list[float]) -> str:
    if isinstance(figure, list):
        return spread(figure)
    return f"{count(figure['median'])} ({count(figure['min'])}-{count(figure['max'])})"


def _rounds(figure: dict[str, Any]) -> str:
    return f"**{figure['median']:.2f}** (rounds {' / '.join(f'{x:.2f}' for x in figure['rounds'])})"


def scale_out_block(document: dict[str, Any]) -> str:
    settings, summary = document["settings"], document["summary"]
    rates = summary["rates"]
    raw = rates["raw"]
    rows = [
        f"{n} | {_range(p['schedule'])} | {_range(p['fire'])}"
        for n, p in rates.items()
        if n != "raw"
    ]
    rows.append(
        f"raw pipelines, batches of {settings['raw_batch']:,} | {_range(raw['schedule'])} | "
        + _range(raw["fire"])
    )
    ratios = [
        (f"{path} path, 1 instance / raw pipeline", _rounds(summary["vs_raw"][path]), ">= 0.8")
        for path in ("schedule", "fire")
    ]
    for n, paths in summary["cpu_vs_one"].items():
        ratios += [
            (f"{path} path, CPU per timer, {n} instances / 1", _rounds(paths[path]), "<= 1.15")
            for path in ("schedule", "fire")
        ]
    cpu_rows = []
    cores = document["machine"]["nproc"]
    for n, paths in summary["cpu_ms"].items():
        for path, part in paths.items():
            own = sum(part[g] for g in ("services", "postgres", "nats-server"))
            cells = [part[k] for k in ("services", "postgres", "nats-server", "other_cores")]
            cpu_rows.append((n, path, *cells, part["commits_per_timer"], per_s(cores * 1000 / own)))
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench scale-out` on {document['date']}; "
            f"{settings['timers']:,} timers a path, `TIMER_BATCH_SIZE={settings['batch_size']}`, "
            f"`TIMER_COMMAND_BATCH_SIZE={settings['command_batch_size']}`, polling "
            f"{settings['polling_interval_ms']} ms, PostgreSQL "
            + ", ".join(f"`{k}={v}`" for k, v in settings["postgres"].items())
            + f"; {settings['rounds']} rounds (raw pipelines, then each instance count), "
            "medians with the rounds' range.",
            markdown_table(
                "instances | schedule path, commands/s | fire path, timers/s", rows, "rrr"
            ),
            markdown_table("ratio (median of the rounds' own) | value | target", ratios, "lrr"),
            f"CPU milliseconds per timer of each part (medians), the cores other work kept busy "
            f"meanwhile, PostgreSQL commits per timer, and the rate {cores} otherwise idle cores "
            "would allow at that cost:",
            markdown_table(
                "instances | path | services | postgres | nats-server | other work, cores "
                "| commits/timer | CPU-bound rate",
                cpu_rows,
                "rlrrrrrr",
            ),
            machine_line(document, "postgres", "nats_server", "packages"),
        ]
    )


def scale_out_steady_block(document: dict[str, Any]) -> str:
    settings = document["settings"]
    rows: list[str | Sequence[object]] = []
    for n, one in document["instances"].items():
        reached, readable = one["reached_lateness"], one["readable_lateness"]
        cores = ", ".join(f"{g} {c:.2f}" for g, c in one["cores"].items())
        rows.append(f"{n} | {_late3(reached)} | {_late3(readable)} | {cores}")
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench scale-out-steady` on {document['date']}: "
            f"{settings['rate_per_s']:,} timers/s for {settings['seconds']:.0f} s, each due 1-2 s "
            f"ahead, `TIMER_BATCH_SIZE={settings['batch_size']}`, polling "
            f"{settings['polling_interval_ms']} ms.",
            markdown_table(
                "instances | reachedAt - dueAt, p50 / p99 / max ms "
                "| read by a consumer - dueAt, ms | cores",
                rows,
                "rrrl",
            ),
            machine_line(document, "postgres", "nats_server", "packages"),
        ]
    )


def _late3(late: dict[str, float]) -> str:
    return f"{late['p50_ms']} / {late['p99_ms']} / {late['max_ms']}"


def backlog_line(document: dict[str, Any]) -> str:
    peaks = " / ".join(f"{peak} MiB" for peak in document["peak_rss_mib"])
    return (
        f"{document['store']}, {document['instances']} service(s): {document['timers']:,} "
        f"overdue drained in {document['drain_s']} s ({per_s(document['per_s'])}); peak RSS "
        f"{peaks}; {document['events']:,} events, {document['early']} early, "
        f"{document['out_of_due_order_within_tenant_and_instance']} out of due order within a "
        "tenant and instance"
    )


def backlog_block(document: dict[str, Any]) -> str:
    return (
        f"Run: `python -m timer_bench backlog-{document['store']}` on {document['date']}: "
        f"{backlog_line(document)}. {checks_line(document['checks'])} {machine_line(document)}"
    )


def fire_baseline_line(document: dict[str, Any]) -> str:
    """The fire path against an earlier commit's service, in the same rounds (when run)."""
    base = document["results"].get("fire_baseline")
    if base is None:
        return ""
    rounds = base["rounds"]
    rates = " / ".join(f"{r['service']['per_s'] / r['baseline']['per_s']:.2f}" for r in rounds)
    cpus = " / ".join(
        f"{r['service']['cpu_us_per_timer'] / r['baseline']['cpu_us_per_timer']:.2f}"
        for r in rounds
    )
    return (
        f" Against the service at `{document['service']['baseline_ref']}` (its own sources, "
        f"same rounds, the two taking turns after the raw pipeline): rate "
        f"**{times(base['rate_vs_baseline'])}** (rounds {rates}), the service's CPU per timer "
        f"**{times(base['cpu_vs_baseline'])}** (rounds {cpus}; "
        + " / ".join(f"{r['service']['cpu_us_per_timer']:.1f}" for r in rounds)
        + " against "
        + " / ".join(f"{r['baseline']['cpu_us_per_timer']:.1f}" for r in rounds)
        + " us)."
    )


def fire_tenants_block(document: dict[str, Any]) -> str:
    service = document["service"]
    fire = document["results"]["fire"][str(service["batch_size"])]
    raw = document["results"]["yardsticks"]["raw_pipeline"][str(service["yardstick_batch"])]
    return (
        f"Run: `python -m timer_bench fire-tenants` on {document['date']}: "
        f"{fire['timers']:,} overdue timers over 50 tenants fired by one service at the "
        f"defaults (`TIMER_BATCH_SIZE={service['batch_size']}`, claims shared among the "
        f"tenants) against the raw pipeline (batches of {service['yardstick_batch']}), "
        f"{service['rounds']} alternated rounds: **{times(fire['vs_raw'])}** (rounds "
        + " / ".join(f"{x:.2f}" for x in fire.get("rounds_vs_raw", [fire["vs_raw"]]))
        + f"; service {spread(fire.get('rounds_per_s', [fire['per_s']]))}/s, raw "
        f"{spread(raw.get('rounds_per_s', [raw['per_s']]))}/s; load average "
        + " / ".join(f"{x:.1f}" for x in fire.get("rounds_load", [fire["load"]]))
        + f").{fire_baseline_line(document)} {checks_line(document['checks'])} "
        f"{machine_line(document)}"
    )


# -- the large table -------------------------------------------------------------------------


def large_purge(r: dict[str, Any]) -> str:
    """A steady run's purge against its fire rate: in the stream (the services' own count)
    where the run has it, then over the kit's window (idle seconds at both ends included)."""
    window = f"{times(r['purge_vs_fire'])} ({per_s(r['purged_per_s'])})"
    if "purge_in_stream_vs_fire" not in r:
        return window
    return f"{times(r['purge_in_stream_vs_fire'])}; {window}"


def large_steady_rows(document: dict[str, Any]) -> list[str | Sequence[object]]:
    rows: list[str | Sequence[object]] = []
    for r in document["steady"]:
        lateness = r["reached_lateness"]
        rows.append(
            (
                f"{r['table']}, {r['instances']} service(s), {per_s(r['rate_per_s'])}",
                f"{r['fired']:,} of {r['sent']:,}",
                " / ".join(ms(lateness[f"{q}_ms"]) for q in ("p50", "p99", "max")) + " ms",
                large_purge(r) if r["table"] == "large" else "-",
                " / ".join(f"{peak:.0f}" for peak in r["peak_rss_mib"]) + " MiB",
                f"{r['load'][0]:.1f}",
            )
        )
    return rows


def large_block(document: dict[str, Any]) -> str:
    sizes, schedule = document["sizes"], document["schedule"]
    index_bytes = sum(sizes["index_bytes"].values())
    rows = document["pending"] + document["reached"]
    where = (
        "one `timer-service` on SQLite"
        if document["store"] == "sqlite"
        else "`timer-service` processes on one PostgreSQL database (`fsync`, "
        "`synchronous_commit` on; `auto_explain` sampling 2% of statements)"
    )
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench large-{document['store']} --pending "
            f"{document['pending']}` on {document['date']}: {document['pending']:,} pending "
            f"timers due over the next 30 days over {document['tenants']:,} tenants and "
            f"{document['reached']:,} fired 7-14 days ago (all past the default retention), "
            f"loaded by bulk SQL at {count(document['load_per_s'])} rows/s; {where}, at the "
            "defaults; steady runs of "
            f"{document['seconds']:.0f} s, each timer due 1-2 s after it was sent.",
            markdown_table(
                "measure | value",
                [
                    (
                        "table + indexes, bytes per stored timer",
                        f"{sizes['bytes_per_timer']:,.0f} ({sizes['table_bytes'] / rows:,.0f} "
                        f"+ {index_bytes / rows:,.0f})",
                    ),
                    (
                        f"schedule rate, {schedule['commands']:,} commands, large / empty "
                        "(alternated)",
                        f"**{times(schedule['large_vs_empty'])}** (rounds "
                        + " / ".join(f"{x:.2f}" for x in schedule["rounds_vs_empty"])
                        + f"; large {spread(schedule['large_per_s'])}/s, empty "
                        f"{spread(schedule['empty_per_s'])}/s)",
                    ),
                ],
                "lr",
            ),
            markdown_table(
                "steady run | fired | lateness p50 / p99 / max | retention purge vs fire "
                "rate (in the stream; over the kit's window) | peak RSS | load",
                large_steady_rows(document),
                "lrrrrr",
            ),
            f"{checks_line(document['checks'])} {machine_line(document, 'sqlite', 'postgres')}",
        ]
    )


# -- the peers -------------------------------------------------------------------------------

YARDSTICKS = {
    "timer": "raw `sqlite3` upserts, 100 a commit; select 100 due, acked nats-py publishes, "
    "mark, one commit",
    "timer-postgres": "raw psycopg: `INSERT ... SELECT FROM unnest(...)` of 100 rows; select "
    "100 due `FOR UPDATE SKIP LOCKED`, acked nats-py publishes, one `UPDATE` to `Reached`",
    "pgqueuer": "raw asyncpg: `INSERT ... unnest(...)` of 100 rows; `UPDATE ... FOR UPDATE "
    "SKIP LOCKED LIMIT 100 RETURNING` then `DELETE`",
    "dbos-postgres": "raw asyncpg: one insert a commit; select 100 due `FOR UPDATE SKIP "
    "LOCKED` and delete them, one commit",
    "awa": "raw asyncpg: one insert a commit; select 100 due `FOR UPDATE SKIP LOCKED` and "
    "delete them, one commit",
    "apscheduler": "raw `sqlite3`: one insert a commit (as `add_schedule`); select 100 due and "
    "delete them, one commit",
    "dbos-sqlite": "raw `sqlite3`: one insert a commit (as `enqueue`); select 100 due and "
    "delete them, one commit",
}


#: The systems of the race on SQLite (the others are on PostgreSQL).
SQLITE = ("timer", "apscheduler", "dbos-sqlite")


def compare_systems(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, name and version, what it runs on and does per item) of each system measured,
    each Timer before its peers on the same database."""
    peers = document["peers"]
    postgres = document["machine"]["postgres"].split(" (")[0]
    dbos = f"DBOS {peers.get('dbos', '?')}"
    every = [
        (
            "timer-postgres",
            f"Timer {document['timer_version']}",
            f"{postgres}, in-process (`TimerStore.apply`, `TimerWorker`); each firing a claim "
            "under a lease, an acked JetStream publish, a mark to `Reached`",
        ),
        (
            "pgqueuer",
            f"pgqueuer {peers['pgqueuer']}",
            f"{postgres}, asyncpg {peers['asyncpg']}; each job a no-op, deleted when done",
        ),
        (
            "dbos-postgres",
            dbos,
            f"{postgres}; each job a delayed workflow (`SetEnqueueOptions(delay_seconds=...)`), "
            "its status and output kept",
        ),
        (
            "awa",
            f"awa {peers.get('awa-pg', '?')}",
            f"{postgres}; each job a no-op async handler (its Rust runtime claims, runs and "
            "completes it)",
        ),
        (
            "timer",
            f"Timer {document['timer_version']}",
            "SQLite, in-process (`TimerStore.apply`, `TimerWorker`); each firing an acked "
            "JetStream publish",
        ),
        (
            "apscheduler",
            f"APScheduler {peers['apscheduler[sqlalchemy]']}",
            f"SQLite via SQLAlchemy {peers['sqlalchemy[asyncio]']} + aiosqlite "
            f"{peers['aiosqlite']}; each job a no-op coroutine",
        ),
        (
            "dbos-sqlite",
            dbos,
            "SQLite (DBOS's own settings); each job a delayed workflow, its status and output kept",
        ),
    ]
    return [system for system in every if system[0] in document["systems"]]


def late(value: float) -> str:
    """Timer's timestamps are whole milliseconds: 0 reads "< 1"."""
    return "< 1" if value < 1 else ms(value)


def compare_tables(document: dict[str, Any]) -> str:
    systems = compare_systems(document)
    results = [
        (
            f"**{name}**",
            f"{per_s(s['schedule_per_s']['median'])} ({times(s['schedule_vs_raw']['median'])})",
            f"{per_s(s['fire_per_s']['median'])} ({times(s['fire_vs_raw']['median'])})",
            f"{late(s['lateness.p50_ms']['median'])} / {late(s['lateness.p99_ms']['median'])} ms",
            runs_on,
        )
        for key, name, runs_on in systems
        for s in [document["systems"][key]]
    ]
    raw = [
        f"{name}: {YARDSTICKS[key]} | {per_s(s['yardstick.insert_per_s']['median'])} | "
        + per_s(s["yardstick.claim_delete_per_s"]["median"])
        for key, name, _ in systems
        for s in [document["systems"][key]]
    ]
    return "\n\n".join(
        [
            markdown_table(
                "system | schedule | fire | lateness p50 / p99 | runs on", results, "lrrrl"
            ),
            "In brackets: the rate as a fraction of the system's own raw yardstick, the same "
            "database work written by hand and measured in the same round:",
            markdown_table("yardstick | insert | claim and complete", raw, "lrr"),
        ]
    )


def compare_settings(document: dict[str, Any]) -> str:
    settings, jobs = document["settings"], document["settings"]["jobs"]
    measured = {key: name for key, name, _ in compare_systems(document)}
    counts: dict[int, list[str]] = {}
    for key, name in measured.items():
        counts.setdefault(jobs[key], []).append(
            f"{name} ({'SQLite' if key in SQLITE else 'PostgreSQL'})"
        )
    pending = settings.get("pending", 0)
    return (
        "Schedule and fire: "
        + "; ".join(f"{n:,} jobs for {', '.join(names)}" for n, names in counts.items())
        + f" (the slower ones' rates do not depend on the count); batches of {settings['batch']}"
        + (
            f"; {pending:,} future jobs already stored in each system's table before it ran"
            if pending
            else ""
        )
        + f"; lateness: {settings['steady_rate_per_s']} new jobs/s "
        f"for {settings['steady_seconds']:.0f} s, each due 1-2 s ahead; medians of "
        f"{settings['rounds']} rounds, the systems in turn in every round. SQLite: "
        f"{settings['sqlite']}. PostgreSQL: "
        + ", ".join(f"`{k}={v}`" for k, v in settings["postgres"].items())
        + "."
    )


def timer_vs_pgqueuer(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Timer on PostgreSQL over pgqueuer on the same server: per figure, the median of the
    rounds' own ratios and each round's (the systems ran in turn in every round)."""
    rounds = document["rounds"]
    if not rounds.get("timer-postgres") or not rounds.get("pgqueuer"):
        return {}
    out = {}
    for figure in ("schedule_per_s", "fire_per_s"):
        timer = [r[figure] for r in rounds["timer-postgres"]]
        peer = [r[figure] for r in rounds["pgqueuer"]]
        out[figure] = {"median": kit.median_ratio(timer, peer), "rounds": kit.ratios(timer, peer)}
    return out


def compare_block(document: dict[str, Any]) -> str:
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench "
            f"{'compare-pending' if document['settings'].get('pending') else 'compare'}` on "
            f"{document['date']}. " + compare_settings(document),
            compare_tables(document),
            *(
                [
                    "Timer on PostgreSQL over pgqueuer, median of the rounds' own ratios: "
                    + "; ".join(
                        f"{what} **{times(v['median'])}** (rounds "
                        + " / ".join(f"{x:.2f}" for x in v["rounds"])
                        + ")"
                        for what, v in zip(
                            ("schedule", "fire"), timer_vs_pgqueuer(document).values(), strict=True
                        )
                    )
                ]
                if timer_vs_pgqueuer(document)
                else []
            ),
            machine_line(document, "sqlite", "postgres"),
        ]
    )


# -- the parts -------------------------------------------------------------------------------


def otel_block(document: dict[str, Any]) -> str:
    settings = document["settings"]
    rows = [
        f"`{name}` | {count(v['rate'])} | {v['rate_vs_off']:.3f}x | "
        + ", ".join(f"{x:.2f}" for x in v["rounds_rate_vs_off"])
        + f" | {v['cpu_us']:.0f} us | {v['cpu_vs_off']:.3f}x"
        for name, v in document["variants"].items()
    ]
    base = document["hooks_us"]["no instrumentation"]
    hooks = [(name, f"{us:.1f}", f"{us - base:.1f}") for name, us in document["hooks_us"].items()]
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench otel` on {document['date']}: {settings['timers']:,} "
            f"overdue timers fired by a `TimerWorker` (batches of {settings['batch']}) from "
            f"{settings['store']} through a local `nats-server`, a fresh process each; "
            f"{settings['rounds']} rounds, the variants in rotated order.",
            markdown_table(
                "variant | timers/s (median) | rate vs `off` (median of rounds) | each round "
                "| CPU per timer | CPU vs `off`",
                rows,
                "lrrlrr",
            ),
            "The hooks of one firing alone (least of 5 repetitions):",
            markdown_table(
                "hooks (build the events, then the instrumentation) | us per timer "
                "| instrumentation's own",
                hooks,
                "lrr",
            ),
            machine_line(document, "packages"),
        ]
    )


def fairness_block(document: dict[str, Any]) -> str:
    settings, storm = document["settings"], document["storm"]
    keys = ("quiet_p50_s", "quiet_max_s", "storm_p50_s", "storm_drained_s")
    rows = [" | ".join(f"{storm[key]} s" for key in keys)]
    parts = [
        f"Run: `python -m timer_bench fairness` on {document['date']}: a storm of "
        f"{settings['storm']:,} timers of one tenant due at one instant, {settings['quiet']} of a "
        f"quiet tenant due then and over the 2 s after; {settings['store']}, "
        f"`batch_size={settings['batch_size']}`.",
        markdown_table(
            "quiet tenant p50 | quiet tenant max | storm p50 | storm drained after",
            rows,
            "rrrr",
        ),
    ]
    if "fire_per_s" in document:
        fire = document["fire_per_s"]
        parts.append(
            f"Fire rate of {settings['fire']:,} overdue timers (median of {settings['rounds']} "
            f"alternated rounds): {per_s(fire['1'])} over 1 tenant, {per_s(fire['50'])} over 50."
        )
    return "\n\n".join([*parts, machine_line(document)])


def flood_block(document: dict[str, Any]) -> str:
    settings = document["settings"]
    names = {
        "per-tenant": "per-tenant intake (default)",
        "per-tenant-quota": f"per-tenant, `TIMER_MAX_PENDING_PER_TENANT={settings['quota']}`",
        "per-tenant-limits": f"the same and `TIMER_MAX_QUEUED_PER_TENANT={settings['queued']}`",
        "shared": "shared intake (`TIMER_INTAKE=shared`)",
    }
    rows: list[str | Sequence[object]] = []
    for setup, name in names.items():
        taken = [one[setup] for one in document["rounds"]]
        shown = kit.median_round(taken, lambda r: float(r["b_late_max_s"]))
        outcomes = shown["a"]["outcomes"]
        refused = sum(n for why, n in outcomes.items() if why != "stored")
        rows.append(
            (
                name,
                f"{shown['b_late_p50_s']} s",
                f"{shown['b_late_max_s']} s ({', '.join(str(r['b_late_max_s']) for r in taken)})",
                f"{shown['a']['sent']:,} at {shown['a_rate_per_s']:,}/s",
                f"{outcomes.get('stored', 0):,}",
                f"{refused:,}",
                f"{int(shown['rejected_metric']):,}",
            )
        )
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench flood` on {document['date']}: tenant A publishes "
            f"`ScheduleTimer` at {settings['rate']:,}/s for {settings['seconds']:g} s from a "
            f"process of its own; tenant B schedules a timer due {settings['b_due_in_s']:g} s "
            f"later every {settings['b_every_s']:g} s meanwhile. The service at its defaults "
            f"on SQLite; {settings['rounds']} alternated rounds, the round with the median B "
            "max shown (every round's max in brackets). B's lateness is when B received the "
            "event minus the `dueAt` it asked for.",
            markdown_table(
                "setup | B late p50 | B late max | A sent | A acked (stored) | A refused at "
                "publish | A dead-lettered",
                rows,
                "lrrrrrr",
            ),
            checks_line(document["checks"]),
            machine_line(document, "nats_server"),
        ]
    )


def store_block(document: dict[str, Any]) -> str:
    rows: list[str | Sequence[object]] = []
    for row in document["rows"]:
        if "store_us" in row:
            store = f"{row['store_us']:.0f} us (p99 {row['store_p99_us']:.0f})"
            raw = f"{row['raw_us']:.0f} us (p99 {row['raw_p99_us']:.0f})"
            gap, cpu = f"+{row['store_us'] - row['raw_us']:.0f} us", ""
        else:
            store = f"{spread(row['store_per_s'])}/s"
            raw = f"{spread(row['raw_per_s'])}/s" + (f" ({row['raw']})" if row["raw"] else "")
            gap = times(row["store_vs_raw"])
            cpu = f"{row['store_cpu_us']:.0f} / {row['raw_cpu_us']:.0f} us"
        rows.append(f"{row['measurement']} | {store} | {raw} | {gap} | {cpu}")
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench store` on {document['date']}; WAL, "
            f"`synchronous=NORMAL` unless stated; {document['settings']['repeat']} interleaved "
            "repetitions, medians with their range; store / raw is the median of the "
            "repetitions' own ratios.",
            markdown_table(
                "measurement | SqliteTimerStore | raw sqlite3 | store / raw "
                "| CPU per item, store / raw",
                rows,
                "lrrrr",
            ),
            machine_line(document),
        ]
    )


def publish_block(document: dict[str, Any]) -> str:
    rows = [
        f"{row['path']} | {count(row['messages'])} | {count(median(row['rounds_per_s']))} | "
        f"{row['vs_baseline']:.1f}x"
        for row in document["rows"]
    ]
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench publish` on {document['date']}; publish window "
            f"{document['settings']['publish_window']}, {document['settings']['rounds']} rounds "
            "of every path in turn.",
            markdown_table(
                "path | messages | msg/s (median) | vs baseline (median of rounds)",
                rows,
                "lrrr",
            ),
            machine_line(document, "nats_server", "packages"),
        ]
    )


def command_order_block(document: dict[str, Any]) -> str:
    r = document["results"]
    steps = ("insert", "reschedule", "cancel")
    rows = [(mode, *(per_s(r[mode][s]) for s in steps)) for mode in ("plain", "positioned")]
    ratios = [times(r["positioned_vs_plain"][s]) for s in steps]
    rows.append(("positioned / plain (median of rounds)", *ratios))
    settings = document["settings"]
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench command-order` on {document['date']}: "
            f"{settings['operations']:,} of each, batches of {settings['batch']}, "
            f"{settings['rounds']} alternated rounds.",
            markdown_table(" | ".join(["operations", *steps]), rows, "lrrr"),
            machine_line(document),
        ]
    )


def _handlers_tuned(settings: dict[str, Any]) -> str:
    """The tuned handler row's settings, as a Timer is given them."""
    tuned = settings["timer_tuned"]
    return (
        f"`batch_size={tuned['batch_size']}`, "
        f"`HandlerSettings(max_concurrency={tuned['max_concurrency']})`"
    )


def handlers_block(document: dict[str, Any]) -> str:
    settings, sqlite = document["settings"], document["sqlite"]
    rows = [
        (what, per_s(sqlite[side]["median_per_s"]), spread(sqlite[side]["per_s"], per_s), ratio)
        for what, side, ratio in (
            ("hand-written loop (yardstick)", "raw", "1"),
            (
                "the same loop on the store's API",
                "store_loop",
                times(sqlite["store_loop"]["vs_raw"]),
            ),
            *(
                [
                    (
                        "the loop by hand, handing a batch handler each timer's envelope",
                        "raw_envelopes",
                        times(sqlite["raw_envelopes"]["vs_raw"]),
                    )
                ]
                if "raw_envelopes" in sqlite
                else []
            ),
            (
                "`Timer(store, handler=noop)`, default settings",
                "timer",
                times(sqlite["timer"]["vs_raw"]),
            ),
            *(
                [
                    (
                        f"`Timer(store, handler=noop)`, tuned: {_handlers_tuned(settings)}",
                        "timer_tuned",
                        times(sqlite["timer_tuned"]["vs_raw"]),
                    )
                ]
                if "timer_tuned" in sqlite
                else []
            ),
            *(
                [
                    (
                        "`Timer(store, batch_handler=noop_batch)`, default settings"
                        + (
                            f" ({times(sqlite['timer_batch']['vs_raw_envelopes'])} of the loop "
                            "by hand handing envelopes)"
                            if "vs_raw_envelopes" in sqlite["timer_batch"]
                            else ""
                        ),
                        "timer_batch",
                        times(sqlite["timer_batch"]["vs_raw"]),
                    )
                ]
                if "timer_batch" in sqlite
                else []
            ),
        )
    ]
    parts = [
        f"Run: `python -m timer_bench handlers` on {document['date']}: "
        f"{settings['jobs']:,} due timers to a no-op handler on SQLite "
        f"({settings['sqlite']}), the loops by hand in batches of {settings['batch']:,}, "
        f"{settings['rounds']} alternated rounds, median of the per-round ratios.",
        markdown_table("loop | timers/s | rounds | vs the yardstick", rows, "lrrr"),
    ]
    if "baseline" in document:
        base = document["baseline"]
        parts.append(
            f"The per-timer handler path against its own sources at "
            f"`{settings['baseline_ref']}` (each in a process of its own, same rounds): "
            f"{per_s(base['timer_child']['median_per_s'])} against "
            f"{per_s(base['timer_baseline']['median_per_s'])}, "
            f"**{times(base['timer_child']['vs_timer_baseline'])}** (rounds "
            + " / ".join(
                f"{c / b:.2f}"
                for c, b in zip(
                    base["timer_child"]["per_s"], base["timer_baseline"]["per_s"], strict=True
                )
            )
            + ")."
        )
    if "transcribed" in document:
        parts.append(f"Transcribed {document['transcribed']}.")
    if "postgres" in document:
        pg = document["postgres"]
        tuned = (
            f"; tuned {per_s(pg['timer_tuned']['median_per_s'])} "
            f"({times(pg['timer_tuned']['vs_pgqueuer'])})"
            if "timer_tuned" in pg
            else ""
        )
        parts.append(
            f"PostgreSQL, same rounds: Timer's handler path "
            f"{per_s(pg['timer']['median_per_s'])} at its default settings "
            f"({times(pg['timer']['vs_pgqueuer'])} of pgqueuer's rate){tuned}; pgqueuer's "
            f"no-op execution {per_s(pg['pgqueuer']['median_per_s'])}."
        )
    return "\n\n".join([*parts, machine_line(document)])


# -- isolation -------------------------------------------------------------------------------


def isolation_rows(document: dict[str, Any]) -> list[Sequence[object]]:
    """One row per case and figure: per side, the median of the rounds, the worst, and the
    rounds."""
    results, sides = document["results"], ["current", "baseline"]
    unacked = document["settings"]["unacked"]
    figures = {
        "storm": [
            ("the quiet tenant's timer, handled late by", "quiet_late_s"),
            ("the storm's last timer, handled after its due time", "storm_drained_s"),
        ],
        "unacked": [
            (f"the {unacked['others']} others, stored late by: median", "late_p50_s"),
            (f"the {unacked['others']} others, stored late by: most", "late_max_s"),
        ],
    }
    rows: list[Sequence[object]] = []
    for case, named in figures.items():
        if case not in results:
            continue
        for what, key in named:
            cells: list[object] = [what]
            for side in sides:
                taken = [float(one[key]) for one in results[case].get(side, [])]
                cells.append(
                    f"{median(taken):.3f} s, worst {max(taken):.3f} "
                    f"({' / '.join(f'{x:.3f}' for x in taken)})"
                    if taken
                    else "-"
                )
            rows.append(cells)
    return rows


def isolation_block(document: dict[str, Any]) -> str:
    settings = document["settings"]
    storm, unacked = settings["storm"], settings["unacked"]
    ref = settings.get("baseline_ref") or "-"
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench isolation --baseline-ref {ref}` on "
            f"{document['date']}, {settings['rounds']} alternated rounds, each side in a "
            "process of its own, at the defaults. Storm: `Timer(SqliteTimerStore(...), "
            f"handler=...)`, tenant `storm` {storm['timers']:,} timers due at one instant "
            f"(each call awaiting {storm['call_s'] * 1000:.0f} ms), tenant `quiet` one due "
            f"{storm['quiet_after_s']} s later. Unacknowledged: `Timer(SqliteTimerStore(...), "
            "broker.publisher)` on a nats-server (5 s ack timeout), one timer's subject read "
            f"by a subscriber that never answers, {unacked['others']} timers of "
            f"{unacked['tenants']} other tenants due with it and over the next "
            f"{unacked['over_s']:g} s, lateness as JetStream stored them.",
            markdown_table(
                f"figure | current sources | at `{ref}`",
                isolation_rows(document),
                "lrr",
            ),
            f"{checks_line(document['checks'])} {machine_line(document, 'nats_server')}",
        ]
    )


# -- the console and the census ----------------------------------------------------------

REQUESTS = 100


def console_block(document: dict[str, Any]) -> str:
    pages = document["pages"]
    cold = pages.pop("overview (cold: reads the tenant ranking)", None)
    rows = [(page, ms(v["p50_ms"]), ms(v["p99_ms"]), ms(v["max_ms"])) for page, v in pages.items()]
    census = document["census"]
    counts = ", ".join(f"{name} {count(n)}" for name, n in census["counts"].items())
    loaded = f"loaded by bulk SQL in {document['load_s']:.0f} s"
    if "reused_load_s" in document:  # --db: a file loaded by an earlier run
        earlier = document["reused_load_s"]
        took = "" if earlier is None else f" in {earlier:.0f} s"
        loaded = (
            f"in a file loaded by bulk SQL by an earlier run{took} (due times relative to that "
            "load: more overdue)"
        )
    parts = [
        f"Run: `python -m timer_bench console-{document['store']}` on {document['date']}: "
        f"{document['timers']:,} timers over 1,000 tenants, {loaded}. Each page asked for "
        f"{REQUESTS} times over loopback HTTP after 3 warm-ups (ms):",
        markdown_table("page | p50 | p99 | max", rows, "lrrr"),
    ]
    if cold is not None:
        parts.append(
            f"The overview's first answer, which reads the tenant ranking: {cold['seconds']:.1f} s "
            "(then read again in the background, at most every 30 s)."
        )
    parts.append(
        f"Census at `TIMER_CENSUS_CAP={census['cap']}` ({counts}): "
        f"{census['census_wall_ms_median']:.0f} ms, {census['census_cpu_ms_median']:.0f} ms of "
        f"CPU (median of {census['rounds']} rounds), "
        f"{census['census_core_share_at_interval'] * 100:.2f}% of a core every "
        f"{census['interval_s']:.0f} s. Yardstick, the full count of pending timers "
        f"(`timer_timers_pending`) in the same rounds: {census['full_count_wall_ms_median']:.0f} "
        f"ms, {census['full_count_cpu_ms_median']:.0f} ms of CPU; the census takes "
        f"{times(census['census_to_full_count_wall_ratio_median'])} its time."
    )
    return "\n\n".join([*parts, machine_line(document, "postgres")])


def durability_block(document: dict[str, Any]) -> str:
    titles = {
        "sqlite": "SQLite (old: `synchronous=NORMAL`; new: the default)",
        "postgres": "PostgreSQL, server `synchronous_commit=off` (old: inherited)",
        "nats": "JetStream (old: nats-server's `sync_interval`, 2 min; new: the embedded "
        "server's `always`)",
    }
    tables = []
    for store, measures in document["results"].items():
        rows = [
            (
                name,
                per_s(kit.median(r["old"])),
                per_s(kit.median(r["new"])),
                f"**{times(r['new_vs_old'])}** ({' / '.join(times(x) for x in r['rounds'])})",
            )
            for name, r in measures.items()
        ]
        header = f"{titles[store]} | old (median) | new (median) | new / old, median (rounds)"
        tables.append(markdown_table(header, rows, "lrrr"))
    settings = document["settings"]
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench durability` on {document['date']}: "
            f"{settings['timers']:,} timers a measure (the one-by-one rows a fiftieth), "
            f"{settings['rounds']} alternated rounds, old and new on fresh databases.",
            *tables,
            machine_line(document, "postgres", "nats_server"),
        ]
    )


def _late_pair(late: dict[str, float | None]) -> str:
    return " / ".join("-" if late[q] is None else ms(late[q] or 0.0) for q in ("p50", "p99"))


def faults_rows(document: dict[str, Any]) -> list[Sequence[object]]:
    """One row per scenario: services, recovery, time to recover, lateness, checks."""
    rows: list[Sequence[object]] = []
    for name, r in document["results"].items():
        failed = [check for check, ok in r["checks"].items() if not ok]
        rows.append(
            (
                f"`{name}`",
                r["instances"],
                f"{r['during']:.0%}",
                f"**{r['recovery']:.0%}**",
                f"{r['recovery_s']:g} s",
                _late_pair(r["late_ms"]["fault"]),
                _late_pair(r["late_ms"]["recovery"]),
                "all passed" if not failed else "FAILED: " + ", ".join(failed),
            )
        )
    return rows


def faults_block(document: dict[str, Any]) -> str:
    shape = document["shape"]
    header = (
        "scenario | services | completion during the fault / baseline | "
        "after it (recovery) | time to recover | "
        "late p50 / p99 during (ms) | late p50 / p99 after (ms) | checks"
    )
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench faults` on {document['date']}: "
            f"{shape['rate']} timers a second over {kit.TENANTS} tenants, each due 1-1.5 s "
            f"after it is sent; phases of {shape['baseline_s']:g} s baseline, "
            f"{shape['fault_s']:g} s fault, {shape['recovery_s']:g} s recovery.",
            markdown_table(header, faults_rows(document), "lrrrrrrl"),
            machine_line(document, "postgres", "nats_server"),
        ]
    )


# -- the handler path by interpreter -----------------------------------------------------------


def _interpreter(document: dict[str, Any], side: str) -> str:
    """A side's interpreter, where it comes from, and the SQLite it links."""
    i = document["interpreters"][side]
    origin = document["settings"]["origins"][side]
    return f"Python {i['python']}, {origin}; SQLite {i['sqlite']}"


def handlers_pythons_table(document: dict[str, Any]) -> str:
    """The handler path at its default settings on each side: its rate (median of the
    rounds), against this interpreter's and against the loop by hand on its own, both the
    median of the rounds' own ratios."""
    this = document["interpreters"]["this"]["python"]
    rows = [
        (
            _interpreter(document, side) + (", eager task starts turned off" if lazy else ""),
            per_s(document[side]["median_per_s"]),
            "1" if side == "this" else f"**{times(document[f'{side}_vs_this'])}**",
            times(document[side]["vs_raw"]),
        )
        for side, lazy in (("this", False), ("other", False), ("other_lazy", True))
    ]
    return markdown_table(
        f"interpreter | `Timer(store, handler=noop)`, default settings | against {this} | "
        "against the loop by hand on the same interpreter",
        rows,
        "lrrr",
    )


def handlers_pythons_block(document: dict[str, Any]) -> str:
    settings = document["settings"]
    interpreters = document["interpreters"]
    rounds = document["rounds"]
    rows = [
        (
            f"`{side}`",
            interpreters[side]["version"].replace("\n", " "),
            " / ".join(count(r[side]["timer"]) for r in rounds),
            " / ".join(count(r[side]["raw"]) for r in rounds),
        )
        for side in ("this", "other", "other_lazy")
    ]
    return "\n\n".join(
        [
            f"Run: `python -m timer_bench handlers-pythons` on {document['date']}: "
            f"`{settings['command']}` in a process of its own per side, this machine's "
            f"interpreter and `.ci/python {settings['python']}`'s (with handler calls' eager "
            f"task starts, and again without), {settings['rounds']} alternated rounds (order "
            "rotated), medians of the per-round ratios.",
            handlers_pythons_table(document),
            f"Rounds: the other interpreter against this one "
            f"{' / '.join(map(str, document['other_vs_this_rounds']))}; with eager starts "
            f"against without {' / '.join(map(str, document['eager_vs_lazy_rounds']))}. "
            "Load average at each side's start, round by round: "
            + " / ".join(
                "-".join(f"{r[side]['load']:g}" for side in ("this", "other", "other_lazy"))
                for r in rounds
            )
            + ".",
            markdown_table(
                "side | interpreter | handler path, timers/s by round | "
                "loop by hand, timers/s by round",
                rows,
                "llrr",
            ),
            machine_line(document),
        ]
    )


BLOCKS: dict[str, Callable[[dict[str, Any]], str]] = {
    "e2e": e2e_block,
    "fire-tenants": fire_tenants_block,
    "scale-out": scale_out_block,
    "scale-out-steady": scale_out_steady_block,
    "backlog-sqlite": backlog_block,
    "backlog-postgres": backlog_block,
    "large-sqlite": large_block,
    "large-postgres": large_block,
    "compare": compare_block,
    "compare-pending": compare_block,
    "otel": otel_block,
    "fairness": fairness_block,
    "flood": flood_block,
    "store": store_block,
    "publish": publish_block,
    "command-order": command_order_block,
    "handlers": handlers_block,
    "isolation": isolation_block,
    "console-sqlite": console_block,
    "console-postgres": console_block,
    "durability": durability_block,
    "handlers-pythons": handlers_pythons_block,
    "faults": faults_block,
}


def block(name: str, results: Path = kit.RESULTS) -> str:
    if not (results / f"{name}.json").exists():
        return (
            f"Not measured yet: `python -m timer_bench {name}` writes `bench/results/{name}.json`."
        )
    return BLOCKS[name](kit.read_result(name, results))


def readme(text: str, results: Path = kit.RESULTS) -> str:
    """``text`` with every results block rewritten from its results file."""
    return MARKERS.sub(lambda m: f"{m[1]}{block(m[2], results)}\n{m[4]}", text)


def main(*, check: bool) -> int:
    text = README.read_text()
    fresh = readme(text)
    if check:
        if fresh != text:
            print("bench/README.md is stale: run `python -m timer_bench render`", file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    print(f"rewrote {len(MARKERS.findall(fresh))} results blocks of {README}")
    return 0
