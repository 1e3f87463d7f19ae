"""The session's output file name, claimed for as long as the session runs (see
:mod:`xsp.io.output_claim`): a second run writing the same name at once gets a numbered name of
its own, and says so (at the end, one file would replace the other)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from xsp.io.output_claim import Claim, claim
from xsp.io.segments import killed_run_left


class OutputName:
    """The claim a session holds on its output's name (none while it holds none)."""

    def __init__(self) -> None:
        self.claim: Claim | None = None

    @property
    def requested(self) -> Path | None:
        """The name asked for, where one is claimed (the claimed one may be numbered)."""
        return None if self.claim is None else self.claim.requested

    def take(self, output: Path, warn: Callable[[str], None]) -> Path:
        """Claim ``output`` for this run; returns the name to write (``output``, or a numbered
        one where another live session writes ``output``, which ``warn`` says)."""
        self.claim = claim(output, killed_run_left)
        if self.claim.awaiting is not None:
            warn(f"a run writing {self.claim.awaiting} left its windows without writing it (it was killed, or runs "
                 f"in another container); they wait for `xsp recover {self.claim.awaiting}`, and this run writes "
                 f"{self.claim.path} instead")
        elif self.claim.path != output:
            warn(f"another xsp session (process {self.claim.other_pid}) is writing {output}; "
                 f"this one writes {self.claim.path} instead")
        return self.claim.path

    def claim_exactly(self, output: Path) -> Path | None:
        """Claim ``output`` itself for this run, or nothing (None: a live session writes it, or a
        killed run's windows wait for ``xsp recover`` of it). Where no claim can be made at all (a
        read-only folder), ``output`` unclaimed, as :meth:`take` gives it."""
        claimed = claim(output, killed_run_left)
        if claimed.path != output or claimed.awaiting is not None:
            claimed.release()
            return None
        self.claim = claimed
        return output

    def release(self) -> None:
        """Give the name back (the file, if written, stays)."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None
