"""A tiny random-init causal LM with a ChatML tokenizer, built offline, for tests and benchmarks of the reference
engine.

`build_tiny(directory)` writes an HF directory (config.json, model.safetensors, generation_config.json, tokenizer
files with a Qwen-style chat template) that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load with no
network. The build is deterministic for a spec and skipped when the directory already holds the same spec's build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

BUILD_VERSION = 2  # bump when the build below changes in a way the spec does not capture
SPEC_FILE = "rollq_tiny_spec.json"  # written last: its presence marks a complete build

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen keeps the tool tags as added but non-special tokens, so they survive skip_special_tokens for tool parsers.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class TinySpec(msgspec.Struct, frozen=True, kw_only=True):
    seed: int = 0
    bpe_vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2  # larger than usual: peaked logits, so greedy ties are practically impossible

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(msgspec.json.encode(self))
        h.update(f"{BUILD_VERSION}|{CORPUS}|{CHAT_TEMPLATE}".encode())
        return h.hexdigest()[:16]


CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}' }}
    {{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Enough text for a few hundred BPE merges: chat turns, tool calls, arithmetic and code, as RL rollouts see them.
CORPUS = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is 2 + 2? Think step by step and put the final answer in a box.<|im_end|>
<|im_start|>assistant
First, we add two and two. The sum of 2 and 2 is 4. So the answer is \\boxed{4}.<|im_end|>
<|im_start|>user
Please find the weather in Paris and in London for tomorrow.<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "date": "tomorrow"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "London", "date": "tomorrow"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 21, "condition": "sunny"}
</tool_response>
<tool_response>
{"temperature": 17, "condition": "rain"}
</tool_response><|im_end|>
<|im_start|>assistant
Tomorrow it will be sunny and 21 degrees in Paris, with rain and 17 degrees in London.<|im_end|>
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Reinforcement learning trains a policy to maximize the expected reward. The policy generates a rollout, the
environment returns a reward, and the trainer updates the weights. Rollouts are generated by inference engines;
workers pull prompts from a queue, run the agent, and publish trajectories of tokens, log probabilities and rewards.
def add(a: int, b: int) -> int:
    return a + b

for i in range(10):
    print(i * i)

class Solution:
    def solve(self, numbers: list[int]) -> int:
        total = 0
        for number in numbers:
            total += number
        return total

Question: If a train travels 60 miles per hour for 3 hours, how far does it travel?
Answer: The distance is speed times time, 60 * 3 = 180 miles. The answer is 180.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: Solve for x: 3x + 5 = 20. Answer: Subtract 5 from both sides to get 3x = 15, then x = 5.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 100 1000 2024 3.14 0.5 -1 +1 = == != <= >=
The model reads the prompt, then writes the answer one token at a time. Each token has a probability, and the
log probability of the sampled token is what the trainer needs for importance sampling and the policy loss.
"""


def build_tokenizer(spec: TinySpec):
    """Byte-level BPE trained on CORPUS, wrapped as a PreTrainedTokenizerFast with the ChatML template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    # Qwen2's normalizer and pre-tokenizer: AutoTokenizer loads this directory as Qwen2Tokenizer, which sets them.
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(spec: TinySpec, vocab_size: int, eos_ids: list[int], pad_id: int):
    """Seeded random-init Qwen2 model; the global torch RNG is left as it was."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=pad_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, do_sample=False)
    return model


def build_tiny(directory: str | os.PathLike[str], spec: TinySpec | None = None) -> Path:
    """Write the tiny model to `directory` (skipped when it already holds this spec's build) and return its path."""
    spec = spec or TinySpec()

    def write(tmp: Path) -> None:
        tok = build_tokenizer(spec)
        eos_ids = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)]
        model = build_model(spec, len(tok), eos_ids, tok.pad_token_id)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return build_once(directory, spec.digest(), msgspec.to_builtins(spec), write)


def build_once(directory: str | os.PathLike[str], digest: str, spec: Any, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` a model directory, unless `directory` already holds the build of `digest`; built next to the
    target and renamed into place (the spec file written last), so concurrent builders never see half a build."""
    out = Path(directory).expanduser()
    if _is_built(out, digest):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        (tmp / SPEC_FILE).write_text(json.dumps({"digest": digest, "spec": spec}, indent=1))
        if out.exists():
            if _is_built(out, digest):  # another builder won the race
                return out
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _is_built(directory: Path, digest: str) -> bool:
    try:
        return json.loads((directory / SPEC_FILE).read_text())["digest"] == digest
    except (OSError, ValueError, KeyError):
        return False


def cache_root() -> Path:
    """$ROLLQ_CACHE, else ~/.cache/rollq: where the offline models are built."""
    return Path(os.environ.get("ROLLQ_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rollq"))


def default_cache_dir() -> Path:
    """$ROLLQ_CACHE/tiny-model, else ~/.cache/rollq/tiny-model."""
    return cache_root() / "tiny-model"
