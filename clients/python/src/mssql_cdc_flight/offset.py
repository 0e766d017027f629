"""Offsets: the last processed commit of a stream, in the seed library's checkpoint form."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class Offset:
    """``{"lsn", "commit_ts"}``: ``lsn`` is the last processed commit LSN (``0x`` and 20
    upper-case hex digits, so string order is commit order), ``commit_ts`` its UTC commit
    time with milliseconds (``""`` when unknown)."""

    lsn: str
    commit_ts: str = ""

    @classmethod
    def from_json(cls, value: Any) -> Offset:
        """From the JSON text or the decoded object."""
        if isinstance(value, (str, bytes)):
            value = json.loads(value)
        if not isinstance(value, dict) or "lsn" not in value:
            raise ValueError(f"an offset is {{'lsn', 'commit_ts'}}, not {value!r}")
        return cls(lsn=str(value["lsn"]), commit_ts=str(value.get("commit_ts") or ""))

    def to_dict(self) -> dict[str, str]:
        return {"lsn": self.lsn, "commit_ts": self.commit_ts}

    def to_json(self) -> str:
        """The seed library's JSON form."""
        return json.dumps(self.to_dict())
