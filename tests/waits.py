"""Waiting on what a test can observe: a predicate, a count that stops, a blocked read
(this module holds no tests). A thread or process is never given a guessed time to get
somewhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def wait_still(
    read: Callable[[], float], *, by: float = 0.0, over: float = 0.2, timeout: float = 60.0
) -> float:
    """Until `read()`, a count that grows while a thread or process works (engine steps, CPU
    seconds), grows by no more than `by` in `over` seconds: that work waits now. Returns the
    last reading."""
    deadline = time.monotonic() + timeout
    last = read()
    while True:
        time.sleep(over)
        now = read()
        if now - last <= by:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"still moving: {last} then {now} in {over} s")
        last = now


def named(url: str, name: str) -> str:
    """`url` with a client name: CLIENT LIST shows what its connections do."""
    return f"{url}{'&' if '?' in url else '?'}client_name={name}"


def blocked_in_xread(conn: redis.Redis, name: str) -> bool:
    """Whether a connection named `name` waits in a blocked XREAD now."""
    return any(
        c["name"] == name and c["cmd"] == "xread" and "b" in c["flags"] for c in conn.client_list()
    )
