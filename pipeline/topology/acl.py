"""Per-role ACL users for the Redis topologies the launcher starts (``redis.acl_file``:
``redis=cluster`` and ``redis=ha``), from an ACL file such as deploy/redis/users.acl.

- :func:`per_run_users` copies the file with a new password per user (its placeholders
  never become real).
- :func:`write_node_acl` writes each node's own ACL file: those users plus :data:`ADMIN`,
  the launcher's, redis-cli's, the replicas' and the sentinels' user (every command,
  key and channel; the per-run password). ``user default off`` in the file leaves no
  other way in.
- :func:`sentinel_users` gives a sentinel's ``user`` lines (sentinels load no ACL file):
  :data:`ADMIN` again (the other sentinels log in as it: ``sentinel sentinel-user``),
  and each role's user with the same password and :data:`SENTINEL_RULES` only, so a
  pool can find the primary and nothing more (no ``SENTINEL SET``, ``MONITOR``,
  ``FAILOVER``, ``RESET``, ``CONFIG``, ``ACL``, ``SHUTDOWN``). deploy/bin/
  nonstop-sentinel-start writes the same rules for an operator's sentinels.
"""

from __future__ import annotations

import os
import secrets

from pipeline.redisd.tls import write_private

ADMIN = "nonstop-admin"  # with an ACL file: the launcher's own user on every node
POOL_ROLES = ("actor", "preprocessor", "trainer", "evaluator")  # users a pool connects as

# What a pool (and pipeline.inspect) asks a sentinel: which node is the primary, and the
# state behind it (the start-up probe's failover check); connection commands as on a node.
SENTINEL_RULES = (
    "resetchannels -@all +@connection -@dangerous +sentinel|get-master-addr-by-name "
    "+sentinel|master +sentinel|masters +sentinel|replicas +sentinel|slaves +sentinel|sentinels"
)


def per_run_users(src: str, dest: str) -> dict[str, str]:
    """Copy the ACL file ``src`` (deploy/redis/users.acl) to ``dest`` (mode 0600) with a
    new password for each user but ``default`` (its passwords and hashes dropped, so the
    file's placeholders never become real); returns {user: password}."""
    if not os.path.isfile(src):
        raise ValueError(
            f"redis.acl_file={src!r} is not a file: give the path of an ACL file of per-role "
            "users, e.g. redis.acl_file=deploy/redis/users.acl"
        )
    users, out = {}, []
    with open(src) as f:
        for line in f:
            words = line.split()
            if len(words) >= 2 and words[0] == "user" and words[1] != "default":
                users[words[1]] = secrets.token_hex(16)
                rules = [w for w in words[2:] if w[0] not in "><#!" and w != "nopass"]
                words = ["user", words[1], *rules, f">{users[words[1]]}"]
            if words:
                out.append(" ".join(words))
    write_private(dest, "\n".join(out) + "\n")
    return users


def write_node_acl(acl_file: str, data_dirs: list[str], password: str) -> None:
    """Each node's ACL file (``DIR/users.acl``, mode 0600): the users of ``acl_file``
    and :data:`ADMIN` with ``password``. A replica promoted in a failover has the same
    users, since every node loads the same file."""
    with open(acl_file) as f:
        users = [ln.strip() for ln in f if ln.strip()]
    if any(ln.split()[:2] == ["user", ADMIN] for ln in users):
        raise ValueError(
            f"{acl_file} defines the user {ADMIN}, which the launcher keeps for itself: "
            "rename that user"
        )
    users.append(admin_line(password))
    for d in data_dirs:
        os.makedirs(d, exist_ok=True)
        write_private(os.path.join(d, "users.acl"), "\n".join(users) + "\n")


def admin_line(password: str) -> str:
    return f"user {ADMIN} on >{password} ~* &* +@all"


def sentinel_users(users: dict[str, str], password: str) -> list[str]:
    """A sentinel's ``user`` lines: no default user, :data:`ADMIN` with ``password``,
    each of ``users`` ({name: password}) with :data:`SENTINEL_RULES`."""
    lines = ["user default off", admin_line(password)]
    lines += [f"user {name} on >{pw} {SENTINEL_RULES}" for name, pw in sorted(users.items())]
    return lines
