"""`mlxkv cache info | clear`: an SSD tier directory, or a remote tier's keys, without opening a tier."""

from __future__ import annotations

import json

from mlxkv.connectors.remote.keys import DEFAULT_PREFIX


def add_cache_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect or clear an SSD tier directory or a remote tier's keys")
    p.add_argument("action", choices=["info", "clear"])
    p.add_argument("--disk-tier", default=None, metavar="DIR", help="SSD tier directory (default: the user cache dir)")
    p.add_argument("--remote-tier", default=None, metavar="URL",
                   help="a remote tier's server instead: its keys under --remote-tier-prefix")
    p.add_argument("--remote-tier-prefix", default=DEFAULT_PREFIX, metavar="PREFIX")
    p.add_argument("--verify", action="store_true",
                   help="info: read every file (or value), check its checksum and count the corrupt ones")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.remote_tier is not None:
        from mlxkv.connectors.remote.admin import remote_clear, remote_info
        from mlxkv.connectors.remote.url import redact

        if args.action == "clear":
            print(f"removed {remote_clear(args.remote_tier, args.remote_tier_prefix)} keys under "
                  f"{args.remote_tier_prefix!r} from {redact(args.remote_tier)}")
        else:
            print(json.dumps(remote_info(args.remote_tier, args.remote_tier_prefix, args.verify), indent=2))
        return 0
    from mlxkv.connectors.disk.cache_dir import cache_clear, cache_info
    from mlxkv.system.paths import default_disk_tier_dir

    directory = args.disk_tier or str(default_disk_tier_dir())
    if args.action == "clear":
        print(f"removed {cache_clear(directory)} block files from {directory}")
    else:
        print(json.dumps(cache_info(directory, args.verify), indent=2))
    return 0
