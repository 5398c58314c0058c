"""The gateway's operator endpoints (tokenq/server/dashboard.py), in the gateway's app served by
uvicorn: /metrics scraped and parsed with prometheus_client's parser, and /dashboard
loaded in a real headless Chromium (Debian's `chromium` and `chromium-driver`, driven by
selenium) while a real worker process runs jobs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from tests.faults import WorkerProcess, free_port
from tests.redis_fixtures import CLIENT
from tests.test_ops import dead_letter, parse, total
from tests.worker_support import tiny_model, wait_for  # noqa: F401
from tokenq.ops.fleet import FLEET_METRICS, Fleet, RegisteredWorker
from tokenq.producer.client import Client
from tokenq.producer.errors import JobFailed
from tokenq.server.dashboard import Rates
from tokenq.server.gateway import GatewayConfig, create_app

GREEDY = {"temperature": 0, "ignore_eos": True}
APT = "apt-get update -qq && apt-get install -y -qq chromium chromium-driver"


class AppServer:
    """A FastAPI app served by uvicorn on a free port, on a thread of this process."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> AppServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def app_for(url: str, namespace: str) -> FastAPI:
    """The gateway's own app (`tokenq serve` serves the same)."""
    return create_app(GatewayConfig(redis_url=url, namespace=namespace))


