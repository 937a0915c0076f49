"""verl's own example run scripts: each one's argument list, as the user's shell expands
it, is taken by ``rlhf config`` (recorded from verl's examples/ by
``scripts/verl_examples.py``; see docs/verl-examples.md for the notes each prints)."""

import json
import math
from pathlib import Path

import pytest

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.verl_examples import examples_text

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads((ROOT / "tests" / "data" / "verl_examples.json").read_text())
SCRIPTS = RECORDED["scripts"]


def test_the_recorded_set_is_verls_fsdp_vllm_text_scripts():
    assert len(SCRIPTS) == 40, sorted(SCRIPTS)
    assert all(path.startswith("examples/") and path.endswith(".sh") for path in SCRIPTS)
    assert all(len(args) >= 4 and args[0] for args in SCRIPTS.values())


@pytest.mark.parametrize("path", sorted(SCRIPTS))
def test_each_example_script_is_taken_whole(path):
    notes: list[str] = []
    cfg = apply_overrides(RunConfig(), SCRIPTS[path], notes=notes).validate()
    keys = {arg.split("=", 1)[0].lstrip("+") for arg in SCRIPTS[path] if "=" in arg}
    assert cfg.to_dict() != RunConfig().to_dict()
    # every note names a key the script set, or the empty argument it passed
    assert all(note.split("=", 1)[0] in keys or note.startswith("an empty argument") for note in notes), notes


FULLY_ASYNC = RECORDED["fully_async_scripts"]
#: verl's fully-async scripts refused in one line, and why (everything else is taken whole)
FULLY_ASYNC_REFUSED = {
    "dapo_30b_a3b_base_math_fsdp.sh": r"^verl key '--config-name'=fully_async_dapo_trainer.yaml: verl's named config ",
    "dapo_7b_async_retool.sh": r"^verl key 'data.custom_cls.path'=recipe/retool/retool.py: a custom custom_cls",
    "dapo_7b_math_fsdp2_64_64.sh": r"^async_training.partial_rollout: expected false",
    "dapo_7b_math_fsdp2_64_64_mis.sh": r"^async_training.partial_rollout: expected false",
}


def test_the_recorded_fully_async_scripts_are_verls_fsdp_ones():
    assert len(FULLY_ASYNC) == 9 and all("/fully_async_policy/shell/" in path for path in FULLY_ASYNC)
    assert set(FULLY_ASYNC_REFUSED) <= {path.rsplit("/", 1)[1] for path in FULLY_ASYNC}


@pytest.mark.parametrize("path", sorted(FULLY_ASYNC))
def test_each_fully_async_script_is_taken_whole_with_the_entry_point_changed(path):
    """``python -m verl.experimental.fully_async_policy.fully_async_main ARGS`` becomes
    ``rlhf run async_training.enable=true ARGS``: verl's counting (train_batch_size=0, totals
    in prompts, validation per sync) resolved, or one line naming what is not here."""
    from rlhf_core.config import ConfigError

    refused = FULLY_ASYNC_REFUSED.get(path.rsplit("/", 1)[1])
    if refused:
        with pytest.raises(ConfigError, match=refused):
            apply_overrides(RunConfig(), ["async_training.enable=true", *FULLY_ASYNC[path]], notes=[]).validate()
        return
    args = dict(arg.lstrip("+").split("=", 1) for arg in FULLY_ASYNC[path] if "=" in arg)
    cfg = apply_overrides(RunConfig(), ["async_training.enable=true", *FULLY_ASYNC[path]], notes=[]).validate()
    step = int(args["async_training.require_batches"]) * int(args["actor_rollout_ref.actor.ppo_mini_batch_size"])
    assert args["data.train_batch_size"] == "0" and cfg.data.train_batch_size == step
    assert cfg.trainer.total_iterations == int(args["rollout.total_rollout_steps"]) // step
    if "rollout.test_freq" in args:  # else the script's trainer.test_freq stands
        assert cfg.trainer.test_freq == \
            int(args["rollout.test_freq"]) * int(args["async_training.trigger_parameter_sync_step"])
    assert cfg.rollout.checkpoint_engine.backend == "nccl" and cfg.old_log_prob_column == "rollout_log_probs"


def test_docs_list_what_rlhf_config_says_of_each():
    doc = (ROOT / "docs" / "verl-examples.md").read_text()
    listing = doc.split("```text\n", 1)[1].split("\n```", 1)[0]
    assert listing == examples_text(SCRIPTS, RECORDED["verl_commit"]), \
        "docs/verl-examples.md is stale: python scripts/verl_examples.py --doc-only"


