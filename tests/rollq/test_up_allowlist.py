"""`rollq up --workflow mod:Cls` allows the workers exactly that workflow: an allowlist pattern is over dotted names,
so the colon spelling, appended as it was written, matched nothing and every sample was dead-lettered."""

from __future__ import annotations

import pytest

from rollq.trainer.config import TrainConfig
from rollq.up import UpConfig, worker_allowlist
from rollq.workers.resolver import Allowlist, ImportNotAllowed, resolve
from tests.workflows import Echo


@pytest.mark.parametrize("workflow", ["tests.workflows:Echo", "tests.workflows.Echo"])
def test_the_trainers_workflow_is_what_the_workers_may_import(workflow):
    allowlist = Allowlist(patterns=tuple(worker_allowlist(TrainConfig(workflow=workflow), UpConfig())))
    assert resolve(workflow, allowlist=allowlist) is Echo
    with pytest.raises(ImportNotAllowed):  # that workflow, not its whole module
        resolve("tests.workflows:Boom", allowlist=allowlist)


def test_a_built_in_loops_short_name_adds_no_pattern():
    assert worker_allowlist(TrainConfig(workflow="rlvr"), UpConfig(allow=["mine"])) == ["mine"]
