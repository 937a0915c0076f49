"""One typed, documented config for a whole run, with dotted command-line overrides.

Field names follow verl where verl has one (``actor.ppo_mini_batch_size``,
``algorithm.adv_estimator``, ``rollout.n``, ...) so configs and habits port. Every field
has a default; ``rlhf run`` with no arguments runs the built-in task on this machine.

    cfg = RunConfig()
    cfg = apply_overrides(cfg, ["actor.lr=1e-5", "rollout.n=4"])
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

from rlhf_core.rollout import EngineConfigError, engine_class, engine_names


def _f(default, help: str, *, choices: tuple | None = None, registry: str | None = None, ge=None, gt=None,
       le=None, lt=None, hashed: bool = True, checkpoint: bool = False, **kw):
    """A field with its documentation, valid values and class attached: ``rlhf config``
    shows the help (``field_help``: with the choices, or the names registered in
    ``rlhf_core.algorithms.<registry>``); ``RunConfig.validate`` checks choices, registry
    and bounds. ``hashed=False``: the field changes how a run is shown, stored or placed,
    never what it trains (left out of ``config_hash``). ``checkpoint=True``: a checkpoint's
    tensors depend on it (a replay cannot change it)."""
    meta = {"help": help, "choices": choices, "registry": registry, "ge": ge, "gt": gt, "le": le, "lt": lt,
            "hashed": hashed, "checkpoint": checkpoint}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


POSITIVE = {"gt": 0}
NON_NEGATIVE = {"ge": 0}
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
#: ``actor.strategy``: how ranks share a trained model (``rlhf_core.distributed.sharding``).
STRATEGIES = ("fsdp", "ddp")
#: Reward functions named by a word in ``reward.function`` (else ``module:function``).
NAMED_REWARDS = {"verl": "rlhf_core.data.reward_scores:default_compute_score",  # verl's: by data_source
                 "builtin": "rlhf_core.data.builtin:reward_score",   # the built-in digits task
                 "gsm8k": "rlhf_core.data.gsm8k:compute_score"}      # the number after '####'
_REWARD_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass
class ModelConfig:
    path: str = _f("builtin:digits", "HF model directory (a local or mounted folder, or an s3:// / gs:// "
                   "folder fetched once per node into the cache and checked), or builtin:<task> for the built-in "
                   "task's small model (built locally, warm-started by a short SFT, cached)", checkpoint=True)
    dtype: str = _f("float32", "parameter dtype for training (the master weights AdamW steps: float32; FSDP "
                    "computes in bf16 on GPUs, actor.fsdp_config.mixed_precision)", choices=("float32", "bfloat16",
                                                                                              "float16"),
                    checkpoint=True)
    train_in_16bit: bool = _f(False, "train 16-bit weights as they are (model.dtype bfloat16/float16 without "
                              "LoRA): AdamW then steps 16-bit weights, and an update below half a 16-bit step (~6e-5 "
                              "for a weight of 0.02 in bf16) rounds away; off: such a model.dtype is refused")
    max_position_embeddings: int | None = _f(None, "overrides the model config's position limit (verl's "
                                             "model.override_config.max_position_embeddings), for the trained "
                                             "models and vLLM (hf_overrides); None: the model's own", **POSITIVE)
    enable_gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass (actor and "
                                             "critic): less memory for longer sequences, ~30% more compute")
    use_remove_padding: bool = _f(False, "padding-free forwards of the actor and reference (and the critic, unless "
                                  "critic.use_remove_padding says otherwise): each micro-batch's sequences packed "
                                  "into one, attention bounded per sequence (FlashAttention's varlen kernel where "
                                  "it is installed, else SDPA per sequence); equal to the padded forward up to "
                                  "float rounding")
    lora_rank: int = _f(0, "LoRA rank of the actor's adapters (peft): > 0 trains adapters over the frozen base, "
                        "the reference is the base with the adapter off (no copy), checkpoints hold the adapter "
                        "and its optimizer state; 0: a full fine-tune", checkpoint=True, **NON_NEGATIVE)
    lora_alpha: int = _f(16, "LoRA scaling numerator (the adapter's output is scaled by lora_alpha / lora_rank)",
                         checkpoint=True, **POSITIVE)
    target_modules: str = _f("all-linear", "the modules LoRA adapts: all-linear (every Linear but the output "
                             "head) or a comma-separated list of module names (q_proj,v_proj)", checkpoint=True)
    exclude_modules: str = _f("", "comma-separated module names LoRA leaves alone, even when target_modules "
                              "matches them", checkpoint=True)
    lora_adapter_path: str = _f("", "start from this saved PEFT adapter folder (adapter_config.json + "
                                "adapter_model.safetensors) over model.path; its rank, alpha and modules are "
                                "the adapter's own", checkpoint=True)

    @property
    def lora(self) -> bool:
        """Whether the actor trains LoRA adapters (a rank, or an adapter to start from)."""
        return self.lora_rank > 0 or bool(self.lora_adapter_path)


@dataclass
class DataConfig:
    train_files: str = _f("builtin:digits", "parquet/jsonl file (a path, or an s3:// / gs:// URI fetched "
                          "once per node into the cache and checked) in verl's format (prompt as chat messages, "
                          "data_source, reward_model.ground_truth, extra_info) or ours (prompt text, "
                          "ground_truth, data_source), or builtin:<task>")
    train_batch_size: int = _f(256, "prompts per iteration (before rollout.n repeats); 0 only with "
                               "async_training.enable (verl's fully-async scripts): async_training.require_batches x "
                               "actor.ppo_mini_batch_size", **NON_NEGATIVE)
    gen_batch_size: int = _f(0, "prompts per generation batch with algorithm.filter_groups.enable (DAPO's "
                             "dynamic sampling: batches are generated until train_batch_size groups are kept); "
                             "0: train_batch_size. No effect with async_training.enable (verl's streaming unit: "
                             "the rollout generates whole steps' batches here)", **NON_NEGATIVE)
    max_prompt_length: int = _f(16, "prompt tokens (after the chat template); longer prompts are "
                                "handled by data.truncation", **POSITIVE)
    truncation: str = _f("error", "a prompt longer than max_prompt_length: error (refuse the dataset), "
                         "left (keep its end), right (keep its start)", choices=("error", "left", "right"))
    shuffle: bool = _f(True, "reshuffle prompts every epoch (seeded by trainer.seed)")
    prompt_key: str = _f("prompt", "the dataset column holding the prompt (verl's data.prompt_key)")
    reward_fn_key: str = _f("data_source", "the dataset column that names the reward function's data source "
                            "(verl's data.reward_fn_key)")
    filter_overlong_prompts: bool = _f(False, "drop the prompts longer than max_prompt_length (after the chat "
                                       "template) when the dataset loads, as verl does; data.truncation then never "
                                       "applies")
    val_files: str = _f("", "validation prompts (verl's data.val_files; the same formats as train_files): "
                        "generated (rollout.val_kwargs) and scored by the run's reward every trainer.test_freq "
                        "iterations; empty: no validation", hashed=False)


@dataclass
class FSDPConfig:
    """FSDP2 settings (``actor.strategy=fsdp``), shared by actor, reference and critic."""

    param_offload: bool = _f(False, "keep parameters, gradients and optimizer state on the CPU (the "
                             "optimizer steps there): fits bigger models, trains slower")
    optimizer_offload: bool = _f(False, "move AdamW's state to the CPU between updates (GPU memory for "
                                 "rollout); no effect on CPU machines")
    ref_param_offload: bool = _f(True, "keep the frozen reference model's shards on the CPU")
    reshard_after_forward: bool = _f(True, "free gathered layers after forward (ZeRO-3); False keeps them "
                                     "for backward (ZeRO-2: faster, more memory)")
    mixed_precision: str = _f("auto", "auto (bf16 compute, fp32 gradient reduction on GPU; fp32 on CPU) "
                              "| bf16 | fp32", choices=("auto", "bf16", "fp32"))
    keep_gathered_between_micro_batches: bool = _f(
        False, "FSDP: keep each layer's parameters gathered from one micro-batch's backward to the next's "
        "forward within an optimizer step (the forward then skips its all-gather; with reshard_after_forward "
        "false, every gather after the step's first): fewer collectives for the whole model's bf16 weights "
        "held on every GPU during the step", hashed=False)
    fsdp_size: int = _f(0, "ranks that share one sharded copy of the model (verl's fsdp_size): -1 all "
                        "of a role's ranks; 0 (auto): all of them on one node, each node's ranks on a GPU pool of "
                        "several nodes (parameter gathers stay inside a node); k: groups of k ranks, replicated "
                        "across groups (HSDP: one gradient all-reduce between groups)", ge=-1, hashed=False)


#: The learning-rate schedule's fields, the same for the actor and the critic (verl's
#: ``optim.*``; the math: ``rlhf_core/algorithms/schedules.py``).
_SCHEDULE_FIELDS = {
    "lr_warmup_steps": (-1, "updates of linear warmup from 0 (one per training step, as verl counts); -1: "
                            "lr_warmup_steps_ratio of the run's total", {"ge": -1}),
    "lr_warmup_steps_ratio": (0.0, "warmup as a share of trainer.total_iterations, when lr_warmup_steps is -1",
                              {"ge": 0, "le": 1}),
    "lr_scheduler_type": ("constant", "after the warmup: constant, or cosine down to min_lr_ratio by "
                                      "trainer.total_iterations (verl's warmup_style)",
                          {"choices": ("constant", "cosine")}),
    "min_lr_ratio": (0.0, "the cosine schedule's floor, a share of lr", {"ge": 0, "le": 1}),
    "num_cycles": (0.5, "the cosine schedule's waves (0.5: from lr down to the floor once)", {"ge": 0}),
}


def _schedule(name: str):
    default, help, bounds = _SCHEDULE_FIELDS[name]
    return _f(default, help, **bounds)


@dataclass
class ActorConfig:
    lr: float = _f(3e-4, "AdamW learning rate of the policy", **NON_NEGATIVE)
    lr_warmup_steps: int = _schedule("lr_warmup_steps")
    lr_warmup_steps_ratio: float = _schedule("lr_warmup_steps_ratio")
    lr_scheduler_type: str = _schedule("lr_scheduler_type")
    min_lr_ratio: float = _schedule("min_lr_ratio")
    num_cycles: float = _schedule("num_cycles")
    weight_decay: float = _f(0.0, "AdamW weight decay", **NON_NEGATIVE)
    ppo_mini_batch_size: int = _f(32, "prompts per optimizer step (x rollout.n responses)", **POSITIVE)
    ppo_epochs: int = _f(1, "passes over each iteration's batch", **POSITIVE)
    shuffle: bool = _f(True, "each PPO epoch takes its mini-batches in a seeded random order (false, verl's "
                       "default: in batch order, a group's responses together)")
    ppo_micro_batch_size_per_gpu: int = _f(0, "responses per forward/backward on one rank; the mini-batch's "
                                           "gradient accumulates over them (0: the whole mini-batch at once)",
                                           **NON_NEGATIVE)
    log_prob_micro_batch_size_per_gpu: int = _f(0, "responses per forward when computing old and reference "
                                                "log-probs on one rank (0: all at once)", **NON_NEGATIVE)
    use_dynamic_bsz: bool = _f(False, "micro-batches of the update by tokens, not rows: each holds at most "
                               "ppo_max_token_len_per_gpu tokens (prompt and response), balanced by tokens "
                               "(ppo_micro_batch_size_per_gpu is then not used)")
    ppo_max_token_len_per_gpu: int = _f(16384, "tokens per update micro-batch on one rank, with use_dynamic_bsz",
                                        **POSITIVE)
    log_prob_use_dynamic_bsz: bool = _f(False, "forwards for old and reference log-probs by tokens, not rows "
                                        "(log_prob_max_token_len_per_gpu each)")
    log_prob_max_token_len_per_gpu: int = _f(16384, "tokens per log-prob forward on one rank, with "
                                             "log_prob_use_dynamic_bsz", **POSITIVE)
    calculate_sum_pi_squared: bool = _f(False, "the old_log_prob stage also keeps sum over the vocabulary of "
                                        "pi^2 per token (the optimal token baseline's input; the stage runs "
                                        "whenever this is on)")
    clip_ratio_low: float = _f(0.2, "PPO clip range below 1 (ratio >= 1 - low; 1 or more: no lower bound, as "
                                     "verl's CISPO script's 10)", **NON_NEGATIVE)
    clip_ratio_high: float = _f(0.28, "PPO clip range above 1 (DAPO clip-higher)", **NON_NEGATIVE)
    clip_ratio_c: float = _f(3.0, "dual-clip bound for negative advantages (Ye et al. 2020)", gt=1)
    policy_loss: str = _f("vanilla", "the policy loss", registry="POLICY_LOSSES")
    tau_pos: float = _f(1.0, "sapo's gate temperature where the advantage is positive", gt=0)
    tau_neg: float = _f(1.05, "sapo's gate temperature where the advantage is not positive", gt=0)
    clip_cov_ratio: float = _f(0.0002, "clip_cov: the share of tokens whose gradient is dropped", gt=0, le=1)
    clip_cov_lb: float = _f(1.0, "clip_cov: the covariance above which a token may be dropped")
    clip_cov_ub: float = _f(5.0, "clip_cov: the covariance below which a token may be dropped")
    kl_cov_ratio: float = _f(0.0002, "kl_cov: the share of tokens (largest covariance) given the KL penalty",
                             gt=0, le=1)
    ppo_kl_coef: float = _f(0.1, "kl_cov: the weight of |log pi - log pi_old| on those tokens", **NON_NEGATIVE)
    loss_agg_mode: str = _f("token-mean", "how the policy loss reduces over tokens and responses",
                            choices=LOSS_AGG_MODES)
    entropy_coeff: float = _f(0.0, "entropy bonus weight (0 disables)")
    use_kl_loss: bool = _f(False, "add KL(policy || reference) to the loss (GRPO style)")
    kl_loss_coef: float = _f(0.001, "weight of the KL loss", **NON_NEGATIVE)
    kl_loss_type: str = _f("low_var_kl", "KL estimator for the loss", registry="KL_ESTIMATORS")
    grad_clip: float = _f(1.0, "max global grad norm", **POSITIVE)
    strategy: str = _f("fsdp", "how the ranks of actor, reference and critic share a model: fsdp (FSDP2: "
                       "parameters, gradients and optimizer state sharded per decoder layer) or ddp (every "
                       "rank holds the whole model); one rank trains the plain model either way",
                       choices=STRATEGIES)
    world_size: int = _f(1, "actor/rollout/reference ranks (processes)", checkpoint=True, **POSITIVE)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's ``actor_rollout_ref.rollout.multi_turn``; the
    loops are rlhf_core/agent/). Off: one generation per prompt, as single_turn_agent."""

    enable: bool = _f(False, "run each prompt through an agent loop (rollout.agent.default_agent_loop, or the "
                      "row's agent_name): tool_agent calls the tools of tool_config_path over several turns")
    max_assistant_turns: int = _f(0, "the most turns the model generates in one trajectory (0: no limit but the "
                                  "response length, verl's null)", **NON_NEGATIVE)
    max_user_turns: int = _f(0, "the most tool or user answers inserted in one trajectory (0: no limit, verl's "
                             "null)", **NON_NEGATIVE)
    max_parallel_calls: int = _f(1, "tool calls of one turn that are run (side by side); the rest are recorded as "
                                 "skipped", **POSITIVE)
    max_tool_response_length: int = _f(256, "characters of a tool's answer the model is shown; a longer one is "
                                       "cut on tool_response_truncate_side and marked", **POSITIVE)
    tool_response_truncate_side: str = _f("middle", "which part of a long answer is cut, verl's names: left keeps "
                                          "the start, right keeps the end, middle keeps both ends",
                                          choices=("left", "middle", "right"))
    tool_config_path: str = _f("", "verl's tool-config YAML (tools: class_name, config, tool_schema); its content "
                               "hash is in the run's manifest")
    interaction_config_path: str = _f("", "verl's interaction-config YAML (interaction: name, class_name, config): "
                                      "simulated users answer each turn without a tool call; a row picks one by "
                                      "extra_info.interaction_kwargs.name; its content hash is in the manifest")
    format: str = _f("hermes", "how tool calls are written in a turn (verl's parser names)", choices=("hermes",))
    use_inference_chat_template: bool = _f(False, "no effect here: the chat template renders each turn as "
                                           "inference would (verl's switch for templates that drop reasoning)",
                                           hashed=False)
    tokenization_sanity_check_mode: str = _f("strict", "compare the tokens built turn by turn with the whole chat "
                                             "rendered at once, counted in agent/tokenization_mismatch (disable, "
                                             "strict, ignore_strippable: whitespace ignored)",
                                             choices=("disable", "strict", "ignore_strippable"), hashed=False)


