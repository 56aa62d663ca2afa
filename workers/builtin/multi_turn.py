"""MultiTurnWorkflow: answer, get feedback when the reward is below 1, answer again, in one token sequence.

The sequence grows incrementally: assistant turns are the engine's output ids verbatim, and only the new turn's text
(user feedback here, tool responses in tool_agent) is rendered and tokenized. Re-rendering the whole conversation
would re-tokenize generated text, which can yield other ids than the model sampled and so wrong logprobs.
"""

from __future__ import annotations

from typing import Any

from workers.builtin.rlvr import (
    GenerationConfig,
    LazyTokenizer,
    TokenSequence,
    encode,
    prompt_ids,
    render,
    reward_caller,
)

# A stand-in conversation: the template's rendering of new turns after an assistant turn is the difference between
# rendering it with and without them (the template renders turns independently of their neighbours' content).
_ANCHOR = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def anchor_text(tokenizer: Any) -> str:
    """The stand-in conversation rendered (callers on a hot path compute it once and pass it as `base`)."""
    return render(tokenizer, _ANCHOR)


def continuation_ids(tokenizer: Any, last_output: list[int], messages: list[dict[str, Any]],
                     base: str | None = None) -> list[int]:
    """Tokens that close the assistant turn ending in `last_output` and add `messages`, then open the next
    assistant turn (the generation prompt)."""
    base = base if base is not None else anchor_text(tokenizer)
    full = render(tokenizer, _ANCHOR + messages, add_generation_prompt=True)
    if not full.startswith(base):
        raise ValueError("the chat template does not render new turns as a suffix of the conversation")
    closing = base[base.rindex("a") + 1:]  # what the template writes after assistant content, e.g. "<|im_end|>\n"
    # A turn that stopped on the end-of-turn token already holds that token: add only the rest of the closing text.
    # A turn cut off by length gets the whole closing text (masked: the model did not write it).
    if last_output and last_output[-1] in _eos_ids(tokenizer):
        eos_text = tokenizer.decode([last_output[-1]])
        if closing.startswith(eos_text):
            closing = closing[len(eos_text):]
    return encode(tokenizer, closing + full[len(base):])


def _eos_ids(tokenizer: Any) -> set[int]:
    ids = tokenizer.eos_token_id
    return set(ids) if isinstance(ids, list) else {ids} if ids is not None else set()


class MultiTurnWorkflow:
    def __init__(self, reward_fn: Any, tokenizer: str = "tiny", max_new_tokens: int = 64, temperature: float = 1.0,
                 max_turns: int = 2, feedback: str = "Try again.", reward_mode: str = "inline",
                 reward_timeout: float = 15.0, reward_workers: int = 2, reward_run: str = "default") -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.reward = reward_caller(reward_fn, reward_mode, reward_timeout, reward_workers, reward_run)
        if self.reward is None:
            raise ValueError("MultiTurnWorkflow needs a reward_fn")
        self.reward_fn = self.reward.fn
        self.tokenizer = LazyTokenizer(tokenizer)
        self.generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)
        self.max_turns = max_turns
        self.feedback = feedback

    async def aclose(self) -> None:
        """Stops reward child processes / connections (process and remote modes)."""
        await self.reward.close()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        tok = await self.tokenizer.get()
        prompt = prompt_ids(tok, data)
        prompt_text = tok.decode(prompt)
        seq = TokenSequence()
        seq.add_context(prompt)
        reward = 0.0
        for turn in range(self.max_turns):
            resp = await engine.agenerate(self.generation.request(seq.input_ids, data))
            seq.add_generated(resp)
            reward = await self.reward(
                prompt_text, tok.decode(resp.output_tokens, skip_special_tokens=True), prompt,
                list(resp.output_tokens), {**data, "turn": turn},
            )
            if reward >= 1.0 or turn + 1 == self.max_turns:
                break
            seq.add_context(continuation_ids(tok, resp.output_tokens, [{"role": "user", "content": self.feedback}]))
        return seq.trajectory(reward)


__all__ = ["MultiTurnWorkflow", "continuation_ids"]
