"""Result files as strict JSON: ``NaN`` and ``Infinity`` are not JSON (Python's ``json`` writes
them by default; strict parsers such as JavaScript's ``JSON.parse`` or ``jq`` reject the file),
so a non-finite number is written as ``null``. scripts/train.py and scripts/parity.py write
their files through here."""
from __future__ import annotations

import json
import math
from typing import IO, Any


def strict_json(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-inf) replaced by None, recursively through
    dicts, lists and tuples (tuples become lists, as json writes them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def dump_json(obj: Any, f: IO[str], **kwargs) -> None:
    """``json.dump`` of ``strict_json(obj)`` with ``allow_nan=False`` (so nothing non-finite can
    slip through); indent 1 unless given."""
    kwargs.setdefault("indent", 1)
    json.dump(strict_json(obj), f, allow_nan=False, **kwargs)


def dumps_json(obj: Any, **kwargs) -> str:
    kwargs.setdefault("indent", 1)
    return json.dumps(strict_json(obj), allow_nan=False, **kwargs)
