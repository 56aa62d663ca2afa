"""An agent episode's recorded completions -> rewards per completion -> training sequences.

The completions form a tree by parent links (a request that continues a recorded conversation is its child; `n > 1`
and an agent that retries from an earlier point make branches). Returns flow up that tree with AReaL's rule
(`InteractionCache.apply_reward_discount`): a completion's value is its own reward (0 when it has none; an explicit 0
counts the same) plus `turn_discount` times its child's value, the mean of its children's values when it has several.
AReaL walks creation order instead; along one linear conversation the two agree, and with the tree concurrent
sub-agents or abandoned branches don't discount each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollq.workers.proxy.sessions import CompletionRecord
from rollq.workers.rewards.values import as_reward


class AgentOutputError(ValueError):
    """The agent's return value or its recorded completions can't be turned into trajectories."""


def _number(value: Any, what: str) -> float:
    reward = as_reward(value)
    if reward is None:
        raise AgentOutputError(f"{what} must be a finite number, got {type(value).__name__} {value!r:.80}")
    return reward


def assign_rewards(records: list[CompletionRecord], result: Any) -> None:
    """A number rewards the last completion (every choice of the last request); a mapping maps completion ids
    (`response.id`, or `id:choice` for one choice of an n > 1 request) to rewards."""
    if not records:
        raise AgentOutputError(
            "the agent made no completion through the proxy: it must call the base_url with the "
            "api_key it was given (or OPENAI_BASE_URL / OPENAI_API_KEY in subproc mode)"
        )
    if isinstance(result, Mapping):
        by_key: dict[str, list[CompletionRecord]] = {}
        for rec in records:
            by_key.setdefault(rec.key, []).append(rec)
            if rec.choice != 0:  # the response id stands for all its choices
                by_key.setdefault(rec.id, []).append(rec)
        # A response id rewards all its choices; an `id:choice` key then overrides its one choice.
        for cid, value in sorted(result.items(), key=lambda kv: ":" in str(kv[0])):
            targets = by_key.get(str(cid))
            if targets is None:
                known = ", ".join(sorted({r.id for r in records}))
                raise AgentOutputError(f"reward for unknown completion id {cid!r}; this episode's ids: {known}")
            reward = _number(value, f"reward of completion {cid!r}")
            for rec in targets:
                rec.reward = reward
        return
    reward = _number(result, "the agent's return value (a reward, or {completion_id: reward})")
    last = max(r.order for r in records)
    for rec in records:
        if rec.order == last:
            rec.reward = reward


def tree_rewards(records: list[CompletionRecord], turn_discount: float) -> dict[str, float]:
    """Each completion's return: own reward (or 0) + turn_discount * mean of its children's returns."""
    children: dict[str, list[str]] = {}
    for rec in records:
        if rec.parent is not None:
            children.setdefault(rec.parent, []).append(rec.key)
    values: dict[str, float] = {}
    # A child is always created after its parent, so reverse creation order visits children first.
    for rec in sorted(records, key=lambda r: (r.order, r.choice), reverse=True):
        kids = children.get(rec.key, [])
        later = sum(values[k] for k in kids) / len(kids) if kids else 0.0
        values[rec.key] = (rec.reward or 0.0) + turn_discount * later
    return values


def _individual(rec: CompletionRecord, reward: float) -> dict[str, Any]:
    n_prompt, n_out = len(rec.prompt_ids), len(rec.output_ids)
    return {
        "input_ids": rec.prompt_ids + rec.output_ids,
        "loss_mask": [0] * n_prompt + [1] * n_out,
        "logprobs": [0.0] * n_prompt + rec.output_logprobs,
        "versions": [-1] * n_prompt + rec.output_versions,
        "reward": reward,
        **_vision(rec),
    }


def _vision(leaf: CompletionRecord) -> dict[str, Any]:
    """The images of a sequence that ends with `leaf`'s output: its prompt's, which are every image of the
    conversation up to it (a continued prompt keeps its parent's), so also the whole branch's in `concat`."""
    return leaf.vision.trajectory_fields(len(leaf.full_ids)) if leaf.vision is not None else {}


def _concat(path: list[CompletionRecord], reward: float) -> dict[str, Any]:
    leaf = path[-1]
    ids = leaf.full_ids
    mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
    for rec in path:
        start, end = len(rec.prompt_ids), len(rec.prompt_ids) + len(rec.output_ids)
        if ids[start:end] != rec.output_ids:
            raise AgentOutputError(f"completion {leaf.key} does not extend {rec.key} token by token")
        mask[start:end] = [1] * (end - start)
        logprobs[start:end] = rec.output_logprobs
        versions[start:end] = rec.output_versions
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "versions": versions,
        "reward": reward,
        **_vision(leaf),
    }


def _extends(child: CompletionRecord, parent: CompletionRecord) -> bool:
    """Whether the child's prompt is the parent's exact tokens plus more (the proxy's default continuation; with
    `continuation = "template"` a child starts a new token sequence)."""
    n = len(parent.prompt_ids) + len(parent.output_ids)
    return len(child.prompt_ids) >= n and child.prompt_ids[:n] == parent.full_ids


def export(records: list[CompletionRecord], style: str, turn_discount: float) -> list[dict[str, Any]]:
    """`individual`: one sequence per completion. `concat`: one per conversation branch (root to leaf), the leaf's
    exact token sequence with every ancestor's output trained on and everything else (prompts, user and tool
    turns) masked. A child whose prompt does not extend its parent's tokens (a re-rendered conversation) starts a
    new sequence; the parent's then ends with the parent, rewarded with its return."""
    return list(export_by_key(records, style, turn_discount).values())


def export_by_key(records: list[CompletionRecord], style: str, turn_discount: float) -> dict[str, dict[str, Any]]:
    """export()'s sequences in the same order, each keyed by the completion it ends with (its record's `key`)."""
    ordered = sorted(records, key=lambda r: (r.order, r.choice))
    rewards = tree_rewards(ordered, turn_discount)
    if style == "individual":
        return {r.key: _individual(r, rewards[r.key]) for r in ordered}
    if style != "concat":
        raise AgentOutputError(f"unknown export style {style!r} (individual or concat)")
    by_key = {r.key: r for r in ordered}
    extended = {r.parent for r in ordered if r.parent is not None and _extends(r, by_key[r.parent])}
    out: dict[str, dict[str, Any]] = {}
    for leaf in ordered:
        if leaf.key in extended:
            continue
        path = [leaf]
        while path[-1].parent is not None and _extends(path[-1], parent := by_key[path[-1].parent]):
            path.append(parent)
        out[leaf.key] = _concat(path[::-1], rewards[leaf.key])
    return out


__all__ = ["AgentOutputError", "assign_rewards", "export", "export_by_key", "tree_rewards"]
