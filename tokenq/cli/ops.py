"""The operator's commands: `inspect`, `result`, `cancel`, `dlq`, `exporter` (no torch).

They read and act on the keys of docs/protocol.md directly, so they work against any
fleet without asking a worker; `tokenq/ops/fleet.py` reads the fleet, `tokenq/ops/dlq.py` the
dead letters.

Exit statuses, as every client command's (tokenq/cli/): 0 done; 1 the job failed
(`result` prints its error); 2 usage, an unknown job or dead-letter id, a dead letter that
cannot be replayed, or Redis unreachable (one line naming the URL, never its password);
3 QueueFull (`dlq replay`); 4 the job has not ended (`result`, within --timeout); 130
interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server

from tokenq.cli.client import event_json
from tokenq.cli.options import (
    EXIT_JOB_FAILED,
    EXIT_NO_REDIS,
    EXIT_QUEUE_FULL,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    common_options,
    flag_option,
    option,
    refused,
)
from tokenq.ops.dlq import DeadLetter, DeadLetters, NotFound, NotReplayable
from tokenq.ops.fleet import DEFAULT_RESCAN_S, DEFAULT_STALE_S, Fleet, FleetCollector, FleetReader
from tokenq.producer.client import Client, ClientConfig
from tokenq.producer.errors import QueueFull
from tokenq.protocol import (
    DONE,
    ERROR,
    JOB_ID_RE,
    NO_TENANT,
    TERMINAL_EVENTS,
    ErrorEvent,
    Event,
    decode_event,
    lane_of,
    quote,
)
from tokenq.protocol.connection import Cluster, connect, redacted

RETRY_FOR = 5.0  # seconds a command rides out an unreachable Redis before it says so
EXPORTER_PORT = 9310
EXITS = {
    "inspect": "exit status: 0 shown; 2 Redis unreachable; 130 interrupted",
    "result": "exit status: 0 done (text printed); 1 the job failed (its error printed); "
    "2 unknown job or Redis unreachable; 4 not ended (within --timeout)",
    "cancel": "exit status: 0 cancel requested, or the job had already ended; "
    "2 unknown job or Redis unreachable",
    "dlq": "exit status: 0 done; 2 unknown dead letter, not replayable, purge not confirmed, "
    "or Redis unreachable; 3 replay: the lane is full (QueueFull)",
    "exporter": "exit status: 2 the port cannot be served; 130 interrupted",
}


class Failure(Exception):
    """A command's one-line error and its exit status."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def add_commands(sub: Any) -> None:
    """Register the commands on the `tokenq` command's subparsers."""

    def parser(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EXITS[name])
        common_options(p)
        return p

    inspect = parser(
        "inspect", "the fleet: workers, queues and backlog, pending entries, dead letters"
    )
    flag_option(inspect, "--json", "print JSON (one object per refresh with --watch)")
    option(
        inspect,
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        help="refresh every N seconds (2 if no N is given) until interrupted",
    )
    option(
        inspect,
        "--stale-after",
        type=float,
        default=DEFAULT_STALE_S,
        help="seconds of silence after which a worker is not live",
    )
    option(inspect, "--entries", type=int, default=10, help="pending entries listed per consumer")
    inspect.set_defaults(run=cmd_inspect)

    result = parser("result", "print a job's final text, or its error")
    result.add_argument("job_id", help="the job id")
    flag_option(result, "--json", "print the final event as JSON")
    option(
        result,
        "--timeout",
        type=float,
        default=0.0,
        help="seconds to wait for the end (0: answer at once)",
    )
    result.set_defaults(run=cmd_result)

    cancel = parser("cancel", "cancel a job, queued or running")
    cancel.add_argument("job_id", help="the job id")
    cancel.set_defaults(run=cmd_cancel)

    dlq = sub.add_parser("dlq", help="dead letters: list, show, replay, purge", epilog=EXITS["dlq"])
    verbs = dlq.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="the newest dead letters", epilog=EXITS["dlq"])
    common_options(listing)
    flag_option(listing, "--json", "print JSON")
    option(listing, "--limit", type=int, default=20, help="how many, newest first")
    listing.set_defaults(run=cmd_dlq_list)
    show = verbs.add_parser(
        "show", help="one dead letter and its job's payload", epilog=EXITS["dlq"]
    )
    common_options(show)
    show.add_argument("ref", help="a dead letter's id (from `dlq list`) or a job id")
    flag_option(show, "--json", "print JSON")
    show.set_defaults(run=cmd_dlq_show)
    replay = verbs.add_parser(
        "replay",
        help="put a dead job back on its queue (same job id and payload), after fixing the cause",
        epilog=EXITS["dlq"],
    )
    common_options(replay)
    replay.add_argument("ref", help="a dead letter's id (from `dlq list`) or a job id")
    option(
        replay,
        "--max-backlog",
        type=int,
        help="QueueFull beyond this many outputs in the lane (a job of n counts n)",
    )
    replay.set_defaults(run=cmd_dlq_replay)
    purge = verbs.add_parser("purge", help="delete every dead letter", epilog=EXITS["dlq"])
    common_options(purge)
    flag_option(purge, "--yes", "do not ask for confirmation")
    purge.set_defaults(run=cmd_dlq_purge)

    exporter = parser(
        "exporter",
        "serve the fleet's gauges (queues, pending, dead letters, workers) to Prometheus",
    )
    option(exporter, "--port", type=int, default=EXPORTER_PORT, help="HTTP port")
    option(exporter, "--addr", default="0.0.0.0", help="address to bind")
    option(
        exporter,
        "--stale-after",
        type=float,
        default=DEFAULT_STALE_S,
        help="seconds of silence after which a worker is not live",
    )
    option(
        exporter,
        "--rescan",
        type=float,
        default=DEFAULT_RESCAN_S,
        help="seconds between SCANs for model names",
    )
    exporter.set_defaults(run=cmd_exporter)


