"""`python -m zero_utils.data cache`: list the prepared-data cache, or prune it (zero_utils.data.cache).

    python -m zero_utils.data cache [--cache_dir DIR]
    python -m zero_utils.data cache --prune (--keep_days N | --max_gb G) [--dry_run]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from zero_utils.data import cache


def _table(folders) -> str:
    now = time.time()
    lines = ["| kind | data | tokenizer | seq_len | size | last use | folder |", "|---|---|---|---|---|---|---|"]
    for f in folders:
        days = (now - f.last_use) / 86400
        lines.append(f"| {f.kind} | {f.data} | {f.tokenizer} | {f.seq_len or '?'} | {f.size_bytes / 1e6:,.1f} MB | "
                     f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(f.last_use))} ({days:.1f} days ago) | "
                     f"{f.path.name} |")
    total = sum(f.size_bytes for f in folders)
    return "\n".join(lines) + f"\n{len(folders)} folder(s), {total / 1e6:,.1f} MB"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_utils.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cache", help="list the prepared-data cache (kind, data, tokenizer, seq_len, size, last use), "
                                     "or prune it")
    p.add_argument("--cache_dir", help="the cache's folder (default: <datasets cache>/zero_recipes_rows, "
                                       "from HF_DATASETS_CACHE or HF_HOME)")
    p.add_argument("--prune", action="store_true", help="remove folders: those --keep_days makes old, then the least "
                                                        "recently used above --max_gb; never one a running job holds")
    p.add_argument("--keep_days", type=float, help="with --prune: keep the folders used in the last N days")
    p.add_argument("--max_gb", type=float, help="with --prune: remove the least recently used down to G GB")
    p.add_argument("--dry_run", action="store_true", help="with --prune: say what would be removed, remove nothing")
    args = parser.parse_args(argv)
    if args.prune and args.keep_days is None and args.max_gb is None:
        parser.error("--prune needs --keep_days N or --max_gb G (or both): which folders to remove.")
    if not args.prune and (args.keep_days is not None or args.max_gb is not None or args.dry_run):
        parser.error("--keep_days, --max_gb and --dry_run go with --prune; add it, or drop them to list the cache.")
    if args.cache_dir:
        root = Path(args.cache_dir).expanduser()
    else:
        from zero_utils.data.preparation import rows_cache_root

        root = rows_cache_root()
    if not root.is_dir():
        print(f"{root}: no prepared data yet (0 folders)")
        return
    if args.prune:
        max_bytes = None if args.max_gb is None else int(args.max_gb * 1e9)
        for folder, what in cache.prune(root, keep_days=args.keep_days, max_bytes=max_bytes, dry_run=args.dry_run):
            print(f"{what}: {folder.path} ({folder.kind}, {folder.data}, {folder.size_bytes / 1e6:,.1f} MB)")
    print(f"{root}:\n{_table(cache.list_folders(root))}")


if __name__ == "__main__":
    main()
