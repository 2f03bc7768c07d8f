"""Contract tests of the engine adapters in timeslice.engines.

The HTTP adapters run against local aiohttp servers (real HTTP on loopback, in a background
loop thread) that follow the engines' documented endpoints and keep a sleeping / released state:
vLLM's dev-mode routes (``POST /sleep?level=``, ``POST /wake_up?tags=``, ``GET /is_sleeping``)
and SGLang's ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` with a
``{"tags": [...]}`` body. They are contract tests of the adapters (what they send, how they read
answers, failures and time-outs), not proof that a real engine behaves this way. The in-process
adapter runs against a recording double of ``vllm.LLM``, and NVML against a stand-in
``pynvml`` module: both are the true boundaries of this code.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import types
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from tests.sdk.fakes import LoopThread
from timeslice.engines import (
    EngineAdapter,
    EngineHttpError,
    EngineResponseError,
    MemoryTag,
    SglangHttp,
    SleepLevel,
    VllmHttp,
    VllmInProcess,
    nvml_process_memory,
)
from timeslice.errors import InvalidArgument, Timeout, TimeSliceError, Unavailable

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class Seen:
    """One request a fake engine received."""

    method: str
    path: str
    query: list[tuple[str, str]]
    body: bytes
    content_type: str


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeEngine:
    """An aiohttp app on loopback that records requests and can fail or hang on a path."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.fail: dict[str, tuple[int, str]] = {}
        self.hang: set[str] = set()
        self.url = ""
        self._unhang = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._thread: LoopThread | None = None

    def routes(self) -> list[web.RouteDef]:
        raise NotImplementedError

    def posts(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST" and s.path == path]

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            Seen(
                request.method,
                request.path,
                list(request.query.items()),
                body,
                request.content_type,
            )
        )
        if request.path in self.hang:
            await self._unhang.wait()
        if request.path in self.fail:
            status, text = self.fail[request.path]
            return web.Response(status=status, text=text)
        return await handler(request)

    def start(self, thread: LoopThread) -> FakeEngine:
        async def start() -> str:
            app = web.Application(middlewares=[self._middleware])
            app.add_routes(self.routes())
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self._runner = runner
            host, port = runner.addresses[0][:2]
            return f"http://{host}:{port}"

        self._thread = thread
        self.url = thread.run(start())
        return self

    def stop(self) -> None:
        runner, thread = self._runner, self._thread
        if runner is None or thread is None:
            return
        self._runner = None

        async def stop() -> None:
            self._unhang.set()  # let hanging handlers finish, so cleanup does not wait on them
            await runner.cleanup()

        thread.run(stop())


class FakeVllm(FakeEngine):
    """vLLM's sleep routes over a model of its executor's sleeping tags.

    Like vLLM's executor, sleeping while asleep and waking while awake (or waking a tag that is
    not asleep) do nothing. ``GET /is_sleeping`` may lag behind a change by ``lag_polls``
    answers, or never catch up (``never_settles``), as vLLM answers before the engine finished.
    """

    WEIGHTS = 2 * GIB
    KV_CACHE = 1 * GIB
    RESIDUAL = 300 * MIB

    def __init__(self) -> None:
        super().__init__()
        self.sleeping_tags: set[str] = set()
        self.levels: list[int] = []
        self.wakes: list[list[str] | None] = []
        self.lag_polls = 0
        self.never_settles = False
        self.is_sleeping_body: bytes | None = None
        self._shown = False
        self._lag_left = 0

    def used_bytes(self) -> int:
        used = self.RESIDUAL
        if "weights" not in self.sleeping_tags:
            used += self.WEIGHTS
        if "kv_cache" not in self.sleeping_tags:
            used += self.KV_CACHE
        return used

    def _changed(self) -> None:
        self._lag_left = self.lag_polls

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/sleep", self._sleep),
            web.post("/wake_up", self._wake_up),
            web.get("/is_sleeping", self._is_sleeping),
        ]

    async def _sleep(self, request: web.Request) -> web.Response:
        level = int(request.query.get("level", "1"))
        if not self.sleeping_tags:
            self.levels.append(level)
            self.sleeping_tags = {"weights", "kv_cache"}
            self._changed()
        return web.Response(status=200)

    async def _wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        if self.sleeping_tags and all(t in self.sleeping_tags for t in tags or ()):
            self.wakes.append(tags)
            if tags is None:
                self.sleeping_tags.clear()
            else:
                self.sleeping_tags.difference_update(tags)
            self._changed()
        return web.Response(status=200)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        if self.is_sleeping_body is not None:
            return web.Response(body=self.is_sleeping_body, content_type="application/json")
        if self.never_settles:
            pass
        elif self._lag_left > 0:
            self._lag_left -= 1
        else:
            self._shown = bool(self.sleeping_tags)
        return web.json_response({"is_sleeping": self._shown})


