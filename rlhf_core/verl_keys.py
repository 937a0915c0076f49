"""verl's config keys, translated to ours: the one table (``rlhf config --verl`` prints it).

A verl run script (``python3 -m verl.trainer.main_ppo key=value ...``) or a verl-style YAML
runs here with its keys unchanged: ``apply_overrides`` passes every key through
``translate`` first. A key of ours is taken as it is; a verl key in ``TABLE`` is either

- mapped: it sets one or more of our fields, following *verl's* meaning where the two
  differ (the value may be converted: ``save_freq=-1``, ``n_gpus_per_node`` x ``nnodes``);
- noted: it names logging or a verl-internal mechanism; it is accepted and a one-line note
  says what happens to it here;
- refused: one line naming the key and why.

A verl key not in the table is refused with one line too. Rows whose targets are fields
this config does not have (yet) are refused with their note, so the table can list keys
another part of the code adds (validation, custom reward files) before they land.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

#: Top-level sections that exist only in verl's config: a key under one is a verl key.
VERL_ONLY_SECTIONS = ("actor_rollout_ref", "reward_model", "custom_reward_function", "global_profiler",
                      "ray_kwargs", "transfer_queue", "reward_manager")
#: verl's KL estimator names that ours spell differently (verl's ``kl`` is Schulman's k1).
KL_NAMES = {"kl": "k1"}
#: ``trainer.save_freq`` <= 0 (verl: never save): here a checkpoint at the run's last only.
NEVER = 2 ** 31 - 1


def _same(raw: str) -> str:
    return raw


def _kl_name(raw: str) -> str:
    return KL_NAMES.get(raw, raw)


def _save_freq(raw: str) -> str:
    return str(NEVER) if int(raw) <= 0 else raw


def _unless_null(raw: str) -> str | None:
    return None if raw.lower() in ("null", "none") else raw


def _strategy(raw: str) -> str:
    return "fsdp" if raw == "fsdp2" else raw


def _listed(raw: str) -> set[str]:
    """A Hydra list value as the shell passes it (``['model','optimizer']``, ``[model]``)."""
    return {item.strip().strip("'\"") for item in raw.strip().strip("[]").split(",") if item.strip()}


#: What every checkpoint here holds (an exact resume needs all three).
CHECKPOINT_CONTENTS = {"model", "optimizer", "extra"}


def _zero_if_null(raw: str) -> str:
    return "0.0" if raw.strip().lower() in ("null", "none", "~") else raw


def _int_zero_if_null(raw: str) -> str:
    return "0" if raw.strip().lower() in ("null", "none", "~") else raw


def _empty_if_null(raw: str) -> str:
    return "" if raw.strip().lower() in ("null", "none", "~") else raw


@dataclass(frozen=True)
class Rule:
    """One verl key: the fields of ours it sets (none: accepted with ``note`` only),
    how its value converts, or ``refuse`` (why it cannot run here)."""

    targets: tuple[str, ...] = ()
    note: str = ""
    convert: Callable[[str], str] = _same
    refuse: str = ""
    accepts: Callable[[str], bool] | None = None  # with refuse: the values taken (with the note), others refused


def _m(*targets: str, note: str = "", convert=_same) -> Rule:
    return Rule(tuple(targets), note, convert)


def _note(note: str) -> Rule:
    return Rule((), note)


def _refuse(why: str) -> Rule:
    return Rule(refuse=why)


ULYSSES_NOTE = ("no sequence parallelism here: each rank holds whole sequences (the same losses and gradients; "
                "activation memory per rank is for whole sequences, which verl splits over the N ranks)")
LOGIT_SLICES_NOTE = ("no effect on results: log-probs and entropy are computed here in token slices under a logit "
                     "budget and recomputed in the backward (the memory verl's fused kernels and entropy "
                     "checkpointing save)")

TEACHER_HERE = ("the teacher is a frozen HF model on the actor's ranks here (sharded as the reference), scoring "
                "each batch in one forward, not an inference server of its own")
A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
TABLE: dict[str, Rule] = {
    # model
    "actor_rollout_ref.model.path": _m("model.path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": _m("model.enable_gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": _m("model.use_remove_padding"),
    "critic.model.use_remove_padding": _m("critic.use_remove_padding"),
    "critic.model.path": _m("critic.model_path"),
    # one switch here for actor and critic (it changes memory and time, not what is computed): asked for by
    # either, both recompute activations
    "critic.model.enable_gradient_checkpointing": _m(
        "model.enable_gradient_checkpointing", note="one setting here for actor and critic: on when either asks",
        convert=lambda raw: "true" if raw.strip().lower() in ("true", "1") else None),
    **{f"critic.model.fsdp_config.{key}": Rule(
        note=f"the critic's FSDP follows actor.fsdp_config here (false, verl's default, as ours)",
        refuse=f"the critic's FSDP follows actor.fsdp_config here: set actor_rollout_ref.actor.fsdp_config.{key}",
        accepts=lambda raw: raw.strip().lower() in ("false", "0")) for key in ("param_offload", "optimizer_offload")},
    "critic.model.tokenizer_path": _note("no effect: the critic reads the policy's token ids (critic.model_path "
                                         "must share its vocabulary)"),
    "actor_rollout_ref.model.lora_rank": _m("model.lora_rank"),
    "actor_rollout_ref.model.lora_alpha": _m("model.lora_alpha"),
    "actor_rollout_ref.model.target_modules": _m("model.target_modules",
                                                 note="all-linear or a list of module names, as in verl"),
    "actor_rollout_ref.model.exclude_modules": _m("model.exclude_modules"),
    "actor_rollout_ref.model.lora_adapter_path": _m("model.lora_adapter_path"),
    "actor_rollout_ref.model.lora.merge": _m("rollout.lora_merge", note="vLLM serves the adapter merged into the "
                                                                        "weights"),
    "actor_rollout_ref.model.override_config.max_position_embeddings": _m("model.max_position_embeddings"),
    "actor_rollout_ref.model.torch_dtype": _note("no effect: not a key of verl's config (Hydra refuses it there "
                                                 "without '+'); the actor trains in model.dtype here, float32 "
                                                 "by default as verl's actor"),
    "actor_rollout_ref.model.use_shm": _note("no effect: model and adapter folders are read where they are (an "
                                             "object-store folder is fetched once per node into the cache)"),
    "critic.model.lora_rank": _m("critic.lora_rank"),
    "critic.model.lora_alpha": _m("critic.lora_alpha"),
    "critic.model.target_modules": _m("critic.target_modules", note="all-linear or a list of module names, as in verl"),
    "critic.model.exclude_modules": _m("critic.exclude_modules"),
    "actor_rollout_ref.hybrid_engine": _note("actor and reference share processes here; the rollout too unless "
                                             "rollout.nnodes >= 1 gives it a pool of its own"),
    # Ulysses splits each sequence's attention heads over N ranks: the same losses and
    # gradients as whole sequences on one rank, so a layout choice (like a kernel's)
    **{f"{role}.ulysses_sequence_parallel_size": Rule(
        note=ULYSSES_NOTE, refuse="expected a positive integer", accepts=lambda raw: raw.strip().isdigit()
        and int(raw) >= 1) for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")},
    "actor_rollout_ref.model.use_fused_kernels": _note(LOGIT_SLICES_NOTE),
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": _note(LOGIT_SLICES_NOTE),
    A + "entropy_checkpointing": _note(LOGIT_SLICES_NOTE),
    "actor_rollout_ref.ref.entropy_checkpointing": _note(LOGIT_SLICES_NOTE),
    A + "calculate_sum_pi_squared": _m("actor.calculate_sum_pi_squared"),
    A + "use_prefix_grouper": _note("no effect on results: a compute saving (the prompt shared by a group's "
                                    "responses is run once); here each response's forward includes its prompt, "
                                    "the same log-probs"),
    "trainer.use_legacy_worker_impl": _note("no effect: one worker implementation here"),
    "actor_rollout_ref.ref.strategy": Rule(note="the reference is sharded as actor.strategy says (fsdp and fsdp2 "
                                                "are both FSDP2 here)", refuse="only FSDP here",
                                           accepts=lambda raw: raw in ("fsdp", "fsdp2")),
    **{R + f"multi_turn.{key}": _m(f"rollout.multi_turn.{key}")
       for key in ("enable", "max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side",
                   "format", "use_inference_chat_template", "tokenization_sanity_check_mode")},
    **{R + f"multi_turn.{key}": _m(f"rollout.multi_turn.{key}", convert=_int_zero_if_null)
       for key in ("max_assistant_turns", "max_user_turns")},
    **{R + f"multi_turn.{key}": _m(f"rollout.multi_turn.{key}", convert=_empty_if_null)
       for key in ("tool_config_path", "interaction_config_path")},
    R + "multi_turn.num_repeat_rollouts": Rule(note="null: one rollout per interaction, as here",
                                               refuse="repeated rollouts per interaction are not built here",
                                               accepts=lambda raw: raw.strip().lower() in ("null", "none", "~", "1")),
    # actor
    A + "optim.lr": _m("actor.lr"),
    A + "optim.lr_warmup_steps": _m("actor.lr_warmup_steps"),
    A + "optim.lr_warmup_steps_ratio": _m("actor.lr_warmup_steps_ratio"),
    A + "optim.warmup_style": _m("actor.lr_scheduler_type", note="verl's older name of lr_scheduler_type"),
    A + "optim.lr_scheduler_type": _m("actor.lr_scheduler_type"),
    A + "optim.min_lr_ratio": _m("actor.min_lr_ratio", convert=_zero_if_null),
    A + "optim.num_cycles": _m("actor.num_cycles"),
    "critic.optim.lr_warmup_steps": _m("critic.lr_warmup_steps"),
    "critic.optim.lr_warmup_steps_ratio": _m("critic.lr_warmup_steps_ratio"),
    "critic.optim.warmup_style": _m("critic.lr_scheduler_type", note="verl's older name of lr_scheduler_type"),
    "critic.optim.lr_scheduler_type": _m("critic.lr_scheduler_type"),
    "critic.optim.min_lr_ratio": _m("critic.min_lr_ratio", convert=_zero_if_null),
    "critic.optim.num_cycles": _m("critic.num_cycles"),
    A + "optim.weight_decay": _m("actor.weight_decay"),
    A + "ppo_mini_batch_size": _m("actor.ppo_mini_batch_size", note="prompts per optimizer step, as in verl"),
    A + "ppo_micro_batch_size_per_gpu": _m("actor.ppo_micro_batch_size_per_gpu",
                                           note="responses per forward/backward on one rank, as in verl"),
    A + "ppo_epochs": _m("actor.ppo_epochs"),
    A + "use_dynamic_bsz": _m("actor.use_dynamic_bsz", note="update micro-batches by tokens, as in verl"),
    A + "ppo_max_token_len_per_gpu": _m("actor.ppo_max_token_len_per_gpu"),
    R + "log_prob_use_dynamic_bsz": _m("actor.log_prob_use_dynamic_bsz",
                                       note="one setting here for old and reference log-probs"),
    R + "log_prob_max_token_len_per_gpu": _m("actor.log_prob_max_token_len_per_gpu",
                                             note="one setting here for old and reference log-probs"),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": _m("actor.log_prob_use_dynamic_bsz",
                                                         note="one setting here for old and reference log-probs"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": _m(
        "actor.log_prob_max_token_len_per_gpu", note="one setting here for old and reference log-probs"),
    A + "clip_ratio": _m("actor.clip_ratio_low", "actor.clip_ratio_high", note="sets both bounds, as in verl"),
    A + "clip_ratio_low": _m("actor.clip_ratio_low"),
    A + "clip_ratio_high": _m("actor.clip_ratio_high"),
    A + "clip_ratio_c": _m("actor.clip_ratio_c"),
    A + "loss_agg_mode": _m("actor.loss_agg_mode"),
    A + "entropy_coeff": _m("actor.entropy_coeff"),
    A + "use_kl_loss": _m("actor.use_kl_loss"),
    A + "kl_loss_coef": _m("actor.kl_loss_coef"),
    A + "kl_loss_type": _m("actor.kl_loss_type", convert=_kl_name),
    A + "grad_clip": _m("actor.grad_clip"),
    A + "strategy": _m("actor.strategy", note="fsdp and fsdp2 are both FSDP2 here", convert=_strategy),
    A + "policy_loss.loss_mode": _m("actor.policy_loss"),
    A + "tau_pos": _m("actor.tau_pos"),
    A + "tau_neg": _m("actor.tau_neg"),
    **{A + f"policy_loss.{knob}": _m(f"actor.{knob}")
       for knob in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
    A + "fsdp_config.param_offload": _m("actor.fsdp_config.param_offload"),
    A + "fsdp_config.optimizer_offload": _m("actor.fsdp_config.optimizer_offload"),
    A + "fsdp_config.reshard_after_forward": _m("actor.fsdp_config.reshard_after_forward"),
    A + "fsdp_config.fsdp_size": _m("actor.fsdp_config.fsdp_size", note="-1 as in verl; here 0 (the default) "
                                    "shards within each node of a multi-node GPU pool"),
    "actor_rollout_ref.ref.fsdp_config.param_offload": _m("actor.fsdp_config.ref_param_offload"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": _m(
        "actor.log_prob_micro_batch_size_per_gpu", note="one setting here for old and reference log-probs"),
    # rollout
    R + "log_prob_micro_batch_size_per_gpu": _m(
        "actor.log_prob_micro_batch_size_per_gpu", note="one setting here for old and reference log-probs"),
    R + "name": _m("rollout.name"),
    R + "n": _m("rollout.n"),
    R + "temperature": _m("rollout.temperature"),
    R + "top_p": _m("rollout.top_p"),
    R + "response_length": _m("rollout.response_length"),
    R + "prompt_length": _m("data.max_prompt_length"),
    R + "tensor_model_parallel_size": _m("rollout.tensor_model_parallel_size"),
    R + "gpu_memory_utilization": _m("rollout.gpu_memory_utilization"),
    R + "dtype": _m("rollout.dtype", convert=lambda raw: {"bf16": "bfloat16", "fp16": "float16"}.get(raw, raw)),
    R + "free_cache_engine": _m("rollout.free_cache_engine"),
    R + "enforce_eager": _m("rollout.enforce_eager"),
    **{R + key: _m(f"rollout.{key}", note="vLLM's engine setting") for key in (
        "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching", "max_model_len")},
    "algorithm.kl_penalty": _m("algorithm.kl_penalty", note="verl's kl is k1 here", convert=_kl_name),
    R + "mode": _m("rollout.mode", note="async: the actor's ranks serve as replicas behind a balancing manager; "
                                        "sync: each rank generates its static share"),
    R + "load_format": _note("no effect: the engine gets the policy's weights from the trainer before it first "
                             "generates"),
    R + "layered_summon": _note("no effect: a LoRA policy sends vLLM its adapter, gathered one tensor at a time, "
                                "and its base only when the engine holds none"),
    R + "calculate_log_probs": _note("always here: the rollout keeps the engine's log-probs of its samples "
                                     "(rollout_log_probs: bypass mode's old log-probs, rollout correction's "
                                     "behaviour policy)"),
    R + "top_k": _m("rollout.top_k"),
    R + "val_kwargs.do_sample": _m("rollout.val_kwargs.do_sample", note="validation generation"),
    R + "val_kwargs.temperature": _m("rollout.val_kwargs.temperature", note="validation generation"),
    R + "val_kwargs.top_p": _m("rollout.val_kwargs.top_p", note="validation generation"),
    R + "val_kwargs.top_k": _m("rollout.val_kwargs.top_k", note="validation generation"),
    R + "val_kwargs.n": _m("rollout.val_kwargs.n", note="validation generation"),
    # data
    "data.max_response_length": _m("rollout.response_length", note="max new tokens per response"),
    "data.val_files": _m("data.val_files", note="the validation set"),
    # critic (verl's critic.* keys of the same name are ours)
    "critic.optim.lr": _m("critic.lr"),
    "critic.strategy": _m("actor.strategy", note="one strategy for actor and critic here", convert=_strategy),
    # reward
    # reward_model.* keys of the same name are ours (enable, model.path, micro_batch_size_per_gpu, max_length,
    # truncation, use_dynamic_bsz, forward_max_token_len_per_gpu, reward_manager, reward_kwargs.overlong_buffer_cfg.*,
    # reward_kwargs.max_resp_len, enable_resource_pool, n_gpus_per_node, nnodes, use_reward_loop, rollout.name,
    # rollout.prompt_length, rollout.response_length (a served judge's; no effect on a classifier), max_concurrent,
    # timeout,
    # rollout.gpu_memory_utilization, rollout.tensor_model_parallel_size, model.use_remove_padding,
    # model.fsdp_config.param_offload); the rest:
    # verl's DAPO recipe (recipe.dapo.main_dapo) names the overlong buffer without reward_kwargs
    **{f"reward_model.overlong_buffer.{key}": _m(f"reward_model.reward_kwargs.overlong_buffer_cfg.{key}",
                                                 note="the DAPO recipe's name of reward_kwargs.overlong_buffer_cfg")
       for key in ("enable", "len", "penalty_factor", "log")},
    "reward_model.sandbox_fusion.url": _m("reward_model.sandbox_fusion.url",
                                          note="the coding data sources are scored by running them there"),
    "reward_model.sandbox_fusion.max_concurrent": _m("reward_model.sandbox_fusion.max_concurrent"),
    "reward_model.sandbox_fusion.memory_limit_mb": _m("reward_model.sandbox_fusion.memory_limit_mb"),
    "reward_model.strategy": Rule(note="the reward model is sharded as actor.strategy says (verl's fsdp and fsdp2 "
                                       "are both FSDP2 there)", refuse="only FSDP here",
                                  accepts=lambda raw: raw in ("fsdp", "fsdp2")),
    "reward_model.num_workers": _note("no effect: the reward worker runs on every rank of the training pool; a "
                                      "served judge's responses are scored reward_model.max_concurrent at a time"),
    "reward_model.model.input_tokenizer": _note("the policy's tokenizer is model.path's here; responses are "
                                                "re-templated when the reward model's tokenizer or chat template "
                                                "differs from it"),
    "reward_model.model.trust_remote_code": Rule(note="false: the model's own classes only",
                                                 refuse="no remote code is run here",
                                                 accepts=lambda raw: raw.lower() in ("false", "0")),
    "reward_model.launch_reward_fn_async": Rule(note="false: rewards are computed in the reward stage",
                                                refuse="no asynchronous reward function here",
                                                accepts=lambda raw: raw.lower() in ("false", "0")),
    "data.return_raw_chat": _note("no effect: the prompts' chat messages are kept for a reward model here"),
    "custom_reward_function.path": _m("custom_reward_function.path", note="a reward function from a file"),
    "custom_reward_function.name": _m("custom_reward_function.name", note="the function's name in that file"),
    # trainer
    "trainer.total_epochs": _m("trainer.total_epochs", note="iterations = epochs x floor(prompts / "
                               "data.train_batch_size), verl's rule"),
    "trainer.total_training_steps": _m("trainer.total_iterations", note="null (verl's default): the total comes "
                                       "from total_epochs", convert=_unless_null),
    "trainer.save_freq": _m("trainer.checkpoint_every", note="<= 0 (verl: never): a checkpoint at the run's "
                            "last iteration only (resume needs one)", convert=_save_freq),
    "trainer.n_gpus_per_node": _m("resources.gpus_per_node", "actor.world_size",
                                  note="actor.world_size = n_gpus_per_node x nnodes, as in verl"),
    "trainer.nnodes": _m("resources.nnodes", note="with n_gpus_per_node: actor.world_size = n_gpus_per_node x "
                         "nnodes"),
    "trainer.critic_warmup": _m("trainer.critic_warmup"),
    "trainer.test_freq": _m("trainer.test_freq", note="validation every K iterations"),
    "trainer.val_before_train": _m("trainer.val_before_train", note="validation before the first iteration"),
    "trainer.project_name": _m("trainer.project_name", note="names the MLflow experiment"),
    "trainer.experiment_name": _m("trainer.experiment_name", note="names the MLflow run"),
    "trainer.logger": _m("trainer.logger", convert=lambda raw: ",".join(sorted(_listed(raw), key=raw.find))),
    "trainer.default_local_dir": _note("checkpoints go to the run's store (rlhf run --store)"),
    "trainer.resume_mode": _note("resume is automatic here: a run id with committed iterations continues"),
    "trainer.balance_batch": _m("trainer.balance_batch", note="tokens balanced across the actor's ranks"),
    "trainer.device": _note("no effect: the device follows resources.gpus_per_node"),
    "trainer.val_only": Rule(note="false: the run trains", refuse="no validation-only runs here",
                             accepts=lambda raw: raw.strip().lower() in ("false", "0")),
    **{f"{role}.checkpoint.{what}_contents": Rule(
        note="every checkpoint holds the model, the optimizer and the extra state (an exact resume needs all "
             "three); hf_model is not written at save time: `rlhf export <checkpoint>` writes that folder from any "
             "checkpoint",
        refuse="checkpoints here always hold the model, the optimizer and the extra state (an exact resume needs "
               "all three); expected a list of model, optimizer, extra, hf_model",
        accepts=lambda raw: _listed(raw) <= CHECKPOINT_CONTENTS | {"hf_model"} and (
            CHECKPOINT_CONTENTS <= _listed(raw) | {"extra"} and "model" in _listed(raw) or _listed(raw) == {"hf_model"}))
       for role in ("actor_rollout_ref.actor", "critic") for what in ("save", "load")},
}


# ---------------------------------------------------------------- verl's full trainer config
# A YAML as verl's trainer writes it (ppo_trainer.yaml, every default in it) sets ~550 keys.
# Those for features this trainer does not have are taken at verl's default, which is
# what happens here (the feature off), and refused at any other value, naming the feature.


def _normal(raw: str) -> str:
    text = str(raw).strip().strip("'\"").lower()
    if text in ("null", "none", "~", ""):
        return "null"
    try:
        return repr(float(text))
    except ValueError:
        return text.replace(" ", "").replace("'", "").replace('"', "")


def _only(default: str, note: str, feature: str) -> Rule:
    """Taken at verl's ``default`` (``note``: why that is what happens here); any other value
    refused: ``feature`` names what it would ask for."""
    return Rule(note=f"{default} (verl's default): {note}", refuse=f"{feature} is not here: only {default} is taken",
                accepts=lambda raw, d=default: _normal(raw) == _normal(d))


def _inert(note: str) -> Rule:
    """A setting with no effect on what is computed here, at any value."""
    return Rule(note=f"no effect: {note}")


KERNEL = "a kernel or compile choice (the same values; log-probs and entropy are computed in token slices here)"
FEATURE_OFF = "the feature is off, as here"
FSDP_SECTIONS = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.model.fsdp_config",
                 "reward_model.model.fsdp_config")
VERL_DEFAULTS: dict[str, Rule] = {
    **{f"{section}.{key}": rule for section in FSDP_SECTIONS for key, rule in {
        "wrap_policy.min_num_params": _only("0", "each transformer layer is one FSDP unit", "size-based FSDP wrapping"),
        "offload_policy": _only("False", "param_offload / optimizer_offload say what is offloaded",
                                "FSDP2's CPUOffloadPolicy switch"),
        "forward_prefetch": _only("False", "no explicit forward prefetch", "FSDP forward prefetch"),
        "model_dtype": _only("fp32", "the trained weights are model.dtype (float32 by default)",
                             "another master-weight dtype (set model.dtype)"),
        "use_orig_params": _inert("an FSDP1 setting (FSDP2 here)"),
        "seed": _inert("every seed here derives from trainer.seed"),
        "full_determinism": _only("False", "no deterministic-algorithms mode", "torch's deterministic mode"),
        "ulysses_sequence_parallel_size": Rule(note=ULYSSES_NOTE, refuse="expected a positive integer",
                                               accepts=lambda raw: raw.strip().isdigit() and int(raw) >= 1),
        "entropy_from_logits_with_chunking": _inert(KERNEL),
        "use_torch_compile": _inert(KERNEL),
        "entropy_checkpointing": _inert(KERNEL),
        "forward_only": _inert("set by verl for its reference model; the reference here never trains"),
        "strategy": Rule(note="fsdp and fsdp2 are both FSDP2 here", refuse="only FSDP here",
                         accepts=lambda raw: raw in ("fsdp", "fsdp2")),
        "dtype": _only("bfloat16", "mixed precision computes in bfloat16 on GPUs here",
                       "another mixed-precision compute dtype"),
        "reshard_after_forward": _only("True", "parameters are resharded after each forward",
                                       "keeping gathered parameters between forward and backward"),
        "fsdp_size": _only("-1", "the role is sharded as actor.fsdp_config.fsdp_size says",
                           "a sharding group size of its own for this role"),
        "optimizer_offload": _inert("a frozen model has no optimizer state"),
    }.items() if f"{section}.{key}" not in TABLE and (key != "optimizer_offload" or "critic" not in section)},
    # optimizer
    **{f"{role}.optim.{key}": rule for role in ("actor_rollout_ref.actor", "critic") for key, rule in {
        "optimizer": _only("AdamW", "torch's AdamW", "another optimizer"),
        "optimizer_impl": _only("torch.optim", "torch's AdamW", "another optimizer implementation"),
        "betas": _only("[0.9, 0.999]", "AdamW's default betas", "other AdamW betas"),
        "clip_grad": _inert("verl's engine-worker name; the gradient clip is actor.grad_clip / critic.grad_clip"),
        "total_training_steps": _only("-1", "the schedule's total is trainer.total_iterations (verl fills it in "
                                            "the same way)", "a schedule length of its own"),
        "override_optimizer_config": _only("null", "AdamW as configured", "optimizer overrides"),
    }.items()},
    "critic.optim.weight_decay": _m("critic.weight_decay"),
    # actor / reference / critic sections verl fills from others
    **{f"{role}.rollout_n": _inert("the responses per prompt are rollout.n")
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")},
    **{key: _only("null", "micro-batches are set per GPU (..._per_gpu)", "verl's deprecated global micro-batch")
       for key in ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size",
                   "actor_rollout_ref.rollout.log_prob_micro_batch_size", "critic.ppo_micro_batch_size",
                   "critic.forward_micro_batch_size", "reward_model.micro_batch_size")},
    "actor_rollout_ref.actor.freeze_vision_tower": _inert("text models only here"),
    "actor_rollout_ref.actor.loss_scale_factor": _only("null", "the loss is aggregated as loss_agg_mode says",
                                                       "a fixed loss scale"),
    "actor_rollout_ref.actor.calculate_entropy": _inert("the entropy is computed where it is needed (the old_log_prob "
                                                        "stage, entropy_coeff) and always logged"),
    **{f"{role}.{key}": _inert(KERNEL) for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")
       for key in ("use_torch_compile", "entropy_from_logits_with_chunking", "use_fused_kernels")},
    "actor_rollout_ref.actor.sum_pi_squared_checkpointing": _inert(KERNEL),
    "actor_rollout_ref.actor.use_remove_padding": _m("model.use_remove_padding"),
    "actor_rollout_ref.actor.shuffle": _m("actor.shuffle"),
    "critic.shuffle": _m("critic.shuffle"),
    **{f"{role}.data_loader_seed": _inert("the mini-batch order is seeded by trainer.seed")
       for role in ("actor_rollout_ref.actor", "critic")},
    **{f"{role}.checkpoint.async_save": _only("False", "checkpoints are written while the next stages run, and "
                                              "committed before the iteration is", "verl's async checkpoint save")
       for role in ("actor_rollout_ref.actor", "critic")},
    # rollout
    "actor_rollout_ref.rollout.ignore_eos": _only("False", "a response ends at its EOS", "generation past EOS"),
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": _inert("a vLLM compile choice"),
    **{f"actor_rollout_ref.rollout.{key}": _only("1", "one engine per tensor-parallel group",
                                                 key.replace("_size", "").replace("_", " "))
       for key in ("data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size")},
    "actor_rollout_ref.rollout.logprobs_mode": _only("processed_logprobs", "the engine's log-probs are used only "
                                                     "where they are the sampling distribution's (with vLLM: "
                                                     "temperature 1, checked)", "another log-prob mode"),
    "actor_rollout_ref.rollout.scheduling_policy": _inert("vLLM's request order within one generation call"),
    "actor_rollout_ref.rollout.disable_log_stats": _inert("vLLM's own logging"),
    "actor_rollout_ref.rollout.do_sample": _only("True", "training responses are sampled",
                                                 "greedy training rollouts"),
    "actor_rollout_ref.rollout.over_sample_rate": _only("0", "every response is awaited", "over-sampling"),
    "actor_rollout_ref.rollout.multi_stage_wake_up": _inert("the engine's weights and KV cache wake together here"),
    "actor_rollout_ref.rollout.skip_rollout": _only("False", "every iteration generates (replay reuses a stage's "
                                                    "snapshot instead)", "verl's rollout dump reuse"),
    "actor_rollout_ref.rollout.skip_dump_dir": _inert("skip_rollout is off"),
    "actor_rollout_ref.rollout.skip_tokenizer_init": _inert("the engine is given token ids"),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": _only("False", FEATURE_OFF, "MoE routing replay"),
    "actor_rollout_ref.rollout.quantization": _only("null", "the engine serves the policy's own weights",
                                                    "rollout quantization"),
    "actor_rollout_ref.rollout.quantization_config_file": _only("null", "no quantization", "rollout quantization"),
    "actor_rollout_ref.rollout.mtp": _only("null", FEATURE_OFF, "multi-token prediction"),
    # model
    "actor_rollout_ref.model.hf_config_path": _only("null", "the config is model.path's", "a separate model config"),
    "actor_rollout_ref.model.tokenizer_path": _only("null", "the tokenizer is model.path's", "a separate tokenizer"),
    **{f"{section}.trust_remote_code": _only("False", "the model's own classes only", "remote code")
       for section in ("actor_rollout_ref.model", "critic.model", "data")},
    "actor_rollout_ref.model.custom_chat_template": _only("null", "the tokenizer's chat template", "a custom chat "
                                                          "template"),
    **{f"{section}.external_lib": _only("null", "no module is imported for the model", "external model libraries")
       for section in ("actor_rollout_ref.model", "critic.model", "reward_model.model")},
    **{f"{section}.enable_activation_offload": _only("False", FEATURE_OFF, "activation offload")
       for section in ("actor_rollout_ref.model", "critic.model")},
    "actor_rollout_ref.model.use_liger": _inert(KERNEL),
    "actor_rollout_ref.nccl_timeout": _inert("collectives use the process group's default timeout"),
    **{f"{section}.use_shm": _inert("model and adapter folders are read where they are")
       for section in ("critic.model", "reward_model.model", "data")},
    "reward_model.model.use_fused_kernels": _inert(KERNEL),
    # data
    "data.tokenizer": _only("null", "the tokenizer is model.path's", "a separate tokenizer"),
    **{f"data.{key}_max_samples": _only("-1", "every row of the file", "a row limit") for key in ("train", "val")},
    "data.val_batch_size": _inert("validation generates every prompt in one batch (verl: deprecated)"),
    "data.return_raw_input_ids": _inert("the prompts' token ids are kept"),
    "data.return_full_prompt": _inert("the decoded prompt is kept as raw_prompt"),
    "data.seed": _only("null", "the data order is seeded by trainer.seed", "a data seed apart from trainer.seed"),
    "data.dataloader_num_workers": _inert("prompts are read and tokenized once, up front"),
    **{f"data.{key}": _inert("text prompts only here") for key in ("image_patch_size", "image_key", "video_key",
                                                                     "return_multi_modal_inputs")},
    "data.validation_shuffle": _only("False", "validation prompts in file order", "shuffled validation"),
    "data.filter_overlong_prompts_workers": _inert("filtering runs in the controller"),
    "data.tool_config_path": _only("null", "no tools", "tool calling"),
    **{f"data.{section}.{key}": _only("null", "the built-in dataset and sampler", f"a custom {section}")
       for section, keys in (("custom_cls", ("path", "name")), ("sampler", ("class_path", "class_name")),
                             ("datagen", ("path", "name"))) for key in keys},
    # verl's newer reward-manager section (the same choice as reward_model.reward_manager)
    "reward_manager.source": _only("register", "the managers registered here", "reward managers from a module"),
    "reward_manager.name": _inert("reward_model.reward_manager names the manager"),
    "reward_manager.module.path": _only("null", "the managers registered here", "reward managers from a module"),
    "reward_manager.module.name": _inert("reward_manager.module.path is unset"),
    # critic
    "critic.forward_micro_batch_size_per_gpu": _m("critic.forward_micro_batch_size_per_gpu"),
    # reward model
    "reward_model.max_length": _m("reward_model.max_length", convert=lambda raw: "0" if _normal(raw) == "null" else raw),
    "reward_model.reward_loop_source": _only("register", "the reward loop here", "a reward loop from a module"),
    "reward_model.reward_loop_module_path": _only("null", "the reward loop here", "a reward loop from a module"),
    "reward_model.reward_loop_class_name": _only("null", "the reward loop here", "a reward loop from a module"),
    "reward_model.ulysses_sequence_parallel_size": Rule(note=ULYSSES_NOTE, refuse="expected a positive integer",
                                                        accepts=lambda raw: raw.strip().isdigit() and int(raw) >= 1),
    **{f"reward_model.rollout.{key}": _inert("an engine setting of verl's reward loop; the reward model's engine "
                                             "here follows reward_model.rollout.name and gpu_memory_utilization")
       for key in ("dtype", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine", "max_num_batched_tokens",
                   "max_model_len", "max_num_seqs", "load_format", "limit_images", "enable_chunked_prefill",
                   "enable_prefix_caching", "disable_log_stats", "skip_tokenizer_init")},
    **{f"reward_model.rollout.{key}": _only("1", "one engine per rank", key.replace("_size", "").replace("_", " "))
       for key in ("data_parallel_size", "expert_parallel_size")},
    # trainer
    "trainer.rollout_data_dir": _only("null", "every stage's batch is a snapshot in the store (rlhf audit reads "
                                      "them)", "verl's rollout dump"),
    "trainer.validation_data_dir": _only("null", "the validation batch is a snapshot in the store",
                                         "verl's validation dump"),
    "trainer.esi_redundant_time": _inert("checkpoints follow trainer.save_freq; a preempted run resumes from its "
                                         "last committed stage"),
    "trainer.resume_from_path": _only("null", "a run resumes from its own store", "resuming from another path"),
    "trainer.default_hdfs_dir": _only("null", "checkpoints are in the run's store", "HDFS checkpoint copies"),
    "trainer.del_local_ckpt_after_load": _inert("checkpoints are in the run's store"),
    **{f"trainer.max_{role}_ckpt_to_keep": _only("null", "every committed checkpoint is kept (`rlhf retention` "
                                                 "prunes a run's store)", "checkpoint rotation at save time")
       for role in ("actor", "critic")},
    "trainer.ray_wait_register_center_timeout": _inert("worker groups are placed by the controller here"),
    "transfer_queue.enable": _only("False", FEATURE_OFF, "verl's transfer queue"),
    "ray_kwargs.ray_init.num_cpus": _only("null", "Ray sizes the local head; a cluster's pool is resources.*",
                                          "a CPU count for ray.init"),
    "ray_kwargs.timeline_json_file": _only("null", FEATURE_OFF, "Ray timelines"),
    # switches of the feature groups below
    **{f"{role}.profiler.enable": _only("False", FEATURE_OFF, "profiling")
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic",
                    "reward_model")},
    **{f"{role}.profiler.tool": _only("null", FEATURE_OFF, "profiling")
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic",
                    "reward_model")},
    "global_profiler.tool": _only("null", FEATURE_OFF, "profiling"),
    "global_profiler.steps": _only("null", FEATURE_OFF, "profiling"),
    **{f"{section}.{key}": _only("False", FEATURE_OFF, "multi-token prediction")
       for section in ("actor_rollout_ref.model.mtp", "actor_rollout_ref.rollout.mtp")
       for key in ("enable", "enable_train", "enable_rollout")},
    **{f"{role}.router_replay.mode": _only("disabled", FEATURE_OFF, "MoE router replay")
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")},
    "actor_rollout_ref.rollout.prometheus.enable": _only("False", FEATURE_OFF, "the engine's Prometheus metrics"),
    "actor_rollout_ref.rollout.trace.backend": _only("null", FEATURE_OFF, "rollout tracing"),
    "actor_rollout_ref.rollout.checkpoint_engine.backend": _m("rollout.checkpoint_engine.backend"),
    "actor_rollout_ref.rollout.enable_sleep_mode": _m("rollout.free_cache_engine", note="vLLM's sleep mode: the "
                                                      "engine's memory freed while the actor trains"),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        _m("rollout.checkpoint_engine.update_weights_bucket_megabytes"),
    # newer verl's on-policy distillation (distillation.* of ours has its other keys under the same names)
    "distillation.distillation_loss.use_policy_loss": _m("distillation.distillation_loss.use_task_rewards",
                                                         note="verl's earlier name of use_task_rewards"),
    "distillation.distillation_loss.jsd_beta": _inert("the jsd loss_mode is not built here"),
    "distillation.num_workers": _inert(TEACHER_HERE),
    **{f"{section}.{key}": _inert(TEACHER_HERE) for section in ("distillation", "distillation.teacher_model")
       for key in ("n_gpus_per_node", "nnodes")},
    **{f"{section}.enable_resource_pool": _only("False", TEACHER_HERE, "a pool of its own for the teacher")
       for section in ("distillation", "distillation.teacher_model")},
    **{f"distillation.teacher_model.inference.{key}": _inert(TEACHER_HERE) for key in (
        "name", "dtype", "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine",
        "data_parallel_size", "expert_parallel_size", "tensor_model_parallel_size", "max_num_batched_tokens",
        "max_model_len", "max_num_seqs", "load_format", "limit_images", "enable_chunked_prefill",
        "enable_prefix_caching", "disable_log_stats", "skip_tokenizer_init", "prompt_length", "response_length",
        "temperature")},
    # Hydra's choice of a named config file (verl's recipes' own trainer YAMLs)
    "--config-path": Rule(note="config (verl's): where verl's own trainer YAMLs are; its defaults are ours",
                          refuse="verl's recipe config folders are not read here: give the file to `rlhf run --config "
                                 "FILE` (a verl YAML), or its keys as arguments",
                          accepts=lambda raw: raw.strip().strip("'\"") == "config"),
    "--config-name": Rule(note="ppo_trainer (verl's default trainer config): its defaults are ours",
                          refuse="verl's named config files are not read here: give the file to `rlhf run --config "
                                 "FILE` (a verl YAML), or its keys as arguments",
                          accepts=lambda raw: raw.strip().strip("'\"") in ("ppo_trainer", "ppo_trainer.yaml")),
    # verl's fully-async recipe (async_training.* of ours has its other keys under the same names)
    "async_training.checkpoint_engine.enable": _only("True", "the weights always go through the checkpoint engine "
                                                     "(rollout.checkpoint_engine)", "a per-tensor weight sync"),
    "async_training.checkpoint_engine.device_buffer_size_M": _m(
        "rollout.checkpoint_engine.update_weights_bucket_megabytes", note="the MiB of one broadcast bucket"),
    "async_training.checkpoint_engine.overlap_broadcast_and_consume": _only(
        "False", "a bucket is loaded before the next one is broadcast", "overlapping a broadcast with the load"),
    "async_training.use_trainer_do_validate": _only("False", "validation generates on the rollout replicas, the "
                                                    "rollout paused for it", "validating on the trainer's ranks"),
    "rollout.total_epochs": _m("trainer.total_epochs", note="the run's passes over the training set"),
    **{f"{section}.tiled_mlp.enabled": _only("False", FEATURE_OFF, "tiled MLP")
       for section in ("actor_rollout_ref.model", "critic.model")},
    "actor_rollout_ref.rollout.agent.default_agent_loop": _m("rollout.agent.default_agent_loop"),
    "actor_rollout_ref.rollout.agent.num_workers": _m("rollout.agent.num_workers"),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": _m("rollout.agent.agent_loop_config_path",
                                                                 convert=_empty_if_null),
    "actor_rollout_ref.rollout.agent.custom_async_server.path": _only("null", "the engines here", "a custom server"),
}
#: Groups of verl keys that only act when their feature's switch (in VERL_DEFAULTS) is on.
VERL_GROUPS: tuple[tuple[re.Pattern, Rule], ...] = (
    (re.compile(r"\.profiler\.|^global_profiler\."), _inert("no profiler runs (its switch is off)")),
    (re.compile(r"\.mtp\."), _inert("multi-token prediction is off")),
    (re.compile(r"\.router_replay\."), _inert("router replay is disabled")),
    (re.compile(r"\.rollout\.prometheus\."), _inert("the engine's Prometheus metrics are off")),
    (re.compile(r"\.rollout\.trace\."), _inert("rollout tracing is off")),
    (re.compile(r"\.rollout\.checkpoint_engine\."), _inert("the checkpoint engine's other settings are verl's "
                                                           "backends' own")),
    (re.compile(r"\.tiled_mlp\."), _inert("tiled MLP is off")),
    (re.compile(r"\.rollout\.agent\.custom_async_server\."), _inert("no custom server (its path is null)")),
    (re.compile(r"(^|\.)_target_$"), _inert("verl's dataclass for the section")),
)


def rule_of(path: str) -> Rule | None:
    """The rule for a verl key: its own row, or its feature group's."""
    rule = TABLE.get(path) or VERL_DEFAULTS.get(path)
    if rule is None:
        rule = next((group for pattern, group in VERL_GROUPS if pattern.search(path)), None)
    return rule


