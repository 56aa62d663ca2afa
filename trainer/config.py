"""The trainer's settings (`rollq train`, `rollq up`): the `trainer` section, ROLLQ_TRAINER_<KEY>, `--key` flags or
`KEY=VALUE` overrides. `rollq up`'s own (the `up` section) are rollq.up.UpConfig."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from rollq.config import RunSettings, setting
from rollq.protocol.messages import AgentOptions
from rollq.tasks.generated import TASK_REWARD, is_task_source

WHERE, WHAT, HOW_MUCH, OPTIM, UPDATES = "where", "what", "how much", "optimisation", "weight updates"
TASK = "generated tasks"
RANKS = "ranks"
AGENTS = "agents"
LORA = "LoRA"
LORA_LR = 5e-3  # an adapter on the random-init tiny model learns at about ten times full fine-tuning's rate
LORA_STEPS = 200  # what the LoRA loops of CONTRIBUTING.md measure the toy task with (reward >= 0.95 in each)


# rollq's built-in loops by short name (rollq.workers.builtin.BUILTIN_WORKFLOWS); all but the vision one take a
# `tokenizer`, which must tokenize as the trained model does.
BUILTIN_LOOPS = ("rlvr", "multi_turn", "tool_agent", "vision_rlvr")
_TOKENIZING_BUILTINS = ("rlvr", "multi_turn", "tool_agent")


def _toy_workflow_kwargs() -> dict[str, Any]:
    # temperature 1.2: at 1.0 a policy can lock onto one answer worth 0.875 (a stray byte token) whose fix it samples
    # with p ~ 1e-4, which no filtering brings back (2 of 5 runs stuck; 33 of 33 reached >= 0.996 at 1.2)
    return {"reward_fn": "rollq.tasks.digits:digits_reward", "max_new_tokens": 8, "temperature": 1.2}


def smollm2_task() -> dict[str, Any]:
    """What `--model smollm2` trains unless told otherwise: single-digit additions in a chat (rollq.tasks.
    addition), evaluated greedily on 20 held-out sums, sized to learn on a 2-core CPU in under 20 minutes (a
    gentle lr: at 5e-5 the reward rose within 6 steps and then fell apart as the model forgot sums it knew)."""
    return {
        "dataset": "toy:add",
        "workflow_kwargs": {"reward_fn": "rollq.tasks.addition:addition_reward", "max_new_tokens": 8},
        "eval_dataset": "toy:add-heldout",
        "steps": 80,
        "group_size": 8,
        "groups_per_step": 4,
        "lr": 5e-6,
    }


def colours_task() -> dict[str, Any]:
    """What `--model tiny-vl` trains unless told otherwise: the built-in visual task (rollq.tasks.colours: name the
    colour of a picture by its letter), with rollq's vision workflow, evaluated greedily on 20 held-out pictures."""
    # Exploration: the model starts with the four letters alike (engine/tiny_vlm.py, answer_prior), so sampling at
    # temperature 1 finds each picture's letter; a group whose samples all score alike teaches nothing, and
    # filtering up to 2 batches of such groups per step keeps those that tell the pictures apart. (At 1.5 the
    # held-out pictures were all named right from step 130 while the sampled reward stayed near 0.75.)
    return {
        "dataset": "toy:colours",
        "workflow": "vision_rlvr",
        "workflow_kwargs": {
            "reward_fn": "rollq.tasks.colours:colours_reward",
            "processor": "tiny-vl",
            "max_new_tokens": 2,
            "temperature": 1.0,
        },
        "eval_dataset": "toy:colours-heldout",
        "steps": 200,
        "group_size": 8,
        "groups_per_step": 4,
        "dynamic_sampling_budget": 2.0,
        "lr": 1e-3,
    }


def is_generated_dataset(dataset: str) -> bool:
    """Whether a dataset setting names a generated task (reasoning-gym:NAME, MODULE:FACTORY), not a file or a toy
    task."""
    return bool(dataset) and not os.path.exists(os.path.expanduser(dataset)) and is_task_source(dataset)


