"""AReaL's in-process OpenAI client (`areal.experimental.openai.ArealOpenAI`) on rollq's recording proxy, so a
workflow that talks to the engine through it (AReaL's `experimental/workflow/multi_turn_v2.py`) runs with only its
imports changed:

    client = ArealOpenAI(engine=engine, tokenizer=tokenizer)
    comp = await client.chat.completions.create(messages=..., max_completion_tokens=..., temperature=..., ...)
    client.get_interaction(comp.id).model_response.output_tokens   # the engine's ModelResponse
    client.set_reward(comp.id, reward)
    return client.export_interactions()                            # {completion id: interaction}

No HTTP: a request goes through the proxy's own code in this process (request validation, chat template, parent
matching, generation on the engine, reply parsing, response body, CompletionRecord), so it is recorded exactly as an
agent's request to the proxy is, and exported by the agents' export (rollq.workers.agents.export). What the worker
makes of the returned mapping is in rollq.workers.outputs (any `{id: object with to_tensor_dict()}`).

AReaL's options, rollq's meaning:
- `chat_template_type`: "hf" (AReaL's default) renders every request's whole conversation with the chat template
  (the proxy's `continuation = "template"`); "concat" sends a continued conversation as its parent's exact prompt +
  output ids followed by the new turns' tokens (`continuation = "exact"`), one growing token sequence.
- `export_interactions(style="individual")`: AReaL's own default wherever it names one (AgentConfig.export_style,
  its proxy workflow, its session client); 1.0.4's ArealOpenAI.export_interactions has no default and so fails in
  multi_turn_v2.py, which calls it without one. "concat" gives one sequence per conversation branch (rollq's rule:
  a child that does not extend its parent's tokens starts a new sequence, where AReaL refuses "concat" for "hf").
- rewards are not propagated unless asked (`apply_reward_discount(turn_discount)` or `reward_discount=`), as in
  AReaL; propagation is rollq's tree rule, which along one conversation is AReaL's.

Not supported (an error, not a silent difference): `stream=True`, images, the Responses API (`client.responses`).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import uuid
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec

from rollq.engine.types import InferenceEngine, ModelRequest, ModelResponse, ProgressCallback
from rollq.workers.agents.export import assign_rewards, export_by_key, tree_rewards
from rollq.workers.proxy.chat import (
    BadRequest,
    chat_completion,
    generation_params,
    normalize_messages,
    normalize_tools,
    tool_choice_allows_calls,
)
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy
from rollq.workers.proxy.sessions import CompletionRecord, Session

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion

_CONTINUATION: dict[str, Literal["template", "exact"]] = {"hf": "template", "concat": "exact"}

# The engine responses of the create() call running in this context (its choices' ModelResponses).
_RESPONSES: contextvars.ContextVar[list[ModelResponse] | None] = contextvars.ContextVar(
    "rollq_areal_openai_responses", default=None
)


class _CapturingEngine:
    """The proxy's engine for these clients: passes requests on and keeps each response for the create() call that
    asked for it, with the tokenizer set (AReaL's ModelResponse.end_with_stop needs it)."""

    def __init__(self, inner: InferenceEngine, tokenizer: Any) -> None:
        self.inner = inner
        self.tokenizer = tokenizer

    async def agenerate(self, req: ModelRequest, on_tokens: ProgressCallback | None = None) -> ModelResponse:
        if req.tokenizer is None:
            req.tokenizer = self.tokenizer
        # An AReaL-style engine takes the request only.
        resp = await (self.inner.agenerate(req) if on_tokens is None else self.inner.agenerate(req, on_tokens))
        sink = _RESPONSES.get()
        if sink is not None:
            sink.append(resp)
        return resp


@functools.lru_cache(maxsize=16)
def _cached_proxy(engine: Any, tokenizer: Any, continuation: Literal["template", "exact"]) -> RecordingProxy:
    """One proxy per engine, tokenizer and continuation: workflows build a client per episode, and a proxy's prompt
    encoder costs milliseconds to set up (its cache of encoded prompt pieces then serves every episode). It never
    listens: clients call it in-process, each with a session of its own."""
    return _proxy(engine, tokenizer, continuation)


def _proxy(engine: InferenceEngine, tokenizer: Any, continuation: Literal["template", "exact"]) -> RecordingProxy:
    return RecordingProxy(_CapturingEngine(engine, tokenizer), tokenizer, ProxyConfig(continuation=continuation))


def _omitted(value: Any) -> bool:
    """None, or the OpenAI SDK's NOT_GIVEN / omit markers (by name: the SDK is not needed to run this)."""
    return value is None or type(value).__name__ in ("NotGiven", "Omit")


def _as_dict(message: Any) -> Any:
    """A message as a dict (the SDK's pydantic messages too: a ChatCompletionMessage appended to the history)."""
    dump = getattr(message, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else message


class InteractionWithTokenLogpReward:
    """One recorded completion (one choice) with its reward: AReaL's interaction, over rollq's CompletionRecord.

    `model_response` is the engine's ModelResponse, `completion` the ChatCompletion the caller got, `messages` the
    request's messages, `output_message_list` the reply as a message, `parent` the interaction whose conversation
    this one continues. `to_tensor_dict()` is its trajectory (rollq's mapping: input_ids, loss_mask, logprobs,
    versions, reward, as lists; with images also multi_modal_input and mm_token_type_ids) as the last
    export_interactions() made it, else this completion alone."""

    chat_template_type: str
    is_completion = True
    is_response = False

    def __init__(
        self,
        record: CompletionRecord,
        *,
        model_response: ModelResponse,
        completion: ChatCompletion,
        messages: list[Any],
        output_message_list: list[dict[str, Any]],
        parent: InteractionWithTokenLogpReward | None,
        chat_template_type: str,
    ) -> None:
        self.record = record
        self.model_response = model_response
        self.completion = completion
        self.messages = messages
        self.output_message_list = output_message_list
        self.parent = parent
        self.chat_template_type = chat_template_type
        self.exported: dict[str, Any] | None = None

    @property
    def reward(self) -> float | None:
        return self.record.reward

    @reward.setter
    def reward(self, value: float | None) -> None:
        self.record.reward = value

    @property
    def interaction_id(self) -> str:
        return self.record.key

    @property
    def created_at(self) -> float:
        return float(self.completion.created)

    def to_tensor_dict(self) -> dict[str, Any]:
        if self.exported is not None:
            return self.exported
        return export_by_key([self.record], "individual", 0.0)[self.record.key]

    def __repr__(self) -> str:
        return f"<InteractionWithTokenLogpReward {self.interaction_id} reward={self.reward}>"


class _Completions:
    def __init__(self, client: ArealOpenAI) -> None:
        self._client = client

    async def create(
        self,
        *,
        messages: Iterable[Any],
        model: str | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        max_completion_tokens: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        store: bool | None = None,
        stream: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: Iterable[Any] | None = None,
        tool_choice: Any = None,
        logprobs: bool | None = None,
    ) -> ChatCompletion:
        """A chat completion generated on the client's engine; recorded unless `store=False`. Parameters as
        OpenAI's (NOT_GIVEN / omit mean unset). Invalid values raise ValueError."""
        from openai.types.chat import ChatCompletion  # the SDK's types: installed wherever this client is used

        if not _omitted(stream) and stream:
            raise NotImplementedError("ArealOpenAI in rollq does not stream: call create() without stream=True")
        if not _omitted(max_tokens) and not _omitted(max_completion_tokens):
            raise ValueError("max_tokens and max_completion_tokens cannot both be set (max_tokens is deprecated)")
        client = self._client
        proxy = client.proxy
        given = {
            "frequency_penalty": frequency_penalty,
            "presence_penalty": presence_penalty,
            "max_completion_tokens": max_completion_tokens,
            "max_tokens": max_tokens,
            "n": n,
            "stop": stop,
            "temperature": temperature,
            "top_p": top_p,
            "tools": None if _omitted(tools) else [_as_dict(t) for t in tools],  # type: ignore[union-attr]
            "tool_choice": tool_choice,
        }
        body = {k: v for k, v in given.items() if not _omitted(v)}
        raw = [_as_dict(m) for m in messages]
        try:
            params = generation_params(
                body, proxy.config.default_max_tokens, max_tokens_keys=("max_completion_tokens", "max_tokens")
            )
            params.logprobs = not _omitted(logprobs) and bool(logprobs)
            normalized = normalize_messages(raw)
            normalized_tools = normalize_tools(body.get("tools"))
            parse_tools = tool_choice_allows_calls(body.get("tool_choice"), normalized_tools)
            prompt = await proxy._chat_prompt(client.session, normalized, normalized_tools)
        except BadRequest as exc:
            raise ValueError(f"{exc} (parameter {exc.param})" if exc.param else str(exc)) from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        responses: list[ModelResponse] = []
        token = _RESPONSES.set(responses)
        try:
            choices = await proxy._generate(
                client.session, prompt, params, parse_tools=parse_tools, rid=rid, want_pieces=params.logprobs
            )
        finally:
            _RESPONSES.reset(token)
        name = model if isinstance(model, str) and model else proxy.config.model_name
        completion = ChatCompletion.model_validate(
            chat_completion(rid, name, choices, len(prompt.ids), params.logprobs)
        )
        if _omitted(store) or store:
            parent = client._interactions.get(prompt.parent) if prompt.parent is not None else None
            for index, choice in enumerate(choices):
                record: CompletionRecord = choice.record
                record.delivered = True  # the caller has it: it counts (rewards, export, parent of later turns)
                client._interactions[record.key] = InteractionWithTokenLogpReward(
                    record,
                    model_response=_response_of(record, responses),
                    completion=completion,
                    messages=copy.deepcopy(raw),
                    output_message_list=[completion.choices[index].message.model_dump(exclude_none=True)],
                    parent=parent,
                    chat_template_type=client.chat_template_type,
                )
        return completion


def _response_of(record: CompletionRecord, responses: list[ModelResponse]) -> ModelResponse:
    """The engine response behind a choice, as the client's caller sees it (a parsed tool call makes its stop reason
    "tool_calls", as in AReaL). A copy: the worker keeps the episode's responses too."""
    found = next((r for r in responses if r.output_tokens == record.output_ids), responses[0])
    responses.remove(found)
    stop_reason = "tool_calls" if record.finish_reason == "tool_calls" else found.stop_reason
    return msgspec.structs.replace(found, stop_reason=stop_reason)


class _Chat:
    def __init__(self, client: ArealOpenAI) -> None:
        self.completions = _Completions(client)


class ArealOpenAI:
    """AReaL's `ArealOpenAI(engine, tokenizer)`: `chat.completions.create`, `get_interaction`, `set_reward`,
    `set_last_reward`, `apply_reward_discount`, `export_interactions`. One client per episode; its completions
    share an engine while it is healthy (their prefix cache)."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        *,
        chat_template_type: str = "hf",
    ) -> None:
        if chat_template_type not in _CONTINUATION:
            raise ValueError(f"chat_template_type must be 'hf' or 'concat', got {chat_template_type!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template_type = chat_template_type
        continuation = _CONTINUATION[chat_template_type]
        try:
            self.proxy = _cached_proxy(cast(Hashable, engine), tokenizer, continuation)
        except TypeError:  # an engine or tokenizer that can't be a cache key
            self.proxy = _proxy(engine, tokenizer, continuation)
        self.session = Session(f"areal-openai-{uuid.uuid4().hex}")  # also the engine affinity of its requests
        self._interactions: dict[str, InteractionWithTokenLogpReward] = {}
        self._discounted = False
        self.chat = _Chat(self)

    def get_interaction(self, id: str) -> InteractionWithTokenLogpReward | None:
        """A stored completion by its id (`completion.id`; `id:i` for choice i > 0 of an n > 1 request)."""
        return self._interactions.get(id)

    def set_reward(self, id: str, reward: float) -> None:
        """The reward of one completion (a completion id rewards all its choices; `id:i` one choice)."""
        if id not in self._interactions:
            raise KeyError(f"Interaction with ID {id} not found in cache")
        assign_rewards(self.session.ordered(), {id: reward})

    def set_last_reward(self, reward: float) -> None:
        """The reward of the most recent completion."""
        if not self._interactions:
            raise RuntimeError("No interaction in cache to set reward for")
        assign_rewards(self.session.ordered(), reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> dict[str, InteractionWithTokenLogpReward]:
        """Once: every completion's reward becomes its return (own reward, 0 if unset, + turn_discount * the
        return of the completion that continues it; the mean over several). Returns all interactions."""
        if self._discounted:
            raise RuntimeError("apply_reward_discount should only be called once.")
        self._discounted = True
        records = self.session.ordered()
        returns = tree_rewards(records, turn_discount)
        for record in records:
            record.reward = returns[record.key]
        return dict(self._interactions)

    def export_interactions(
        self, style: str = "individual", reward_discount: float | None = None
    ) -> dict[str, InteractionWithTokenLogpReward]:
        """{id: interaction}: every completion ("individual"), or the last completion of each conversation branch
        ("concat", its trajectory covering the whole branch), in creation order. With `reward_discount`, rewards
        are first propagated (apply_reward_discount) unless they already were."""
        if reward_discount is not None and not self._discounted:
            self.apply_reward_discount(reward_discount)
        trajectories = export_by_key(self.session.ordered(), style, 0.0)  # rewards are already what they should be
        out = {}
        for key, trajectory in trajectories.items():
            interaction = self._interactions[key]
            interaction.exported = trajectory
            out[key] = interaction
        return out


__all__ = ["ArealOpenAI", "InteractionWithTokenLogpReward"]