#: Keys whose value is computed from several verl keys together (``translate`` applies them last).
JOINT = ("trainer.n_gpus_per_node", "trainer.nnodes")


@dataclass
class Translation:
    """Our ``key=value`` overrides, the verl key each came from (``provenance``: our key ->
    the verl key), and one note per accepted verl key that does something other than set a
    field of the same meaning."""

    overrides: list[str] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def is_verl_key(path: str) -> bool:
    return path in TABLE or path in VERL_DEFAULTS or path.split(".", 1)[0] in VERL_ONLY_SECTIONS


def translate(items: list[str], ours: set[str], current: Callable[[str], object]) -> Translation:
    """``items`` (``key=value``) with every verl key replaced by ours. ``ours``: our
    dotted keys; ``current(key)``: our config's value (for keys verl computes from two:
    ``actor.world_size`` from ``n_gpus_per_node`` x ``nnodes``). Raises ``ValueError``
    naming a refused verl key and why."""
    out = Translation()
    joint: dict[str, str] = {}
    for item in items:
        if item.partition("=")[2].strip() == "???":  # OmegaConf's "required, not given"
            out.notes.append(f"{item.partition('=')[0].strip()}=???: not given in verl's file (a value it requires); "
                             f"the key keeps its value here")
            continue
        if not item.strip():  # a comment after a line continuation in a shell script
            out.notes.append("an empty argument is ignored (a shell script's line continuation broken by a comment "
                             "ends the command there: the lines after it are not arguments)")
            continue
        if "=" not in item:
            out.overrides.append(item)  # apply_overrides says what is wrong with it
            continue
        path, raw = item.split("=", 1)
        # Hydra's + (add a key) and ++ (add or override): our config's keys are fixed, so
        # the key is what counts (its value is refused where the key is not one)
        path = path.strip().lstrip("+")
        item = f"{path}={raw}"
        rule = rule_of(path) if path not in ours else TABLE.get(path)
        if rule is None and (path in ours or not is_verl_key(path)):
            out.overrides.append(item)
            continue
        if rule is None:
            raise ValueError(f"verl key {path!r}: no counterpart here (`rlhf config --verl` lists the verl keys "
                             f"this trainer takes)")
        if rule.refuse and (rule.accepts is None or not rule.accepts(raw)):
            raise ValueError(f"verl key {path!r}={raw}: {rule.refuse}")
        missing = [t for t in rule.targets if t not in ours]
        if missing:
            raise ValueError(f"verl key {path!r}: not supported yet ({rule.note or 'no field ' + missing[0]})")
        if path in JOINT:
            joint[path] = raw
            continue
        try:
            value = rule.convert(raw) if rule.targets else None
        except ValueError:
            raise ValueError(f"verl key {path!r}: expected a number; found {raw!r}") from None
        if value is None:
            out.notes.append(f"{path}={raw}: {rule.note}")
            continue
        for target in rule.targets:
            out.overrides.append(f"{target}={value}")
            if target != path:
                out.provenance[target] = path
        if rule.note and value != raw:
            out.notes.append(f"{path}={raw}: {rule.note}")
    if joint:
        _place(joint, current, out)
    return out