def _with_client(args: argparse.Namespace, body: Callable[[Client], int]) -> int:
    """Run `body` with a client; every failure becomes one line on stderr and a status."""
    try:
        with Client(args.redis_url, namespace=args.namespace, retry_for=RETRY_FOR) as client:
            return body(client)
    except Failure as exc:
        return _fail(str(exc), exc.status)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return _fail(f"cannot reach Redis at {redacted(args.redis_url)}: {exc}", EXIT_NO_REDIS)
    except redis.RedisError as exc:
        return _fail(refused(args.redis_url, exc), EXIT_USAGE)
    except ValueError as exc:  # a malformed URL
        return _fail(str(exc), EXIT_USAGE)


def _fail(message: str, status: int) -> int:
    print(f"tokenq: {message}", file=sys.stderr)
    return status


# --- inspect ---------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    def body(client: Client) -> int:
        rescan = 0.0 if args.watch is None else max(10.0, 5 * args.watch)
        conn = client.cluster or client.redis
        reader = FleetReader(conn, args.namespace, stale_s=args.stale_after, rescan_s=rescan)
        while True:
            fleet = reader.read(entries=args.entries)
            if args.json:
                print(json.dumps(fleet.to_json()), flush=True)
            else:
                if args.watch is not None and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")
                print(render(fleet, redacted(args.redis_url)), flush=True)
            if args.watch is None:
                return 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0

    return _with_client(args, body)


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


def render(fleet: Fleet, url: str) -> str:
    """`tokenq inspect`'s text: what an operator reads first comes first."""
    out = [f"tokenq fleet at {url}, namespace {fleet.namespace}, {_when(fleet.at)}", ""]
    out.append("models")
    if not fleet.models:
        out.append("  none: no live worker and no queue")
    for m in fleet.models:
        served = ", ".join(m.workers) if m.workers else "no live worker"
        out.append(f"  {m.name} (served by {served})")
        out.append(f"    {'lane':<12} {'backlog':>8} {'waiting':>8} {'pending':>8}  oldest waiting")
        for name, lane in m.lanes.items():
            oldest = "-"
            if lane.oldest is not None:
                oldest = f"{_age(lane.oldest.age_s)} (job {lane.oldest.job_id or '?'})"
            out.append(
                f"    {name:<12} {lane.backlog:>8} {lane.waiting:>8} {lane.pending:>8}  {oldest}"
            )
    out += ["", "workers"]
    if not fleet.workers:
        out.append("  none registered")
    for w in fleet.workers:
        state = "live" if w.live else "silent"
        what = f"serves {', '.join(w.names)}, {w.host}:{w.pid}" if w.names else "entry expired"
        load = ""
        if w.load:
            load = (
                f", running {w.load.get('num_requests_running', 0):.0f}, "
                f"waiting {w.load.get('num_requests_waiting', 0):.0f}, "
                f"KV cache {100 * w.load.get('kv_cache_usage_perc', 0):.0f}%"
            )
        age = _age(w.heartbeat_age_s)
        out.append(f"  {w.consumer}: {state}, heartbeat {age} ago, {what}{load}")
    out += ["", "pending entries (taken, not acknowledged)"]
    if not fleet.pending:
        out.append("  none")
    for c in fleet.pending:
        state = (
            "live"
            if c.live
            else "NOT LIVE: another worker takes them once idle past the claim time"
        )
        idle = _age(c.max_idle_s)
        out.append(f"  {c.consumer} ({state}): {c.count} entries, longest idle {idle}")
        for e in c.entries:
            out.append(
                f"    job {e.job_id or '?'}  {e.model}/{e.lane}  entry {e.entry_id}  "
                f"idle {_age(e.idle_s)}  deliveries {e.deliveries}"
            )
        if c.count > len(c.entries):
            out.append(f"    ... and {c.count - len(c.entries)} more")
    out += [
        "",
        f"dead letters: {fleet.dead_letters}"
        + ("  (tokenq dlq list)" if fleet.dead_letters else ""),
    ]
    hooks = fleet.webhooks
    out += [
        "",
        f"webhooks: {hooks.backlog} events to deliver ({hooks.held} held by dispatchers) in "
        f"{hooks.streams} streams; {hooks.failures} deliveries given up; {hooks.endpoints} "
        f"endpoints ({hooks.endpoints_disabled} disabled)",
    ]
    for f in hooks.recent_failures:
        when = _when(float(f.get("at") or 0))
        out.append(
            f"  {when}  {f.get('type')} of {f.get('subject')} to {f.get('url')}: "
            f"{f.get('outcome')} ({f.get('reason')})"
        )
    return "\n".join(out)