class FakeSglang(FakeEngine):
    """SGLang's memory-occupation routes over a model of its scheduler's offloaded tags.

    Releasing a released region or resuming a resident one answers 400 here; the real
    scheduler fails hard (a KeyError) on the latter, so the adapter must never ask for it.
    """

    SIZES = {"weights": 2 * GIB, "kv_cache": 1 * GIB, "cuda_graph": 200 * MIB}
    RESIDUAL = 300 * MIB

    def __init__(self) -> None:
        super().__init__()
        self.offloaded: set[str] = set()
        self.answer_body = "null"

    def used_bytes(self) -> int:
        return self.RESIDUAL + sum(
            size for tag, size in self.SIZES.items() if tag not in self.offloaded
        )

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/release_memory_occupation", self._release),
            web.post("/resume_memory_occupation", self._resume),
        ]

    async def _tags(self, request: web.Request) -> list[str]:
        if request.content_type != "application/json":
            raise web.HTTPBadRequest(text="Only 'application/json' is allowed")
        body = await request.json()
        if not isinstance(body, dict) or set(body) - {"tags"}:
            raise web.HTTPBadRequest(text=f"bad body {body!r}")
        tags = body.get("tags")
        return list(tags) if tags else list(self.SIZES)

    @staticmethod
    def _error(message: str) -> web.Response:
        return web.json_response({"error": {"message": message}}, status=400)

    async def _release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if any(t in self.offloaded for t in tags):
            return self._error(f"already released: {tags}")
        self.offloaded.update(tags)
        return web.Response(text=self.answer_body, content_type="application/json")

    async def _resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        missing = [t for t in tags if t not in self.offloaded]
        if missing:
            return self._error(f"KeyError: {missing[0]!r}")
        self.offloaded.difference_update(tags)
        return web.Response(text=self.answer_body, content_type="application/json")


@pytest.fixture
def vllm(loop_thread: LoopThread) -> Iterator[FakeVllm]:
    fake = FakeVllm()
    fake.start(loop_thread)
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def sglang(loop_thread: LoopThread) -> Iterator[FakeSglang]:
    fake = FakeSglang()
    fake.start(loop_thread)
    try:
        yield fake
    finally:
        fake.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# ----------------------------------------------------------------------------- vLLM over HTTP


@pytest.mark.parametrize("level", [1, 2])
def test_vllm_sleep_at_level_reports_bytes_freed(vllm: FakeVllm, level: int) -> None:
    adapter = VllmHttp(vllm.url, level=level, measure=vllm.used_bytes)
    freed = adapter.release()
    assert freed == FakeVllm.WEIGHTS + FakeVllm.KV_CACHE
    assert [s.query for s in vllm.posts("/sleep")] == [[("level", str(level))]]
    assert vllm.levels == [level]
    assert adapter.is_sleeping() is True


def test_vllm_wake_up_reports_bytes_back_and_confirms(vllm: FakeVllm) -> None:
    adapter = VllmHttp(vllm.url, measure=vllm.used_bytes)
    adapter.release()
    restored = adapter.resume()
    assert restored == FakeVllm.WEIGHTS + FakeVllm.KV_CACHE
    assert [s.query for s in vllm.posts("/wake_up")] == [[]]  # no tags: wake everything
    assert vllm.wakes == [None]
    assert adapter.is_sleeping() is False


def test_vllm_wake_with_tags_sends_each_tag(vllm: FakeVllm) -> None:
    adapter = VllmHttp(vllm.url, wake_tags=["weights", MemoryTag.KV_CACHE])
    adapter.release()
    adapter.resume()
    assert vllm.posts("/wake_up")[0].query == [("tags", "weights"), ("tags", "kv_cache")]
    assert vllm.wakes == [["weights", "kv_cache"]]
    assert adapter.is_sleeping() is False