@dataclass
class AgentConfig:
    """Agent loops (verl's ``actor_rollout_ref.rollout.agent``)."""

    num_workers: int = _f(8, "no effect here: the trajectories of a batch run as coroutines in the controller, "
                          "each turn a request to the rollout manager (verl's agent-loop worker processes)",
                          hashed=False, **POSITIVE)
    default_agent_loop: str = _f("single_turn_agent", "the loop of a row without an agent_name column: "
                                 "single_turn_agent, tool_agent (rlhf_core/agent/loops/) or a name "
                                 "agent_loop_config_path gives")
    agent_loop_config_path: str = _f("", "verl's agent-loop YAML (- name, _target_: module.Class): a user's own "
                                     "loops, imported like a reward function")


@dataclass
class ValKwargsConfig:
    """Sampling for validation (verl's ``actor_rollout_ref.rollout.val_kwargs``)."""

    do_sample: bool = _f(False, "sample validation responses (False: greedy, verl's default)", hashed=False)
    temperature: float = _f(0.0, "sampling temperature when do_sample (0: greedy)", **NON_NEGATIVE, hashed=False)
    top_p: float = _f(1.0, "nucleus sampling when do_sample", gt=0, le=1, hashed=False)
    top_k: int = _f(-1, "top-k sampling when do_sample (-1 or 0: off, verl's -1)", ge=-1, hashed=False)
    n: int = _f(1, "responses per validation prompt (metrics mean@n, std@n)", **POSITIVE, hashed=False)
    seed: int = _f(7_000_003, "base seed of validation sampling: its own, so validation never moves the "
                   "training's random draws", **NON_NEGATIVE, hashed=False)


@dataclass
class CheckpointEngineConfig:
    backend: str = _f("naive", "how the trainer's weights reach the rollout replicas (verl's rollout.checkpoint_engine."
                      "backend): naive, in place, the replicas being the actor's own ranks (rollout.nnodes=0); nccl "
                      "(GPU) or gloo (CPU), bucketed broadcasts over a collective group from the actor's first rank to "
                      "a rollout pool of its own", choices=("naive", "nccl", "gloo"))
    update_weights_bucket_megabytes: int = _f(2048, "MiB of weights per broadcast bucket (verl's default; a "
                                              "tensor larger than a bucket goes alone): the most any rank holds "
                                              "for the transfer, never the whole model", **POSITIVE, hashed=False)


@dataclass
class RolloutConfig:
    name: str = _f("hf", "generation engine: hf (transformers generate on the actor's own model: fastest "
                   "for the demo's tiny model and short responses) or vllm (an in-process engine per rank: "
                   "for real models and long responses; benchmarks/generation.py); an engine is a module of "
                   "rlhf_core/rollout/engines", registry="rollout.engines")
    mode: str = _f("sync", "how generation is served (verl's rollout.mode): sync, each actor rank generates its "
                   "static share of the batch in one call; async, each rank (or tensor-parallel group) is a "
                   "replica server and a manager balances requests over them as they free up (docs/rollout.md)",
                   choices=("sync", "async"))
    n: int = _f(8, "responses sampled per prompt (GRPO group size)", ge=1)
    temperature: float = _f(1.0, "sampling temperature", **POSITIVE)
    top_p: float = _f(1.0, "nucleus sampling", gt=0, le=1)
    top_k: int = _f(-1, "top-k sampling: only the k likeliest tokens (-1 or 0: off, verl's -1; both engines)",
                    ge=-1)
    response_length: int = _f(8, "max new tokens per response", **POSITIVE)
    seed: int = _f(1234, "base sampling seed; each response gets seed + its row offset", **NON_NEGATIVE)
    seed_scope: str = _f("auto", "what one vLLM seed covers: request (each response its own: its sample does "
                         "not depend on its batch, chunking or restarts, but vLLM's sampler loops over rows every "
                         "decoding step), call (one per generate call, its first row's: batched sampling, the same "
                         "samples for the same batch on the same hardware), auto (call on GPU, request on CPU)",
                         choices=("auto", "call", "request"))
    tensor_model_parallel_size: int = _f(1, "vLLM tensor parallel size: ranks that serve one engine "
                                         "together (GPU only; divides actor.world_size, at most "
                                         "resources.gpus_per_node)", **POSITIVE)
    gpu_memory_utilization: float = _f(0.5, "share of each GPU vLLM may take for weights and KV cache "
                                       "(the trained model, its gradients and optimizer need the rest)",
                                       gt=0, le=1)
    dtype: str = _f("auto", "the engine's weights (auto: bfloat16 on GPU, model.dtype on CPU)",
                    choices=("auto", "float32", "bfloat16", "float16"))
    free_cache_engine: bool = _f(True, "free vLLM's KV cache and weights while the actor trains (sleep / "
                                 "wake up around training; no-op on CPU)")
    enforce_eager: bool | None = _f(None, "vLLM without CUDA graphs (None: CUDA graphs on GPU, where they "
                                    "make decoding several times faster; eager on CPU)", hashed=False)
    max_num_seqs: int = _f(1024, "vLLM: the most requests one engine step schedules", **POSITIVE, hashed=False)
    max_num_batched_tokens: int = _f(0, "vLLM: the most tokens one engine step schedules (0: vLLM's own "
                                     "default)", **NON_NEGATIVE, hashed=False)
    enable_chunked_prefill: bool | None = _f(None, "vLLM on GPU: split a long prompt over engine steps (None: "
                                             "vLLM's default); never on CPU workers, where a split prompt breaks "
                                             "its request's seed", hashed=False)
    enable_prefix_caching: bool | None = _f(None, "vLLM on GPU: the n samples of a prompt share its prefill "
                                            "(None: on); never on CPU workers", hashed=False)
    max_model_len: int = _f(0, "vLLM: the longest prompt + response the engine takes (0: data.max_prompt_length "
                            "+ rollout.response_length, at least 64)", **NON_NEGATIVE, hashed=False)
    lora_merge: bool | None = _f(None, "how vLLM serves a LoRA policy: true, the adapter merged into the weights "
                                 "(a full sync each update, generation at the base model's speed); false, the "
                                 "adapter as a LoRA request (verl's FSDP path: a small sync, LoRA kernels while "
                                 "generating); None: false on GPU, true on CPU, where vLLM's LoRA kernels "
                                 "generated 4x slower (benchmarks/lora.py)", hashed=False)
    nnodes: int = _f(0, "nodes of a rollout pool of its own (verl's fully-async rollout.nnodes): replicas there "
                     "receive the trainer's weights through rollout.checkpoint_engine; 0: the replicas are the actor's "
                     "ranks (colocated, hybrid)", **NON_NEGATIVE)
    n_gpus_per_node: int = _f(1, "ranks per node of the rollout's own pool: one GPU each on GPU nodes, "
                              "trainer.cpus_per_worker CPUs each on CPU nodes (no effect with rollout.nnodes=0)",
                              **POSITIVE)
    total_rollout_steps: int = _f(0, "verl's fully-async total of prompts generated (with async_training.enable): "
                                  "sets trainer.total_iterations to it / data.train_batch_size; 0: unset",
                                  **NON_NEGATIVE)
    test_freq: int = _f(0, "verl's fully-async validation every K weight syncs (with async_training.enable): sets "
                        "trainer.test_freq to K x async_training.trigger_parameter_sync_step; 0: unset",
                        **NON_NEGATIVE)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    @property
    def own_pool(self) -> bool:
        """Whether the replicas run on a pool of their own (else they are the actor's ranks)."""
        return self.nnodes > 0

    @property
    def own_pool_world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node if self.own_pool else 0


@dataclass
class TeacherModelConfig:
    model_path: str = _f("", "the teacher (verl's distillation.teacher_model.model_path): an HF folder, an s3:// / gs:// "
                         "folder or builtin:<task>, any size, with the policy's tokenizer (its vocabulary is checked "
                         "when the workers load it); a frozen copy on the actor's ranks scores the policy's samples, "
                         "as the reference does")


