"""A receiver's place on the data plane: the trainer's groups it joined and the relay edges below it.

A receiver joins the trainer's group (a sharded trainer's: one per owning trainer rank) when the
trainer asks it to (``join_route``: ``/init_group``, vLLM's ``/init_weight_transfer_engine``), and,
where the trainer planned a relay tree (``protocol.relay``), the edges to the servers below it.
Leaving them is how a receiver says no at once: a receiver that refuses a version before its
payload leaves its groups (``leave(broken=True)``), so the trainer's broadcasts fail at once instead
of waiting for it, and the servers below are told that the version is lost.

Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncsync.protocol.admission import VersionRejected
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.group import Abandoner
from asyncsync.protocol.relay import Edge, Edges
from asyncsync.protocol.stream import join_member
from asyncsync.protocol.wire import GroupSpec, WireError


class JoinedGroups:
    """The data-plane groups one receiver is a member of, joined and left together.

    ``groups``: the trainer's, group i trainer rank i's (a relayed server's one group is its edge
    from the server above: a ``protocol.stream.StreamEdge`` for host weights); ``relay``: the edges
    to the servers below this one. ``join_route`` is named in every error that asks the trainer to join again.
    ``abandoner`` lets another thread give up a join that hangs on a silent peer."""

    def __init__(self, runtime: Runtime, join_route: str, abandoner: Abandoner | None = None):
        self.runtime, self.join_route, self.abandoner = runtime, join_route, abandoner
        self.groups: list[Edge] = []
        self.relay = Edges()

    def join(self, specs: GroupSpec | Sequence[GroupSpec], rank: int, warmup: bool = True,
             relay: Sequence[GroupSpec] = ()) -> None:
        """Leave the groups joined before, then join the trainer's group (a sharded trainer's: one per
        owning trainer rank, in order) as ``rank`` and the ``relay`` edges below; ``WireError`` (before
        any rendezvous) when a group's backend is not the one this receiver's weights take. A join
        that fails leaves whatever it joined."""
        specs = (specs,) if isinstance(specs, GroupSpec) else tuple(specs)
        _check_backends((*specs, *relay), self.runtime)
        self.leave()
        try:
            for spec in specs:
                self.groups.append(join_member(spec, rank, self.runtime, warmup, self.abandoner))
            self.relay.join(relay, self.runtime, warmup, self.abandoner)
        except BaseException:
            self.leave()
            raise

    @property
    def group(self) -> Edge | None:
        """The first group (trainer rank 0's): the only one of an unsharded trainer."""
        return self.groups[0] if self.groups else None

    def require(self) -> Edge:
        """The first group; ``VersionRejected`` naming ``join_route`` when none was joined."""
        if not self.groups:
            raise VersionRejected(f"no data-plane group: call {self.join_route} before sending updates")
        return self.groups[0]

    def leave(self, broken: bool = False) -> None:
        """Leave the groups and the relay edges (aborting them when ``broken``: a receive of them may
        still be pending; the servers below then fail theirs at once)."""
        self.relay.close(broken)  # after a failure the servers below are told the version is lost
        groups, self.groups = self.groups, []
        for group in groups:
            group.close(broken)


def _check_backends(specs: Sequence[GroupSpec], runtime: Runtime) -> None:
    """``WireError`` when a group's backend is not the one weights on ``runtime``'s device take (a
    stream carries host weights, as gloo does)."""
    takes = {runtime.wire_backend, "stream"} if runtime.wire_backend == "gloo" else {runtime.wire_backend}
    for spec in specs:
        if spec.backend not in takes:
            raise WireError(f"the trainer's group uses {spec.backend}, but this server's weights are on "
                            f"{runtime.device}, which take {runtime.wire_backend}: use backend: auto on "
                            "the trainer, or serve the model on the trainer's kind of device")
