"""What `mlxkv doctor` says of the cache tiers: the state each would open in here, and why.

The SSD tier's directory is looked at, never written (a missing one is
judged by the directory it would be made in); the remote tier's server
is pinged once, with its settings read as `mlxkv cache info` reads them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mlxkv.connectors.health import DOWN, DROPPING, OK, READ_ONLY
from mlxkv.errors import MlxkvError


def tier_report(disk_dir: str | None, remote_url: str | None) -> dict:
    return {"disk": None if disk_dir is None else disk_report(disk_dir),
            "remote": None if remote_url is None else remote_report(remote_url)}


def disk_report(directory: str) -> dict:
    from mlxkv.connectors.disk.cache_dir import cache_info
    from mlxkv.connectors.disk.connector import MAX_MIN_FREE_BYTES, MIN_FREE_SHARE

    root = Path(directory).expanduser()
    there = next((p for p in (root, *root.parents) if p.exists()), Path(os.sep))
    report = {"directory": str(root), "state": OK, "reason": None}
    try:
        st = os.statvfs(there)
        info = cache_info(root) if root.is_dir() else {"files": 0, "bytes": 0}
    except (OSError, MlxkvError) as e:  # not a directory, unreadable
        return {**report, "state": DOWN, "reason": str(getattr(e, "strerror", None) or e)}
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    floor = min(MAX_MIN_FREE_BYTES, int(total * MIN_FREE_SHARE))
    report.update(free_bytes=free, total_bytes=total, min_free_bytes=floor, files=info["files"], bytes=info["bytes"])
    if st.f_flag & os.ST_RDONLY or not os.access(there, os.W_OK):
        report.update(state=READ_ONLY, reason=f"{there} is not writable")
    elif st.f_files and st.f_favail == 0:
        report.update(state=DROPPING, reason=f"out of inodes on {there}")
    elif free + info["bytes"] < floor:
        report.update(state=DROPPING, reason=f"{free >> 20} MiB free, under the floor of {floor >> 20} MiB, "
                                             "even with every file of the tier deleted")
    return report


def remote_report(url: str) -> dict:
    from redis.exceptions import RedisError

    from mlxkv.connectors.remote.admin import admin_client, advice, server_settings
    from mlxkv.connectors.remote.link import classify
    from mlxkv.connectors.remote.url import redact

    report = {"url": redact(url), "state": OK, "reason": None}
    try:
        client = admin_client(url)
        start = time.perf_counter()
        client.ping()
        report["round_trip_ms"] = round((time.perf_counter() - start) * 1000, 2)
        report["server"] = server = server_settings(client)
        report["advice"] = advice(server)
        client.close()
    except MlxkvError as e:
        report.update(state=DOWN, reason=str(e))
    except (RedisError, OSError) as e:
        state, reason = classify(e, write=False)
        report.update(state=state, reason=reason)
    return report


def tier_lines(report: dict) -> list[tuple[str, str]]:
    """The report as `mlxkv doctor` lines."""
    lines = []
    disk = report.get("disk")
    if disk is not None:
        where = disk["directory"]
        if disk["state"] == OK:
            lines.append(("SSD tier", f"ok: {where}, {_gb(disk['free_bytes'])} free (floor "
                                      f"{_gb(disk['min_free_bytes'])}), {disk['files']} files, {_gb(disk['bytes'])}"))
        else:
            lines.append(("SSD tier", f"{disk['state']}: {disk['reason']} ({where})"))
    remote = report.get("remote")
    if remote is not None:
        if remote["state"] == OK:
            server = remote["server"]
            limit = f"of {_gb(server['maxmemory'])}" if server["maxmemory"] else "used, no maxmemory"
            lines.append(("remote tier", f"ok: {remote['url']}, version {server['version']}, round trip "
                                         f"{remote['round_trip_ms']} ms, {_gb(server['used_memory'] or 0)} {limit}, "
                                         f"{server['maxmemory_policy']}"))
            lines += [("remote advice", line) for line in remote["advice"]]
        else:
            lines.append(("remote tier", f"{remote['state']}: {remote['reason']}"))
    return lines


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