def _place(joint: dict[str, str], current, out: Translation) -> None:
    """verl's pool: ``n_gpus_per_node`` GPUs on each of ``nnodes`` nodes, one rank per GPU."""
    try:
        nnodes = int(joint.get("trainer.nnodes", current("resources.nnodes")))
        gpus = int(joint["trainer.n_gpus_per_node"]) if "trainer.n_gpus_per_node" in joint else None
    except ValueError:
        raise ValueError(f"verl keys trainer.n_gpus_per_node / trainer.nnodes: expected integers; found "
                         f"{joint}") from None
    if "trainer.nnodes" in joint:
        out.overrides.append(f"resources.nnodes={nnodes}")
        out.provenance["resources.nnodes"] = "trainer.nnodes"
    if gpus is not None:
        out.overrides += [f"resources.gpus_per_node={gpus}", f"actor.world_size={gpus * nnodes}"]
        out.provenance["resources.gpus_per_node"] = "trainer.n_gpus_per_node"
        out.provenance["actor.world_size"] = "trainer.n_gpus_per_node"


_INTERPOLATION = re.compile(r"^\$\{\s*(.*?)\s*\}$")
_EMBEDDED = re.compile(r"\$\{([^${}]*)\}")
#: the most values (mapping entries, list items, scalars) a config file may hold once YAML's
#: aliases and the interpolations are expanded: a file of a few hundred bytes can otherwise
#: name gigabytes (each alias doubling the one before)
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_TEXT = 1_000_000


