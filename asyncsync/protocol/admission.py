"""What a receiver admits: a version's tensors judged against the served model's, before anything
is allocated for them or applied, and the errors that say why not.

``protocol.staging`` asks it on both ways in (a whole version per request, a bucket per request).
Its messages are the receiver's answer to the trainer: each names the tensor, the bytes or the
version at fault, and one refused for its layout says ``specs.LAYOUT_REFUSED`` (every version of
that plan would be refused: the trainer evicts the server instead of retrying).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from asyncsync.protocol.specs import LAYOUT_REFUSED, Bucket, TensorSpec, layout_mismatch
from asyncsync.protocol.wire import LayoutCheck

log = logging.getLogger(__name__)

MAX_REPORTED_PROBLEMS = 5


class VersionRejected(Exception):
    """A version was received but not applied; the old weights keep serving. The message says why;
    one refused for its layout says ``specs.LAYOUT_REFUSED``: every version of that plan would be."""


class BucketRefused(VersionRejected):
    """A bucket sent one per request (SGLang's protocol) was refused before its broadcast: the
    receiver took no part in it, so the sender must not wait for this receiver."""


class Admission:
    """The tensors a receiver expects (names, dtypes, shapes, every one exactly once) and its staging
    budget: the most bytes one version may make it allocate. A valid version holds every expected
    tensor exactly once, so the model's own size is the default; more can only repeat or invent
    tensors."""

    def __init__(self, expected: Mapping[str, TensorSpec], max_version_bytes: int | None = None):
        self.expected = dict(expected)
        self.model_bytes = sum(spec.nbytes for spec in self.expected.values())
        self.max_version_bytes = self.model_bytes if max_version_bytes is None else max_version_bytes

    def unstageable(self, buckets: Iterable[Bucket], nbytes: int, whole: bool,
                    carrying: Mapping[str, TensorSpec] | None = None) -> list[str]:
        """Why nothing may be allocated for ``buckets`` (staging ``nbytes`` in all): names the model
        does not have (with ``whole``, a whole version: also what it lacks), or more bytes than the
        staging budget. ``carrying``: the tensors the version must carry, when not the model's."""
        expected = self.expected if carrying is None else carrying
        specs = [s for b in buckets for s in b.specs]
        unknown = any(s.name not in expected for s in specs)
        why = [layout_mismatch(expected, specs, part=not whole) or ""] if unknown else []  # marked lasting
        if nbytes > self.max_version_bytes:
            why.append(f"it needs {nbytes} bytes of staging, more than this receiver's budget of "
                       f"{self.max_version_bytes} (the served model is {self.model_bytes})")
        return why

    def check_specs(self, specs: Iterable[TensorSpec], seen: set[str]) -> list[str]:
        """Problems with ``specs`` given the names ``seen`` earlier in the version (updated in place)."""
        problems = []
        for spec in specs:
            want = self.expected.get(spec.name)
            if spec.name in seen:
                problems.append(f"tensor '{spec.name}' sent twice")
            elif want is None:
                problems.append(f"unknown tensor '{spec.name}'")
            elif (want.dtype, want.shape) != (spec.dtype, spec.shape):
                problems.append(f"'{spec.name}': got {spec.dtype} {spec.shape}, expected {want.dtype} {want.shape}")
            seen.add(spec.name)
        return [f"{LAYOUT_REFUSED}: " + "; ".join(problems[:MAX_REPORTED_PROBLEMS])] if problems else []

    def check_complete(self, buckets: list[Bucket], version: int, served_version: int,
                       carrying: Mapping[str, TensorSpec] | None = None) -> list[str]:
        """Problems with a whole version: tensors missing, extra or of another shape (first: what the
        server loads), a version not newer than the served one."""
        problems = []
        if version <= served_version:
            problems.append(f"version {version} is not newer than the served version {served_version}")
        mismatch = layout_mismatch(self.expected if carrying is None else carrying, [s for b in buckets for s in b.specs])
        return [mismatch, *problems] if mismatch else problems

    def check_layout(self, check: LayoutCheck) -> None:
        """Raise ``VersionRejected`` (saying ``LAYOUT_REFUSED`` and the differences) unless the trainer
        plans to send exactly the tensors this receiver expects: asked at the trainer's ``connect``."""
        problem = layout_mismatch(self.expected, check.specs)
        if problem is not None:
            log.warning("the trainer's plan was refused: %s", problem)
            raise VersionRejected(problem)


def reject_if(problems: list[str], version: int | None) -> None:
    """Raise ``VersionRejected`` naming ``version`` (None: a bucket) and the first problems, if any."""
    if problems:
        what = f"version {version}" if version is not None else "bucket"
        log.warning("rejected %s: %s", what, "; ".join(problems))
        raise VersionRejected(f"{what} rejected: " + "; ".join(problems[:MAX_REPORTED_PROBLEMS]))