# --- result, cancel --------------------------------------------------------------------


def _job_id(text: str) -> str:
    if not JOB_ID_RE.fullmatch(text):
        raise Failure(f"{quote(text)} is not a job id (must match {JOB_ID_RE.pattern})")
    return text


def _final_event(client: Client, job_id: str) -> Event | None:
    """The reply's terminal event if it is there (always the stream's last entry)."""
    last = client.redis.xrevrange(client.keys_of(job_id).reply(job_id), "+", "-", count=1)
    if not last:
        return None
    event = decode_event(*last[0])
    return event if event.type in TERMINAL_EVENTS else None


def _unknown(client: Client, job_id: str) -> Failure:
    return Failure(
        f"no job {job_id} in namespace {client.keys.namespace} "
        "(never submitted, or its id has expired)"
    )


def cmd_result(args: argparse.Namespace) -> int:
    def body(client: Client) -> int:
        job_id = _job_id(args.job_id)
        event = _final_event(client, job_id)
        job = client.job(job_id)
        status = "" if event is not None else job.status()
        if status in (DONE, ERROR):
            event = _final_event(client, job_id)  # it may have ended since the first look
        if event is None:
            if status == "unknown":
                raise _unknown(client, job_id)
            if status in (DONE, ERROR):
                raise Failure(f"job {job_id} ended ({status}) but its reply has expired")
            if args.timeout <= 0:
                raise Failure(f"job {job_id} has not ended: it is {status}", EXIT_TIMEOUT)
            try:
                *_, event = job.stream(timeout=args.timeout)
            except TimeoutError:
                raise Failure(
                    f"job {job_id} did not end within {args.timeout}s", EXIT_TIMEOUT
                ) from None
        if args.json:
            print(json.dumps({"job_id": job_id, **event_json(event)}))
        elif isinstance(event, ErrorEvent):
            print(f"tokenq: job {job_id} failed: {event.code}: {event.message}", file=sys.stderr)
        else:
            print(event.text)  # type: ignore[union-attr]
        return EXIT_JOB_FAILED if isinstance(event, ErrorEvent) else 0

    return _with_client(args, body)


def cmd_cancel(args: argparse.Namespace) -> int:
    def body(client: Client) -> int:
        job = client.job(_job_id(args.job_id))
        status = job.status()
        if status == "unknown":
            raise _unknown(client, job.id)
        if status in (DONE, ERROR):
            print(f"job {job.id} has already ended ({status}): nothing to cancel")
            return 0
        job.cancel()
        print(f"cancel requested for job {job.id} ({status}): it ends with finish reason cancelled")
        return 0

    return _with_client(args, body)


# --- dlq -------------------------------------------------------------------------------


def _find(letters: DeadLetters, ref: str) -> DeadLetter:
    try:
        return letters.find(ref)
    except NotFound as exc:
        raise Failure(str(exc)) from None


def _queue_label(client: Client, queue: str | None) -> str:
    """model/lane (and tenant) of a queue's key, for listings."""
    keys = client.keys
    if client.layout.sharded and (queue or "").startswith(f"{keys.namespace}:{{"):
        keys = client.layout.of_key(queue)  # type: ignore[arg-type]
    where = keys.parse_queue(queue or "")
    if where is None:
        return queue or "?"
    model, priority, tenant = where
    return f"{model}/{lane_of(priority)}" + ("" if tenant == NO_TENANT else f"/{tenant}")


