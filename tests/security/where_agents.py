"""Agents that report where they run (tests/security/test_agent_planting.py). They import only `os`, which every
Python process has loaded: as uid 65534 a child cannot read the rest of the standard library on the test machine
(it lies in root's home)."""

import os


class WhereAmI:
    """Reports its working directory and user as {"<cwd> <uid> <owner of cwd>": 1.0}."""

    def run(self, data):
        cwd = os.getcwd()
        return {f"{cwd} {os.getuid()} {os.stat(cwd).st_uid}": 1.0}


class AsyncWhereAmI(WhereAmI):
    async def run(self, data):
        return WhereAmI.run(self, data)
