"""``timeslice top``: the dashboard's view in a terminal, live, for people on a login node.

It speaks gRPC to the orchestrator, like ``timeslice status``: the same targets, the same TLS
(``$TIMESLICE_TLS_*``, or ``$TIMESLICE_INSECURE=1``) and the same identity, where the web
dashboard's HTTP port is plaintext and meant for a trusted network. Groups come from
``ListGroups`` (asked again every ``--refresh`` seconds, to see new groups); each shown group
is followed with a ``WatchGroup`` stream, so a change shows as soon as the replica's watch
sees it. The screen is redrawn with plain ANSI escapes, at most every ``--interval`` seconds;
``--once`` prints one frame and exits, ``--json`` prints the same snapshot as JSON (each group
as ``timeslice status --json`` shows it). ``q`` (when stdin is a terminal, read in cbreak mode
without blocking the loop) and Ctrl-C exit cleanly (status 0).

Every node is shown with the backend its agent registered with; a backend that only models
data movement (``sim``) is labelled ``emulated``, as are the switches of groups on such nodes:
their times are not measurements.

"Recent switches" are the hand-overs this terminal saw (a new holder, or one more switch in
the group's count). A switch's duration is timed from its ``started_at`` to the first status
without it, ``?`` when no data moved or the switch came and went between two statuses (the web
page shows the driver's own figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

from timeslice._streams import retrying_stream
from timeslice._transport import Transport
from timeslice.cli.base import (
    CALL_TIMEOUT,
    Commands,
    add_json_option,
    add_target_option,
    count,
    parse_targets,
    positive_float,
    print_json,
)
from timeslice.cli.status import (
    _phase_name,
    backend_label,
    get_status,
    list_groups,
    status_view,
)
from timeslice.targets import Target
from timeslice.tls import client_tls
from timeslice_proto.timeslice.v1 import (
    GroupEvent,
    GroupStatus,
    TimeSliceStub,
    WatchGroupRequest,
)

__all__ = ["RecentSwitch", "Top", "register", "render_frame"]

_CLEAR = "\x1b[H\x1b[2J"
_HIDE_CURSOR = "\x1b[?25l"
_SHOW_CURSOR = "\x1b[?25h"
_BOLD = "\x1b[1m"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"
_RECENT = 10


# How long leaving top waits for its watch streams to end.
CLOSE_SECONDS = 5.0


def register(commands: Commands) -> None:
    """Add ``top``."""
    top = commands.add(
        "top",
        cmd_top,
        help="every group, live, in the terminal (q or Ctrl-C ends)",
        description="Every group, live: holder, queue, nodes (each with its backend; emulated "
        "ones labelled), the switch in flight and the switches seen, redrawn as they change. "
        "Press q (or Ctrl-C) to quit. --once prints one frame, --json one snapshot as JSON.",
        epilog="examples:\n"
        "  timeslice top --target 10.0.0.5:50051,10.0.0.6:50051\n"
        "  timeslice top --once\n"
        "  timeslice top --json | jq '.groups[].node_backends'",
    )
    add_target_option(top)
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    add_json_option(top)
    top.add_argument(
        "--interval",
        type=positive_float,
        default=0.5,
        help="redraw at most this often, seconds (default 0.5)",
    )
    top.add_argument(
        "--refresh",
        type=positive_float,
        default=5.0,
        help="look for new groups this often, seconds (default 5)",
    )
    top.add_argument(
        "--max-groups",
        type=count(1),
        default=50,
        help="groups shown and watched at most, busiest first (default 50)",
    )


@dataclass(frozen=True)
class RecentSwitch:
    """A switch this terminal saw end."""

    group: str
    from_job: str
    to_job: str
    seconds: float | None
    at: float
    emulated: bool = False
    """The group's nodes only model data movement: ``seconds`` is no measurement."""


def _secs(value: float) -> str:
    if value < 10:
        return f"{value:.2f}s"
    if value < 120:
        return f"{value:.1f}s"
    return f"{int(value // 60)}m{int(value % 60):02d}s"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _printable(text: str) -> str:
    """Names are user input: no escape sequence of theirs reaches the terminal."""
    return "".join(c if c.isprintable() else "?" for c in text)


