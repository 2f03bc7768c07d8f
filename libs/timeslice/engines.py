"""Engine adapters: free an inference engine's device memory on a time-slice switch, and back.

An inference engine (vLLM, SGLang) keeps model weights and a KV cache resident on its devices.
Before the agent switches the job out, the engine has to give that memory up; after the job is
switched back in, it has to take it again. Each adapter here wraps one engine's own API for that::

    from timeslice.engines import VllmHttp

    engine = VllmHttp("http://127.0.0.1:8000", level=1, pids=[worker_pid])
    registration = engine.register("rollout-group", job_id="job-a")

:meth:`EngineAdapter.register` hands :meth:`~EngineAdapter.release` and
:meth:`~EngineAdapter.resume` to :func:`timeslice.worker.register` as the ``on_checkpoint`` /
``on_restore`` hooks. The agent calls them in a worker thread and afterwards checks through NVML
that the engine's processes really gave their memory up; the adapters only drive the engine and
confirm the engine's own view of its state.

Adapters:

* :class:`VllmHttp`: a vLLM OpenAI-compatible server started with ``VLLM_SERVER_DEV_MODE=1`` and
  ``--enable-sleep-mode`` (``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``).
* :class:`VllmInProcess`: a ``vllm.LLM`` object in this process (``LLM.sleep`` /
  ``LLM.wake_up``).
* :class:`SglangHttp`: an SGLang server started with ``--enable-memory-saver``
  (``POST /release_memory_occupation``, ``POST /resume_memory_occupation``).

Bytes reported: engines do not say how much memory they freed, so an adapter measures the device
memory the engine's processes hold before and after (``measure=``, or NVML over ``pids=``) and
reports the difference. Where neither can measure it reports 0; the agent's own NVML check stays
the authority on whether the memory was freed.

HTTP goes through the standard library (``urllib.request``); every request has a timeout, and
failures surface as :mod:`timeslice.errors` exceptions: :class:`~timeslice.errors.Unavailable`
when the engine cannot be reached, :class:`~timeslice.errors.Timeout` when it does not answer in
time, :class:`EngineHttpError` when it answers with a non-2xx status.
"""

from __future__ import annotations

import abc
import enum
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, TypedDict, Unpack

from timeslice._validate import check_seconds
from timeslice.backoff import Backoff
from timeslice.errors import InternalError, InvalidArgument, Timeout, Unavailable
from timeslice.worker import HookCallback, WorkerRegistration
from timeslice.worker import register as register_worker

log = logging.getLogger("timeslice.engines")

__all__ = [
    "EngineAdapter",
    "EngineError",
    "EngineHttpError",
    "EngineResponseError",
    "MemoryTag",
    "RegisterOptions",
    "SglangHttp",
    "SleepLevel",
    "SleepableLLM",
    "VllmHttp",
    "VllmInProcess",
    "nvml_process_memory",
]

DEFAULT_TIMEOUT = 60.0
"""Seconds per HTTP request, and for an engine to confirm its new state.

Matches the agent's default hook deadline (``--hook-timeout 60``): waiting longer is pointless,
because the agent has failed the switch by then.
"""

# Enough of an error body to see the engine's reason, not so much that a traceback page floods
# the log line the agent records.
_EXCERPT_CHARS = 300
# Responses of these endpoints are a few bytes; the cap only guards against a wrong URL that
# serves something big.
_MAX_BODY = 1 << 20
_POLL_INITIAL = 0.02
_POLL_MAX = 0.5


class MemoryTag(enum.StrEnum):
    """A region of an engine's device memory, as the engines name it in their APIs."""

    WEIGHTS = "weights"
    """Model weights (vLLM and SGLang)."""
    KV_CACHE = "kv_cache"
    """The KV cache (vLLM and SGLang)."""
    CUDA_GRAPH = "cuda_graph"
    """Captured CUDA graphs' memory (SGLang only)."""


_VLLM_TAGS = frozenset({MemoryTag.WEIGHTS, MemoryTag.KV_CACHE})
_SGLANG_TAGS = frozenset({MemoryTag.WEIGHTS, MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH})


class SleepLevel(enum.IntEnum):
    """vLLM's sleep levels."""

    OFFLOAD_WEIGHTS = 1
    """Weights are copied to CPU memory, the KV cache is discarded. Needs host RAM for the
    weights; waking up brings the same model back."""
    DISCARD_WEIGHTS = 2
    """Weights and KV cache are both discarded (buffers are kept). Waking up gives the memory
    back but the weights must be reloaded (for example by an RL weight update)."""