def resolve_interpolations(data: dict) -> dict:
    """``data`` (a verl YAML as its trainer writes it) with each OmegaConf interpolation
    that is a whole value replaced by what it names: ``${a.b}`` (from the top),
    ``${.b}`` (beside it), ``${oc.select:a.b,default}`` (the default when ``a.b`` is
    absent). Other resolvers (``oc.env``, arithmetic) are refused: a file's values are data."""

    def lookup(path: str, section: tuple[str, ...]):
        """(the value at ``path``, its own path: what its interpolations are relative to)."""
        parts = (list(section) + path[1:].split(".")) if path.startswith(".") else path.split(".")
        node = data
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                raise KeyError(path)
            node = node[part]
        return node, tuple(parts)

    def resolve(value, section: tuple[str, ...], seen: tuple = ()):
        if isinstance(value, dict):
            return {k: resolve(v, section + (k,), seen) for k, v in value.items()}
        match = _INTERPOLATION.match(value) if isinstance(value, str) else None
        if match is None and isinstance(value, str) and _EMBEDDED.search(value):
            return embedded(value, section, seen)
        if match is None:
            return value
        expr = match.group(1)
        if expr in seen:
            raise ValueError(f"the interpolation ${{{expr}}} refers to itself")
        default, has_default = None, False
        if expr.startswith("oc.select:"):
            expr, _, rest = expr[len("oc.select:"):].partition(",")
            default, has_default = yaml_scalar(rest.strip()) if rest.strip() else None, bool(rest)
        elif ":" in expr:
            raise ValueError(f"the interpolation ${{{match.group(1)}}}: only ${{key}}, ${{.key}} and "
                             f"${{oc.select:key,default}} are resolved here")
        try:
            target, where = lookup(expr.strip(), section[:-1])
        except KeyError:
            if has_default:
                return default
            raise ValueError(f"the interpolation ${{{match.group(1)}}} names no key of the file") from None
        return resolve(target, where, seen + (match.group(1),))

    def embedded(text: str, section: tuple[str, ...], seen: tuple) -> str:
        """``proj-${trainer.experiment_name}``: each interpolation inside a string replaced
        by its value's text, as OmegaConf does (a value that is a mapping or list refused)."""
        def one(m: re.Match) -> str:
            got = resolve("${" + m.group(1) + "}", section, seen)
            if isinstance(got, (dict, list)):
                raise ValueError(f"the interpolation ${{{m.group(1)}}} inside {text!r}: expected a single value; "
                                 f"found a {type(got).__name__}")
            return "None" if got is None else str(got).lower() if isinstance(got, bool) else str(got)

        out = _EMBEDDED.sub(one, text)
        if len(out) > MAX_CONFIG_TEXT:
            raise ValueError(f"{text!r}: expected at most {MAX_CONFIG_TEXT} characters once interpolated; found "
                             f"{len(out)}")
        return out

    check_size(data)
    return resolve(data, ())


