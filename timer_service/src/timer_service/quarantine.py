"""``timer-service quarantine``: list the running service's quarantined timers and retry them.

A timer whose ``DueTimeReached`` keeps failing to publish while other timers go out is
quarantined by the worker (see :class:`timer_core.TimerWorker`): it stays ``Scheduled`` and
is left out until retried. The record lives in the running service, so these subcommands
ask it over its HTTP endpoint (``TIMER_HTTP_HOST``/``TIMER_HTTP_PORT``), with the service's
``TIMER_HTTP_TOKEN``.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from timer_service.access import bearer
from timer_service.settings import Settings

__all__ = ["QuarantineError", "add_quarantine_parser", "run_quarantine"]

_TIMEOUT_S = 10.0


class QuarantineError(Exception):
    """The service could not be asked; one line says why."""


def add_quarantine_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_common: Callable[[argparse.ArgumentParser], None],
) -> None:
    """The ``quarantine list`` and ``quarantine retry`` subcommands."""
    quarantine = sub.add_parser(
        "quarantine", help="list or retry timers the running service quarantined"
    )
    actions = quarantine.add_subparsers(dest="quarantine_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="show quarantined timers with their last error")
    listing.add_argument("--json", action="store_true", help="print JSON instead of lines")
    retry = actions.add_parser("retry", help="put quarantined timers back in the next pass")
    retry.add_argument("tenant_id", nargs="?")
    retry.add_argument("service_call_id", nargs="?")
    retry.add_argument("--all", action="store_true", help="every quarantined timer")
    for action in (listing, retry):
        add_common(action)
        group = action.add_argument_group("the service's HTTP endpoint")
        group.add_argument("--http-host", dest="TIMER_HTTP_HOST", metavar="HOST")
        group.add_argument("--http-port", dest="TIMER_HTTP_PORT", metavar="PORT")


def _base_url(settings: Settings) -> str:
    host = settings.http_host
    if host in ("", "0.0.0.0", "::"):  # listening everywhere: ask it locally
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.http_port}"


def _ask(settings: Settings, method: str, path: str) -> Any:
    if not settings.http_port:
        raise QuarantineError("TIMER_HTTP_PORT is 0: the service has no HTTP endpoint to ask")
    url = _base_url(settings) + path
    # The service refuses these endpoints without its token (timer_service.access).
    request = urllib.request.Request(url, method=method, headers=bearer(settings.http_token))
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace").strip()
        raise QuarantineError(f"{url}: HTTP {exc.code}: {detail}") from None
    except (OSError, ValueError) as exc:
        raise QuarantineError(
            f"TIMER_HTTP_PORT={settings.http_port}: no Timer service answered at {url} ({exc}); "
            "is `timer-service run` running with its HTTP endpoint there?"
        ) from None


def run_quarantine(settings: Settings, args: argparse.Namespace) -> int:
    """Run ``quarantine list`` or ``quarantine retry``; returns the exit code."""
    if args.quarantine_command == "list":
        rows = _ask(settings, "GET", "/quarantine")
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for row in rows:
                print(
                    f"{row['tenantId']}/{row['serviceCallId']}  due {row['dueAt']}  "
                    f"{row['failures']} failures since {row['since']}: {row['error']}"
                )
            print(f"{len(rows)} quarantined timer(s)", file=sys.stderr)
        return 0
    if args.all == (args.tenant_id is not None):
        raise QuarantineError("quarantine retry: name TENANT SERVICE_CALL, or --all")
    if args.tenant_id is not None and args.service_call_id is None:
        raise QuarantineError("quarantine retry: name the SERVICE_CALL after the TENANT")
    query = ""
    if args.tenant_id is not None:
        query = "?" + urllib.parse.urlencode(
            {"tenant": args.tenant_id, "call": args.service_call_id}
        )
    retried = int(_ask(settings, "POST", "/quarantine/retry" + query)["retried"])
    print(f"{retried} timer(s) put back for the next pass")
    return 0 if retried else 1