def render_frame(
    statuses: Sequence[GroupStatus],
    recent: Sequence[RecentSwitch],
    now: float,
    *,
    width: int = 100,
    source: str = "",
    color: bool = False,
    omitted: int = 0,
) -> str:
    """One screen: a line per group (holder, queue, nodes, switch), then recent switches."""
    bold, dim, reset = (_BOLD, _DIM, _RESET) if color else ("", "", "")
    lines = [
        f"{bold}timeslice top{reset}  {time.strftime('%H:%M:%S', time.localtime(now))}  "
        f"{len(statuses)} group(s){f' (+{omitted} not shown)' if omitted else ''}  "
        f"{dim}{_printable(source)}{reset}",
        "",
    ]
    if not statuses:
        lines.append("(no groups)")
    for s in statuses:
        name = _printable(s.group_id)
        if s.holder_job_id:
            held = _secs(max(0.0, now - s.held_since)) if s.held_since > 0 else "?"
            holder = f"holder {_printable(s.holder_job_id)} ({held})"
        else:
            holder = "free"
        queue = ", ".join(_printable(q.job_id) for q in sorted(s.queue, key=lambda q: q.revision))
        lines.append(
            _clip(
                f"{bold}{name}{reset}  {holder}  queue[{len(s.queue)}]: {queue or '-'}  "
                f"switches {s.switches}",
                width + len(bold) + len(reset),
            )
        )
        nodes = "  ".join(
            f"{_printable(n.node)}={','.join(_printable(j) for j in n.resident_jobs) or '-'} "
            f"({_printable(backend_label(n.backend, n.emulated))})"
            for n in s.nodes
        )
        lines.append(_clip(f"    nodes: {nodes or '-'}", width))
        if s.switch is not None:
            sw = s.switch
            elapsed = _secs(max(0.0, now - sw.started_at)) if sw.started_at > 0 else "?"
            lines.append(
                _clip(
                    f"    switch: {_phase_name(sw.phase)} "
                    f"{_printable(sw.from_job_id) or '(none)'} -> {_printable(sw.to_job_id)}, "
                    f"{elapsed} in",
                    width,
                )
            )
        if s.last_error:
            lines.append(_clip(f"    last error: {_printable(s.last_error)}", width))
    if any(n.emulated for s in statuses for n in s.nodes):
        lines += [
            "",
            f"{dim}emulated: those nodes only model data movement; their switch times are "
            f"not measurements{reset}",
        ]
    lines += ["", f"{bold}recent switches{reset}"]
    if not recent:
        lines.append("  (none seen yet)")
    for r in recent:
        took = f"~{_secs(r.seconds)}" if r.seconds is not None else "?"
        lines.append(
            _clip(
                f"  {time.strftime('%H:%M:%S', time.localtime(r.at))}  "
                f"{_printable(r.group)}  {_printable(r.from_job) or '(none)'} -> "
                f"{_printable(r.to_job)}  {took}{' (emulated)' if r.emulated else ''}",
                width,
            )
        )
    return "\n".join(lines)


def _busy_first(statuses: Sequence[GroupStatus]) -> list[GroupStatus]:
    return sorted(
        statuses,
        key=lambda s: (not (s.holder_job_id or s.queue or s.switch is not None), s.group_id),
    )


class Top:
    """The live view: one watch per shown group, the latest status of each, recent switches."""

    def __init__(self, targets: Sequence[Target], max_groups: int) -> None:
        self._targets = list(targets)
        self._max_groups = max_groups
        self.statuses: dict[str, GroupStatus] = {}
        self.recent: deque[RecentSwitch] = deque(maxlen=_RECENT)
        self.omitted = 0
        self.changed = asyncio.Event()
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._last_holder: dict[str, str] = {}

    def note(self, status: GroupStatus, now: float) -> None:
        """A new status of a group: keep it, and note a hand-over (a new holder) or a switch."""
        group = status.group_id
        before = self.statuses.get(group)
        self.statuses[group] = status
        last = self._last_holder.get(group, "")
        if status.holder_job_id:
            self._last_holder[group] = status.holder_job_id
        if before is None:
            return
        switched = status.switches > before.switches
        handed = bool(status.holder_job_id) and status.holder_job_id != last and bool(last)
        if switched or handed:
            seconds = None
            if before.switch is not None and before.switch.started_at > 0:
                seconds = max(0.0, now - before.switch.started_at)
            from_job = before.switch.from_job_id if before.switch is not None else last
            emulated = any(n.emulated for n in (*before.nodes, *status.nodes))
            self.recent.appendleft(
                RecentSwitch(group, from_job, status.holder_job_id, seconds, now, emulated)
            )
        self.changed.set()

    async def _watch(self, group: str) -> None:
        transport = Transport(self._targets, client_tls(self._targets))

        def open_stream(_: Target, stub: TimeSliceStub) -> AsyncGenerator[GroupEvent, None]:
            request = WatchGroupRequest(group_id=group)
            return cast(AsyncGenerator[GroupEvent, None], stub.watch_group(request))

        events = retrying_stream(
            transport,
            open_stream,
            what=f"WatchGroup({group})",
            outage_limit=lambda: CALL_TIMEOUT * len(self._targets),
        )
        try:
            async for event in events:
                if event.status is not None:
                    self.note(event.status, time.time())
        finally:
            await events.aclose()
            transport.close()

    async def discover(self) -> None:
        """List the groups; start watching new ones (busiest first), stop watching gone ones."""
        summaries = await list_groups(self._targets)
        ranked = sorted(
            summaries,
            key=lambda g: (not (g.holder_job_id or g.queue_length or g.switching), g.group_id),
        )
        shown = {g.group_id for g in ranked[: self._max_groups]}
        self.omitted = max(0, len(summaries) - len(shown))
        for group in list(self._watches):
            if group not in shown:
                self._watches.pop(group).cancel()
                self.statuses.pop(group, None)
        for group in sorted(shown - set(self._watches)):
            self._watches[group] = asyncio.create_task(self._watch(group), name=f"top-{group}")
        self.changed.set()

    def failed(self) -> BaseException | None:
        """The error of a watch that ended with one (the replicas are gone for too long)."""
        for task in self._watches.values():
            if task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    async def close(self) -> None:
        tasks = list(self._watches.values())
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: Ctrl-C must end top even if a replica never answers the stream's end.
            await asyncio.wait(tasks, timeout=CLOSE_SECONDS)
        self._watches.clear()

    def frame(self, color: bool, width: int) -> str:
        statuses = _busy_first([self.statuses[g] for g in sorted(self.statuses)])
        return render_frame(
            statuses,
            list(self.recent),
            time.time(),
            width=width,
            source=",".join(str(t) for t in self._targets),
            color=color,
            omitted=self.omitted,
        )


