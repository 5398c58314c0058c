"""The PUBLISH script's duplicate guard, called directly on a real Redis: a call sent again
(its answer lost), or one that overlaps what an earlier call wrote, adds only the events
the reply stream lacks, each under its own sequence id; a stream the worker did not write
gets its events under auto ids rather than losing them."""

from __future__ import annotations

import redis

from tokenq.protocol import Keys, TokenEvent, decode_event
from tokenq.worker.scripts import Item, Scripts, event_arg

FENCE = b"w1:fence"


def _scripts(conn: redis.Redis, namespace: str, jobs: list[str]) -> Scripts:
    keys = Keys(namespace)
    for jid in jobs:
        conn.set(keys.owner(jid), FENCE)
        conn.set(keys.job(jid), "running")
    return Scripts(conn, keys, "workers", "w1")


def _tokens(first: int, n: int) -> list[bytes]:
    return [
        event_arg(TokenEvent(i - 1, [100 + i], f" t{i}", None)) for i in range(first, first + n)
    ]


def _run(scripts: Scripts, jid: str, first: int, events: list[bytes]) -> list[tuple[str, bool]]:
    item = Item("run", b"q", b"1-1", jid, first_seq=first, events=events)
    return scripts.publish(FENCE, [item], 600, 3600, 1000)


def _reply(conn: redis.Redis, namespace: str, jid: str) -> list[tuple[bytes, list[int]]]:
    entries = conn.xrange(Keys(namespace).reply(jid))
    return [(eid, decode_event(eid, fields).token_ids) for eid, fields in entries]


def test_a_resent_or_overlapping_publish_adds_only_missing_events(
    redis_conn: redis.Redis, redis_namespace: str
) -> None:
    scripts = _scripts(redis_conn, redis_namespace, ["a", "b"])
    assert _run(scripts, "a", 1, _tokens(1, 3)) == [("ok", False)]
    assert _run(scripts, "a", 1, _tokens(1, 3)) == [("ok", False)]  # sent again
    assert _run(scripts, "a", 2, _tokens(2, 4)) == [("ok", False)]  # overlaps two of three
    assert _run(scripts, "a", 6, _tokens(6, 1)) == [("ok", False)]
    want = [(f"0-{i}".encode(), [100 + i]) for i in range(1, 7)]
    assert _reply(redis_conn, redis_namespace, "a") == want
    # One call for two jobs, one of them re-sent: the other's events all land.
    both = [
        Item("run", b"q", b"1-1", "a", first_seq=6, events=_tokens(6, 2)),
        Item("run", b"q", b"1-2", "b", first_seq=1, events=_tokens(1, 2)),
    ]
    assert scripts.publish(FENCE, both, 600, 3600, 1000) == [("ok", False)] * 2
    assert _reply(redis_conn, redis_namespace, "a") == [*want, (b"0-7", [107])]
    assert _reply(redis_conn, redis_namespace, "b") == [(b"0-1", [101]), (b"0-2", [102])]


def test_a_reply_stream_with_foreign_ids_gets_the_events_under_auto_ids(
    redis_conn: redis.Redis, redis_namespace: str
) -> None:
    scripts = _scripts(redis_conn, redis_namespace, ["f"])
    redis_conn.xadd(Keys(redis_namespace).reply("f"), {"note": "written by someone else"})
    assert _run(scripts, "f", 1, _tokens(1, 2)) == [("ok", False)]
    entries = redis_conn.xrange(Keys(redis_namespace).reply("f"))
    assert len(entries) == 3
    assert all(not eid.startswith(b"0-") for eid, _ in entries)
    assert [decode_event(eid, f).token_ids for eid, f in entries[1:]] == [[101], [102]]


def test_a_publish_goes_through_after_a_script_flush_or_a_killed_connection(
    redis_conn: redis.Redis, redis_namespace: str
) -> None:
    # Its own client, named, so that only its connection is killed on a shared server.
    kwargs = redis_conn.connection_pool.connection_kwargs
    own = redis.Redis(host=kwargs["host"], port=kwargs["port"], client_name="tokenq-publish-test")
    scripts = _scripts(own, redis_namespace, ["a"])
    assert _run(scripts, "a", 1, _tokens(1, 1)) == [("ok", False)]
    redis_conn.script_flush()
    assert _run(scripts, "a", 2, _tokens(2, 1)) == [("ok", False)]
    for client in redis_conn.client_list():
        if client["name"] == "tokenq-publish-test":
            redis_conn.client_kill_filter(_id=client["id"])
    assert _run(scripts, "a", 3, _tokens(3, 1)) == [("ok", False)]
    want = [(f"0-{i}".encode(), [100 + i]) for i in range(1, 4)]
    assert _reply(redis_conn, redis_namespace, "a") == want
    own.close()


def test_an_acknowledgement_takes_the_entrys_weight_off_its_backlog_never_below_0(
    redis_conn: redis.Redis, redis_namespace: str
) -> None:
    scripts = _scripts(redis_conn, redis_namespace, ["a", "b"])
    keys = Keys(redis_namespace)
    queue, backlog = keys.queue("m", 0, "-"), keys.backlog("m", "default")
    entries = [redis_conn.xadd(queue, {"id": jid}) for jid in ("a", "b")]
    redis_conn.set(backlog, 7)
    done = [
        Item("run", queue.encode(), eid, jid, first_seq=1, status="done", backlog=backlog, weight=w)
        for eid, jid, w in zip(entries, ("a", "b"), (5, 4), strict=True)
    ]
    assert scripts.publish(FENCE, done[:1], 600, 3600, 1000) == [("ok", False)]
    assert redis_conn.get(backlog) == b"2"
    assert scripts.publish(FENCE, done[1:], 600, 3600, 1000) == [("ok", False)]
    assert redis_conn.get(backlog) == b"0"
