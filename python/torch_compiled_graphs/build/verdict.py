"""Whether the remote holds a cell's key as the fleet would take it: fetched and verified.

A ref alone proves nothing: anyone who can write to the bucket can create ``refs/<key>``
naming a manifest that does not exist, or an artifact no allowed signer signed, and a
ref is first writer wins. So a cell counts as present only when a fresh worker of this
process's configuration (remote, trust policy from the environment) can take the key:
:func:`remote_verdict` pulls it into a private temporary store, which fetches every chunk,
verifies the whole envelope and, under a trust policy, admits it only when an allowed
signer signed it (``Engine.pull``, docs/fleet.md). Nothing is kept.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

__all__ = ["RemoteVerdict", "remote_verdict"]


@dataclass(frozen=True)
class RemoteVerdict:
    """What a fresh worker found on the remote for one key."""

    #: The key's artifact was fetched, verified in full and (under a trust policy) admitted.
    present: bool
    #: Under a trust policy: an allowed signer signed it (admission requires one). Without a
    #: policy: at least one valid signature record about these exact bytes is on the remote.
    signed: bool
    #: Whether the verdict was reached under a trust policy.
    trusting: bool
    #: Why it is not present (``None`` when it is).
    reason: str | None = None

    def fact(self) -> dict[str, Any]:
        return {"present": self.present, "signed": self.signed, "trusting": self.trusting, "reason": self.reason}


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def remote_verdict(remote: str, key: str) -> RemoteVerdict:
    """Fetch ``key`` from ``remote`` into a private temporary store as a fresh worker would.

    Costs one verified download of the key's artifact (code only; the weights are never
    in it). The remote's warnings during the fetch are the reason of a refusal; they are
    not logged again.
    """
    from ..engine import Engine

    logger = logging.getLogger("torch_compiled_graphs")
    collect = _Collect()
    propagate = logger.propagate
    logger.addHandler(collect)
    # The cell or the plan reports the reason once; the worker's warnings would repeat it.
    logger.propagate = False
    try:
        with tempfile.TemporaryDirectory(prefix="tcg-build-verdict-") as work:
            engine = Engine(os.path.join(work, "store"), remote=remote)
            (row,) = engine.pull([key])
            stats = engine.stats()
            trusting = engine.trusting
    finally:
        logger.removeHandler(collect)
        logger.propagate = propagate
    if row.get("source") == "remote":
        signed = True if trusting else int(row.get("signatures") or 0) > 0
        return RemoteVerdict(True, signed, trusting)
    if row.get("refused"):
        reason = f"refused by this trust policy ({row['refused']}): {row.get('error', '')}".rstrip(": ")
    elif collect.messages:
        reason = collect.messages[-1].removeprefix("remote tier: ")
    elif stats.get("remote_misses"):
        reason = "the ref names an artifact the remote does not hold in full (its manifest or a chunk is missing)"
    else:
        reason = "the remote has nothing a worker can take for this key"
    return RemoteVerdict(False, False, trusting, reason)