# ----------------------------------------------------------------------------- errors


class EngineError(InternalError):
    """The engine could not release or resume its memory; the message says why."""


class EngineHttpError(EngineError):
    """The engine answered an HTTP request with a non-2xx status.

    ``http_status`` is the engine's HTTP status (``status``, inherited from
    :class:`~timeslice.errors.TimeSliceError`, is the gRPC status this error maps to).
    """

    def __init__(self, method: str, url: str, http_status: int, body: str, hint: str = "") -> None:
        self.method = method
        self.url = url
        self.http_status = http_status
        self.body = body
        """The start of the response body (at most a few hundred characters)."""
        detail = f": {body}" if body else ""
        suffix = f" ({hint})" if hint else ""
        super().__init__(f"{method} {url} answered HTTP {http_status}{detail}{suffix}")


class EngineResponseError(EngineError):
    """The engine answered with success but with a body the adapter cannot read."""


# ----------------------------------------------------------------------------- measuring


class _PynvmlProcess(Protocol):
    pid: int
    usedGpuMemory: int | None  # pynvml's field name


def nvml_process_memory(pids: Collection[int]) -> int | None:
    """Device memory in bytes that the processes ``pids`` hold on all GPUs, per NVML.

    Sums ``usedGpuMemory`` of every compute process NVML lists with one of ``pids``, over all
    devices. Returns ``None`` when NVML is not usable here (no ``pynvml``, no driver). A device
    NVML cannot query, or a process whose usage NVML does not report (``None``, as inside some
    containers), counts as 0.

    NVML reports pids as the host sees them: from inside a container with its own pid
    namespace, pass the host pids.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses vary by driver; all mean "no NVML here".
        log.debug("nvml: not available (%s)", exc)
        return None
    wanted = set(pids)
    total = 0
    try:
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                processes: Sequence[_PynvmlProcess] = pynvml.nvmlDeviceGetComputeRunningProcesses(
                    handle
                )
            except Exception as exc:  # one device (lost, MIG parent) must not hide the others
                log.debug("nvml: device %d not queried (%s)", index, exc)
                continue
            for process in processes:
                used = process.usedGpuMemory
                if int(process.pid) in wanted and used is not None:
                    total += int(used)
    except Exception as exc:
        log.debug("nvml: query failed (%s)", exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvml: shutdown failed (%s)", exc)
    return total


class _NvmlMeasure:
    """The default measure: NVML over the engine's pids; 0 where NVML is unavailable."""

    def __init__(self, pids: tuple[int, ...]) -> None:
        self.pids = pids
        self._warned = False

    def __call__(self) -> int:
        if not self.pids:
            return 0
        used = nvml_process_memory(self.pids)
        if used is None:
            if not self._warned:
                self._warned = True
                log.info(
                    "nvml is not available: engine adapters report 0 bytes moved for pids %s "
                    "(the agent's own NVML check still verifies the release)",
                    list(self.pids),
                )
            return 0
        return used


def _check_pids(pids: Iterable[int] | None) -> tuple[int, ...]:
    if pids is None:
        return ()
    if isinstance(pids, str | bytes):
        raise InvalidArgument(f"pids must be a collection of ints, got {pids!r}")
    checked: list[int] = []
    for pid in pids:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise InvalidArgument(f"pids must be positive ints, got {pid!r}")
        checked.append(pid)
    return tuple(checked)


def _check_level(level: int) -> SleepLevel:
    if isinstance(level, bool) or not isinstance(level, int):
        raise InvalidArgument(f"level must be 1 or 2, got {level!r}")
    try:
        return SleepLevel(level)
    except ValueError:
        raise InvalidArgument(f"level must be 1 or 2, got {level!r}") from None


def _check_tags(
    tags: Iterable[MemoryTag | str] | None, allowed: frozenset[MemoryTag], engine: str
) -> tuple[MemoryTag, ...] | None:
    """Validate tags up front: vLLM silently skips a wake-up naming a tag it does not know."""
    if tags is None:
        return None
    if isinstance(tags, str | bytes):
        raise InvalidArgument(f"tags must be a list of tags, got the string {tags!r}")
    checked: list[MemoryTag] = []
    for tag in tags:
        try:
            member = MemoryTag(tag)
        except ValueError:
            member = None
        if member is None or member not in allowed:
            names = ", ".join(sorted(t.value for t in allowed))
            raise InvalidArgument(f"{engine} memory tags are {names}; got {tag!r}")
        if member not in checked:
            checked.append(member)
    if not checked:
        raise InvalidArgument("tags must name at least one tag; pass None for all of them")
    return tuple(checked)


