"""The receiving half every receiver shares, wired together once: the reference server (which swaps
the staged buffers in), asyncsync's vLLM engine (which loads from views of them), the reference
server's SGLang API (which receives one bucket per request) and ``protocol.background``.

``BucketStager`` only builds the parts and routes a whole-version request to its intake; each part
is its own class with its own job, used through the stager's attributes::

    stager = BucketStager(expected, "/init_group", runtime)
    stager.joined.join(specs, rank, relay=edges)     # the data plane (protocol.joined)
    staged = stager.receive(request, served)          # a whole version: off the wire, or adopted
                                                      # from the trainer's shared memory (protocol.intake)
    # or, one bucket per request (SGLang's protocol):
    stager.assembly.receive_bucket(meta); ...; staged = stager.assembly.seal(version, served)
    apply(staged.tensors())                           # the receiver's business
    stager.buffers.mark_live(staged)                  # the live weights now alias the buffers, or:
    stager.buffers.mark_committed(staged)             # the receiver copied the version out (vLLM)
    stager.joined.leave()

Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from asyncsync.protocol.admission import Admission
from asyncsync.protocol.arena import Arena
from asyncsync.protocol.device import HostRuntime, Runtime
from asyncsync.protocol.group import Abandoner
from asyncsync.protocol.intake import BucketAssembly, SharedMemoryIntake, WireIntake
from asyncsync.protocol.joined import JoinedGroups
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.staging import StagedVersion, StagingBuffers
from asyncsync.protocol.wire import UpdateRequest


class BucketStager:
    """One receiver's parts: ``admission`` (what a version may hold: the ``expected`` tensors and the
    staging budget ``max_version_bytes``), ``buffers`` (where versions land: ``arenas``, on the
    weights' device ``runtime``, which also decides the groups' backend), ``joined`` (its data-plane
    groups; ``join_route`` is named in errors, ``abandoner`` gives up a hanging join) and the three
    intakes over them: ``wire``, ``shared`` (a same-host trainer's memory) and ``assembly``."""

    def __init__(self, expected: Mapping[str, TensorSpec], join_route: str, runtime: Runtime | None = None,
                 arenas: Sequence[Arena] = (), max_version_bytes: int | None = None,
                 abandoner: Abandoner | None = None):
        self.runtime = runtime or HostRuntime()
        self.admission = Admission(expected, max_version_bytes)
        self.buffers = StagingBuffers(self.runtime, arenas)
        self.joined = JoinedGroups(self.runtime, join_route, abandoner)
        self.wire = WireIntake(self.admission, self.buffers, self.joined)
        self.shared = SharedMemoryIntake(self.admission, self.buffers)
        self.assembly = BucketAssembly(self.admission, self.buffers, self.joined)

    def receive(self, req: UpdateRequest, served_version: int,
                carrying: Mapping[str, TensorSpec] | None = None) -> StagedVersion:
        """A whole version, verified: mapped from the trainer's shared memory when ``req.shm``
        (``shared.adopt``), else off the data plane (``wire.receive``), which ends a version being
        assembled bucket by bucket (its buffers may be the ones this version lands in). Raises as
        those do (``VersionRejected``, ``DataPlaneError``). ``carrying``: the tensors the version must
        carry, when not the receiver's own (an adapter's)."""
        if req.shm is not None:
            return self.shared.adopt(req, served_version, carrying)
        self.joined.require()  # refused before anything changes, an assembly in progress included
        self.assembly.discard()
        return self.wire.receive(req, served_version, carrying)
