"""deploy/redis-acl.conf as data (its users and their rules) and the `--user` directives of a redis-server command
line, so tests can hold compose.yaml's Redis users to the file's rules."""

from __future__ import annotations

from collections.abc import Sequence

from tests.helpers import REPO_ROOT

ACL_FILE = REPO_ROOT / "deploy" / "redis-acl.conf"
# What redis-py's cluster client sends besides a role's own commands (the file's header says to add them on a cluster)
CLUSTER_RULES = ("+cluster|slots", "+command", "+command|getkeys")
# What go-redis's cluster client (KEDA's scaler) sends besides the `keda` user's own commands: CLUSTER SLOTS and the
# bare COMMAND, none of COMMAND's subcommands (deploy/redis-acl.conf's `keda` comment)
KEDA_CLUSTER_RULES = ("+cluster|slots", "+command") + tuple(
    f"-command|{sub}" for sub in ("count", "docs", "getkeys", "getkeysandflags", "help", "info", "list")
)


def acl_users(text: str | None = None) -> dict[str, list[str]]:
    """user name -> its rules as the file writes them (`RUN` and `CHANGE-ME-<user>` placeholders included)."""
    text = ACL_FILE.read_text() if text is None else text
    users = {}
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["user"]:
            users[words[1]] = words[2:]
    return users


def for_run(rules: Sequence[str], user: str, run: str, password: str) -> list[str]:
    """The file's rules of `user` for `run` with `password` (its placeholders filled in as an operator would)."""
    return [
        f">{password}"
        if rule == f">CHANGE-ME-{user}"
        else rule.replace("{RUN}", "{" + run + "}").replace("{RUN/", "{" + run + "/")
        for rule in rules
    ]


def user_directives(argv: Sequence[str]) -> dict[str, list[str]]:
    """user name -> its rules, from a redis-server command line's `--user NAME RULE...` directives (the rules run to
    the next `--option`)."""
    users: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        if argv[i] == "--user":
            j = i + 2
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            name = argv[i + 1]
            assert name not in users, f"user {name} declared twice"
            users[name] = list(argv[i + 2 : j])
            i = j
        else:
            i += 1
    return users


def option(argv: Sequence[str], name: str) -> list[str]:
    """The values of every `--name VALUE` on a redis-server command line."""
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == f"--{name}"]
