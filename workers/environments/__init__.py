"""Environments people already have, run as rollq workloads unchanged: a job's workflow `verifiers:ENV_ID` names a
verifiers environment, `openenv:NAME` an OpenEnv server the operator runs or lets the worker start.

An environment is a command agent whose program the operator fixes: the environment's own interpreter (a virtualenv
of its own, `verifiers_python` / `openenv_python`) running rollq's driver script for it (`verifiers_driver.py`,
`openenv_driver.py`, stdlib and their package only: they never import rollq). The driver runs one episode with the
model behind the worker's recording proxy and prints the environment's own reward, so AgentWorkflow records the
completions token-exactly and turns them into trajectories; groups, staleness, exactly-once and dead letters are a
job's as for any agent. rollq itself never imports verifiers or openenv (their pins clash with each other and with
rollq's).

- naming: the workflow names and their syntax;
- settings: the worker's `environments` settings (which interpreters, which OpenEnv servers);
- agent: EnvironmentAgent, the command agent a job's environment name becomes (after the allowlist allowed it).
"""