def test_vllm_partial_wake_is_not_waited_for(vllm: FakeVllm) -> None:
    adapter = VllmHttp(vllm.url, wake_tags=["weights"], measure=vllm.used_bytes, timeout=0.5)
    adapter.release()
    assert adapter.resume() == FakeVllm.WEIGHTS
    # vLLM keeps reporting sleeping until the KV cache is awake too; the adapter returned at once.
    assert adapter.is_sleeping() is True
    assert vllm.sleeping_tags == {"kv_cache"}


def test_vllm_is_sleeping_round_trip(vllm: FakeVllm) -> None:
    adapter = VllmHttp(vllm.url)
    assert adapter.is_sleeping() is False
    adapter.release()
    assert adapter.is_sleeping() is True
    adapter.resume()
    assert adapter.is_sleeping() is False
    assert [s.path for s in vllm.seen if s.method == "GET"] != []
    assert all(s.path == "/is_sleeping" for s in vllm.seen if s.method == "GET")


def test_vllm_release_waits_until_the_engine_reports_sleeping(vllm: FakeVllm) -> None:
    vllm.lag_polls = 3
    adapter = VllmHttp(vllm.url, timeout=2.0)
    adapter.release()
    polls_after_sleep = [
        s for s in vllm.seen[vllm.seen.index(vllm.posts("/sleep")[0]) :] if s.method == "GET"
    ]
    assert len(polls_after_sleep) == 4  # three stale answers, then the confirmation
    assert adapter.is_sleeping() is True


def test_vllm_release_times_out_when_the_engine_never_reports_sleeping(vllm: FakeVllm) -> None:
    vllm.never_settles = True
    adapter = VllmHttp(vllm.url, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(Timeout, match="is_sleeping=false"):
        adapter.release()
    assert time.monotonic() - started < 4.0  # the 1 s timeout, not a hang


def test_vllm_release_and_resume_are_idempotent(vllm: FakeVllm) -> None:
    adapter = VllmHttp(vllm.url, measure=vllm.used_bytes)
    assert adapter.resume() == 0  # awake already: no wake_up sent
    assert vllm.posts("/wake_up") == []
    assert adapter.release() > 0
    assert adapter.release() == 0
    assert len(vllm.posts("/sleep")) == 1
    assert adapter.resume() > 0
    assert adapter.resume() == 0
    assert len(vllm.posts("/wake_up")) == 1


def test_vllm_release_of_an_engine_slept_by_someone_else_is_a_no_op(vllm: FakeVllm) -> None:
    VllmHttp(vllm.url).release()
    assert VllmHttp(vllm.url).release() == 0
    assert len(vllm.posts("/sleep")) == 1


def test_vllm_concurrent_releases_send_one_sleep(vllm: FakeVllm) -> None:
    vllm.lag_polls = 2
    adapter = VllmHttp(vllm.url, measure=vllm.used_bytes)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(adapter.release())) for _ in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(results) == [0, FakeVllm.WEIGHTS + FakeVllm.KV_CACHE]
    assert len(vllm.posts("/sleep")) == 1


def test_vllm_server_error_becomes_typed_error_with_status_and_body(vllm: FakeVllm) -> None:
    vllm.fail["/sleep"] = (500, "Internal Server Error: sleep mode is not enabled")
    adapter = VllmHttp(vllm.url)
    with pytest.raises(EngineHttpError) as caught:
        adapter.release()
    err = caught.value
    assert isinstance(err, TimeSliceError)
    assert err.http_status == 500
    assert "sleep mode is not enabled" in err.body
    assert "HTTP 500" in str(err) and "sleep mode is not enabled" in str(err)
    assert err.method == "POST" and err.url.endswith("/sleep?level=1")


def test_vllm_error_body_is_cut_to_an_excerpt(vllm: FakeVllm) -> None:
    vllm.fail["/sleep"] = (500, "x" * 10_000)
    with pytest.raises(EngineHttpError) as caught:
        VllmHttp(vllm.url).release()
    assert 0 < len(caught.value.body) <= 310


def test_vllm_missing_dev_routes_say_how_to_enable_them(vllm: FakeVllm) -> None:
    vllm.fail["/is_sleeping"] = (404, '{"detail":"Not Found"}')
    with pytest.raises(EngineHttpError, match="VLLM_SERVER_DEV_MODE=1") as caught:
        VllmHttp(vllm.url).release()
    assert caught.value.http_status == 404
    assert vllm.posts("/sleep") == []