def check_size(data) -> None:
    """Refuse a file that expands (YAML aliases, nested references) past ``MAX_CONFIG_VALUES``
    values, counting with an early stop (never building what it names)."""
    count, stack = 0, [data]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ValueError(f"expected at most {MAX_CONFIG_VALUES} values once YAML's aliases are expanded; found "
                             f"more (a file whose aliases multiply its size?)")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def yaml_scalar(text: str):
    import yaml

    return yaml.safe_load(text)


def flatten(data: dict, prefix: str = "") -> list[str]:
    """A nested mapping (a YAML file, ours or verl's) as ``key.path=value`` strings; lists
    and null are written as JSON (``[...]``, ``null``)."""
    flat = []
    for key, value in data.items():
        if isinstance(value, dict):
            flat += flatten(value, f"{prefix}{key}.")
        elif isinstance(value, (list, type(None))):
            flat.append(f"{prefix}{key}={json.dumps(value)}")
        else:
            flat.append(f"{prefix}{key}={value}")
    return flat


def table_text(ours: set[str]) -> str:
    """The table as ``rlhf config --verl`` prints it: verl key, what it becomes, the note."""
    lines = [f"{'verl key':<58} {'here':<44} note"]
    for key, rule in {**TABLE, **{k: r for k, r in VERL_DEFAULTS.items() if k not in TABLE}}.items():
        if rule.refuse and rule.accepts is None:
            here = "refused"
            note = rule.refuse
        elif rule.targets and not all(t in ours for t in rule.targets):
            here, note = "(not yet)", rule.note
        else:
            here = ", ".join(rule.targets) or "accepted, no field"
            note = rule.note if not rule.refuse else f"{rule.note}{'; ' if rule.note else ''}other values: " \
                                                     f"{rule.refuse}"
        lines.append(f"{key:<58} {here:<44} {note}")
    lines += [f"{'(group) ' + pattern.pattern:<58} {'accepted, no field':<44} {rule.note}"
              for pattern, rule in VERL_GROUPS]
    lines.append("verl keys of the same name as ours (data.train_batch_size, algorithm.*, critic.ppo_*, ...) are "
                 "ours; any other verl key is refused")
    return "\n".join(lines)