class TrainConfig(RunSettings, kw_only=True):
    """The trainer: feeds prompts through the staleness ledger, trains on fresh groups, updates every engine."""

    run_dir: Annotated[
        str,
        setting(
            "metrics.jsonl, samples.jsonl, plot.png, checkpoints/ go here ('' = runs/RUN); `rollq up` given the "
            "directory of an earlier `rollq up` resumes that run (its name from DIR/up.json)",
            metavar="DIR",
            group=WHERE,
        ),
    ] = ""
    weights_dir: Annotated[
        str,
        setting(
            "where engines read new weights, a directory they share ('' = RUN_DIR/weights)", metavar="DIR", group=WHERE
        ),
    ] = ""
    engine: Annotated[
        list[str],
        setting(
            "static engine URL (repeatable); engines registered for the run are used too", metavar="URL", group=WHERE
        ),
    ] = []
    engine_api_key: Annotated[
        str | None,
        setting("the engines' api_key: sent as Bearer on every engine call", metavar="KEY", group=WHERE),
    ] = None
    engine_admin_api_key: Annotated[
        str | None,
        setting(
            "the engines' admin_api_key: sent on control routes (pause, weights, abort, flush); default engine_api_key",
            metavar="KEY",
            group=WHERE,
        ),
    ] = None
    gateway_admin_api_key: Annotated[
        str | None,
        setting(
            "the admin key of a gateway among `engine` (smg --control-plane-api-keys ID:NAME:admin:KEY): lists the "
            "engines behind it (GET /workers), which get the control calls the gateway does not forward",
            metavar="KEY",
            group=WHERE,
        ),
    ] = None
    engine_agents: Annotated[
        dict[str, str],
        setting(
            "the host agents (`rollq weight-agent`) of engines that load only full weights from disk (SGLang), by "
            "engine URL, e.g. {http://sglang-0:30000: http://sglang-0:30010}: weight deltas are prepared there, "
            "with engine_admin_api_key; for static engines and those a gateway lists (a registered engine's entry "
            "names its own)",
            metavar="MAPPING",
            group=WHERE,
        ),
    ] = {}
    model: Annotated[
        str,
        setting(
            "`tiny` (the offline test model), `smollm2` (SmolLM2-135M-Instruct, offline), `tiny-vl` (a tiny "
            "Qwen2-VL, offline) or an HF model directory; engines must serve the same model. `smollm2` and `tiny-vl` "
            "bring their own task for every setting not given: dataset, eval_dataset, workflow and its arguments, "
            "lr, steps and batch (trainer.config.smollm2_task: toy:add; colours_task: toy:colours, pictures)",
            group=WHAT,
        ),
    ] = "tiny"
    dataset: Annotated[
        str,
        setting(
            "prompts: JSONL, Parquet, a `datasets` directory saved to disk, a built-in task (toy:digits, toy:add, "
            "toy:colours), a reasoning-gym task (reasoning-gym:NAME, scored by its own score_answer: task_reward) or "
            "your own generator (MODULE:FACTORY, docs/tasks.md)",
            group=WHAT,
        ),
    ] = "toy:digits"
    prompt_key: Annotated[
        str,
        setting(
            "the dataset column holding each line's prompt, when it is not one the loops read (verl's name): a "
            "string becomes `prompt` (one user turn), a list of messages `messages`; the line's own prompt keys "
            "give way ('' = none: lines hold `messages`, `prompt` or `input_ids`; docs/rewards.md)",
            metavar="COLUMN",
            group=WHAT,
        ),
    ] = ""
    answer_key: Annotated[
        str,
        setting(
            "the dataset column copied to `answer` for the reward (a dotted path reaches into a mapping, e.g. "
            "verl's reward_model.ground_truth; '' = none)",
            metavar="COLUMN",
            group=WHAT,
        ),
    ] = ""
    workflow: Annotated[
        str, setting("a built-in loop's name or an import path (workers must allow it)", group=WHAT)
    ] = "rlvr"
    workflow_kwargs: Annotated[
        dict[str, Any],
        setting(
            "the workflow's arguments (a mapping; default: the built-in task's, or none for a workflow of one's own)",
            metavar="MAPPING",
            group=WHAT,
        ),
    ] = msgspec.field(default_factory=_toy_workflow_kwargs)
    eval_dataset: Annotated[
        str,
        setting(
            "held-out prompts (same forms as dataset; '' = none) evaluated before the first step, every eval_every "
            "steps and after the last: one sample each (eval_workflow_kwargs), run by the workers; mean reward in "
            "RUN_DIR/eval.jsonl and the plot",
            group=WHAT,
        ),
    ] = ""
    eval_every: Annotated[int, setting("steps between evaluations (0 = only before and after)", ge=0, group=WHAT)] = 10
    eval_workflow_kwargs: Annotated[
        dict[str, Any],
        setting(
            "evaluation jobs' workflow arguments, over workflow_kwargs, passed as given (e.g. AReaL's "
            "`{gconfig: {...}}`)",
            metavar="MAPPING",
            group=WHAT,
        ),
    ] = {}
    eval_temperature: Annotated[
        float | None,
        setting(
            "evaluation's sampling temperature (0 = greedy), given to a workflow whose constructor takes "
            "`temperature` (the built-in loops) and left out for one that does not (an agent; AReaL's workflows, "
            "which sample by their gconfig); a temperature in eval_workflow_kwargs wins (null = as in training)",
            group=WHAT,
        ),
    ] = 0.0
    agent_mode: Annotated[
        Literal["inline", "subproc"],
        setting(
            "an agent workflow's jobs (a class with `async def run(self, data, **kw)`): inline in the worker's "
            "event loop, or subproc in a process pool (OPENAI_BASE_URL/OPENAI_API_KEY set)",
            group=AGENTS,
        ),
    ] = "inline"
    agent_timeout: Annotated[
        float,
        setting(
            "an agent episode's time limit (within the workers' max_agent_timeout)", metavar="S", gt=0, group=AGENTS
        ),
    ] = 600.0
    export_style: Annotated[
        Literal["individual", "concat"],
        setting("an agent's trajectories: a sequence per completion, or per conversation branch", group=AGENTS),
    ] = "individual"
    turn_discount: Annotated[
        float,
        setting(
            "an agent's completion's reward = its own + this x its child's (mean of its children's), as AReaL's",
            ge=0,
            le=1,
            group=AGENTS,
        ),
    ] = 1.0
    task_size: Annotated[
        int, setting("a generated task's (reasoning-gym:NAME, MODULE:FACTORY) training prompts", ge=1, group=TASK)
    ] = 1000
    task_seed: Annotated[int, setting("the seed a generated task's training prompts are made from", group=TASK)] = 0
    task_config: Annotated[
        dict[str, Any],
        setting(
            "a generated task's own settings (a mapping: reasoning-gym's are its dataset config's fields, e.g. "
            "{max_digits: 1}), for the training and the held-out prompts",
            metavar="MAPPING",
            group=TASK,
        ),
    ] = {}
    task_system_prompt: Annotated[
        str,
        setting(
            "a generated task's system prompt: one of reasoning-gym's by name (default, direct, simple, "
            "DeepSeekZero, chain_of_draft: each asks for the answer in answer tags, where the reward reads "
            "it), your own text, or '' for none",
            group=TASK,
        ),
    ] = "default"
    task_examples: Annotated[
        int,
        setting(
            "worked examples before each question of a generated task, as earlier turns of the chat: entries of the "
            "training prompts with their answers in answer tags (never the question asked); a small model "
            "copies the answer form from them",
            ge=0,
            group=TASK,
        ),
    ] = 0
    eval_task_size: Annotated[
        int, setting("a generated task's held-out prompts (eval_dataset reasoning-gym:NAME)", ge=1, group=TASK)
    ] = 100
    eval_task_seed: Annotated[
        int,
        setting(
            "the seed of a generated task's held-out prompts; one whose question is among the training prompts is "
            "replaced by another, so none is trained on",
            group=TASK,
        ),
    ] = 1_000_000
    steps: Annotated[int, setting("training steps", ge=1, group=HOW_MUCH)] = 200
    group_size: Annotated[int, setting("samples per prompt (GRPO group)", ge=1, group=HOW_MUCH)] = 8
    groups_per_step: Annotated[
        int, setting("a step trains on group_size * groups_per_step samples (B)", ge=1, group=HOW_MUCH)
    ] = 8
    max_staleness: Annotated[
        int,
        setting(
            "eta: a trained token is at most this many versions older than the policy trained", ge=0, group=HOW_MUCH
        ),
    ] = 2
    stale_policy: Annotated[
        Literal["drop", "mask"],
        setting(
            "a group with tokens older than v - eta at the step that trains it: `drop` it whole (its samples go back "
            "to the ledger), or `mask` only those tokens out of the loss and train the rest (dropped when nothing is "
            "left); either way no trained token is older than v - eta",
            group=HOW_MUCH,
        ),
    ] = "drop"
    partial_groups: Annotated[
        int,
        setting(
            "a group with failed samples (error, timeout, rejected) trains on the others when at least this many "
            "are left, its advantages normalised over them (0 = off: the group is dropped whole)",
            metavar="N",
            ge=0,
            group=HOW_MUCH,
        ),
    ] = 0
    split_groups: Annotated[
        int,
        setting(
            "a group's finished samples train before its stragglers when waiting another step would put their "
            "tokens past the bound, once at least this many of the group have finished; their advantages are "
            "normalised over the finished samples, the stragglers' later over the whole group (0 = off: a group "
            "trains whole)",
            metavar="N",
            ge=0,
            group=HOW_MUCH,
        ),
    ] = 0
    dynamic_sampling: Annotated[
        bool,
        setting(
            "DAPO's dynamic sampling: a complete group whose rewards are all equal (every advantage zero: it "
            "teaches nothing) is not trained but dropped as `filtered` (acked, its samples given back to the ledger, "
            "so another group is admitted in its place) and the step waits for groups with a signal, up to "
            "dynamic_sampling_budget; its rewards still count in the step's reward metrics",
            group=HOW_MUCH,
        ),
    ] = True
    dynamic_sampling_budget: Annotated[
        float,
        setting(
            "dynamic_sampling filters at most K x groups_per_step groups per step (rounded up); past that, groups "
            "without a signal train (zero advantage) after those with one, so a policy that solved the task still "
            "steps. Each filtered group costs its generation, so a step generates at most 1 + K batches",
            metavar="K",
            gt=0,
            group=HOW_MUCH,
        ),
    ] = 0.5
    join_late: Annotated[
        bool,
        setting(
            "groups (and parts, with split_groups) that finish while a step trains and would pass the bound at the "
            "next update join that step's optimizer step (the per-token mean over both), instead of the next step a "
            "version older; needs ppo_minibatches 1",
            group=HOW_MUCH,
        ),
    ] = False
    min_step_s: Annotated[
        float,
        setting(
            "pace the weight updates: a step publishes its weights no sooner than this after it began, waiting "
            "before it collects (so groups finishing meanwhile train at this step; engines keep generating), so a "
            "long answer spans fewer versions and less of it passes the bound",
            metavar="S",
            ge=0,
            group=HOW_MUCH,
        ),
    ] = 0.0
    priority_by_age: Annotated[
        bool,
        setting(
            "engine requests of older groups first (priority -group index; engines schedule larger first, SGLang "
            "with --enable-priority-scheduling): long answers finish sooner, fewer of their tokens pass the bound",
            group=HOW_MUCH,
        ),
    ] = False
    lr: Annotated[float, setting("learning rate (AdamW)", gt=0, group=OPTIM)] = 5e-4
    weight_decay: Annotated[float, setting("AdamW weight decay", ge=0, group=OPTIM)] = 0.0
    clip_eps: Annotated[float, setting("PPO clip of pi_theta / pi_prox", gt=0, lt=1, group=OPTIM)] = 0.2
    behav_imp_cap: Annotated[
        float,
        setting("tokens whose pi_prox / pi_behaviour exceeds this are left out (decoupled PPO)", gt=1, group=OPTIM),
    ] = 5.0
    ppo_minibatches: Annotated[int, setting("optimizer steps per training step", ge=1, group=OPTIM)] = 1
    max_tokens_per_microbatch: Annotated[
        int, setting("padded tokens per forward/backward (length-sorted micro-batches)", ge=1, group=OPTIM)
    ] = 4096
    grad_clip: Annotated[float, setting("gradient norm clip", gt=0, group=OPTIM)] = 1.0
    adv_std_norm: Annotated[
        bool,
        setting(
            "divide a group's advantages by its rewards' std (GRPO); off: reward minus the group's mean only (Dr. "
            "GRPO, verl's norm_adv_by_std_in_grpo=False), so a rare penalty weighs what it costs, not as much as a "
            "rare success",
            group=OPTIM,
        ),
    ] = True
    train_vision_tower: Annotated[
        bool,
        setting(
            "a vision-language model's vision tower trains too (default: frozen, the language model and the "
            "projector's merger train)",
            group=OPTIM,
        ),
    ] = False
    seed: Annotated[int, setting("random seed of the trainer", group=OPTIM)] = 0
    device: Annotated[str, setting("torch device of the trainer (and of `rollq up`'s engines)", group=OPTIM)] = "cpu"
    compute_dtype: Annotated[
        Literal["float32", "bfloat16"],
        setting(
            "dtype of the trainer's forward and backward passes (autocast; weights and optimizer state stay "
            "float32): bfloat16 on a GPU halves activations and uses its tensor cores",
            group=OPTIM,
        ),
    ] = "float32"
    pause_mode: Annotated[
        Literal["abort", "retract", "in_place"],
        setting(
            "how engines pause for a weight update: retract / in_place keep in-flight work, abort returns partial "
            "output (the pool resubmits it); in_place cannot flush the engines' prefix caches (new requests may reuse "
            "KV of older weights, as on SGLang)",
            group=UPDATES,
        ),
    ] = "retract"
    weight_sync: Annotated[
        Literal["disk", "distributed"],
        setting(
            "how new weights reach engines: disk = safetensors in weights_dir, which engines must share; distributed "
            "= broadcast from the trainer over a gloo process group (SGLang's update_weights_from_distributed)",
            group=UPDATES,
        ),
    ] = "disk"
    weight_sync_address: Annotated[
        str,
        setting(
            "distributed: the address engines reach the trainer at ('' = this host's address towards the engines)",
            metavar="HOST",
            group=UPDATES,
        ),
    ] = ""
    weight_sync_port: Annotated[
        int,
        setting("distributed: the group's rendezvous port (0: a free one per group)", ge=0, lt=65536, group=UPDATES),
    ] = 0
    weight_sync_timeout_s: Annotated[
        float,
        setting(
            "distributed: bound on the group join, each broadcast and each control call (a hung engine costs this)",
            gt=0,
            metavar="S",
            group=UPDATES,
        ),
    ] = 60.0
    delta_sync: Annotated[
        bool,
        setting(
            "full-weight runs: each update sends only what changed since the version an engine holds (per tensor, "
            "in sync_dtype, XOR + zstd with a checksum each), and each engine (or its host agent) prepares it before "
            "the pause, so the pause covers only the swap; an engine not on the delta's base version (new, "
            "restarted, missed an update, checksum mismatch) gets the full weights (docs/weight-sync.md)",
            group=UPDATES,
        ),
    ] = True
    delta_full_every: Annotated[
        int,
        setting(
            "delta_sync: send the full weights every this many updates even when a delta would do (0 = only when "
            "an engine needs them)",
            metavar="N",
            ge=0,
            group=UPDATES,
        ),
    ] = 20
    delta_max_share: Annotated[
        float,
        setting(
            "delta_sync: a delta of at least this share of the full weights' bytes is sent as a full update "
            "instead (an fp32 engine changes nearly every weight each step: its delta would not be smaller)",
            metavar="SHARE",
            ge=0,
            le=1,
            group=UPDATES,
        ),
    ] = 0.5
    sync_dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        setting(
            "dtype of the weights sent to engines when delta_sync is on (deltas and full versions; the trainer "
            "keeps a CPU copy of the last version in it): auto = the dtype the engines report in /server_info, "
            "else the model config's, else float32",
            group=UPDATES,
        ),
    ] = "auto"
    min_engines_updated: Annotated[
        int,
        setting(
            "a weight update must leave at least this many engines at the new version (0 = every engine of the pool "
            "that is healthy, at least one: an engine whose control calls cannot connect is out of routing and "
            "skipped, one that answers and refuses counts); short of it the pause -> load -> resume cycle is retried "
            "(weight_update_retries), then the trainer exits with each failing engine's route, HTTP status and "
            "answer. Engines it did not update are out of its routing until reloaded",
            metavar="N",
            ge=0,
            group=UPDATES,
        ),
    ] = 0
    weight_update_retries: Annotated[
        int,
        setting(
            "times a weight update that fell short of min_engines_updated is tried again before the trainer stops",
            metavar="N",
            ge=0,
            group=UPDATES,
        ),
    ] = 3
    weight_update_backoff_s: Annotated[
        float,
        setting(
            "wait before the first weight update retry, doubled before each next one (1 s, 3 retries: 7 s in all)",
            metavar="S",
            ge=0,
            group=UPDATES,
        ),
    ] = 1.0
    metrics_port: Annotated[
        int,
        setting("serve Prometheus /metrics on this port (0 = off)", metavar="PORT", ge=0, le=65535, group=WHERE),
    ] = 0
    metrics_host: Annotated[
        str,
        setting("address the /metrics server binds (0.0.0.0 in a container so Prometheus can scrape it)", group=WHERE),
    ] = "127.0.0.1"
    checkpoint_every: Annotated[
        int,
        setting(
            "steps between checkpoints; 1 makes a restart exact (nothing trained is lost or trained twice)",
            ge=1,
            group=UPDATES,
        ),
    ] = 1
    reoffer_after_s: Annotated[
        float,
        setting(
            "a group admitted this long ago and not yet trained or dropped is looked for in Redis; when its "
            "submission vanished (a Redis restart or failover that lost writes) it is queued again (0 = never)",
            metavar="S",
            ge=0,
            group=UPDATES,
        ),
    ] = 60.0
    redis_wait_replicas: Annotated[
        int,
        setting(
            "on a Redis Cluster, each ledger write and each ack of trained samples waits (WAIT) until this many "
            "replicas of its node have it, so a failover keeps it (0 = never wait, e.g. a cluster without replicas; "
            "what a failover loses is written again either way)",
            metavar="N",
            ge=0,
            group=UPDATES,
        ),
    ] = 1
    redis_wait_timeout_ms: Annotated[
        int,
        setting(
            "the longest such a write waits for its replicas; after one that times out (a replica down or "
            "resyncing) the trainer does not wait for 10 s",
            metavar="MS",
            ge=1,
            group=UPDATES,
        ),
    ] = 100
    samples_every: Annotated[
        int,
        setting(
            "write decoded samples (prompt, completion, reward, versions: text a person can read, decoded with the "
            "model's tokenizer from the ids trained, special tokens kept) of the first step and every N-th to "
            "RUN_DIR/samples.jsonl (0 = none)",
            metavar="N",
            ge=0,
            group=WHERE,
        ),
    ] = 1
    samples_per_step: Annotated[
        int,
        setting(
            "trained samples decoded per such step, one per group first (0 = none)", metavar="N", ge=0, group=WHERE
        ),
    ] = 4
    trained_log: Annotated[
        bool,
        setting(
            "append (step, version, job id, sample index, oldest trained token version) of every trained sample to "
            "RUN_DIR/trained.jsonl (an audit trail; a restart cuts it back to the checkpoint, as metrics.jsonl)",
            group=UPDATES,
        ),
    ] = False
    nproc: Annotated[
        int,
        setting(
            "training processes (ranks) on this machine: above 1, `rollq train` starts itself under torchrun with "
            "that many, the model sharded over them (FSDP2); a multi-node trainer runs torchrun itself",
            metavar="N",
            ge=1,
            group=RANKS,
        ),
    ] = 1
    max_restarts: Annotated[
        int,
        setting(
            "with nproc above 1: times torchrun restarts the whole group after a rank dies (it resumes from the "
            "last checkpoint)",
            metavar="N",
            ge=0,
            group=RANKS,
        ),
    ] = 3
    dist_timeout_s: Annotated[
        float,
        setting(
            "a collective of the trainer's ranks that takes longer than this fails", metavar="S", gt=0, group=RANKS
        ),
    ] = 600.0
    publish_bucket_mb: Annotated[
        float,
        setting(
            "weights go to the engines in buckets of about this many MiB (one safetensors file each, or one "
            "broadcast): the most of the full weights any process holds at once while publishing",
            metavar="MIB",
            gt=0,
            group=RANKS,
        ),
    ] = 512.0

    lora_rank: Annotated[
        int,
        setting(
            "train a LoRA adapter of this rank (peft) instead of every weight: the base model frozen, only the "
            "adapter in the optimizer and the checkpoints (0 = off: full fine-tuning). Without `lr` given, a LoRA "
            "run takes lora_lr, and without `steps`, 200 steps",
            metavar="R",
            ge=0,
            group=LORA,
        ),
    ] = 0
    lora_alpha: Annotated[
        int, setting("LoRA scaling numerator: the update is (lora_alpha / lora_rank) B A", gt=0, group=LORA)
    ] = 32
    lora_target_modules: Annotated[
        list[str],
        setting(
            "modules that get an adapter: names or name suffixes (q_proj, v_proj, ...), or `all-linear` (every "
            "linear layer but the output head)",
            metavar="NAME",
            group=LORA,
        ),
    ] = msgspec.field(default_factory=lambda: ["all-linear"])
    lora_dropout: Annotated[float, setting("dropout on the adapter's input", ge=0, lt=1, group=LORA)] = 0.0
    lora_publish: Annotated[
        Literal["adapter", "merged"],
        setting(
            "how a LoRA run reaches the engines: `adapter` loads each version's adapter beside the previous ones "
            "(engines with enable_lora; no pause: requests in flight finish on the version they started with, new "
            "groups name the newest), `merged` sends the merged full weights through the usual paused update",
            group=LORA,
        ),
    ] = "adapter"
    lora_lr: Annotated[
        float,
        setting(
            "the learning rate of a LoRA run when `lr` is not given: an adapter on a random-init base (the tiny "
            "model) learns at about ten times the full fine-tuning rate",
            gt=0,
            group=LORA,
        ),
    ] = LORA_LR

    fleet: Annotated[
        str,
        setting(
            "train on the engines of fleet NAME, shared with other runs (`rollq engine --fleet NAME --register`; "
            "workers serving several runs): only a LoRA run publishing adapters (lora_rank above 0, lora_publish "
            "adapter) on the fleet's base model, whose updates never pause the others",
            metavar="NAME",
            group=LORA,
        ),
    ] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        for engine, agent in self.engine_agents.items():
            if not all(u.startswith(("http://", "https://")) for u in (engine, agent)):
                raise ValueError(f"engine_agents maps engine URLs to agent URLs (http(s)://...), got {engine}: {agent}")
        if self.eval_temperature is not None and self.eval_temperature < 0:
            raise ValueError(f"eval_temperature must be >= 0 (or null), got {self.eval_temperature}")
        if (
            is_generated_dataset(self.dataset)
            and self.workflow in BUILTIN_LOOPS
            and "reward_fn" not in self.workflow_kwargs
        ):
            # the task's own scorer: a generated dataset brings its reward to a built-in loop (workflow_kwargs
            # given without one); a workflow of one's own scores as it likes
            self.workflow_kwargs = {**self.workflow_kwargs, "reward_fn": TASK_REWARD}
        if self.fleet and not (self.lora and self.lora_publish == "adapter"):
            raise ValueError(
                f"fleet {self.fleet!r} is shared: a full-weight update (this run's, lora_rank {self.lora_rank}, "
                f"lora_publish {self.lora_publish}) would pause every run on it. Train a LoRA adapter (lora_rank "
                "above 0, lora_publish adapter) or use engines of the run's own"
            )

    @classmethod
    def implied(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """A pretrained model's own task: `model: smollm2` alone trains the arithmetic task (smollm2_task); a LoRA
        run's learning rate is lora_lr unless `lr` is given, and it trains LORA_STEPS steps unless `steps` is. A
        workflow of one's own (an import path) gets no workflow_kwargs unless given: the built-in task's reward and
        sampling arguments are the built-in loop's, which an agent's constructor would refuse."""
        tasks = {"smollm2": smollm2_task, "tiny-vl": colours_task}
        implied = tasks[given["model"]]() if given.get("model") in tasks else {}
        workflow = str(given.get("workflow") or "")
        own_workflow = bool(workflow) and workflow not in BUILTIN_LOOPS
        own_workflow = own_workflow and not workflow.startswith("rollq.workers.builtin.")
        if own_workflow:
            implied["workflow_kwargs"] = {}
        dataset = str(given.get("dataset") or "")
        if is_generated_dataset(dataset):  # its own scorer, and held-out prompts of the same task (from eval_task_seed)
            if not own_workflow:
                kwargs = implied.get("workflow_kwargs") or _toy_workflow_kwargs()
                implied["workflow_kwargs"] = {**kwargs, "reward_fn": TASK_REWARD}
            implied["eval_dataset"] = dataset
        if int(given.get("lora_rank") or 0) > 0:
            implied["lr"] = float(given.get("lora_lr") or LORA_LR)
            implied.setdefault("steps", LORA_STEPS)
        return implied

    def job_kwargs(self) -> dict[str, Any]:
        """The training jobs' workflow kwargs: workflow_kwargs, with the trained model as a built-in loop's
        tokenizer unless one is given (it must tokenize as the trained model does)."""
        if self.workflow in _TOKENIZING_BUILTINS and "tokenizer" not in self.workflow_kwargs:
            return {**self.workflow_kwargs, "tokenizer": self.model}
        return self.workflow_kwargs

    def eval_job_kwargs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The evaluation jobs' workflow kwargs, and those the worker passes only to a workflow that takes them
        (Job.optional_kwargs: eval_temperature; the trainer can't import the workflow to ask)."""
        kwargs = {**self.job_kwargs(), **self.eval_workflow_kwargs}
        if self.eval_temperature is None or "temperature" in self.eval_workflow_kwargs:
            return kwargs, {}
        return kwargs, {"temperature": self.eval_temperature}

    def agent_options(self) -> AgentOptions | None:
        """The agent options the run's jobs carry (None: the defaults, which travel as nothing); a workflow that is
        not an agent ignores them."""
        options = AgentOptions(
            mode=self.agent_mode,
            export_style=self.export_style,
            turn_discount=self.turn_discount,
            timeout_seconds=self.agent_timeout,
        )
        return None if options == AgentOptions() else options

    @property
    def lora(self) -> bool:
        """Whether the run trains a LoRA adapter (lora_rank above 0)."""
        return self.lora_rank > 0

    @property
    def batch_samples(self) -> int:
        """B: samples one step trains on."""
        return self.group_size * self.groups_per_step

    @property
    def directory(self) -> str:
        """The run directory: run_dir, or runs/RUN."""
        return self.run_dir or os.path.join("runs", self.run)

    @property
    def weights_root(self) -> str:
        return self.weights_dir or os.path.join(self.directory, "weights")


__all__ = ["TrainConfig", "is_generated_dataset"]