def test_vllm_unreadable_is_sleeping_answer_is_a_response_error(vllm: FakeVllm) -> None:
    vllm.is_sleeping_body = b'{"sleeping": "yes"}'
    with pytest.raises(EngineResponseError, match="is_sleeping"):
        VllmHttp(vllm.url).is_sleeping()


def test_connection_refused_is_unavailable() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(Unavailable):
        VllmHttp(url, timeout=1.0).release()
    with pytest.raises(Unavailable):
        SglangHttp(url, timeout=1.0).release()


def test_hanging_engine_times_out_within_the_timeout(vllm: FakeVllm) -> None:
    vllm.hang.add("/sleep")
    adapter = VllmHttp(vllm.url, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(Timeout, match="POST"):
        adapter.release()
    assert time.monotonic() - started < 4.0  # the 1 s timeout, not a hang


def test_vllm_reports_bytes_through_nvml_for_its_pids(
    vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVML lists the engine worker (pid 101, whose usage follows the fake engine), a process
    # of the engine that NVML cannot size (pid 202), and someone else's process (pid 999).
    nvml = _fake_pynvml(
        lambda: [
            [_proc(101, vllm.used_bytes()), _proc(999, 40 * GIB)],
            [_proc(202, None), _proc(999, 1 * GIB)],
        ]
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    adapter = VllmHttp(vllm.url, pids=[101, 202])
    assert adapter.release() == FakeVllm.WEIGHTS + FakeVllm.KV_CACHE
    assert adapter.resume() == FakeVllm.WEIGHTS + FakeVllm.KV_CACHE
    assert nvml.state["inits"] == nvml.state["shutdowns"] > 0


def test_without_nvml_or_measure_bytes_are_zero(
    vllm: FakeVllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(None))
    adapter = VllmHttp(vllm.url, pids=[101])
    assert adapter.release() == 0
    assert adapter.is_sleeping() is True  # the release itself happened
    assert VllmHttp(vllm.url).resume() == 0  # no pids at all: nothing to measure


def test_a_failing_measure_does_not_fail_the_switch(vllm: FakeVllm) -> None:
    def broken() -> int:
        raise RuntimeError("gauge broke")

    adapter = VllmHttp(vllm.url, measure=broken)
    assert adapter.release() == 0
    assert adapter.is_sleeping() is True

    # One good reading next to a failed one is no delta: still 0, not the total in use.
    readings: Iterator[int | Exception] = iter([RuntimeError("first reading failed"), 7 * GIB])

    def flaky() -> int:
        value = next(readings)
        if isinstance(value, Exception):
            raise value
        return value

    assert VllmHttp(vllm.url, measure=flaky).resume() == 0
    assert adapter.is_sleeping() is False


def test_hooks_are_release_and_resume(vllm: FakeVllm) -> None:
    adapter = VllmHttp(vllm.url, measure=vllm.used_bytes)
    on_checkpoint, on_restore = adapter.hooks()
    assert on_checkpoint() == FakeVllm.WEIGHTS + FakeVllm.KV_CACHE
    assert adapter.is_sleeping() is True
    assert on_restore() == FakeVllm.WEIGHTS + FakeVllm.KV_CACHE
    assert adapter.is_sleeping() is False


# ----------------------------------------------------------------------------- SGLang over HTTP


def test_sglang_release_and_resume_without_tags_send_empty_bodies(sglang: FakeSglang) -> None:
    adapter = SglangHttp(sglang.url, measure=sglang.used_bytes)
    everything = sum(FakeSglang.SIZES.values())
    assert adapter.release() == everything
    assert adapter.released is True
    assert sglang.offloaded == set(FakeSglang.SIZES)
    assert adapter.resume() == everything
    assert adapter.released is False
    posted = sglang.posts("/release_memory_occupation") + sglang.posts("/resume_memory_occupation")
    assert [json.loads(s.body) for s in posted] == [{}, {}]
    assert all(s.content_type == "application/json" for s in posted)


def test_sglang_release_and_resume_with_tags(sglang: FakeSglang) -> None:
    adapter = SglangHttp(
        sglang.url, tags=[MemoryTag.KV_CACHE, "cuda_graph"], measure=sglang.used_bytes
    )
    assert adapter.release() == FakeSglang.SIZES["kv_cache"] + FakeSglang.SIZES["cuda_graph"]
    assert sglang.offloaded == {"kv_cache", "cuda_graph"}
    assert adapter.resume() == FakeSglang.SIZES["kv_cache"] + FakeSglang.SIZES["cuda_graph"]
    assert sglang.offloaded == set()
    bodies = [json.loads(s.body) for s in sglang.seen]
    assert bodies == [{"tags": ["kv_cache", "cuda_graph"]}] * 2


def test_sglang_is_idempotent_and_never_resumes_what_it_did_not_release(
    sglang: FakeSglang,
) -> None:
    adapter = SglangHttp(sglang.url)
    assert adapter.resume() == 0
    assert sglang.seen == []  # a resume of a resident engine would crash SGLang's scheduler
    adapter.release()
    assert adapter.release() == 0
    assert len(sglang.posts("/release_memory_occupation")) == 1
    adapter.resume()
    assert adapter.resume() == 0
    assert len(sglang.posts("/resume_memory_occupation")) == 1


def test_sglang_error_answer_is_typed_and_keeps_the_state(sglang: FakeSglang) -> None:
    sglang.fail["/release_memory_occupation"] = (
        400,
        '{"error": {"message": "memory saver is not enabled"}}',
    )
    adapter = SglangHttp(sglang.url)
    with pytest.raises(EngineHttpError, match="memory saver is not enabled") as caught:
        adapter.release()
    assert caught.value.http_status == 400
    assert adapter.released is False
    del sglang.fail["/release_memory_occupation"]
    adapter.release()
    assert adapter.released is True


def test_sglang_success_false_is_a_response_error(sglang: FakeSglang) -> None:
    sglang.answer_body = '{"success": false, "message": "busy"}'
    adapter = SglangHttp(sglang.url)
    with pytest.raises(EngineResponseError, match="busy"):
        adapter.release()
    assert adapter.released is False


def test_sglang_hanging_engine_times_out(sglang: FakeSglang) -> None:
    sglang.hang.add("/release_memory_occupation")
    started = time.monotonic()
    with pytest.raises(Timeout):
        SglangHttp(sglang.url, timeout=1.0).release()
    assert time.monotonic() - started < 4.0  # the 1 s timeout, not a hang


def test_api_key_is_sent_as_bearer_token(sglang: FakeSglang, loop_thread: LoopThread) -> None:
    headers: list[str | None] = []

    async def capture(request: web.Request) -> web.Response:
        headers.append(request.headers.get("Authorization"))
        return web.json_response(None)

    class KeyedSglang(FakeSglang):
        def routes(self) -> list[web.RouteDef]:
            return [web.post("/release_memory_occupation", capture)]

    keyed = KeyedSglang().start(loop_thread)
    try:
        SglangHttp(keyed.url, api_key="sk-test").release()
    finally:
        keyed.stop()
    assert headers == ["Bearer sk-test"]


# ----------------------------------------------------------------------------- vLLM in process


@dataclass
class RecordingLLM:
    """A stand-in for vllm.LLM's sleep API: records each call and models its device memory."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    fail_with: Exception | None = None
    device_bytes: int = 5 * GIB

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", {"level": level}))
        if self.fail_with is not None:
            raise self.fail_with
        self.device_bytes = 1 * GIB

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", {"tags": tags}))
        if self.fail_with is not None:
            raise self.fail_with
        self.device_bytes = 5 * GIB


@pytest.mark.parametrize("level", [SleepLevel.OFFLOAD_WEIGHTS, SleepLevel.DISCARD_WEIGHTS])
def test_in_process_sleep_and_wake_up(level: SleepLevel) -> None:
    llm = RecordingLLM()
    adapter = VllmInProcess(llm, level=level, measure=lambda: llm.device_bytes)
    assert adapter.release() == 4 * GIB
    assert adapter.sleeping is True
    assert adapter.resume() == 4 * GIB
    assert adapter.sleeping is False
    assert llm.calls == [("sleep", {"level": int(level)}), ("wake_up", {"tags": None})]


def test_in_process_wake_tags_and_idempotence() -> None:
    llm = RecordingLLM()
    adapter = VllmInProcess(llm, wake_tags=["weights"])
    assert adapter.resume() == 0
    adapter.release()
    adapter.release()
    adapter.resume()
    adapter.resume()
    assert llm.calls == [("sleep", {"level": 1}), ("wake_up", {"tags": ["weights"]})]


def test_in_process_engine_errors_propagate_and_keep_the_state() -> None:
    llm = RecordingLLM(fail_with=RuntimeError("Sleep mode is not enabled"))
    adapter = VllmInProcess(llm)
    with pytest.raises(RuntimeError, match="Sleep mode is not enabled"):
        adapter.release()
    assert adapter.sleeping is False
    llm.fail_with = None
    adapter.release()
    assert adapter.sleeping is True


def test_in_process_needs_an_llm_with_sleep_and_wake_up() -> None:
    with pytest.raises(InvalidArgument, match="sleep"):
        VllmInProcess(object())  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: VllmHttp("http://h:1", level=3), "level"),
        (lambda: VllmHttp("http://h:1", level=True), "level"),
        (lambda: VllmHttp("http://h:1", wake_tags=["cuda_graph"]), "cuda_graph"),
        (lambda: VllmHttp("http://h:1", wake_tags=["weight"]), "weight"),
        (lambda: VllmHttp("http://h:1", wake_tags="weights"), "string"),
        (lambda: VllmHttp("http://h:1", wake_tags=[]), "at least one"),
        (lambda: VllmHttp("http://h:1", timeout=0), "timeout"),
        (lambda: VllmHttp("http://h:1", timeout=-1), "timeout"),
        (lambda: VllmHttp("h:1"), "base_url"),
        (lambda: VllmHttp("http://h:1/?x=1"), "query"),
        (lambda: VllmHttp("http://h:1", pids=[0]), "pids"),
        (lambda: SglangHttp("http://h:1", tags=["bogus"]), "bogus"),
        (lambda: VllmInProcess(RecordingLLM(), level=0), "level"),
    ],
)
def test_bad_arguments_are_refused(build: Callable[[], EngineAdapter], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        build()


def test_register_refuses_hooks_of_its_own(vllm: FakeVllm) -> None:
    adapter = VllmHttp(vllm.url)
    extra: dict[str, Any] = {"on_checkpoint": lambda: 0}
    with pytest.raises(InvalidArgument, match="on_checkpoint"):
        adapter.register("group-a", **extra)


# ----------------------------------------------------------------------------- NVML


def _proc(pid: int, used: int | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


def _fake_pynvml(
    devices: Callable[[], list[list[types.SimpleNamespace]]] | None,
) -> Any:
    """A stand-in pynvml: ``devices`` gives each device's processes; None means no driver."""
    module: Any = types.ModuleType("pynvml")
    module.state = {"inits": 0, "shutdowns": 0}

    class NVMLError(Exception):
        pass

    def init() -> None:
        if devices is None:
            raise NVMLError("NVML Shared Library Not Found")
        module.state["inits"] += 1

    def shutdown() -> None:
        module.state["shutdowns"] += 1

    def listing() -> list[list[types.SimpleNamespace]]:
        assert devices is not None
        return devices()

    module.NVMLError = NVMLError
    module.nvmlInit = init
    module.nvmlShutdown = shutdown
    module.nvmlDeviceGetCount = lambda: len(listing())
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: listing()[handle]
    return module


def test_nvml_process_memory_sums_the_pids_over_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _fake_pynvml(lambda: [[_proc(1, 10), _proc(2, 20)], [_proc(1, 5), _proc(3, 99)]])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert nvml_process_memory([1, 2]) == 35
    assert nvml_process_memory([4]) == 0
    assert nvml.state["inits"] == nvml.state["shutdowns"] == 2


def test_nvml_process_memory_skips_a_device_it_cannot_query(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = _fake_pynvml(lambda: [[_proc(1, 10)], [_proc(1, 7)]])

    def processes(handle: int) -> list[types.SimpleNamespace]:
        if handle == 0:
            raise nvml.NVMLError("GPU is lost")
        return [_proc(1, 7)]

    nvml.nvmlDeviceGetComputeRunningProcesses = processes
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert nvml_process_memory([1]) == 7


def test_nvml_process_memory_is_none_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(None))
    assert nvml_process_memory([1]) is None
