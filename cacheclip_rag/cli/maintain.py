"""`cacheclip inspect | verify | evict | compact`: a store's statistics and upkeep."""

from __future__ import annotations

import argparse

from .args import store_path


def inspect(args: argparse.Namespace) -> int:
    from ..store import LMDBStore

    path = store_path(args)
    with LMDBStore(path, readonly=True) as store:
        stats = store.stats()
    print(f"store   {stats['path']}\nentries {stats['entries']}\nbytes   {stats['bytes']:,} "
          f"(file {stats['file_bytes']:,})\nquarantined {stats['quarantined']}")
    for fingerprint, row in stats["models"].items():
        names = ", ".join(row["names"]) or "unnamed"
        per_token = f"{row['bytes_per_token'] / 1024:.1f} KB/token" if row["bytes_per_token"] else "–"
        print(f"model   {names} [{fingerprint[:12]}]: {row['entries']} entries, {row['tokens']:,} tokens, "
              f"{row['bytes']:,} bytes, {per_token}, stored as {'/'.join(row['dtypes'])}")
    return 0


def maintain(args: argparse.Namespace) -> int:
    """verify (quarantine damaged entries), evict (LRU down to --max-bytes), compact (shrink the file)."""
    from ..store import LMDBStore

    path = store_path(args)
    with LMDBStore(path) as store:
        if args.command == "verify":
            print(store.verify())
        elif args.command == "evict":
            print(f"evicted {store.evict(args.max_bytes)} entries")
        else:
            before, after = store.compact()
            print(f"compacted {path}: {before:,} -> {after:,} bytes")
    return 0