def cmd_dlq_list(args: argparse.Namespace) -> int:
    def body(client: Client) -> int:
        letters = DeadLetters(client.cluster or client.redis, args.namespace)
        total, newest = letters.count(), letters.newest(args.limit)
        if args.json:
            print(json.dumps({"count": total, "dead_letters": [d.summary() for d in newest]}))
            return 0
        where = ", ".join(letters.streams)
        print(f"{total} dead letter(s) in {where}" + (", newest first:" if total else ""))
        for d in newest:
            print(
                f"  {d.id}  {_when(d.failed_at)}  job {d.job_id or '?'}  {d.code}  "
                f"queue {_queue_label(client, d.queue)}  deliveries {d.deliveries}  "
                f"{d.message[:100]}{'  [truncated]' if d.truncated else ''}"
            )
        if total > len(newest):
            print(f"  ... and {total - len(newest)} older (--limit)")
        return 0

    return _with_client(args, body)


def cmd_dlq_show(args: argparse.Namespace) -> int:
    def body(client: Client) -> int:
        letter = _find(DeadLetters(client.cluster or client.redis, args.namespace), args.ref)
        data = letter.to_json()
        if args.json:
            print(json.dumps(data, default=repr))
            return 0
        for key in (
            "id",
            "job_id",
            "code",
            "message",
            "deliveries",
            "consumer",
            "queue",
            "entry_id",
            "truncated",
        ):
            print(f"{key}: {data[key]}")
        print(f"failed_at: {_when(letter.failed_at)}")
        print(f"fields: {json.dumps(data['fields'])}")
        if data["payload"] is None:
            print(f"payload: unreadable ({data['data_bytes']} bytes kept)")
        else:
            print("payload: " + json.dumps(data["payload"], indent=2, default=repr))
        return 0

    return _with_client(args, body)


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    def body(client: Client) -> int:
        letters = DeadLetters(client.cluster or client.redis, args.namespace)
        letter = _find(letters, args.ref)
        config = ClientConfig(namespace=args.namespace)
        if args.max_backlog is not None:
            config = ClientConfig(namespace=args.namespace, max_backlog=args.max_backlog)
        try:
            queue = letters.replay(letter, config)
        except (NotFound, NotReplayable) as exc:
            raise Failure(str(exc)) from None
        except QueueFull as exc:
            raise Failure(str(exc), EXIT_QUEUE_FULL) from None
        print(f"replayed job {letter.job_id} onto {queue} (dead letter {letter.id} removed)")
        model = client.layout.of(letter.job_id or "").parse_queue(queue)[0]  # type: ignore[index]
        served = {n for m in client.models() for n in (m.id, *m.aliases)}
        if model not in served:
            print(f"note: no live worker serves {model} now: the job waits for one")
        return 0

    return _with_client(args, body)


def cmd_dlq_purge(args: argparse.Namespace) -> int:
    def body(client: Client) -> int:
        letters = DeadLetters(client.cluster or client.redis, args.namespace)
        tops, where = letters.tops(), ", ".join(letters.streams)
        if not tops:
            print(f"no dead letters in {where}")
            return 0
        count = letters.count()
        if not args.yes:
            if not sys.stdin.isatty():
                raise Failure(f"purge deletes {count} dead letter(s): confirm with --yes")
            answer = input(f"Delete the {count} dead letter(s) in {where}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                raise Failure("purge not confirmed: nothing deleted")
        deleted = letters.purge(tops)
        print(f"deleted {deleted} dead letter(s)")
        return 0

    return _with_client(args, body)


# --- exporter --------------------------------------------------------------------------


def cmd_exporter(args: argparse.Namespace) -> int:
    url = redacted(args.redis_url)
    try:
        conn = connect(
            args.redis_url, socket_connect_timeout=2, socket_timeout=5, health_check_interval=30
        )
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except redis.ConnectionError as exc:  # no seed of a redis+cluster:// URL answered
        return _fail(f"cannot reach Redis at {url}: {exc}", EXIT_NO_REDIS)
    registry = CollectorRegistry()
    registry.register(
        FleetCollector(conn, args.namespace, stale_s=args.stale_after, rescan_s=args.rescan)
    )
    try:
        start_http_server(args.port, args.addr, registry=registry)
    except OSError as exc:
        return _fail(f"cannot serve on {args.addr}:{args.port}: {exc}", EXIT_USAGE)
    try:
        (conn.redis if isinstance(conn, Cluster) else conn).ping()
    except redis.RedisError as exc:
        print(
            f"tokenq exporter: Redis at {url} does not answer yet ({exc}): "
            "tokenq:redis_up is 0 until it does",
            file=sys.stderr,
        )
    print(
        f"tokenq exporter: fleet gauges of {url} namespace {args.namespace} at "
        f"http://{args.addr}:{args.port}/metrics",
        file=sys.stderr,
        flush=True,
    )
    threading.Event().wait()  # the server runs in its own thread until a signal ends us
    return 0
