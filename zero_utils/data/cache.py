"""The prepared-data cache: what it holds, which folders a running job uses, and pruning the rest.

Every prepared folder (SFT rows, preference pairs, prompts: zero_utils.data.preparation.prepared_folder)
stays under `<datasets cache>/zero_recipes_rows` until removed: each seq_len, tokenizer or data variant adds one.

    python -m zero_utils.data cache                               # list: kind, data, tokenizer, seq_len, size, last use
    python -m zero_utils.data cache --prune --keep_days 14        # remove those unused for 14 days
    python -m zero_utils.data cache --prune --max_gb 50           # remove the least recently used down to 50 GB

A job holds each folder it prepares or opens (`hold`): a shared `flock(2)` on `<folder>/.in_use`, kept until the
process exits (a crash or kill -9 releases it too), and the file's modification time set to now, the folder's last
use. Pruning takes an exclusive lock first and leaves a folder it cannot lock alone: a running job's folder is never
removed. On a shared disk the lock is as good as the file system's locks: Linux NFS clients send flock to the server
(every client sees it); Lustre does so only when mounted with `-o flock` (with `localflock` a lock is seen on its own
node only), and some FUSE file systems not at all. There, prune from a node that runs the jobs, or keep --keep_days
above the longest job: the last use is written when a job starts. Imports nothing of zero_utils.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

HOLD_FILE = ".in_use"
_held: dict[Path, object] = {}  # folder -> its open .in_use: the shared lock lasts as long as this process


def hold(folder: Path) -> None:
    """Mark the prepared `folder` as used by this process until it exits: a shared flock on `<folder>/.in_use`
    (waiting only while a prune is taking the folder) and the file's modification time set to now. A folder this
    process may not write to (a read-only cache) is used without a hold."""
    folder = Path(folder)
    if folder in _held:
        return
    try:
        file = open(folder / HOLD_FILE, "a")  # noqa: SIM115 (open for the process's lifetime)
    except OSError:
        return
    fcntl.flock(file, fcntl.LOCK_SH)
    os.utime(folder / HOLD_FILE)
    _held[folder] = file


@dataclass
class CachedFolder:
    """One folder of the cache: `kind` ('SFT rows', 'SFT rows, unpacked', 'preference pairs' or 'prompts', each with
    ' (mixture)', or 'incomplete': a preparation that is running or was killed), `data` (the data set, or the
    mixture's sources), `tokenizer` (its name when recorded, else its fingerprint's first 12 characters), `seq_len`
    (prompts: their longest), `size_bytes` and `last_use` (seconds since the epoch)."""

    path: Path
    kind: str
    data: str
    tokenizer: str
    seq_len: int | None
    size_bytes: int
    last_use: float


def _size_and_newest(folder: Path) -> tuple[int, float]:
    files = [p.stat() for p in folder.rglob("*") if p.is_file()]
    return sum(s.st_size for s in files), max([s.st_mtime for s in files], default=folder.stat().st_mtime)


def _describe_data(depends_on: dict) -> str:
    if "mixture" in depends_on:
        return " + ".join(s["id"] for s in depends_on["mixture"]["datasets"])
    data = depends_on.get("data", {})
    if "hub" in data:
        return data["hub"]
    files = data.get("files", [])
    return files[0][0] + (f" (+{len(files) - 1} files)" if len(files) > 1 else "") if files else "?"


def list_folders(root: Path) -> list[CachedFolder]:
    """The prepared folders under `root`, least recently used first."""
    folders = []
    for folder in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        if not folder.is_dir():
            continue
        size, newest = _size_and_newest(folder)
        info_file = folder / "info.json"
        if folder.name.startswith(".") or not info_file.is_file():
            folders.append(CachedFolder(folder, "incomplete", "?", "?", None, size, newest))
            continue
        info = json.loads(info_file.read_text())
        depends_on = info.get("depends_on", {})
        rows = depends_on.get("rows", depends_on)  # folders before the one pipeline kept the settings at the top
        made = rows.get("kind", "pairs" if "pairs" in rows else None)  # ... and said pairs by a "pairs" version
        kind = {"pairs": "preference pairs", "prompts": "prompts"}.get(made, "SFT rows")
        kind += (", unpacked" if rows.get("packing") is False else "") + (
            " (mixture)" if "mixture" in depends_on else "")
        hold_file = folder / HOLD_FILE
        last_use = hold_file.stat().st_mtime if hold_file.is_file() else info_file.stat().st_mtime
        folders.append(CachedFolder(folder, kind, _describe_data(depends_on),
                                    info.get("tokenizer_name") or str(depends_on.get("tokenizer", "?"))[:12],
                                    rows.get("seq_len", rows.get("max_prompt_tokens")), size, last_use))
    return sorted(folders, key=lambda f: f.last_use)


def _take(folder: Path):
    """An exclusive lock on `folder`'s .in_use, or None when a job holds it."""
    try:
        file = open(folder / HOLD_FILE, "a")  # noqa: SIM115
    except OSError:
        return None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        return None
    return file


def prune(root: Path, *, keep_days: float | None = None, max_bytes: int | None = None, dry_run: bool = False,
          now: float | None = None) -> list[tuple[CachedFolder, str]]:
    """Remove the folders under `root` last used more than `keep_days` days ago, then the least recently used until
    the rest take at most `max_bytes`; never one a running job holds (`hold`). An incomplete folder (a preparation's
    temporary one) goes only by `keep_days`, its newest file counting as its last use. Returns each folder considered
    with what happened: 'removed' (or 'would remove' with `dry_run`), 'held by a running job: kept'."""
    now = time.time() if now is None else now
    folders, done = list_folders(root), []
    total = sum(f.size_bytes for f in folders)
    for folder in folders:
        too_old = keep_days is not None and now - folder.last_use > keep_days * 86400
        too_big = max_bytes is not None and total > max_bytes and folder.kind != "incomplete"
        if not (too_old or too_big):
            continue
        lock = _take(folder.path)
        if lock is None:
            done.append((folder, "held by a running job: kept"))
            continue
        if not dry_run:
            removing = folder.path.parent / f".removing_{folder.path.name}_{os.getpid()}"
            folder.path.rename(removing)  # a job that looks for the folder from now on prepares it again
            shutil.rmtree(removing)
        lock.close()
        total -= folder.size_bytes
        done.append((folder, "would remove" if dry_run else "removed"))
    return done