# ------------------------------------------------------------------ scaled-down runs of three scripts

REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    # varied within a group: credit for an even number of characters
    return float(len(solution_str) % 2 == 0)
"""


def scaled(path: str, tmp_path, changes: dict[str, str], extra: list[str] = (), scripts: dict = SCRIPTS) -> list[str]:
    """A recorded script's arguments with its model, data and sizes scaled to a tiny model
    on CPU: ``changes`` replace values of keys it sets (a key it does not set is an error),
    the GPU counts are left out (CPU ranks here), ``extra`` is appended."""
    from rlhf_core.testing.model_folders import build_model_folder, write_verl_parquet

    model = build_model_folder(tmp_path / "model")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    common = {"data.train_files": str(write_verl_parquet(tmp_path / "train.parquet", count=8)),
              "data.val_files": str(write_verl_parquet(tmp_path / "test.parquet", count=2)),
              "actor_rollout_ref.model.path": str(model), "actor_rollout_ref.rollout.name": "hf",
              "data.max_prompt_length": "64", "data.max_response_length": "6", "data.train_batch_size": "4",
              "actor_rollout_ref.actor.ppo_mini_batch_size": "2", "actor_rollout_ref.rollout.n": "4"}
    changes = {**common, **changes}
    args, seen = [], set()
    for arg in scripts[path]:
        key = arg.split("=", 1)[0].lstrip("+")
        if key in ("trainer.n_gpus_per_node", "trainer.nnodes"):
            continue
        seen.add(key)
        args.append(f"{key}={changes[key]}" if key in changes else arg)
    assert set(changes) <= seen, sorted(set(changes) - seen)
    return args + [f"custom_reward_function.path={reward}", "custom_reward_function.name=score", *extra]


def run_scaled(args: list[str], tmp_path, iterations: int | None = None) -> list[dict]:
    from rlhf_core.cli import main

    out = tmp_path / "out"
    some = ["--more", str(iterations)] if iterations else []
    assert main(["run", "--direct", *some, "--run-id", "verl", "--store", f"file://{tmp_path / 'store'}", *args,
                 f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    return [json.loads(line) for line in (out / "verl" / "metrics.jsonl").read_text().splitlines()]


def test_verls_gspo_script_scaled_down_runs(tmp_path, ray_local):
    """examples/gspo_trainer/test_gspo_3b_math.sh: GSPO's sequence-level ratio with its tiny
    clip range, dynamic batch sizes, the dapo reward manager, a 5% warmup of
    total_training_steps (verl's ratio: ceil-free int(0.05 x 20) = 1 step). Two of the 20
    iterations run (--more 2: the schedule still spans 20)."""
    args = scaled("examples/gspo_trainer/test_gspo_3b_math.sh", tmp_path, {
        "trainer.total_training_steps": "20", "reward_model.reward_kwargs.overlong_buffer_cfg.len": "2",
        "reward_model.reward_kwargs.max_resp_len": "6", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4"})
    rows = run_scaled(args, tmp_path, iterations=2)
    assert len(rows) == 2 and all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    # verl's constant schedule with a warmup of 1 step: step 0 at 0 / 1, then the full rate
    assert [r["actor/lr"] for r in rows] == pytest.approx([0.0, 1e-6])
    # at rate 0 the first mini-batch's update leaves the weights: the second sees no change
    # of policy; at 1e-6 it does (GSPO's sequence-level ratio moves)
    assert abs(rows[0]["actor/ppo_kl"]) < 1e-7 < abs(rows[1]["actor/ppo_kl"])


def test_verls_dapo_script_scaled_down_runs(tmp_path, ray_local):
    """examples/gmpo_trainer/test_dapo_7b_math.sh: GMPO's geometric-mean loss, the dapo
    manager with an overlong buffer, left truncation, Ulysses (noted), a longer position
    limit for the model."""
    args = scaled("examples/gmpo_trainer/test_dapo_7b_math.sh", tmp_path, {
        "reward_model.reward_kwargs.overlong_buffer_cfg.len": "2", "reward_model.reward_kwargs.max_resp_len": "6",
        "actor_rollout_ref.model.override_config.max_position_embeddings": "4096",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": "1", "actor_rollout_ref.actor.fsdp_config.fsdp_size": "1",
        "trainer.total_training_steps": "2"})
    rows = run_scaled(args, tmp_path)
    assert len(rows) == 2 and all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    assert all("critic/reward_extra/acc/mean" in r for r in rows)  # the dapo manager's acc of a float reward
    # the overlong buffer: with every response at max_resp_len 6, 2 tokens past the buffer's
    # start (6 - 2), each score is its accuracy less the full penalty, 2 / 2 x 1.0
    full = [r for r in rows if r["response_length/clip_ratio"] == 1.0]
    assert full, [r["response_length/clip_ratio"] for r in rows]
    assert all(r["critic/score/mean"] == pytest.approx(r["critic/reward_extra/acc/mean"] - 1.0) for r in full)


def test_verls_fully_async_dapo_script_scaled_down_runs(tmp_path, ray_local):
    """verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh with the entry
    point changed: a step of require_batches x ppo_mini_batch_size prompts (its
    train_batch_size=0), 3 steps from total_rollout_steps, the dapo manager, a sync every 2
    steps with staleness 0.1 (no step beyond a sync: partial_rollout has no effect), the
    rollout's log-probs as the old ones. The second step of each sync window was generated
    on the weights before the first's update."""
    args = scaled("verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh", tmp_path, {
        "data.train_batch_size": "0", "data.gen_batch_size": "1", "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
        "async_training.require_batches": "2", "rollout.total_rollout_steps": "12",
        "async_training.trigger_parameter_sync_step": "2", "rollout.n_gpus_per_node": "1",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len": "2", "reward_model.reward_kwargs.max_resp_len": "6",
        "actor_rollout_ref.model.override_config.max_position_embeddings": "4096",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size": "1", "actor_rollout_ref.rollout.top_k": "0",
        "actor_rollout_ref.rollout.val_kwargs.top_k": "0"},
        extra=["async_training.enable=true", "trainer.cpus_per_worker=1"], scripts=FULLY_ASYNC)
    rows = run_scaled(args, tmp_path)
    assert len(rows) == 12 // 4 and all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    assert [r["fully_async/staleness/max"] for r in rows] == [0.0, 1.0, 0.0]
    assert [r["fully_async/weight_synced"] for r in rows] == [0.0, 1.0, 0.0]
    assert all("critic/reward_extra/acc/mean" in r for r in rows)  # the dapo manager


def test_a_script_with_a_cosine_warmup_follows_verls_schedule(tmp_path, ray_local):
    """The GSPO script with verl's cosine schedule asked for: a warmup of 20% of its 10
    training steps (2, from 0), then a cosine down to min_lr_ratio; each iteration's update
    runs at verl's get_cosine_schedule_with_warmup of its step (once per iteration, as
    verl steps the scheduler), whatever the number of mini-batches."""
    args = scaled("examples/gspo_trainer/test_gspo_3b_math.sh", tmp_path, {
        "trainer.total_training_steps": "10", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "0.2",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len": "2", "reward_model.reward_kwargs.max_resp_len": "6",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4"},
        extra=["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
               "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"])
    rows = run_scaled(args, tmp_path, iterations=4)

    def verl_cosine(step, warmup=2, total=10, min_ratio=0.1, cycles=0.5):  # verl's lr_lambda, init_lr_ratio 0
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(min_ratio, math.cos(math.pi * cycles * 2 * progress) * (1 - min_ratio) * 0.5 + (1 + min_ratio) * 0.5)

    assert [r["actor/lr"] for r in rows] == pytest.approx([1e-6 * verl_cosine(s) for s in range(4)])
    assert rows[3]["actor/lr"] == pytest.approx(1e-6 * (0.45 * math.cos(math.pi / 8) + 0.55))


# ------------------------------------------------------------------ verl's whole trainer YAML

def verl_trainer_yaml(tmp_path, **changes) -> Path:
    """verl's trainer config with every default (recorded flattened, interpolations as
    written), nested again and written as the YAML its trainer writes; ``changes``: values
    replaced (dotted keys with __ for dots)."""
    import yaml

    nested: dict = {}
    replaced = {key.replace("__", "."): value for key, value in changes.items()}
    for item in RECORDED["ppo_trainer_yaml"]:
        key, raw = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = replaced.pop(key) if key in replaced else yaml.safe_load(raw)
    assert not replaced, replaced
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(yaml.safe_dump(nested, sort_keys=False))
    return path


def test_verls_whole_trainer_yaml_is_taken_with_verls_meaning(tmp_path):
    from rlhf_core.config import load_config

    notes: list[str] = []
    cfg, provenance = load_config(str(verl_trainer_yaml(
        tmp_path, actor_rollout_ref__actor__ppo_max_token_len_per_gpu=1000, critic__ppo_max_token_len_per_gpu=2000)),
        [], notes=notes)
    assert len(RECORDED["ppo_trainer_yaml"]) > 500
    # verl's defaults where they differ from ours, each with verl's meaning
    assert cfg.actor.clip_ratio_high == 0.2 and cfg.algorithm.rollout_correction.bypass_mode is False
    assert cfg.actor.shuffle is False and cfg.critic.weight_decay == 0.01
    # its interpolations: ${oc.select:...}, ${.key} beside it, and one through another
    assert cfg.actor.log_prob_max_token_len_per_gpu == 1000  # ref's and rollout's: ${oc.select:actor...}
    assert cfg.critic.forward_max_token_len_per_gpu == 2000 == cfg.reward_model.forward_max_token_len_per_gpu
    assert provenance["actor.clip_ratio_high"].endswith("verl:actor_rollout_ref.actor.clip_ratio_high")
    assert any(note.startswith("actor_rollout_ref.actor.profiler.enable=False") for note in notes)
    # an override of a key the file interpolates reaches the keys that name it, as Hydra resolves
    cfg, _ = load_config(str(verl_trainer_yaml(tmp_path)), ["actor_rollout_ref.actor.ppo_mini_batch_size=8"],
                         notes=[])
    assert cfg.actor.ppo_mini_batch_size == 8 == cfg.critic.ppo_mini_batch_size
    # a value YAML cannot read, or reads as a mapping, is the text it is
    cfg, _ = load_config(str(verl_trainer_yaml(tmp_path)), ["trainer.experiment_name=@run",
                                                            "trainer.project_name=a: b"], notes=[])
    assert (cfg.trainer.experiment_name, cfg.trainer.project_name) == ("@run", "a: b")
    assert any("rollout.name=???" in note for note in notes)


@pytest.mark.parametrize("changes, message", [
    ({"actor_rollout_ref__actor__profiler__enable": True}, "'actor_rollout_ref.actor.profiler.enable'=True: "
                                                           "profiling is not here: only False is taken"),
    ({"actor_rollout_ref__rollout__quantization": "fp8"}, "rollout quantization is not here"),
    ({"actor_rollout_ref__actor__optim__optimizer": "SGD"}, "another optimizer is not here: only AdamW is taken"),
    ({"data__seed": "${oc.env:SEED}"}, "only ${key}, ${.key} and ${oc.select:key,default} are resolved here"),
])
def test_a_verl_yaml_asking_for_a_feature_not_here_is_refused_in_one_line(tmp_path, changes, message):
    from rlhf_core.config import ConfigError, load_config

    with pytest.raises(ConfigError) as refused:
        load_config(str(verl_trainer_yaml(tmp_path, **changes)), [], notes=[])
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_verls_whole_trainer_yaml_runs_scaled_down(tmp_path, ray_local):
    """`rlhf run --config` of verl's whole trainer YAML (PPO with a critic: verl's default
    estimator is gae) with the model, data, sizes and GPU counts overridden on the command
    line, as a user moving a verl run to a CPU machine would."""
    from rlhf_core.testing.model_folders import build_model_folder, write_verl_parquet

    model = build_model_folder(tmp_path / "model")
    data = write_verl_parquet(tmp_path / "train.parquet", count=8)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    overrides = [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}", f"data.train_files={data}",
                 "data.val_files=", "data.max_prompt_length=64", "data.max_response_length=6",
                 "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                 "resources.gpus_per_node=0", "actor.world_size=1",
                 "reward_model.n_gpus_per_node=0", f"custom_reward_function.path={reward}",
                 "custom_reward_function.name=score"]
    from rlhf_core.cli import main

    out = tmp_path / "out"
    assert main(["run", "--direct", "--more", "2", "--run-id", "verl", "--store", f"file://{tmp_path / 'store'}",
                 "--config", str(verl_trainer_yaml(tmp_path)), *overrides, f"trainer.output_dir={out}",
                 "trainer.progress=false"]) == 0
    rows = [json.loads(line) for line in (out / "verl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["critic/vf_loss"]) and math.isfinite(r["actor/pg_loss"])
                                  for r in rows)
    # verl's default estimator is GAE: the critic is trained (a loss, a gradient) and the
    # actor's update moves it too
    assert all(r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0 and r["actor/grad_norm"] > 0 for r in rows)