def _check_timeout(timeout: float) -> float:
    seconds = check_seconds(timeout, "timeout")
    assert seconds is not None
    if seconds == 0:
        # urllib treats 0 as non-blocking sockets: every request would fail at once.
        raise InvalidArgument("timeout must be > 0")
    return seconds


def _check_base_url(base_url: str) -> str:
    if not isinstance(base_url, str):
        raise InvalidArgument(f"base_url must be a string, got {type(base_url).__name__}")
    parsed = urllib.parse.urlsplit(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InvalidArgument(f"base_url must be an http(s) URL, got {base_url!r}")
    if parsed.query or parsed.fragment:
        raise InvalidArgument(f"base_url must not carry a query or fragment: {base_url!r}")
    return base_url.rstrip("/")


# ----------------------------------------------------------------------------- the interface


class RegisterOptions(TypedDict, total=False):
    """Keyword arguments :meth:`EngineAdapter.register` passes on to
    :func:`timeslice.worker.register` (the hooks are the adapter's)."""

    job_id: str | None
    pid: int | None
    state_bytes: int
    socket: str | None
    acquirer: bool
    timeout: float


class EngineAdapter(abc.ABC):
    """Releases an engine's device memory before a switch-out and brings it back after.

    Both operations are idempotent (releasing a released engine, or resuming a resident one,
    does nothing and reports 0 bytes) and serialized (the agent's hook thread and the caller
    may both call them). Each returns the bytes it moved as measured around the engine call:
    by ``measure`` if given, else by NVML over ``pids``; 0 where neither can tell.
    """

    def __init__(self, *, pids: Iterable[int] | None, measure: Callable[[], int] | None) -> None:
        self.pids = _check_pids(pids)
        """The engine's processes whose device memory is measured (may be empty)."""
        if measure is not None and not callable(measure):
            raise InvalidArgument(f"measure must be a callable, got {measure!r}")
        self._measure: Callable[[], int] = (
            measure if measure is not None else _NvmlMeasure(self.pids)
        )
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public API

    def release(self) -> int:
        """Make the engine give up its device memory; returns the bytes freed.

        Raises:
            Unavailable, Timeout, EngineError: the engine could not be driven; for an HTTP
                engine the request may or may not have taken effect.
        """
        with self._lock:
            if not self._needs_release():
                log.debug("%r: already released; nothing to do", self)
                return 0
            started = time.monotonic()
            before = self._measured()
            self._release()
            after = self._measured()
            freed = max(0, before - after) if before is not None and after is not None else 0
            log.info("%r: released %d bytes in %.3f s", self, freed, time.monotonic() - started)
            return freed

    def resume(self) -> int:
        """Make the engine take its device memory back; returns the bytes brought back.

        Raises:
            Unavailable, Timeout, EngineError: as for :meth:`release`.
        """
        with self._lock:
            if not self._needs_resume():
                log.debug("%r: already resident; nothing to do", self)
                return 0
            started = time.monotonic()
            before = self._measured()
            self._resume()
            after = self._measured()
            restored = max(0, after - before) if before is not None and after is not None else 0
            log.info("%r: resumed %d bytes in %.3f s", self, restored, time.monotonic() - started)
            return restored

    def hooks(self) -> tuple[HookCallback, HookCallback]:
        """``(on_checkpoint, on_restore)`` for :func:`timeslice.worker.register`."""
        return self.release, self.resume

    def register(self, group_id: str, **kwargs: Unpack[RegisterOptions]) -> WorkerRegistration:
        """Register with the node agent, with this adapter's hooks as the app callbacks.

        Calls :func:`timeslice.worker.register` with ``on_checkpoint=self.release`` and
        ``on_restore=self.resume``; ``kwargs`` (``job_id``, ``pid``, ...) pass through.
        ``pid`` defaults to this process, the one that runs the hooks.
        """
        for name in ("on_checkpoint", "on_restore"):
            if name in kwargs:
                raise InvalidArgument(f"{name} is the adapter's own hook; do not pass it")
        on_checkpoint, on_restore = self.hooks()
        return register_worker(
            group_id, on_checkpoint=on_checkpoint, on_restore=on_restore, **kwargs
        )

    # ------------------------------------------------------------------ for subclasses

    @abc.abstractmethod
    def _needs_release(self) -> bool:
        """True unless the engine's memory is already released."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Release the memory; return once the engine says it is released."""

    @abc.abstractmethod
    def _needs_resume(self) -> bool:
        """True while there is released memory to bring back."""

    @abc.abstractmethod
    def _resume(self) -> None:
        """Bring the memory back; return once the engine says so (where it can)."""

    def _measured(self) -> int | None:
        """The measure's reading, or None when it failed (the bytes reported are then 0)."""
        try:
            value = self._measure()
        except Exception:
            # The engine call is what matters; a failing gauge must not fail the switch (the
            # agent verifies with NVML anyway).
            log.warning("%r: measuring device memory failed; reporting 0", self, exc_info=True)
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            log.warning("%r: measure returned %r, not bytes >= 0; reporting 0", self, value)
            return None
        return value


# ----------------------------------------------------------------------------- HTTP


class _Http:
    """Blocking JSON-over-HTTP calls with a timeout and typed errors."""

    def __init__(
        self, base_url: str, timeout: float, api_key: str | None, not_found_hint: str
    ) -> None:
        self.base_url = _check_base_url(base_url)
        self.timeout = _check_timeout(timeout)
        if api_key is not None and not isinstance(api_key, str):
            raise InvalidArgument("api_key must be a string")
        self._api_key = api_key
        self._not_found_hint = not_found_hint
        # Engines are reached directly: an HTTP(S)_PROXY meant for the outside world must not
        # carry control calls to a server on this node or in this cluster.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def url(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(list(query))
        return url

    def call(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        json_body: object = None,
    ) -> bytes:
        """One request; returns the response body of a 2xx answer."""
        url = self.url(path, query)
        headers = {"Accept": "application/json"}
        data: bytes | None = None
        if json_body is not None:
            data = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        elif method == "POST":
            data = b""  # an explicit empty body: Content-Length: 0
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        what = f"{method} {url}"
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                body: bytes = response.read(_MAX_BODY)
                return body
        except urllib.error.HTTPError as exc:
            try:
                excerpt = _excerpt(exc.read(_EXCERPT_CHARS * 4))
            except (OSError, http.client.HTTPException):
                excerpt = ""
            finally:
                exc.close()
            hint = self._not_found_hint if exc.code == 404 else ""
            raise EngineHttpError(method, url, exc.code, excerpt, hint) from None
        except urllib.error.URLError as exc:
            # Connect-time failures arrive wrapped; the reason says which kind.
            if isinstance(exc.reason, TimeoutError):
                raise Timeout(f"{what}: no connection within {self.timeout:g} s") from None
            raise Unavailable(f"{what}: engine unreachable ({exc.reason})") from None
        except TimeoutError:
            raise Timeout(f"{what}: no answer within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            # Reset or closed connections: the engine went away mid-request.
            raise Unavailable(f"{what}: connection failed ({exc!r})") from None


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    if len(text) > _EXCERPT_CHARS:
        text = text[:_EXCERPT_CHARS] + "..."
    return text


def _wait_until(predicate: Callable[[], bool], timeout: float, describe: Callable[[], str]) -> None:
    """Poll ``predicate`` (which does its own I/O) until true, for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    # No jitter: one poller per engine, and the first checks should come quickly.
    backoff = Backoff(_POLL_INITIAL, _POLL_MAX, jitter=False)
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout(describe())
        time.sleep(min(backoff.next_delay(), remaining))


class VllmHttp(EngineAdapter):
    """A vLLM server's sleep mode, over HTTP.

    The server must run with ``VLLM_SERVER_DEV_MODE=1`` (which adds the endpoints) and
    ``--enable-sleep-mode``. :meth:`release` is ``POST /sleep?level=N``; :meth:`resume` is
    ``POST /wake_up`` (with ``?tags=...`` for each of ``wake_tags``). Both first ask
    ``GET /is_sleeping`` and do nothing when the engine is already where they would take it,
    and both then poll ``GET /is_sleeping`` until the engine reports the new state, because
    vLLM may answer before the engine finished (the route's own FIXME says so).

    Args:
        base_url: the server root, e.g. ``http://127.0.0.1:8000`` (the routes are not under
            ``/v1``).
        level: 1 offloads weights to CPU memory and drops the KV cache; 2 drops both (the
            weights must be reloaded after waking). See :class:`SleepLevel`.
        wake_tags: wake only these regions (``"weights"``, ``"kv_cache"``); ``None`` wakes
            everything. vLLM keeps reporting ``is_sleeping`` until every region is awake, so a
            partial wake is not confirmed, and the caller must wake the rest before the next
            :meth:`release` (vLLM ignores a sleep request while it reports sleeping).
        timeout: seconds for each HTTP request's connect and each read, and for the engine to
            report its new state.
        pids: the engine's GPU worker processes (as NVML sees them), for the bytes reported.
        measure: returns the engine's device memory in bytes now; overrides NVML over ``pids``.
            With neither (or without NVML) the reported bytes are 0.
        api_key: sent as ``Authorization: Bearer``, for a server behind an authenticating proxy.
    """

    def __init__(
        self,
        base_url: str,
        *,
        level: int = SleepLevel.OFFLOAD_WEIGHTS,
        wake_tags: Iterable[MemoryTag | str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        pids: Iterable[int] | None = None,
        measure: Callable[[], int] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.level = _check_level(level)
        self.wake_tags = _check_tags(wake_tags, _VLLM_TAGS, "vLLM")
        self._http = _Http(
            base_url,
            timeout,
            api_key,
            "the sleep endpoints exist only when the server runs with VLLM_SERVER_DEV_MODE=1",
        )
        super().__init__(pids=pids, measure=measure)

    @property
    def base_url(self) -> str:
        return self._http.base_url

    def __repr__(self) -> str:
        return f"VllmHttp({self.base_url!r}, level={int(self.level)})"

    def is_sleeping(self) -> bool:
        """The engine's own answer to ``GET /is_sleeping``."""
        body = self._http.call("GET", "/is_sleeping")
        try:
            value = json.loads(body)["is_sleeping"]
        except (ValueError, TypeError, KeyError):
            value = None
        if not isinstance(value, bool):
            raise EngineResponseError(
                f"GET {self._http.url('/is_sleeping')} answered {_excerpt(body)!r}; "
                'expected {"is_sleeping": true|false}'
            )
        return value

    def _needs_release(self) -> bool:
        return not self.is_sleeping()

    def _release(self) -> None:
        self._http.call("POST", "/sleep", query=[("level", str(int(self.level)))])
        _wait_until(
            self.is_sleeping,
            self._http.timeout,
            lambda: (
                f"{self!r}: the engine still reports is_sleeping=false "
                f"{self._http.timeout:g} s after POST /sleep"
            ),
        )

    def _needs_resume(self) -> bool:
        return self.is_sleeping()

    def _resume(self) -> None:
        tags = self.wake_tags
        query = [("tags", tag.value) for tag in tags] if tags is not None else []
        self._http.call("POST", "/wake_up", query=query)
        if tags is not None and not _VLLM_TAGS <= set(tags):
            return  # a partial wake leaves is_sleeping true; there is nothing to confirm
        _wait_until(
            lambda: not self.is_sleeping(),
            self._http.timeout,
            lambda: (
                f"{self!r}: the engine still reports is_sleeping=true "
                f"{self._http.timeout:g} s after POST /wake_up"
            ),
        )


class SglangHttp(EngineAdapter):
    """An SGLang server's memory saver, over HTTP.

    The server must run with ``--enable-memory-saver``. :meth:`release` is
    ``POST /release_memory_occupation`` and :meth:`resume` is
    ``POST /resume_memory_occupation``, each with the JSON body ``{"tags": [...]}`` when
    ``tags`` is given and ``{}`` (every region) otherwise.

    SGLang has no endpoint that reports the released state, so the adapter tracks it: it only
    resumes what it released (SGLang's scheduler fails hard when asked to resume a region that
    is not released). It assumes the engine is resident when the adapter is created and that
    nothing else releases or resumes it meanwhile. A request that failed leaves the tracked
    state as it was, though the engine may have acted on it.

    Args:
        base_url: the server root, e.g. ``http://127.0.0.1:30000``.
        tags: the regions to release and resume (``"weights"``, ``"kv_cache"``,
            ``"cuda_graph"``); ``None`` for all of them.
        timeout: seconds for each HTTP request's connect and each read.
        pids: the engine's GPU processes (as NVML sees them), for the bytes reported.
        measure: returns the engine's device memory in bytes now; overrides NVML over ``pids``.
            With neither (or without NVML) the reported bytes are 0.
        api_key: sent as ``Authorization: Bearer`` (the server's ``--api-key``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        tags: Iterable[MemoryTag | str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        pids: Iterable[int] | None = None,
        measure: Callable[[], int] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.tags = _check_tags(tags, _SGLANG_TAGS, "SGLang")
        self._http = _Http(
            base_url,
            timeout,
            api_key,
            "is this an SGLang server? release_memory_occupation is one of its native routes",
        )
        self._released = False
        super().__init__(pids=pids, measure=measure)

    @property
    def base_url(self) -> str:
        return self._http.base_url

    @property
    def released(self) -> bool:
        """True between a successful :meth:`release` and the next successful :meth:`resume`."""
        return self._released

    def __repr__(self) -> str:
        tags = [t.value for t in self.tags] if self.tags is not None else "all"
        return f"SglangHttp({self.base_url!r}, tags={tags})"

    def _body(self) -> dict[str, list[str]]:
        return {"tags": [t.value for t in self.tags]} if self.tags is not None else {}

    def _post(self, path: str) -> None:
        body = self._http.call("POST", path, json_body=self._body())
        # Success is an empty or null body; newer servers may answer {"success": ...}.
        try:
            answer = json.loads(body) if body.strip() else None
        except ValueError:
            answer = None
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineResponseError(
                f"POST {self._http.url(path)} reported failure: {_excerpt(body)}"
            )

    def _needs_release(self) -> bool:
        return not self._released

    def _release(self) -> None:
        self._post("/release_memory_occupation")
        self._released = True

    def _needs_resume(self) -> bool:
        return self._released

    def _resume(self) -> None:
        self._post("/resume_memory_occupation")
        self._released = False


# ----------------------------------------------------------------------------- in process


class SleepableLLM(Protocol):
    """What :class:`VllmInProcess` needs of ``vllm.LLM``."""

    def sleep(self, level: int) -> object: ...

    def wake_up(self, tags: list[str] | None) -> object: ...


class VllmInProcess(EngineAdapter):
    """A ``vllm.LLM`` in this process: ``llm.sleep(level=...)`` / ``llm.wake_up(tags=...)``.

    The LLM must be built with ``enable_sleep_mode=True``. The adapter tracks whether it put
    the engine to sleep, so a second :meth:`release` (or a :meth:`resume` of an awake engine)
    does nothing; it assumes nothing else puts the engine to sleep or wakes it meanwhile.
    Exceptions from the engine propagate unchanged and leave the tracked state as it was.

    Args:
        llm: the ``vllm.LLM`` (anything with its ``sleep`` / ``wake_up``).
        level: see :class:`SleepLevel`.
        wake_tags: wake only these regions; ``None`` wakes everything. As with
            :class:`VllmHttp`, wake the rest before the next :meth:`release`.
        pids: the engine's GPU processes (vLLM's engine core usually runs in a child process),
            for the bytes reported.
        measure: returns the engine's device memory in bytes now; overrides NVML over ``pids``.
            With neither (or without NVML) the reported bytes are 0.
    """

    def __init__(
        self,
        llm: SleepableLLM,
        *,
        level: int = SleepLevel.OFFLOAD_WEIGHTS,
        wake_tags: Iterable[MemoryTag | str] | None = None,
        pids: Iterable[int] | None = None,
        measure: Callable[[], int] | None = None,
    ) -> None:
        for method in ("sleep", "wake_up"):
            if not callable(getattr(llm, method, None)):
                raise InvalidArgument(f"llm has no {method}() method: {llm!r}")
        self.llm = llm
        self.level = _check_level(level)
        self.wake_tags = _check_tags(wake_tags, _VLLM_TAGS, "vLLM")
        self._sleeping = False
        super().__init__(pids=pids, measure=measure)

    @property
    def sleeping(self) -> bool:
        """True between a successful :meth:`release` and the next successful :meth:`resume`."""
        return self._sleeping

    def __repr__(self) -> str:
        return f"VllmInProcess({type(self.llm).__name__}, level={int(self.level)})"

    def _needs_release(self) -> bool:
        return not self._sleeping

    def _release(self) -> None:
        self.llm.sleep(level=int(self.level))
        self._sleeping = True

    def _needs_resume(self) -> bool:
        return self._sleeping

    def _resume(self) -> None:
        tags = [t.value for t in self.wake_tags] if self.wake_tags is not None else None
        self.llm.wake_up(tags=tags)
        self._sleeping = False
