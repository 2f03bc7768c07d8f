"""Which nodes checkpoint and restore what, so that a job's state is on all of its nodes.

Pure functions of a group's view and the agents' records: the driver writes their answer into
the switch record, and every node then acts on its own steps.
"""

from __future__ import annotations

from collections.abc import Collection

from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import (
    AgentRecord,
    NodeStep,
    OperationKind,
    OperationRecord,
    ResidentRecord,
)


def nodes_of(group: str, job: str, agents: dict[str, AgentRecord]) -> list[str]:
    """Nodes where ``job`` has a registered worker of ``group``."""
    return sorted(node for node, agent in agents.items() if job in agent.jobs_of(group))


def stranded(
    residency: ResidentRecord,
    group: str,
    job: str,
    agents: dict[str, AgentRecord],
    members: Collection[str] = (),
) -> list[str]:
    """The nodes where ``job``'s state is parked and that cannot restore it now, so that
    ``job`` must not be granted (``docs/fencing.md``, "A job parked on a node that is away").

    Such a node's agent is away (fenced, or its record expired: a switch would go on without
    it), or it is back but a switch towards ``job`` would leave it out: it lists no worker of
    ``job`` yet (a restarted agent's hello can come before the job's registrations reach it
    again) and is not pinned to the group (``members``). Either way ``job``'s processes there
    would stay parked (stopped, for the freeze backend) while it is told that it holds the
    group. Granted only once that node has restored it.
    """
    return sorted(
        node
        for node, jobs in residency.parked.items()
        if job in jobs
        and (node not in agents or (job not in agents[node].jobs_of(group) and node not in members))
    )


def plan(
    view: GroupView,
    job: str,
    agents: dict[str, AgentRecord],
    co_residency: bool = False,
    protect: str = "",
) -> list[NodeStep] | None:
    """What must move so that ``job`` is resident on every node where it runs.

    Those are the nodes where it registered workers, plus any node an operator pinned to the
    group (static membership). On a node whose backend reports device capacity, jobs already
    there stay as long as ``job`` fits next to them (least recently restored leave first);
    elsewhere every other job leaves. A node where ``job`` is already resident needs nothing.

    A node that evicts several jobs gets one step per job, the restore riding on the last. The
    answer is None when ``job`` only fits by evicting ``protect`` (the holder, for a prefetch).
    """
    residency = view.residency()
    nodes = sorted(set(nodes_of(view.group, job, agents)) | set(view.static_members))
    steps: list[NodeStep] = []
    for node in nodes:
        on_device = residency.nodes.get(node, [])
        if job in on_device:
            continue
        evict = _evictions(on_device, job, agents.get(node), co_residency, protect)
        if protect and protect in evict:
            return None
        steps += [NodeStep(node=node, evict=other, restore="") for other in evict[:-1]]
        steps.append(NodeStep(node=node, evict=evict[-1] if evict else "", restore=job))
    return steps


def _evictions(
    on_device: list[str],
    job: str,
    agent: AgentRecord | None,
    co_residency: bool,
    protect: str,
) -> list[str]:
    """The jobs that leave one node's devices so that ``job`` fits there."""
    if not (co_residency and agent is not None and agent.capacity_bytes):
        return list(on_device)  # one job's state at a time
    free = agent.capacity_bytes - sum(agent.job_bytes(j) for j in on_device)
    evict = []
    for other in on_device:  # least recently restored first
        if free >= agent.job_bytes(job):
            break
        if other == protect:
            continue
        evict.append(other)
        free += agent.job_bytes(other)
    if free < agent.job_bytes(job):
        return list(on_device)  # it does not fit even so: clear the node
    return evict


def plan_operation(
    view: GroupView, op: OperationRecord, agents: dict[str, AgentRecord], co_residency: bool
) -> list[NodeStep] | str:
    """What an operator operation moves on its node, or why the group does not allow it now.

    The same answer at the request (refused with the reason) and when the driver runs it
    (failed with the reason): the group may have changed in between. An empty list is an
    operation with nothing to move (the state is already where it was asked to be).

    - **Snapshot** evicts the job on the node and restores nothing. Never the holder's: the
      orchestrator counts the holder's state as on its devices while it holds.
    - **Restore** brings the job back on the node without granting it. The holder's own
      state (a catch-up), or any job's while the group is free (it then is resident without
      holding; its next acquire is granted in place), may evict what else is there, as a
      switch towards it would. Beside another job's hold it must fit next to the holder,
      exactly as a prefetch: the holder's state never leaves.
    """
    node, job, group = op.node, op.job, op.group
    agent = agents.get(node)
    if agent is None:
        return f"node {node} has no agent connected"
    if job not in agent.jobs_of(group):
        return f"job {job} has no registered worker of group {group} on node {node}"
    holder = view.holder.record.job if view.holder is not None else ""
    on_device = view.residency().nodes.get(node, [])
    if op.kind is OperationKind.SNAPSHOT:
        if holder == job:
            return f"job {job} holds group {group}; yield first"
        if job not in on_device:
            return f"job {job}'s state is not on node {node}'s devices (nothing to snapshot)"
        return [NodeStep(node=node, evict=job, restore="")]
    if job in on_device:
        return []
    protect = holder if holder and holder != job else ""
    evict = _evictions(on_device, job, agent, co_residency or bool(protect), protect)
    if protect and protect in evict:
        return (
            f"group {group} is held by {protect} and job {job}'s state does not fit beside it "
            f"on node {node}"
        )
    steps = [NodeStep(node=node, evict=other, restore="") for other in evict[:-1]]
    steps.append(NodeStep(node=node, evict=evict[-1] if evict else "", restore=job))
    return steps
