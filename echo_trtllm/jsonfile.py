"""Read a JSON object from a file, with errors that name the file (engine.json, config.json, calibration.json)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_json_object"]


def read_json_object(path: str | Path) -> dict:
    """The file's JSON object; ValueError naming the file when it is not valid JSON or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