async def _snapshot(targets: Sequence[Target], max_groups: int) -> tuple[list[GroupStatus], int]:
    """The shown groups' statuses (busiest first) and how many groups were left out."""
    summaries = await list_groups(targets)
    ranked = sorted(
        summaries,
        key=lambda g: (not (g.holder_job_id or g.queue_length or g.switching), g.group_id),
    )
    shown = ranked[:max_groups]
    statuses = await asyncio.gather(*(get_status(targets, g.group_id) for g in shown))
    return _busy_first(statuses), len(summaries) - len(shown)


async def _once(targets: Sequence[Target], max_groups: int) -> str:
    statuses, omitted = await _snapshot(targets, max_groups)
    return render_frame(
        statuses,
        [],
        time.time(),
        width=shutil.get_terminal_size((120, 40)).columns,
        source=",".join(str(t) for t in targets),
        omitted=omitted,
    )


class _QuitKey:
    """``q`` ends top: stdin (a terminal) in cbreak mode, read by the event loop when a key
    arrives, so that waiting for a key never blocks the redraws. Ctrl-C still signals."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_quit: Callable[[], None]) -> None:
        self._loop = loop
        self._on_quit = on_quit
        self._fd: int | None = None
        self._saved: list[Any] | None = None

    def __enter__(self) -> _QuitKey:
        try:
            fd = sys.stdin.fileno()
            if not os.isatty(fd):
                return self
            self._saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)
        except (OSError, ValueError, termios.error):
            return self  # no terminal to read from (or not ours to set): Ctrl-C still works
        self._fd = fd
        self._loop.add_reader(fd, self._read)
        return self

    def _read(self) -> None:
        assert self._fd is not None
        try:
            keys = os.read(self._fd, 64)
        except OSError:
            keys = b""
        if not keys:  # the terminal went away: stop listening, keep running
            self._loop.remove_reader(self._fd)
        elif b"q" in keys.lower():
            self._on_quit()

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        self._loop.remove_reader(self._fd)
        if self._saved is not None:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
        self._fd = None


async def _live(targets: Sequence[Target], args: argparse.Namespace) -> None:
    top = Top(targets, args.max_groups)
    screen = sys.stdout.isatty()  # a terminal: redraw in place
    loop = asyncio.get_running_loop()
    # q, Ctrl-C and SIGTERM end the loop through an event, not by cancelling this task: on
    # Python 3.11 a cancellation that arrives as the redraw wait's own timeout fires is
    # turned into that TimeoutError and lost, and top then ran on after Ctrl-C.
    stop = asyncio.Event()

    def stopping() -> None:
        stop.set()
        top.changed.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping)
    next_discovery = 0.0
    try:
        with _QuitKey(loop, stopping):
            if screen:
                sys.stdout.write(_HIDE_CURSOR)
            while not stop.is_set():
                if loop.time() >= next_discovery:
                    await top.discover()
                    next_discovery = loop.time() + args.refresh
                error = top.failed()
                if error is not None:
                    raise error
                width = shutil.get_terminal_size((120, 40)).columns
                frame = top.frame(color=screen, width=width)
                sys.stdout.write((_CLEAR + frame if screen else frame + "\n\n") + "\n")
                sys.stdout.flush()
                top.changed.clear()
                # Redraw on a change (at most every --interval), and every second for the ages.
                await asyncio.sleep(args.interval)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, 1.0 - args.interval)):
                        await top.changed.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await top.close()
        if screen:
            sys.stdout.write(_SHOW_CURSOR)
            sys.stdout.flush()


def cmd_top(args: argparse.Namespace) -> int:
    """``timeslice top``."""
    targets = parse_targets(args.target)
    if args.json:
        statuses, omitted = asyncio.run(_snapshot(targets, args.max_groups))
        now = time.time()
        print_json(
            {
                "at": now,
                "groups": [asdict(status_view(s, now)) for s in statuses],
                "omitted": omitted,
            }
        )
        return 0
    if args.once:
        print(asyncio.run(_once(targets, args.max_groups)), flush=True)
        return 0
    try:
        asyncio.run(_live(targets, args))
    except KeyboardInterrupt:
        pass  # Ctrl-C is how one leaves top: not an error
    return 0