def get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_the_gateways_metrics_are_the_fleets_gauges(redis_url: str, redis_namespace: str) -> None:
    """Jobs waiting in two lanes, two taken by a consumer, a dead letter, a live worker:
    /metrics answers Prometheus's text format with exactly that."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    conn, keys = client.redis, client.keys
    for lane, n in (("interactive", 1), ("batch", 3)):
        for i in range(n):
            client.submit(f"{lane} {i}", lane=lane)
    queue = f"{redis_namespace}:jobs:tiny:1:-"
    conn.xgroup_create(queue, "workers", id="0")
    conn.xreadgroup("workers", "taker", {queue: ">"}, count=2)
    dead_letter(conn, keys, "dead-0")
    conn.zadd(keys.workers, {"w1": int(time.time() * 1000)})
    conn.hset(keys.worker("w1"), mapping={"names": json.dumps(["tiny"]), "pid": 1})
    with AppServer(app_for(redis_url, redis_namespace)) as app:
        status, kind, body = get(app.url + "/metrics")
    assert status == 200
    assert kind.startswith("text/plain") and "version=" in kind
    samples = parse(body)
    assert {n for n, _, _ in samples} == set(FLEET_METRICS)
    assert total(samples, "tokenq:redis_up") == 1

    def lane(name: str, lane: str) -> float:
        return total(samples, f"tokenq:queue_{name}", model="tiny", lane=lane)

    assert [lane("backlog", x) for x in ("interactive", "default", "batch")] == [1, 0, 3]
    assert [lane("waiting", x) for x in ("interactive", "default", "batch")] == [1, 0, 1]
    assert [lane("pending", x) for x in ("interactive", "default", "batch")] == [0, 0, 2]
    assert total(samples, "tokenq:pending_entries", consumer="taker") == 2
    assert total(samples, "tokenq:dead_letters") == 1
    assert total(samples, "tokenq:workers_live", model="tiny") == 1
    client.close()


def test_without_redis_metrics_say_so_and_the_page_data_is_a_clear_error() -> None:
    with AppServer(app_for(f"redis://127.0.0.1:{free_port()}/0", "nowhere")) as app:
        status, _, body = get(app.url + "/metrics")
        assert status == 200
        assert [(n, v) for n, _, v in parse(body)] == [("tokenq:redis_up", 0)]
        status, kind, body = get(app.url + "/dashboard/data")
        assert status == 503 and kind == "application/json"
        assert json.loads(body)["error"]["message"].startswith("Redis did not answer: ")
        status, kind, page = get(app.url + "/dashboard")
        assert status == 200 and kind.startswith("text/html")  # the page shows the error


# --- the page in a browser ----------------------------------------------------------------


def chromium() -> tuple[str, str]:
    """Debian's chromium and its driver, installed now if they are missing and this runs as
    root (as CI does; `make test` tries first); else the test is skipped, saying why."""

    def found() -> tuple[str | None, str | None]:
        return shutil.which("chromium"), shutil.which("chromedriver")

    browser, driver = found()
    if browser and driver:
        return browser, driver
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        why = "not root, or no apt-get"
    else:
        proc = subprocess.run(APT, shell=True, capture_output=True, text=True, timeout=1200)
        browser, driver = found()
        if browser and driver:
            return browser, driver
        why = f"`{APT}` failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    pytest.skip(f"chromium and chromium-driver are not installed and cannot be installed ({why})")


@pytest.fixture
def browser() -> Iterator[Any]:
    path, driver_path = chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = path
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1200")
    # The Debian driver, given: selenium downloads nothing.
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def text(driver: Any, element_id: str) -> str | None:
    from selenium.common.exceptions import NoSuchElementException

    try:
        return driver.find_element("id", element_id).text
    except NoSuchElementException:
        return None


def cell(driver: Any, row_id: str, column: str) -> str | None:
    """The text of one cell (its class names the column) of the row with that id, or None;
    read in one script run (see `rows`)."""
    script = (
        "const row = document.getElementById(arguments[0]);"
        " const cell = row && row.getElementsByClassName(arguments[1])[0];"
        " return cell ? cell.textContent : null;"
    )
    return driver.execute_script(script, row_id, column)


def rows(driver: Any, table_id: str) -> list[list[str]]:
    """The cells' text of a table's body, read in one script run (the page redraws its
    tables every second: elements found one by one may be gone by the next lookup)."""
    script = (
        "return Array.from(document.getElementById(arguments[0]).tBodies[0].rows,"
        " r => Array.from(r.cells, c => c.textContent))"
    )
    return driver.execute_script(script, table_id)


def number(shown: str | None) -> float:
    """A figure as the page shows it ('12.5', '340 ms', '1.2 s'), in plain units (s)."""
    if shown is None or shown in ("", "-"):
        return float("nan")
    if shown.endswith(" ms"):
        return float(shown[:-3]) / 1000
    if shown.endswith(" s"):
        return float(shown[:-2])
    return float(shown)


def wait(driver: Any, what: str, predicate: Any, timeout: float = 60) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: predicate())
    except Exception as exc:
        status = text(driver, "status")
        raise AssertionError(f"page never showed {what} (status: {status})") from exc


def test_the_dashboard_shows_the_fleet_moving(
    tiny_model: Path,  # noqa: F811
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
    browser: Any,
) -> None:
    """A worker process, the app, Chromium on /dashboard: the page shows the worker, lane
    depths, tokens per second while jobs run, their TTFT (the mean of what their done
    events say), and a dead letter with its code (its message as text, never as HTML)."""
    client = Client(redis_url, namespace=redis_namespace, **CLIENT)
    nobody = [client.submit(f"later {i}", model="other", lane="batch") for i in range(3)]
    log = tmp_path / "worker.log"
    extra = ["--registry-interval", "0.3"]
    with (
        WorkerProcess(
            tiny_model, redis_url, redis_namespace, log, consumer="w1", extra=extra
        ) as worker,
        AppServer(app_for(redis_url, redis_namespace)) as app,
    ):
        browser.get(app.url + "/dashboard")
        assert browser.title == "tokenq fleet"
        wait(browser, "the worker", lambda: text(browser, "live-workers") == "1", timeout=120)
        assert cell(browser, "worker-w1", "model") == "tiny"
        assert (cell(browser, "worker-w1", "heartbeat") or "").endswith(" ago")
        assert text(browser, "total-tokens-per-s") == "0.0"
        assert text(browser, "total-ttft") == "-"
        assert cell(browser, "lane-other-batch", "depth") == "3"
        assert cell(browser, "lane-other-batch", "waiting") == "3"
        assert cell(browser, "lane-other-batch", "workers") == "none live"
        assert text(browser, "dead-count") == "0"

        # Four long jobs: while they run, tokens/s moves and the default lane is 4 deep.
        long = [client.submit(f"long {i}", max_tokens=1800, **GREEDY) for i in range(4)]
        wait(
            browser,
            "tokens/s while four jobs run",
            lambda: (
                number(text(browser, "total-tokens-per-s")) > 0
                and number(cell(browser, "worker-w1", "tokens-per-s")) > 0
                and cell(browser, "worker-w1", "running") == "4"
                and cell(browser, "lane-tiny-default", "depth") == "4"
                and cell(browser, "lane-tiny-default", "pending") == "4"
            ),
        )
        for job in long:
            job.cancel()
        dones = [job.result(timeout=60) for job in long]
        assert {d.finish_reason for d in dones} == {"cancelled"}
        dones += [client.submit(f"short {i}", max_tokens=3, **GREEDY).result(60) for i in range(3)]
        ttfts = [d.timings.time_to_first_token for d in dones]
        assert all(t is not None for t in ttfts)
        expected = sum(ttfts) / len(ttfts)  # type: ignore[arg-type]

        # A job the worker refuses: a dead letter whose message quotes the bad value.
        bad = client.submit("bad sampling", temperature="<b>bold</b>")
        with pytest.raises(JobFailed, match="invalid_params"):
            bad.result(timeout=30)
        wait(browser, "the dead letter", lambda: text(browser, "dead-count") == "1")
        ((job, code, message, failed),) = rows(browser, "dead")
        assert (job, code) == (bad.id, "invalid_params")
        assert "'<b>bold</b>'" in message and failed.endswith(" ago")
        assert browser.find_elements("css selector", "#dead b") == []

        # TTFT: once the worker's heartbeat has counted the seven jobs, the figure is
        # their mean (as their done events give it), in the data and on the page.
        registry = client.keys.worker("w1")
        wait_for(lambda: client.redis.hget(registry, "ttft_count") == b"7")
        generated = float(client.redis.hget(registry, "tokens_generated") or 0)
        assert generated == sum(d.usage.completion_tokens for d in dones)
        _, _, body = get(app.url + "/dashboard/data")
        data = json.loads(body)
        assert data["totals"]["ttft_s"] == pytest.approx(expected, abs=1e-3)
        wait(
            browser,
            "the jobs' TTFT",
            lambda: number(text(browser, "total-ttft")) == pytest.approx(expected, abs=2e-3),
        )
        assert cell(browser, "lane-tiny-default", "depth") == "0"
        (row_data,) = data["workers"]
        assert row_data["ttft_s"] == data["totals"]["ttft_s"]
        assert row_data["running"] == 0
        points = data["history"]["points"]
        assert max(p[1] for p in points) > 0  # the chart has the run in it
        assert "L" in (
            browser.find_element("css selector", "#chart-tokens path").get_attribute("d")
        )
        assert cell(browser, "lane-other-batch", "depth") == "3"

        # A worker that stops leaves the registry: the page drops it.
        worker.proc.send_signal(signal.SIGTERM)
        worker.wait_clean_exit(60)
        wait(browser, "no worker", lambda: text(browser, "live-workers") == "0")
        assert browser.find_elements("id", "worker-w1") == []
        assert text(browser, "total-tokens-per-s") == "0.0"
        assert cell(browser, "lane-tiny-default", "workers") == "none live"
    assert not [j for j in nobody if j.status() != "queued"]
    client.close()


def test_the_dashboard_says_when_redis_does_not_answer(browser: Any) -> None:
    with AppServer(app_for(f"redis://127.0.0.1:{free_port()}/0", "nowhere")) as app:
        browser.get(app.url + "/dashboard")
        wait(browser, "the error", lambda: (text(browser, "status") or "").startswith("no data"))
        assert "Redis did not answer" in text(browser, "status")  # type: ignore[operator]
        assert browser.find_element("id", "status").get_attribute("class") == "error"
        assert text(browser, "live-workers") == "-"


# --- rates from heartbeats, without Redis ---------------------------------------------------


def beat(
    consumer: str, at: float, now: float, tokens: float, ttft: tuple[float, float]
) -> RegisteredWorker:
    figures = {"tokens_generated": tokens, "ttft_sum_s": ttft[0], "ttft_count": ttft[1]}
    return RegisteredWorker(consumer, now - at <= 30, at, now - at, ["tiny"], figures=figures)


def fleet_at(now: float, *workers: RegisteredWorker) -> Fleet:
    return Fleet("ns", now, [], list(workers), [], 0)


def test_rates_come_from_the_counters_between_heartbeats() -> None:
    rates = Rates(history_s=600, sample_s=1, ttft_window_s=60)
    rates.observe(fleet_at(100, beat("a", 100, 100, 1000, (0, 0)), beat("b", 99, 100, 50, (0, 0))))
    assert rates.points[-1] == (100, 0, None)  # one heartbeat each: no rate yet
    a = beat("a", 102, 102.5, 1400, (0.5, 2))  # 400 tokens in 2 s, two requests
    b = beat("b", 101, 102.5, 150, (0.3, 1))  # 100 in 2 s, one
    rates.observe(fleet_at(102.5, a, b))
    assert rates.tokens_per_s([a]) == 200 and rates.tokens_per_s([a, b]) == 250
    assert rates.ttft([a, b]) == pytest.approx(0.8 / 3)
    assert rates.points[-1] == (102.5, 250, pytest.approx(0.8 / 3))
    # The same heartbeats read again add no interval, and a point at most once per second.
    rates.observe(fleet_at(103, a, b))
    assert len(rates.points) == 2 and rates.tokens_per_s([a, b]) == 250
    # b's next heartbeat is overdue (more than twice its interval and a second): it has
    # stopped, its rate counts no more, but the requests it finished count for TTFT.
    a = beat("a", 106, 106.2, 1400, (0.5, 2))  # idle now
    b = beat("b", 101, 106.2, 150, (0.3, 1))
    rates.observe(fleet_at(106.2, a, b))
    assert rates.tokens_per_s([a, b]) == 0
    assert rates.ttft([a, b]) == pytest.approx(0.8 / 3)
    # a restarts (new started_at, counters from 0): no negative rate, just no interval.
    restarted = beat("a", 108, 108, 10, (0, 0))
    restarted.started_at = 107.5
    rates.observe(fleet_at(108, restarted, b))
    assert rates.tokens_per_s([restarted]) == 0 and rates.ttft([restarted]) is None
    # Past the TTFT window, b's requests no longer count; past the history, points go.
    late = beat("b", 101, 190, 150, (0.3, 1))
    rates.observe(fleet_at(190, late))
    assert rates.ttft([late]) is None
    rates.observe(fleet_at(800, late))
    assert [p[0] for p in rates.points] == [800]