@dataclass
class DistillationLossConfig:
    loss_mode: str = _f("k3", "verl's loss_mode: a per-token reverse KL estimator of log pi_student - log pi_teacher "
                        "at each sampled token (a per-token advantage), or forward_kl_topk: the forward KL over the "
                        "teacher's topk likeliest tokens at each position (a supervised loss: with "
                        "use_policy_gradient=false)", registry="KL_ESTIMATORS+TOPK_LOSS_MODES")
    use_task_rewards: bool = _f(False, "keep the task's advantages and subtract distillation_loss_coef x the per-token "
                                "KL from them (A_t - lambda KL_t, slime's form); false: the advantages are -KL_t alone "
                                "(verl's default: distillation without rewards)")
    distillation_loss_coef: float = _f(1.0, "lambda: the KL's weight beside the task's advantages (use_task_rewards)",
                                       ge=0)
    use_policy_gradient: bool = _f(True, "the negative KL enters the policy gradient as a per-token advantage "
                                   "(verl's default, Thinking Machines' recipe; the estimators); false: the KL "
                                   "backpropagated as a supervised loss (forward_kl_topk)")
    loss_max_clamp: float | None = _f(None, "clamp each token's KL to [-value, value] (null: no clamp)", gt=0)
    log_prob_min_clamp: float | None = _f(None, "clamp both log-probs from below before the KL (null: no clamp)")
    topk: int = _f(32, "the teacher's likeliest tokens kept per position (log-probs and ids, in the teacher stage's "
                   "snapshot) for loss_mode=forward_kl_topk; no effect with an estimator", **POSITIVE)


@dataclass
class DistillationConfig:
    """On-policy distillation (newer verl's ``distillation.*``): a teacher's log-probs of the
    policy's own samples as a per-token training signal (docs/distillation.md)."""

    enabled: bool = _f(False, "distill a teacher into the policy on the policy's samples")
    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)

    @property
    def topk_width(self) -> int:
        """How many of the teacher's likeliest tokens each position keeps: ``topk`` for a
        top-k loss, else 0 (the estimators read the sampled token's log-prob only)."""
        from rlhf_core.algorithms.distillation import TOPK_LOSS_MODES

        loss = self.distillation_loss
        return loss.topk if self.enabled and loss.loss_mode in TOPK_LOSS_MODES else 0


@dataclass
class AsyncTrainingConfig:
    """Asynchronous training (verl's fully-async policy, ``async_training.*``): the rollout
    pool generates the coming trainer steps' batches while the trainer trains, and the
    weights move every ``trigger_parameter_sync_step`` steps (docs/async.md)."""

    enable: bool = _f(False, "asynchronous training: a rollout pool of its own (rollout.mode=async, rollout.nnodes "
                      ">= 1) generates ahead of the trainer within the staleness bound (verl's entry point "
                      "verl.experimental.fully_async_policy.fully_async_main sets it)")
    staleness_threshold: float = _f(0.1, "how far the rollout may run ahead of the weights it holds, as a share of a "
                                    "sync window (verl's rule): it may start the batches of the steps up to the "
                                    "next sync plus floor(staleness_threshold x trigger_parameter_sync_step) more "
                                    "(whole steps' batches here); 0: each step's batch waits for the weights of "
                                    "the last sync", ge=0)
    trigger_parameter_sync_step: int = _f(4, "trainer steps between two weight syncs to the rollout pool (verl's "
                                          "default 4; 1 with staleness_threshold=1 is one-step-off-policy)",
                                          **POSITIVE)
    require_batches: int = _f(1, "actor.ppo_mini_batch_size batches a trainer step takes (verl's rule: a step "
                              "trains require_batches x ppo_mini_batch_size prompts, which must equal "
                              "data.train_batch_size here)", **POSITIVE)
    partial_rollout: bool = _f(False, "stop the generations in flight at a weight sync and continue them on the "
                               "new weights (verl's default true); not built yet: refused when a batch can be in "
                               "flight at a sync (staleness_threshold x trigger_parameter_sync_step >= 1), no "
                               "effect otherwise (every batch started before a sync was consumed by it)")
    use_rollout_log_probs: bool = _f(True, "the update's old log-probs are the rollout engine's (the behaviour "
                                     "policy that sampled each row, stale or not; verl's default); false: the "
                                     "trainer's own forward before the update")
    @property
    def steps_beyond_sync(self) -> int:
        """Whole steps' batches the rollout may start beyond the next sync."""
        return int(self.staleness_threshold * self.trigger_parameter_sync_step + 1e-9)

    compute_prox_log_prob: bool = _f(False, "run the old_log_prob stage on the trainer's weights (the proximal "
                                     "policy): the update's ratio uses it, and algorithm.rollout_correction "
                                     "weighs it against the rollout's (AReaL's decoupled PPO)")


@dataclass
class CriticConfig:
    enable: bool | None = _f(None, "train a critic (None: only when adv_estimator is gae)", checkpoint=True)
    model_path: str = _f("", "the value model's starting weights (verl's critic.model.path): a causal LM folder "
                         "(a zero value head is added) or a one-label sequence classifier (a reward model: its score "
                         "head starts the value head); it must share the policy's vocabulary; empty: model.path",
                         checkpoint=True)
    lr: float = _f(1e-3, "AdamW learning rate of the value model", **NON_NEGATIVE)
    weight_decay: float = _f(0.01, "AdamW weight decay of the value model (torch's and verl's default)",
                             **NON_NEGATIVE)
    lr_warmup_steps: int = _schedule("lr_warmup_steps")
    lr_warmup_steps_ratio: float = _schedule("lr_warmup_steps_ratio")
    lr_scheduler_type: str = _schedule("lr_scheduler_type")
    min_lr_ratio: float = _schedule("min_lr_ratio")
    num_cycles: float = _schedule("num_cycles")
    cliprange_value: float = _f(0.5, "value clipping range", **POSITIVE)
    ppo_epochs: int = _f(1, "passes over each iteration's batch", **POSITIVE)
    shuffle: bool = _f(True, "each PPO epoch takes its mini-batches in a seeded random order (false: in batch "
                       "order)")
    ppo_mini_batch_size: int = _f(8, "prompts per critic optimizer step (x rollout.n responses)", **POSITIVE)
    ppo_micro_batch_size_per_gpu: int = _f(0, "responses per forward/backward on one rank (0: the whole "
                                           "mini-batch)", **NON_NEGATIVE)
    forward_micro_batch_size_per_gpu: int = _f(0, "responses per forward when computing values on one rank "
                                               "(0: all at once)", **NON_NEGATIVE)
    use_dynamic_bsz: bool = _f(False, "micro-batches by tokens, not rows: the update's hold at most "
                               "ppo_max_token_len_per_gpu tokens, the value forwards' forward_max_token_len_per_gpu")
    use_remove_padding: bool | None = _f(None, "padding-free forwards of the value model (None: as "
                                         "model.use_remove_padding)")
    ppo_max_token_len_per_gpu: int = _f(32768, "tokens per update micro-batch on one rank, with use_dynamic_bsz",
                                        **POSITIVE)
    forward_max_token_len_per_gpu: int = _f(32768, "tokens per value forward on one rank, with use_dynamic_bsz",
                                            **POSITIVE)
    loss_agg_mode: str = _f("token-mean", "how the value loss reduces over tokens and responses",
                            choices=LOSS_AGG_MODES)
    grad_clip: float = _f(1.0, "max global grad norm", **POSITIVE)
    world_size: int = _f(0, "critic ranks on a pool of their own (resources.critic_nnodes nodes of the same "
                         "shape); 0: colocated with the actor, one critic per actor rank", **NON_NEGATIVE)
    lora_rank: int = _f(0, "LoRA rank of the value model's adapters (peft): > 0 trains adapters over its frozen "
                        "backbone and its value head whole; checkpoints hold those; 0: all its weights train",
                        checkpoint=True, **NON_NEGATIVE)
    lora_alpha: int = _f(16, "LoRA scaling numerator of the critic's adapters", checkpoint=True, **POSITIVE)
    target_modules: str = _f("all-linear", "the backbone modules the critic's LoRA adapts (as model.target_modules)",
                             checkpoint=True)
    exclude_modules: str = _f("", "backbone modules the critic's LoRA leaves alone (as model.exclude_modules)",
                              checkpoint=True)


@dataclass
class RewardConfig:
    function: str = _f("verl", "module:function with verl's signature (data_source, "
                       "solution_str, ground_truth, extra_info) -> float | dict (trusted code of the run's "
                       "owner: it is imported and run by the reward workers), or a named one: verl = verl's "
                       "default reward, the scorer each row's data_source names (gsm8k, MATH, searchR1, code "
                       "through SandboxFusion, the built-in task; rlhf_core/data/reward_scores.py), a data_source "
                       "it does not take refused before anything is placed; builtin = the built-in task's scorer; "
                       "gsm8k = 1 when the number after the last '####' equals the ground truth (numbers "
                       "normalized: '#### 18.0' is 18)")


@dataclass
class CustomRewardFunctionConfig:
    """A reward function loaded from a Python file (verl's ``custom_reward_function``):
    trusted code of the run's owner, like ``reward.function``; it replaces it when set."""

    path: str = _f("", "a .py file defining the reward function (verl's signature); empty: reward.function "
                   "scores")
    name: str = _f("compute_score", "the function's name in that file")


@dataclass
class RewardModelFSDPConfig:
    param_offload: bool = _f(True, "keep the reward model's shards on the CPU between its forwards, as "
                             "verl's reward-model worker always does (no effect on CPU machines)")


@dataclass
class RewardModelModelConfig:
    path: str = _f("", "the reward model: a Hugging Face sequence-classification folder with one label "
                   "(a local or mounted folder, or an s3:// / gs:// folder fetched once per node, like "
                   "model.path)")
    use_remove_padding: bool = _f(False, "padding-free forwards of the reward model (as model.use_remove_padding)")
    fsdp_config: RewardModelFSDPConfig = field(default_factory=RewardModelFSDPConfig)


