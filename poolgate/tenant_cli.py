"""``poolgate tenant add NAME``: make a new API key, print it once, and the config entry holding only its hash.

The key itself is never stored: paste the printed YAML under ``tenants`` (or add the hash to an existing
tenant's ``api_key_sha256``) and hand the key to the tenant.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets

import yaml

KEY_PREFIX = "pg-"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="generate an API key for tenant NAME and print its config entry")
    add.add_argument("name")
    add.add_argument("--priority", default="standard", help="priority class (default standard)")
    hash_key = actions.add_parser("hash", help="print the SHA-256 of an existing key (read from stdin)")
    hash_key.set_defaults(name=None)


def main(args: argparse.Namespace) -> int:
    if args.action == "hash":
        key = input().strip()
        print(hashlib.sha256(key.encode()).hexdigest())
        return 0
    key = new_key()
    entry = {"name": args.name, "priority": args.priority,
             "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}
    print(f"API key for {args.name} (shown once, not stored anywhere): {key}")
    print("Add under `tenants:` in the configuration:")
    print(yaml.safe_dump([entry], sort_keys=False).rstrip())
    return 0