@dataclass
class RewardModelRolloutConfig:
    """The engine that serves the reward model with ``reward_model.use_reward_loop`` (verl's
    ``reward_model.rollout``)."""

    name: str = _f("vllm", "the serving engine: vllm (a classifier: its pooling runner, the score head's raw "
                   "output at the last token; a judge: its generate, per-request seeds) or hf (a judge only: "
                   "transformers' generate); a judge is served behind a chat-completions endpoint",
                   choices=("vllm", "hf"))
    gpu_memory_utilization: float = _f(0.5, "share of a GPU the reward model's engine may take (GPU nodes)", gt=0,
                                       le=1, hashed=False)
    tensor_model_parallel_size: int = _f(1, "GPUs per reward-model engine: 1 here (one engine per rank of the "
                                         "reward model's pool)", **POSITIVE)
    prompt_length: int = _f(2048, "a judge's longest prompt in tokens once templated (a longer request is "
                            "refused, which fails the row); no effect on a classifier (reward_model.max_length)",
                            **POSITIVE)
    response_length: int = _f(2048, "a judge's longest answer in tokens (a request's max_tokens is cut to it); no "
                              "effect on a classifier", **POSITIVE)


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (``reward_manager=dapo``; verl's
    ``reward_model.reward_kwargs.overlong_buffer_cfg``)."""

    enable: bool = _f(False, "punish responses that reach into the last `len` tokens before max_resp_len "
                      "(reward_manager=dapo)")
    len: int = _f(0, "tokens of the buffer before max_resp_len over which the punishment grows", **NON_NEGATIVE)
    penalty_factor: float = _f(1.0, "the punishment of a response max_resp_len tokens long", **NON_NEGATIVE)
    log: bool = _f(False, "log each response's overlong_reward and whether it was punished (overlong)",
                   hashed=False)


@dataclass
class RewardKwargsConfig:
    """What verl passes its reward manager (``reward_model.reward_kwargs``)."""

    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    max_resp_len: int = _f(0, "the response length the overlong buffer counts back from (0: "
                           "rollout.response_length)", **NON_NEGATIVE)


@dataclass
class SandboxFusionConfig:
    """Code rewards from a SandboxFusion server (rlhf_core/workers/sandbox_fusion.py)."""

    url: str = _f("", "the server's run_code endpoint: responses of the coding data sources (codecontests, apps, "
                  "codeforces, taco) are scored by running them on their test cases there (empty: "
                  "reward.function scores them)")
    max_concurrent: int = _f(64, "requests in flight at once per reward process", hashed=False, **POSITIVE)
    memory_limit_mb: int = _f(1024, "each run's memory limit on the server", **POSITIVE)


@dataclass
class RewardModelConfig:
    """A learned reward model (verl's ``reward_model`` section): with ``enable``, a reward-
    model worker scores each response at its last valid token (``rm_scores``), and those
    scores are the rewards (verl's default reward manager), or what a custom reward
    function sees as ``extra_info["rm_score"]``. When its tokenizer or chat template
    differs from the policy's, each response is decoded and re-templated for it, after
    the prompt's chat messages."""

    enable: bool = _f(False, "score responses with reward_model.model.path")
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: int = _f(0, "responses per reward-model forward on one rank (0: forwards of at "
                                       "most forward_max_token_len_per_gpu tokens, never every row at once)",
                                       **NON_NEGATIVE)
    use_dynamic_bsz: bool = _f(False, "reward-model forwards by tokens, not rows (forward_max_token_len_per_gpu "
                               "each), also when micro_batch_size_per_gpu is set")
    forward_max_token_len_per_gpu: int = _f(32768, "tokens per reward-model forward on one rank, with "
                                            "use_dynamic_bsz or without micro_batch_size_per_gpu", **POSITIVE)
    max_length: int = _f(0, "re-templated inputs longer than this are truncated by reward_model.truncation "
                         "(0: the policy's data.max_prompt_length + rollout.response_length, verl's default)",
                         **NON_NEGATIVE)
    truncation: str = _f("right", "a re-templated input longer than max_length: right (keep its start, verl's "
                         "default), left (keep its end), middle (its start and end), error (refuse the batch)",
                         choices=("right", "left", "middle", "error"))
    use_reward_loop: bool = _f(False, "score with a serving engine (reward_model.rollout: vLLM's pooling runner, "
                               "one engine per rank, asleep between scorings on GPUs) instead of an FSDP forward; "
                               "the same inputs, the same score (verl's reward loop; verl's default is true)")
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
    enable_resource_pool: bool = _f(False, "the reward model on a pool of its own (reward_model.nnodes nodes of "
                                    "reward_model.n_gpus_per_node ranks each) instead of colocated with the actor "
                                    "in the training pool", hashed=False)
    n_gpus_per_node: int = _f(0, "ranks per node of the reward model's own pool: one GPU each on GPU nodes, "
                              "trainer.cpus_per_worker CPUs each on CPU nodes (no effect without "
                              "enable_resource_pool, as in verl)", **NON_NEGATIVE, hashed=False)
    nnodes: int = _f(0, "nodes of the reward model's own pool, of the training pool's node shape (no effect "
                     "without enable_resource_pool, as in verl)", **NON_NEGATIVE, hashed=False)
    reward_manager: str = _f("naive", "how rewards are made from scores (verl's reward managers, "
                             "rlhf_core/workers/reward_managers.py): naive = the reward function per response; "
                             "dapo = naive's, then the overlong punishment of reward_kwargs.overlong_buffer_cfg; "
                             "batch = the function once per batch, with lists; prime = naive's calls side by side, each "
                             "in a process of its own, one that raises or outlasts 300 s scores 0 and its process "
                             "is killed (for sandboxed code); rate_limited = naive's calls side by side within "
                             "max_concurrent, max_rpm and max_tpm, one that raises or outlasts timeout scores 0 "
                             "(for functions calling outside APIs). With a "
                             "reward model its scores are the rewards under each",
                             choices=("naive", "dapo", "batch", "prime", "rate_limited"))
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)
    max_concurrent: int = _f(0, "reward-function calls at once with a served judge or reward_manager="
                             "rate_limited, each response's call of its own (verl's key; 0: 64 with a judge, "
                             "verl's 1 for rate_limited)", hashed=False, **NON_NEGATIVE)
    timeout: float = _f(300.0, "seconds one response's reward-function call may take with a served judge (its "
                        "retries of failed judge calls included; then the stage fails in one line) or "
                        "rate_limited (then it scores 0), verl's key", hashed=False, **POSITIVE)
    max_rpm: int = _f(0, "rate_limited: calls started a minute at most, a second's worth in a burst (verl's key; "
                      "0: no limit); per reward worker here (verl's is per process too)", hashed=False,
                      **NON_NEGATIVE)
    max_tpm: int = _f(0, "rate_limited: estimated tokens a minute at most, each call counting "
                      "estimated_tokens_per_request (verl's key; 0: no limit)", hashed=False, **NON_NEGATIVE)
    estimated_tokens_per_request: int = _f(2000, "rate_limited: the tokens one call counts against max_tpm (verl's "
                                           "key)", hashed=False, **POSITIVE)
    log_function_score: bool = _f(False, "also score every response with reward.function and log it "
                                  "(critic/reward_extra/function_score/mean; its other keys too): the task's own check "
                                  "beside the learned reward, which stays the reward (over-optimization shows as the "
                                  "two parting)", hashed=False)

    @property
    def bounded_by_tokens(self) -> bool:
        """Whether a forward holds at most ``forward_max_token_len_per_gpu`` tokens: with
        ``use_dynamic_bsz``, or when no row count is set (a 7B reward model's forward over
        every row of a rank at once needs tens of GB)."""
        return self.use_dynamic_bsz or not self.micro_batch_size_per_gpu


@dataclass
class KLControlConfig:
    type: str = _f("fixed", "fixed | adaptive (Ziegler et al. 2019)", choices=("fixed", "adaptive"))
    kl_coef: float = _f(0.001, "initial / fixed coefficient of KL in the reward", **NON_NEGATIVE)
    target_kl: float = _f(0.1, "adaptive: KL the controller steers to", **POSITIVE)
    horizon: int = _f(10000, "adaptive: samples over which the coefficient adapts", **POSITIVE)


@dataclass
class RolloutCorrectionConfig:
    """How the update treats the rollout engine's own log-probs (verl's ``algorithm.rollout_correction``)."""

    bypass_mode: bool = _f(True, "the PPO ratio's old log-probs are the ones the rollout engine sampled with "
                           "(no old_log_prob stage: one forward pass over the batch less per iteration). Exact "
                           "for rollout.name=hf (the trained model itself, up to float rounding); vllm on GPU "
                           "samples in bf16, so its log-probs differ from the trained model's: set false there to "
                           "recompute them (verl's default). Needs rollout.top_p=1 (and temperature 1 for vllm, "
                           "whose log-probs are the raw model's)")
    rollout_is: str | None = _f(None, "importance weights pi_train / pi_rollout: token | sequence (null: none). "
                                "Without bypass mode they weigh the policy loss per token; in bypass mode "
                                "with loss_type=reinforce they weigh its REINFORCE loss (ppo_clip: metrics only)",
                                choices=(None, "token", "sequence"))
    rollout_is_threshold: float = _f(2.0, "importance weights are truncated above this", **POSITIVE)
    rollout_is_batch_normalize: bool = _f(False, "divide the truncated weights by their mean (the batch's; "
                                          "in bypass mode the micro-batch's on one rank)")
    rollout_rs: str | None = _f(None, "rejection: comma-separated token_k1|k2|k3, seq_sum_k1|k2|k3, "
                                "seq_mean_k1|k2|k3, seq_max_k2|k3 (null: none); rejected tokens or sequences leave "
                                "the loss mask")
    rollout_rs_threshold: str | None = _f(None, "rollout_rs's bounds, one or one per option: k1's lo_hi on "
                                          "pi_rollout / pi_train (a bare hi: lo = 1/hi), the others' upper bound")
    loss_type: str = _f("ppo_clip", "bypass mode's loss: ppo_clip (actor.policy_loss against the rollout's "
                        "log-probs) or reinforce (-A * log pi * importance weight)", choices=("ppo_clip", "reinforce"))

    @property
    def active(self) -> bool:
        return bool(self.rollout_is or self.rollout_rs)


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose responses all score alike teach
    GRPO nothing; they are dropped and more prompts generated until the batch is full."""

    enable: bool = _f(False, "generate batches of data.gen_batch_size prompts, keep the groups whose metric "
                      "varies (or of one response), until data.train_batch_size groups are kept (the first ones)")
    metric: str | None = _f(None, "the per-response value whose spread keeps a group: seq_reward (the summed "
                            "token_level_scores), seq_final_reward (the same here: the KL penalty comes later), or a "
                            "key the reward function returns (acc, score, ...)")
    max_num_gen_batches: int = _f(0, "generation batches per iteration before the run stops with an error (0: no "
                                  "limit)", **NON_NEGATIVE)


@dataclass
class PFPPOConfig:
    """PF-PPO (Zhu et al. 2024): the batch resampled by reward after GAE."""

    reweight_method: str = _f("pow", "pow (|score|^weight_pow), max_min (the best and worst only) or max_random "
                              "(the best 0.4, the rest 0.1)", choices=("pow", "max_min", "max_random"))
    weight_pow: float = _f(2.0, "pow's exponent", **NON_NEGATIVE)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "the advantage estimator (gae needs a critic; remax samples a greedy "
                            "response per prompt as its baseline)", registry="ADV_ESTIMATORS", checkpoint=True)
    gamma: float = _f(1.0, "discount", ge=0, le=1)
    lam: float = _f(1.0, "GAE lambda", ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = _f(True, "GRPO: divide by the group std (False: Dr. GRPO)")
    use_kl_in_reward: bool = _f(False, "subtract beta * KL(policy || ref) from token rewards")
    kl_penalty: str = _f("k1", "KL estimator used in the reward", registry="KL_ESTIMATORS")
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    use_pf_ppo: bool = _f(False, "PF-PPO: after GAE, draw the batch's rows again (as many, with replacement) "
                          "weighted by their scores (adv_estimator=gae only, as verl)")
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)


@dataclass
class TrainerConfig:
    balance_batch: bool = _f(True, "reorder each rollout's rows so that every data-parallel rank of the actor "
                             "gets about the same number of tokens (verl's; no effect at one rank)")
    total_iterations: int = _f(60, "the run's total iterations when `rlhf run` is not given --iterations (a "
                               "re-run of the same command finishes the run, then does nothing)", **POSITIVE,
                               hashed=False)
    total_epochs: int = _f(0, "the run's total as passes over the training set (verl's rule: "
                           "floor(prompts / data.train_batch_size) iterations per epoch, the partial batch "
                           "dropped); 0: trainer.total_iterations. rlhf run --iterations wins", hashed=False,
                           **NON_NEGATIVE)
    critic_warmup: int = _f(0, "verl's critic warmup: the actor updates from iteration critic_warmup on, counted "
                            "from 1 as verl does (so N-1 critic-only iterations first; 0 and 1: none)",
                            **NON_NEGATIVE)
    logger: str = _f("console,mlflow", "where metrics go besides metrics.jsonl and the report (comma-separated; "
                     "verl's ['console','wandb'] taken): console = the progress line; mlflow = an MLflow run when "
                     "MLFLOW_TRACKING_URI is set; wandb = a W&B run (offline, under the run's output folder, unless "
                     "WANDB_API_KEY or WANDB_MODE says otherwise); tensorboard = event files under $TENSORBOARD_DIR "
                     "or the run's output folder (wandb and tensorboard: pip install 'rlhf-core[trackers]')",
                     hashed=False)
    project_name: str | None = _f(None, "the MLflow experiment and W&B project (None: MLflow's "
                                        "$MLFLOW_EXPERIMENT_NAME, else rlhf)",
                                  hashed=False)
    experiment_name: str | None = _f(None, "the MLflow and W&B run's name (None: the run id)", hashed=False)
    seed: int = _f(0, "seed for data order, model init and everything else", **NON_NEGATIVE)
    output_dir: str = _f("runs", "local folder for metrics.jsonl, the curve and logs", hashed=False)
    cpus_per_worker: float = _f(2.0, "CPUs reserved per worker process in the Ray pool (also its torch "
                                "threads)", **POSITIVE)
    progress: bool = _f(True, "show a progress bar per stage", hashed=False)
    session_idle_timeout_s: float = _f(1800.0, "the long-lived session (rlhf serve) ends after this "
                                       "long without a controller using it", **POSITIVE, hashed=False)
    checkpoint_every: int = _f(1, "write a checkpoint every K iterations (and at the run's last); the "
                               "weights of the iterations between are the last checkpoint plus a redo of their "
                               "update stages from their saved inputs, bit-identical on CPU. 1 (the default): "
                               "every pipeline run's Model artifact is a checkpoint one can load or export; "
                               "raise it where a checkpoint is expensive (~100 GB at 7B: e.g. 10)", **POSITIVE,
                               hashed=False)
    keep_checkpoints: int = _f(0, "rlhf gc keeps the checkpoints of the last K steps (0: every checkpoint); "
                               "the newest is always kept", **NON_NEGATIVE, hashed=False)
    keep_checkpoints_every: int = _f(0, "rlhf gc also keeps every M-th step's checkpoint (0: only the last "
                                     "keep_checkpoints)", **NON_NEGATIVE, hashed=False)
    keep_snapshots: int = _f(0, "rlhf gc keeps the stage snapshots of the last N committed iterations (0: "
                             "all); manifests (config, metrics, lineage) are always kept", **NON_NEGATIVE, hashed=False)
    keep_snapshots_every: int = _f(0, "rlhf gc also keeps the stage snapshots of every M-th iteration",
                                   **NON_NEGATIVE, hashed=False)
    test_freq: int = _f(-1, "validate (data.val_files) every K iterations, on the weights an iteration starts "
                        "from (verl's trainer.test_freq; -1: never periodically)", ge=-1, hashed=False)
    log_val_generations: int = _f(0, "validation samples (prompt, response, score) shown per validation, chosen "
                                  "as verl does (sorted by prompt, shuffled with seed 42, the first N): in the "
                                  "Kubeflow report and, with MLflow, as val_generations/iter-N.json", hashed=False,
                                  **NON_NEGATIVE)
    val_before_train: bool = _f(True, "validate the initial weights (iteration 0) when data.val_files is set "
                                "(verl's trainer.val_before_train)", hashed=False)
    prefetch: bool = _f(True, "a session computes the next iteration's inference stages (rollout through "
                        "values) right after an iteration commits, while the next controller starts; "
                        "results are identical either way", hashed=False)


@dataclass
class ResourcesConfig:
    """The training resource pool (every role colocated, one process per actor rank) as
    nodes of one shape: what a cluster must provide. Local runs use this machine."""

    nnodes: int = _f(1, "nodes in the training pool (Ray worker pods on a cluster)", **POSITIVE, hashed=False)
    gpus_per_node: int = _f(0, "GPUs per node, one actor rank each (0: CPU nodes, "
                            "trainer.cpus_per_worker CPUs per rank)", **NON_NEGATIVE, hashed=False)
    cpus_per_node: float = _f(4.0, "CPUs per node", **POSITIVE, hashed=False)
    memory_gib_per_node: float = _f(16.0, "memory per node, GiB", **POSITIVE, hashed=False)
    gpu_memory_gib: float = _f(0.0, "memory of one GPU, GiB, for the micro-batch memory check (validate(), "
                               "when model.path is a readable folder; the workers check again with the model "
                               "loaded); 0: the workers check against the device's own memory", **NON_NEGATIVE,
                               hashed=False)
    object_store_gib_per_node: float = _f(4.0, "Ray object store (shared memory) per node, GiB", **POSITIVE,
                                          hashed=False)
    critic_nnodes: int = _f(1, "nodes of the critic's own pool when critic.world_size > 0", **POSITIVE, hashed=False)
    accelerator_resource: str = _f("GPU", "the Ray resource one rank reserves when gpus_per_node > 0 (GPU, "
                                   "or a custom resource name: other accelerators, simulated clusters)", hashed=False)
    placement_timeout_s: float = _f(300.0, "how long placing the pool may wait for free resources (nodes "
                                    "that can never hold it fail at once)", **POSITIVE, hashed=False)

    def ranks_per_node(self, cpus_per_worker: float) -> int:
        return self.gpus_per_node if self.gpus_per_node else int(self.cpus_per_node // cpus_per_worker)

    def process_on_nodes(self, world_size: int) -> list[int]:
        """Ranks per node of a pool of ``world_size`` ranks (verl's ``process_on_nodes``):
        spread evenly over ``nnodes`` (validate checks it divides)."""
        nodes = min(self.nnodes, world_size)
        return [world_size // nodes] * nodes


#: Settings of particular policy losses (``actor.*``): each reaches the losses that take it
#: by name (``algorithms.loss_settings``), and is hashed only for them.
LOSS_SETTINGS = ("tau_pos", "tau_neg", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


def unused_loss_settings(policy_loss: str) -> list[str]:
    """Those of ``LOSS_SETTINGS`` that the policy loss ``policy_loss`` does not take."""
    from rlhf_core.algorithms import get_policy_loss_fn, loss_settings

    try:
        used = loss_settings(get_policy_loss_fn(policy_loss), **dict.fromkeys(LOSS_SETTINGS))
    except KeyError:  # an unknown loss: validate() refuses it; hash every setting meanwhile
        return []
    return [name for name in LOSS_SETTINGS if name not in used]


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    @property
    def estimator(self):
        """The advantage estimator's declared needs (``AdvEstimatorSpec``)."""
        from rlhf_core.algorithms import get_adv_estimator_spec

        return get_adv_estimator_spec(self.algorithm.adv_estimator)

    @property
    def use_critic(self) -> bool:
        return self.critic.enable if self.critic.enable is not None else self.estimator.needs_critic

    @property
    def critic_remove_padding(self) -> bool:
        """Whether the value model's forwards are packed (``critic.use_remove_padding``)."""
        return self.model.use_remove_padding if self.critic.use_remove_padding is None \
            else self.critic.use_remove_padding

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def validation_due(self, step: int) -> bool:
        """Whether iteration ``step`` starts with validation (data.val_files): every
        trainer.test_freq iterations after the first, and at 0 with trainer.val_before_train."""
        if not self.data.val_files:
            return False
        if step == 0:
            return self.trainer.val_before_train
        return self.trainer.test_freq > 0 and step % self.trainer.test_freq == 0

    @property
    def on_policy_update(self) -> bool:
        """One epoch over one mini-batch: the actor's single optimizer step starts from the
        weights that sampled the batch, so the old log-probs are the update's own forward
        (detached; the ratio is exactly 1) and the ``old_log_prob`` stage is skipped, unless
        the KL penalty in the reward needs them before the update."""
        correction = self.algorithm.rollout_correction  # it compares the rollout's log-probs with the policy's
        return (self.actor.ppo_epochs == 1 and self.actor.ppo_mini_batch_size == self.data.train_batch_size
                and not self.algorithm.use_kl_in_reward and not correction.active)

    @property
    def old_log_prob_column(self) -> str | None:
        """The batch column the update's old log-probs come from: None on-policy (the
        update's own forward), ``rollout_log_probs`` in bypass mode or asynchronous
        training's default (the engine's, written by the rollout stage), else
        ``old_log_probs`` (the ``old_log_prob`` stage's)."""
        asynchronous = self.async_training
        if asynchronous.enable and asynchronous.compute_prox_log_prob:  # the proximal policy's: the stage's
            return "old_log_probs"
        if asynchronous.enable and asynchronous.use_rollout_log_probs:  # rows may be stale: the behaviour policy's
            return "rollout_log_probs"
        if self.on_policy_update:
            return None
        return "rollout_log_probs" if self.algorithm.rollout_correction.bypass_mode else "old_log_probs"

    def _check_rollout_pool(self) -> None:
        """A rollout pool of its own: served replicas (async), fed by a collective backend
        that fits the nodes; colocated replicas: the in-place backend."""
        rollout, res = self.rollout, self.resources
        backend = rollout.checkpoint_engine.backend
        if not rollout.own_pool:
            if backend != "naive":
                raise ConfigError(f"rollout.checkpoint_engine.backend: expected naive (in place) with the replicas on the "
                                  f"actor's ranks (rollout.nnodes=0); found {backend}, which needs a rollout pool of "
                                  f"its own (rollout.nnodes >= 1)")
            return
        per_node = res.ranks_per_node(self.trainer.cpus_per_worker)
        if rollout.mode != "async":
            raise ConfigError(f"rollout.mode: expected async with a rollout pool of its own (rollout.nnodes="
                              f"{rollout.nnodes}: its replicas serve requests); found {rollout.mode}")
        if rollout.n_gpus_per_node > per_node:
            raise ConfigError(f"rollout.n_gpus_per_node: expected at most {per_node} ranks per node (the training "
                              f"pool's node shape); found {rollout.n_gpus_per_node}")
        wanted = "nccl" if res.gpus_per_node else "gloo"
        if backend != wanted:
            raise ConfigError(f"rollout.checkpoint_engine.backend: expected {wanted} with a rollout pool of its own on "
                              f"{'GPU' if res.gpus_per_node else 'CPU'} nodes (resources.gpus_per_node="
                              f"{res.gpus_per_node}); found {backend}")
        if rollout.own_pool_world_size % rollout.tensor_model_parallel_size:
            raise ConfigError(f"rollout.tensor_model_parallel_size: expected a divisor of the rollout pool's "
                              f"{rollout.own_pool_world_size} ranks (rollout.nnodes x n_gpus_per_node); found "
                              f"{rollout.tensor_model_parallel_size}")
        if self.model.lora:
            raise ConfigError(f"rollout.nnodes: expected 0 with a LoRA policy (model.lora_rank={self.model.lora_rank}): "
                              f"sending an adapter to a rollout pool of its own is not built yet; found "
                              f"{rollout.nnodes}")

    def _resolve_fully_async_totals(self) -> None:
        """verl's fully-async scripts count differently: ``data.train_batch_size=0`` (a step is
        ``require_batches x ppo_mini_batch_size`` prompts), ``rollout.total_rollout_steps``
        (prompts generated in all) and ``rollout.test_freq`` (validation every K weight
        syncs); and their weights always go through the checkpoint engine (the collective
        backend of the nodes when ``rollout.checkpoint_engine.backend`` is left naive).
        Resolved here into the trainer's own fields, once (validating again finds them
        resolved)."""
        asynchronous, rollout = self.async_training, self.rollout
        if not asynchronous.enable:
            for key, value in (("data.train_batch_size", self.data.train_batch_size),):
                if value == 0:
                    raise ConfigError(f"{key}: expected > 0 (0 only with async_training.enable); found 0")
            for key in ("total_rollout_steps", "test_freq"):
                if getattr(rollout, key):
                    raise ConfigError(f"rollout.{key}: expected 0 without async_training.enable (verl's fully-async "
                                      f"key); found {getattr(rollout, key)}")
            return
        if self.data.train_batch_size == 0:
            self.data.train_batch_size = asynchronous.require_batches * self.actor.ppo_mini_batch_size
        engine = rollout.checkpoint_engine
        if rollout.own_pool and engine.backend == "naive":  # verl's fully-async always uses its checkpoint engine
            engine.backend = "nccl" if self.resources.gpus_per_node else "gloo"
        if rollout.total_rollout_steps:
            self.trainer.total_iterations = max(1, rollout.total_rollout_steps // self.data.train_batch_size)
        if rollout.test_freq:
            self.trainer.test_freq = rollout.test_freq * asynchronous.trigger_parameter_sync_step

    def _check_distillation(self) -> None:
        """On-policy distillation: a teacher, and only the losses built here."""
        distill = self.distillation
        if not distill.enabled:
            return
        if not distill.teacher_model.model_path:
            raise ConfigError("distillation.teacher_model.model_path: expected the teacher's folder with "
                              "distillation.enabled; found none")
        loss = distill.distillation_loss
        if distill.topk_width and loss.use_policy_gradient:
            raise ConfigError(f"distillation.distillation_loss.use_policy_gradient: expected false with "
                              f"loss_mode={loss.loss_mode} (the top-k forward KL is a supervised loss here; as a "
                              f"per-token advantage it is not built); found true")
        if not distill.topk_width and not loss.use_policy_gradient:
            raise ConfigError(f"distillation.distillation_loss.use_policy_gradient: expected true with "
                              f"loss_mode={loss.loss_mode} (an estimator's KL is a per-token advantage; backpropagated "
                              f"as a supervised loss it is not built); found false")

    def _check_async_training(self) -> None:
        """Asynchronous training: a rollout pool of its own, a step that is whole mini-batches,
        and only what is built for it (each refusal names its key)."""
        asynchronous = self.async_training
        if not asynchronous.enable:
            return
        if not self.rollout.own_pool:
            raise ConfigError("async_training.enable: expected a rollout pool of its own (rollout.mode=async, "
                              "rollout.nnodes >= 1: it generates while the trainer trains); found rollout.nnodes=0")
        step = asynchronous.require_batches * self.actor.ppo_mini_batch_size
        if self.data.train_batch_size != step:
            raise ConfigError(f"async_training.require_batches: expected require_batches x actor.ppo_mini_batch_size "
                              f"= data.train_batch_size (the prompts of one trainer step); found "
                              f"{asynchronous.require_batches} x {self.actor.ppo_mini_batch_size} = {step} against "
                              f"{self.data.train_batch_size}")
        if not self.trainer.total_epochs and asynchronous.trigger_parameter_sync_step > self.trainer.total_iterations:
            raise ConfigError(f"async_training.trigger_parameter_sync_step: expected at most the run's "
                              f"{self.trainer.total_iterations} trainer steps (trainer.total_iterations); found "
                              f"{asynchronous.trigger_parameter_sync_step}")
        if asynchronous.partial_rollout and asynchronous.steps_beyond_sync:
            raise ConfigError(f"async_training.partial_rollout: expected false (stopping generations in flight at a "
                              f"weight sync is not built yet: they finish on the weights they began with); found "
                              f"true with staleness_threshold x trigger_parameter_sync_step >= 1")
        unbuilt = [("algorithm.filter_groups.enable", self.algorithm.filter_groups.enable),
                   (f"algorithm.adv_estimator={self.algorithm.adv_estimator}", self.estimator.needs_reward_baseline)]
        for key, used in unbuilt:
            if used:
                raise ConfigError(f"async_training.enable: expected false with {key} (asynchronous training "
                                  f"generates whole steps' batches without a reward baseline here); found true")
        correction = self.algorithm.rollout_correction
        if correction.active and not correction.bypass_mode and not asynchronous.compute_prox_log_prob:
            raise ConfigError("async_training.compute_prox_log_prob: expected true with algorithm.rollout_correction "
                              "outside bypass mode (its weights compare the trainer's log-probs with the rollout's); "
                              "found false")

    def _check_rollout_correction(self) -> None:
        from rlhf_core.algorithms import rollout_correction

        correction = self.algorithm.rollout_correction
        try:
            options = rollout_correction.rejection_options(correction.rollout_rs)
            if options:
                rollout_correction.rejection_bounds(options, correction.rollout_rs_threshold)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if correction.rollout_is and not correction.bypass_mode and \
                self.actor.policy_loss not in rollout_correction.WEIGHABLE_LOSSES:
            raise ConfigError(f"algorithm.rollout_correction.rollout_is: without bypass mode the weights scale the "
                              f"policy loss per token, supported here for actor.policy_loss in "
                              f"{', '.join(rollout_correction.WEIGHABLE_LOSSES)}; found {self.actor.policy_loss}")

    @property
    def prompts_per_generation(self) -> int:
        """Prompts the loader gives per batch: data.gen_batch_size under dynamic sampling."""
        return (self.data.gen_batch_size or self.data.train_batch_size) if self.algorithm.filter_groups.enable \
            else self.data.train_batch_size

    @property
    def judge_served(self) -> bool:
        """The reward model is a judge served behind ``reward_router_address`` (verl's reward
        loop with a custom reward function): the function asks it, no ``rm_score`` stage runs."""
        rm = self.reward_model
        return rm.enable and rm.use_reward_loop and bool(self.custom_reward_function.path)

    @property
    def runs_old_log_prob_stage(self) -> bool:
        """The ``old_log_prob`` stage runs: the update's old log-probs come from it, or the
        advantage needs its sum pi^2."""
        return self.old_log_prob_column == "old_log_probs" or self.actor.calculate_sum_pi_squared

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of every field that can change what is trained
        (part of lineage; display-only fields such as progress bars are left out)."""
        data = self.to_dict()
        for path in fields_where(lambda meta: not meta["hashed"]):
            *parents, key = path.split(".")
            chain = [data]
            for part in parents:
                chain.append(chain[-1][part])
            chain[-1].pop(key, None)
            for parent, part in zip(reversed(chain[:-1]), reversed(parents)):
                if not parent[part]:  # a section left empty only said how or where the run goes
                    parent.pop(part)
        if not self.reward_model.enable:
            data.pop("reward_model")  # its settings train nothing while it is off (hashes of runs without one stay)
        if not self.async_training.enable:  # the same for sections added later: a run from before resumes
            data.pop("async_training")
            for key in ("total_rollout_steps", "test_freq"):
                data["rollout"].pop(key)
        if not self.distillation.enabled:
            data.pop("distillation")
        if self.reward_model.enable and not self.judge_served:  # a judge's settings score nothing without one
            for key in ("prompt_length", "response_length"):
                data["reward_model"]["rollout"].pop(key)
        for knob in unused_loss_settings(self.actor.policy_loss):  # another loss's knobs train nothing
            data["actor"].pop(knob)
        from rlhf_core.algorithms.schedules import uses_total

        if uses_total(self.actor) or uses_total(self.critic):  # the schedule's total is then what is trained
            data["lr_schedule_total"] = self.trainer.total_iterations
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def validate(self) -> "RunConfig":
        """Every field's type, choices and range first (so nothing below divides by zero or
        meets NaN), then the settings that must agree. Raises ``ConfigError`` naming the
        field, what was expected and what was found."""
        from rlhf_core.algorithms.core import NOT_HERE

        self._resolve_fully_async_totals()
        for path, f in _leaf_paths(self).items():
            value = _get(self, path)
            if isinstance(value, str) and value in NOT_HERE and (f.metadata.get("registry") or f.metadata.get("choices")):
                raise ConfigError(f"{path}={value}: {NOT_HERE[value]}")
            check_field(path, f, _get(self, path))
            if f.metadata.get("registry"):
                names = registered(f.metadata["registry"])
                if _get(self, path) not in names:
                    raise ConfigError(f"{path}: expected a registered name ({', '.join(names)}); "
                                      f"found {_get(self, path)!r}")
        reward = self.reward.function
        if reward not in NAMED_REWARDS and not _REWARD_SPEC.fullmatch(reward):
            raise ConfigError(f"reward.function: expected module:function or one of {', '.join(NAMED_REWARDS)}; "
                              f"found {reward!r}")
        if self.custom_reward_function.path and not self.custom_reward_function.path.endswith(".py"):
            raise ConfigError(f"custom_reward_function.path: expected a .py file; "
                              f"found {self.custom_reward_function.path!r}")
        longest = self.data.max_prompt_length + self.rollout.response_length
        budgets = [("actor.ppo_max_token_len_per_gpu", self.actor.use_dynamic_bsz),
                   ("actor.log_prob_max_token_len_per_gpu", self.actor.log_prob_use_dynamic_bsz),
                   ("critic.ppo_max_token_len_per_gpu", self.use_critic and self.critic.use_dynamic_bsz),
                   ("critic.forward_max_token_len_per_gpu", self.use_critic and self.critic.use_dynamic_bsz)]
        for path, used in budgets:
            if used and _get(self, path) < longest:
                raise ConfigError(f"{path}: expected at least data.max_prompt_length + rollout.response_length "
                                  f"({longest} tokens: the longest sequence); found {_get(self, path)}")
        for section in ("actor", "critic") if self.use_critic else ("actor",):
            mini = getattr(self, section).ppo_mini_batch_size
            if self.data.train_batch_size % mini:
                raise ConfigError(f"{section}.ppo_mini_batch_size ({mini}) must divide data.train_batch_size "
                                  f"({self.data.train_batch_size})")
        res = self.resources
        if res.object_store_gib_per_node >= res.memory_gib_per_node:
            raise ConfigError(f"resources.object_store_gib_per_node ({res.object_store_gib_per_node}) must be "
                              f"less than resources.memory_gib_per_node ({res.memory_gib_per_node})")
        slots = res.nnodes * res.ranks_per_node(self.trainer.cpus_per_worker)
        if self.actor.world_size > slots:
            raise ConfigError(f"actor.world_size={self.actor.world_size} ranks do not fit the pool: "
                              f"resources.nnodes={res.nnodes} x {res.ranks_per_node(self.trainer.cpus_per_worker)} "
                              f"ranks per node (one per GPU, or resources.cpus_per_node / trainer.cpus_per_worker "
                              f"on CPU)")
        if res.nnodes > 1 and self.actor.world_size % res.nnodes:
            raise ConfigError(f"actor.world_size={self.actor.world_size} must split evenly over resources.nnodes="
                              f"{res.nnodes} (the same number of ranks on every node)")
        if self.use_critic and self.critic.world_size:
            per_node = res.ranks_per_node(self.trainer.cpus_per_worker)
            if self.critic.world_size % min(res.critic_nnodes, self.critic.world_size) or \
                    self.critic.world_size > res.critic_nnodes * per_node:
                raise ConfigError(f"critic.world_size={self.critic.world_size} must split evenly over "
                                  f"resources.critic_nnodes={res.critic_nnodes} nodes of {per_node} ranks each")
        rm = self.reward_model
        if rm.enable and rm.use_reward_loop and rm.rollout.tensor_model_parallel_size != 1:
            raise ConfigError(f"reward_model.rollout.tensor_model_parallel_size: expected 1 (one engine per rank of the "
                              f"reward model's pool here); found {rm.rollout.tensor_model_parallel_size}")
        if self.judge_served:
            if rm.rollout.name == "vllm" and self.rollout.name == "vllm" and not rm.enable_resource_pool:
                raise ConfigError("reward_model.rollout.name: expected hf, or reward_model.enable_resource_pool=true, "
                                  "for a vLLM judge beside a vLLM rollout (two vLLM engines never share a process); "
                                  "found vllm colocated with rollout.name=vllm")
            if rm.reward_manager not in ("naive", "dapo", "rate_limited"):
                raise ConfigError(f"reward_model.reward_manager: expected naive, dapo or rate_limited with a served "
                                  f"judge (each response's call a coroutine of its own); found {rm.reward_manager!r}")
        limited = rm.reward_manager == "rate_limited"
        defaults = RewardModelConfig()
        for key in ("max_rpm", "max_tpm", "estimated_tokens_per_request"):
            if not limited and getattr(rm, key) != getattr(defaults, key):
                raise ConfigError(f"reward_model.{key}: expected the default ({getattr(defaults, key)}) unless "
                                  f"reward_model.reward_manager=rate_limited (it bounds that manager's calls); found "
                                  f"{getattr(rm, key)} with reward_manager={rm.reward_manager}")
        for key in ("max_concurrent", "timeout"):
            if not (limited or self.judge_served) and getattr(rm, key) != getattr(defaults, key):
                raise ConfigError(f"reward_model.{key}: expected the default ({getattr(defaults, key)}) unless "
                                  f"reward_model.reward_manager=rate_limited or a judge is served (it bounds their "
                                  f"calls); found {getattr(rm, key)}")
        if self.judge_served and rm.log_function_score:
            raise ConfigError("reward_model.log_function_score: expected false with a served judge (the custom "
                              "function is the score; there is no second one to log); found true")
        if rm.enable and rm.use_reward_loop and not self.judge_served and rm.rollout.name != "vllm":
            raise ConfigError(f"reward_model.rollout.name: expected vllm to serve a classifier (hf serves a judge, "
                              f"with custom_reward_function.path); found {rm.rollout.name!r}")
        if rm.enable_resource_pool:
            per_node = res.ranks_per_node(self.trainer.cpus_per_worker)
            if not rm.enable:
                raise ConfigError("reward_model.enable_resource_pool: expected reward_model.enable=true (a pool for "
                                  "the reward model); found false")
            if not 1 <= rm.n_gpus_per_node <= per_node or rm.nnodes < 1:
                raise ConfigError(f"reward_model.n_gpus_per_node, reward_model.nnodes: expected 1 to {per_node} "
                                  f"ranks on each of at least 1 node (the training pool's node shape) with "
                                  f"enable_resource_pool; found {rm.n_gpus_per_node} x {rm.nnodes}")
        self._check_rollout_pool()
        self._check_async_training()
        self._check_distillation()
        if self.model.dtype != "float32" and not self.model.lora and not self.model.train_in_16bit:
            raise ConfigError(f"model.dtype: expected float32 for trained weights (FSDP computes in bf16 on GPUs "
                              f"with actor.fsdp_config.mixed_precision=auto; AdamW stepping {self.model.dtype} "
                              f"weights rounds small updates away, e.g. lr 1e-6 on a weight of 0.02); found "
                              f"{self.model.dtype} (model.train_in_16bit=true trains them anyway)")
        tp = self.rollout.tensor_model_parallel_size
        if tp > 1 and not res.gpus_per_node:
            raise ConfigError(f"rollout.tensor_model_parallel_size: expected 1 on CPU nodes "
                              f"(resources.gpus_per_node=0); found {tp}")
        if self.actor.world_size % tp:
            raise ConfigError(f"rollout.tensor_model_parallel_size: expected a divisor of actor.world_size="
                              f"{self.actor.world_size}; found {tp}")
        fsdp_size = self.actor.fsdp_config.fsdp_size
        for role, world in (("actor", self.actor.world_size),
                            ("critic", self.critic.world_size if self.use_critic else 0),
                            ("reward_model", rm.n_gpus_per_node * rm.nnodes if rm.enable_resource_pool else 0)):
            if fsdp_size > 0 and world and world % fsdp_size:  # shared by every FSDP role
                ranks = f"{role}.world_size={world}" if role != "reward_model" else \
                    f"the reward model's {world} ranks (reward_model.n_gpus_per_node x nnodes)"
                raise ConfigError(f"actor.fsdp_config.fsdp_size: expected a divisor of {ranks} (or -1: all ranks, "
                                  f"0: each node's); found {fsdp_size}")
        if res.gpus_per_node and tp > res.gpus_per_node:
            raise ConfigError(f"rollout.tensor_model_parallel_size: expected at most resources.gpus_per_node="
                              f"{res.gpus_per_node} (a tensor-parallel group stays on one node); found {tp}")
        if self.estimator.needs_critic and self.critic.enable is False:
            raise ConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs a critic; "
                              f"found critic.enable=False")
        if self.old_log_prob_column == "rollout_log_probs" and (self.rollout.top_p != 1 or self.rollout.top_k > 0):
            key = ("async_training.use_rollout_log_probs" if self.async_training.enable
                   else "algorithm.rollout_correction.bypass_mode")
            raise ConfigError(f"{key}: expected false when sampling is not "
                              f"the plain softmax (the engine's log-probs would not be the policy's); found true "
                              f"with rollout.top_p="
                              f"{self.rollout.top_p}, rollout.top_k={self.rollout.top_k}, rollout.temperature="
                              f"{self.rollout.temperature}")
        self._check_rollout_correction()
        if self.estimator.needs_sum_pi_squared and not self.actor.calculate_sum_pi_squared:
            raise ConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs "
                              f"actor.calculate_sum_pi_squared=true (verl's actor_rollout_ref.actor."
                              f"calculate_sum_pi_squared); found false")
        unknown = [name for name in listed_loggers(self.trainer.logger) if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.logger: expected a list of {', '.join(LOGGERS)}; found {unknown[0]!r}")
        groups = self.algorithm.filter_groups
        if groups.enable and not groups.metric:
            raise ConfigError("algorithm.filter_groups.metric: expected seq_reward, seq_final_reward or a key the "
                              "reward function returns (acc, score, ...); found none")
        if groups.enable and groups.metric == "seq_final_reward" and self.algorithm.use_kl_in_reward:
            raise ConfigError("algorithm.filter_groups.metric=seq_final_reward: the KL penalty in the reward is "
                              "applied after the groups are chosen here; use seq_reward, or "
                              "algorithm.use_kl_in_reward=false")
        if self.data.gen_batch_size and self.data.gen_batch_size != self.data.train_batch_size and \
                not groups.enable and not self.async_training.enable:
            raise ConfigError(f"data.gen_batch_size: differs from data.train_batch_size only with "
                              f"algorithm.filter_groups.enable=true (without it verl trains every generated row: set "
                              f"data.train_batch_size={self.data.gen_batch_size}); found {self.data.gen_batch_size}")
        if self.algorithm.use_pf_ppo and self.algorithm.adv_estimator != "gae":
            raise ConfigError(f"algorithm.use_pf_ppo: PF-PPO resamples after GAE (verl's rule: adv_estimator=gae); "
                              f"found adv_estimator={self.algorithm.adv_estimator}")
        longest = self.data.max_prompt_length + self.rollout.response_length
        if self.rollout.max_model_len and self.rollout.max_model_len < longest:
            raise ConfigError(f"rollout.max_model_len: expected at least data.max_prompt_length + "
                              f"rollout.response_length = {longest} (verl's rule); found {self.rollout.max_model_len}")
        if self.estimator.needs_group and self.rollout.n < 2:
            raise ConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs rollout.n >= 2 "
                              f"(a group per prompt); found {self.rollout.n}")
        manager, buffer = self.reward_model.reward_manager, self.reward_model.reward_kwargs.overlong_buffer_cfg
        if buffer.enable:
            if manager != "dapo":
                raise ConfigError(f"reward_model.reward_kwargs.overlong_buffer_cfg.enable: expected "
                                  f"reward_model.reward_manager=dapo (the manager that applies it); found {manager}")
            longest = self.reward_model.reward_kwargs.max_resp_len or self.rollout.response_length
            if not 0 < buffer.len <= longest:
                raise ConfigError(f"reward_model.reward_kwargs.overlong_buffer_cfg.len: expected 1 to {longest} "
                                  f"tokens (reward_model.reward_kwargs.max_resp_len, 0: rollout.response_length); "
                                  f"found {buffer.len}")
        if self.reward_model.enable and not self.reward_model.model.path:
            raise ConfigError("reward_model.model.path: expected a sequence-classification model folder with "
                              "reward_model.enable=True; found none")
        if self.reward_model.enable and self.estimator.needs_reward_baseline:
            raise ConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator}: expected an estimator "
                              f"without a greedy reward baseline with reward_model.enable=True (the baseline is "
                              f"scored by the reward function here); found one")
        try:  # the engine's own rules (rlhf_core/rollout/engines/<name>.py)
            engine_class(self.rollout.name).check(self)
        except EngineConfigError as exc:
            raise ConfigError(str(exc)) from None
        if self.resources.gpus_per_node and self.resources.gpu_memory_gib:
            shape = ModelShape.from_folder(self.model.path)
            reward_shape = ModelShape.from_folder(self.reward_model.model.path) if self.reward_model.enable else None
            if shape is not None or reward_shape is not None:
                check_micro_batch_memory(self, shape, self.resources.gpu_memory_gib * 2**30, reward_shape)
        return self


def registered(registry: str) -> list[str]:
    """The names registered in ``rlhf_core.algorithms.<registry>`` (imported when asked:
    the registries import torch), or the rollout engines (``rollout.engines``)."""
    if registry == "rollout.engines":
        return list(engine_names())
    from rlhf_core import algorithms

    return sorted(name for part in registry.split("+") for name in getattr(algorithms, part))


def fields_where(test) -> list[str]:
    """The dotted paths of the fields whose metadata passes ``test`` (e.g. the fields a
    checkpoint depends on: ``fields_where(lambda m: m["checkpoint"])``)."""
    return [path for path, f in _leaf_paths(RunConfig()).items() if test(f.metadata)]


def field_help(f: dataclasses.Field) -> str:
    """A field's help with what it accepts: its choices, or the names its registry holds."""
    meta = f.metadata
    help_text = meta.get("help", "")
    if meta.get("choices"):
        return f"{help_text}: {' | '.join(map(str, meta['choices']))}"
    if meta.get("registry"):
        return f"{help_text}: {' | '.join(registered(meta['registry']))} (registered)"
    return help_text


#: The fp32 logits one log-prob pass may hold at once (``workers.modeling``). A batch whose
#: logits fit is one full-vocabulary pass, as it always was (bit for bit: the built-in
#: task's 14-word vocabulary always fits); a larger one is projected on its response
#: positions only, a slice of tokens at a time, each slice recomputed in the backward: at
#: Qwen2's 151,936 words a slice is ~440 tokens.
LOGIT_BUDGET_BYTES = 256 * 2**20
#: The share of a GPU's memory that one micro-batch's activations and logits may take; the
#: rest holds the rank's shards of weights, gradients and optimizer state, the layer FSDP
#: has gathered, and the allocator's slack.
MICRO_BATCH_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class ModelShape:
    """What the micro-batch memory estimate needs of a decoder-only model."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape | None":
        """The shape of a loaded model's config; None for one without the four sizes (GPT-2's
        and OPT's name them otherwise): no estimate then."""
        values = [getattr(config, name, None) for name in _SHAPE_KEYS]
        if not all(type(v) is int and v > 0 for v in values):
            return None
        return cls(*values)

    @classmethod
    def from_folder(cls, path: str) -> "ModelShape | None":
        """The shape in ``path/config.json`` when ``path`` is a folder on this machine with
        the four sizes as integers; None otherwise (an object-store URI, a volume not
        mounted here, a built-in model): the workers check once the model is loaded."""
        import os

        config_file = os.path.join(path, "config.json")
        if "://" in path or ":" in path.split("/")[0] or not os.path.isfile(config_file):
            return None
        try:
            with open(config_file) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return None
        data = data.get("text_config", data) if isinstance(data, dict) else None
        if not isinstance(data, dict) or not all(type(data.get(k)) is int and data[k] > 0 for k in _SHAPE_KEYS):
            return None
        return cls(*(data[k] for k in _SHAPE_KEYS))


_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")


def micro_batch_memory(cfg: "RunConfig", shape: ModelShape | None,
                       reward_shape: ModelShape | None = None) -> list[tuple[str, str, int]]:
    """(the field that sizes it, what it holds, estimated bytes) of one micro-batch of each
    pass a run makes on one rank: the actor's update and log-prob forwards and the
    critic's (of the policy's ``shape``), the reward model's forward (of ``reward_shape``:
    a score head, no vocabulary logits; none when it is served by ``use_reward_loop``).

    An estimate of what grows with the micro-batch, not a measurement: the logits (a full
    pass while its fp32 logits fit ``LOGIT_BUDGET_BYTES``: the model's own, their fp32
    copy, the log-softmax and the entropy; beyond it three budgets' worth of slices) and
    the activations (in the compute dtype, per token and layer ~6 hidden and 4
    intermediate values kept for the backward: q/k/v, attention and projection outputs,
    the norms, the MLP's gate, up, activation and product; with gradient checkpointing one
    hidden per layer plus one layer recomputed; a forward without gradient holds one
    layer's at a time)."""
    width = 2 if cfg.resources.gpus_per_node and cfg.actor.fsdp_config.mixed_precision != "fp32" \
        or cfg.model.dtype != "float32" else 4
    longest = cfg.data.max_prompt_length + cfg.rollout.response_length

    def logits(tokens: int) -> int:
        full = tokens * shape.vocab_size * 4
        return tokens * shape.vocab_size * (width + 12) if full <= LOGIT_BUDGET_BYTES else 3 * LOGIT_BUDGET_BYTES

    def activations(tokens: int, training: bool, of: ModelShape) -> int:
        per_layer = 6 * of.hidden_size + 4 * of.intermediate_size
        if not training:
            return tokens * (per_layer + of.hidden_size) * width
        if cfg.model.enable_gradient_checkpointing:
            return tokens * (of.num_hidden_layers * of.hidden_size + per_layer) * width
        return tokens * of.num_hidden_layers * per_layer * width

    def tokens_of(section, rows_field: str, budget_field: str, dynamic: bool, all_rows: int, ranks: int,
                  row_tokens: int = longest):
        if dynamic:
            budget = getattr(section, budget_field)
            return budget_field, f"{budget} tokens", budget
        rows = getattr(section, rows_field) or -(-all_rows // ranks)
        return rows_field, f"{rows} rows x {row_tokens} tokens", rows * row_tokens

    n, actor = cfg.rollout.n, cfg.actor
    passes = []
    rm = cfg.reward_model
    if rm.enable and not rm.use_reward_loop and reward_shape is not None:
        ranks = rm.nnodes * rm.n_gpus_per_node if rm.enable_resource_pool else actor.world_size
        field_name, held, tokens = tokens_of(rm, "micro_batch_size_per_gpu", "forward_max_token_len_per_gpu",
                                             rm.bounded_by_tokens, cfg.data.train_batch_size * n, max(1, ranks),
                                             rm.max_length or longest)
        passes.append((f"reward_model.{field_name}", held, activations(tokens, False, reward_shape)))
    if shape is None:
        return passes
    field_name, held, tokens = tokens_of(actor, "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
                                         actor.use_dynamic_bsz, actor.ppo_mini_batch_size * n, actor.world_size)
    passes.append((f"actor.{field_name}", held, logits(tokens) + activations(tokens, True, shape)))
    if cfg.use_reference or cfg.runs_old_log_prob_stage:
        field_name, held, tokens = tokens_of(actor, "log_prob_micro_batch_size_per_gpu",
                                             "log_prob_max_token_len_per_gpu", actor.log_prob_use_dynamic_bsz,
                                             cfg.data.train_batch_size * n, actor.world_size)
        passes.append((f"actor.{field_name}", held, logits(tokens) + activations(tokens, False, shape)))
    if cfg.use_critic:
        critic, ranks = cfg.critic, cfg.critic.world_size or actor.world_size
        field_name, held, tokens = tokens_of(critic, "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
                                             critic.use_dynamic_bsz, critic.ppo_mini_batch_size * n, ranks)
        passes.append((f"critic.{field_name}", held, activations(tokens, True, shape)))
        field_name, held, tokens = tokens_of(critic, "forward_micro_batch_size_per_gpu",
                                             "forward_max_token_len_per_gpu", critic.use_dynamic_bsz,
                                             cfg.data.train_batch_size * n, ranks)
        passes.append((f"critic.{field_name}", held, activations(tokens, False, shape)))
    return passes


def check_micro_batch_memory(cfg: "RunConfig", shape: ModelShape | None, gpu_bytes: float,
                             reward_shape: ModelShape | None = None) -> None:
    """Refuse, in one line naming the field, a micro-batch estimated to need more than
    ``MICRO_BATCH_MEMORY_SHARE`` of a GPU's memory (``micro_batch_memory``)."""
    limit = MICRO_BATCH_MEMORY_SHARE * gpu_bytes
    for path, held, need in micro_batch_memory(cfg, shape, reward_shape):
        if need > limit:
            described = reward_shape if path.startswith("reward_model.") else shape
            advice = "lower it" + ("" if cfg.model.enable_gradient_checkpointing or "critic.forward" in path
                                   or "log_prob" in path or "reward_model" in path
                                   else ", or set model.enable_gradient_checkpointing")
            raise ConfigError(
                f"{path}: expected a micro-batch whose logits and activations fit in "
                f"{MICRO_BATCH_MEMORY_SHARE:.0%} of a GPU's {gpu_bytes / 2**30:.0f} GiB ({limit / 2**30:.1f} GiB); "
                f"found ~{need / 2**30:.1f} GiB for {held} (vocabulary {described.vocab_size}, hidden "
                f"{described.hidden_size}, {described.num_hidden_layers} layers): {advice}")


class ConfigError(ValueError):
    """A config field is unknown or has a value of the wrong type/range."""


def _get(cfg, path: str):
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def check_field(path: str, f: dataclasses.Field, value) -> None:
    """One field against its declared type, choices and bounds."""
    import math

    meta = f.metadata
    kind = str(f.type).split("|")[0].strip()
    optional = "None" in str(f.type)
    if value is None:
        if optional:
            return
        raise ConfigError(f"{path}: expected {kind}, found None")
    want = _TYPES.get(kind)
    ok = (isinstance(value, bool) if want is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else
          isinstance(value, int) and not isinstance(value, bool) if want is int else
          isinstance(value, want) if want is not None else True)
    if not ok:
        raise ConfigError(f"{path}: expected {kind}, found {value!r} ({type(value).__name__})")
    if want is float and not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number, found {value!r}")
    if want is str and not value.strip() and f.default != "":  # "" only where it is the default (unset)
        raise ConfigError(f"{path}: expected a non-empty string, found {value!r}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{path}: expected one of {', '.join(map(str, meta['choices']))}; found {value!r}")
    for key, test, words in (("gt", lambda v, b: v > b, ">"), ("ge", lambda v, b: v >= b, ">="),
                             ("lt", lambda v, b: v < b, "<"), ("le", lambda v, b: v <= b, "<=")):
        bound = meta.get(key)
        if bound is not None and not test(value, bound):
            raise ConfigError(f"{path}: expected a value {words} {bound}; found {value!r}")


def _leaf_paths(obj, prefix="") -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(_leaf_paths(value, path + "."))
        else:
            out[path] = f
    return out


def grouped_notes(notes: list[str]) -> list[str]:
    """Notes that say the same of several keys as one line (``k1=v1, k2=v2: why``): a full
    verl YAML notes hundreds of keys for a few reasons."""
    by_reason: dict[str, list[str]] = {}
    for note in notes:
        head, sep, reason = note.partition(": ")
        by_reason.setdefault(reason if sep else note, []).append(head if sep else "")
    return [f"{', '.join(heads)}: {reason}" if heads != [""] else reason for reason, heads in by_reason.items()]


def _optional(annotation) -> bool:
    if isinstance(annotation, str):
        return "None" in annotation
    return typing.get_origin(annotation) in (typing.Union, type(int | None)) and type(None) in typing.get_args(annotation)


def _convert(raw: str, annotation, path: str):
    hints = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, type(int | None)) else ()
    if hints:  # Optional[X]
        if raw.lower() in ("none", "null"):
            return None
        annotation = next(h for h in hints if h is not type(None))
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "str": str, "bool": bool}.get(
            annotation.split("|")[0].strip(), str)
    try:
        if annotation is bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if annotation is int:
            return int(raw)
        if annotation is float:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{path}: expected {getattr(annotation, '__name__', annotation)}, found {raw!r}") from None


#: trainer.logger's names (rlhf_core/record/tracking.py sends each iteration to them).
LOGGERS = ("console", "mlflow", "wandb", "tensorboard")


def listed_loggers(value: str) -> list[str]:
    """trainer.logger's names, in order: ``console,wandb`` or verl's ``['console','wandb']``."""
    return [name.strip().strip("'\"") for name in value.strip().strip("[]").split(",") if name.strip()]


def _unquoted(item: str) -> str:
    """``key='value'`` as Hydra reads it: a value wholly in matching quotes is the text
    inside them (verl's scripts quote values, e.g. ``data.truncation='error'``, and a run
    launched without a shell passes the quotes on)."""
    key, sep, raw = item.partition("=")
    value = raw.strip()
    if sep and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" and value[0] not in value[1:-1]:
        return f"{key}={value[1:-1]}"
    return item


def apply_overrides(cfg: RunConfig, overrides: list[str], sources: dict[str, str] | None = None,
                    origin: str = "override", notes: list[str] | None = None) -> RunConfig:
    """Apply ``key.path=value`` strings, ours or verl's (``rlhf_core.verl_keys`` translates
    them); unknown keys list close matches. ``sources`` (when given) records, per key set,
    ``origin`` or ``verl:<key>`` (a file's: ``<origin> verl:<key>``); ``notes`` collects the
    one-line notes of accepted verl keys (None: printed to stderr)."""
    from rlhf_core import verl_keys

    hints_cache: dict[type, dict] = {}
    leaves = _leaf_paths(cfg)
    try:
        translated = verl_keys.translate([_unquoted(item) for item in overrides], set(leaves),
                                         lambda path: _get(cfg, path))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if notes is None:
        for line in grouped_notes(translated.notes):
            print(f"rlhf: note: verl key {line}", file=sys.stderr)
    else:
        notes += translated.notes
    unset: list[str] = []
    for item in translated.overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        path, raw = item.split("=", 1)
        path = path.strip()
        if path not in leaves:
            close = difflib.get_close_matches(path, leaves, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {path!r}{hint} (nor a verl key: rlhf config --verl)")
        *parents, name = path.split(".")
        target = cfg
        for p in parents:
            target = getattr(target, p)
        owner = type(target)
        if owner not in hints_cache:
            hints_cache[owner] = typing.get_type_hints(owner)
        annotation = hints_cache[owner][name]
        if raw.strip().lower() in ("null", "none", "~") and not _optional(annotation):
            # verl's null: unset, its code then falls back on another setting; here the field keeps its value
            unset.append(f"{path}=null (verl: unset; here it keeps {getattr(target, name)!r}): no effect")
            continue
        setattr(target, name, _convert(raw, annotation, path))
        if sources is not None:
            verl = translated.provenance.get(path)
            sources[path] = origin if verl is None else f"verl:{verl}" if origin == "override" else f"{origin} verl:{verl}"
    if notes is not None:
        notes += unset
    else:
        for line in grouped_notes(unset):
            print(f"rlhf: note: {line}", file=sys.stderr)
    return cfg


def config_from_dict(data: dict, base: RunConfig | None = None) -> RunConfig:
    """Build a RunConfig from a (possibly partial) nested dict, e.g. a YAML/JSON file."""
    from rlhf_core.verl_keys import flatten

    return apply_overrides(base or RunConfig(), flatten(data))


def handover(cfg: RunConfig) -> dict:
    """The resolved config as a parent hands it to a child process (a pipeline run's
    components, the fine-tune driver's runs): the config as JSON text and its hash. Text,
    not a mapping: KFP carries a mapping parameter as a protobuf Struct, which has no null
    and turns every integer into a float. The child rebuilds the config with
    ``config_from_handover``; no override string is parsed twice."""
    return {"config": json.dumps(cfg.to_dict(), sort_keys=True), "config_hash": cfg.config_hash()}


def config_from_handover(config, config_hash, field: str = "config") -> RunConfig:
    """The config ``handover`` wrote: parsed, built, validated, and refused unless it
    hashes to ``config_hash``, so a child runs exactly what its parent resolved."""
    try:
        data = json.loads(config) if isinstance(config, str) else None
    except ValueError:
        data = None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{field}: expected the run's resolved config as JSON text (what `rlhf config "
                          f"--handover` prints); found {config!r:.120}")
    cfg = config_from_dict(data).validate()
    if cfg.config_hash() != config_hash:
        raise ConfigError(f"{field}_hash: expected the hash of {field}, {cfg.config_hash()}; found "
                          f"{config_hash!r:.80}")
    return cfg


def config_file_items(path: str, overrides: list[str] = ()) -> list[str]:
    """The ``key=value`` items of a config file (``--config``: YAML or JSON, ours or verl's
    layout, nested as verl's trainer writes it), in its order; refused in one line when it
    cannot be read or is not a mapping. ``overrides`` that set a key of the file replace it
    before its interpolations are resolved, as Hydra does: an override of
    ``actor_rollout_ref.actor.ppo_mini_batch_size`` reaches ``critic.ppo_mini_batch_size``
    through the file's ``${oc.select:...}``."""
    import yaml

    from rlhf_core.verl_keys import flatten

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of config keys; found {type(data).__name__}")
    from rlhf_core.verl_keys import resolve_interpolations, yaml_scalar

    for item in overrides:
        key, sep, raw = _unquoted(item).partition("=")
        *parents, leaf = key.strip().lstrip("+").split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if sep and isinstance(node, dict) and leaf in node:
            try:  # as the file would hold it; a value YAML cannot read (or reads as a mapping) stays text
                value = yaml_scalar(raw) if raw.strip() else raw
            except yaml.YAMLError:
                value = raw
            node[leaf] = raw if isinstance(value, dict) else value
    try:
        return flatten(resolve_interpolations(data))
    except ValueError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None


def load_config(path: str | None, overrides: list[str], notes: list[str] | None = None
                ) -> tuple[RunConfig, dict[str, str]]:
    """The run's config: the defaults, then the YAML/JSON file at ``path`` (ours or verl's
    layout, nested), then ``overrides``; validated. Returns it with its provenance: every
    key -> ``default`` | ``file:PATH`` | ``override`` | ``verl:<key>`` (``file:PATH verl:<key>``
    for a verl key in the file), kept outside the config (its hash is unchanged)."""
    cfg, sources = RunConfig(), {}
    if path is not None:
        apply_overrides(cfg, config_file_items(path, overrides), sources, origin=f"file:{path}", notes=notes)
    apply_overrides(cfg, overrides, sources, notes=notes)
    cfg.validate()
    return cfg, {key: sources.get(key, "default") for key in _leaf_paths(cfg)}


def describe(cfg: RunConfig) -> str:
    """Every field with its value and help text (printed at the start of a run)."""
    lines = []
    for path, f in _leaf_paths(cfg).items():
        value = _get(cfg, path)
        lines.append(f"  {path:<38} = {value!r:<18} # {field_help(f)}")
    return "\n".join(lines)
