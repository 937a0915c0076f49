"""TRL's GRPOTrainer on our built-in task, for benchmarks/learning.py (runs in .bench/trl).

    .bench/trl/bin/python benchmarks/trl_grpo.py MODEL_DIR OUT.jsonl BUDGET_S

Same model (the warm-started built-in model), same prompts, same reward function, and
the learning settings of our defaults read from ``RunConfig`` (learning rate, group size,
batch, optimizer steps per generation batch, clip range, lengths, KL term).
Writes one JSON line per optimizer step: wall-clock seconds since training started and
the mean reward of the completions that step trained on.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    model_dir, out_path, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_core.config import RunConfig
    from rlhf_core.data.builtin import make_rows, reward_score

    rows = make_rows(2048, seed=1)  # the prompts `rlhf run` uses (trainer.seed 0 -> seed + 1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # our loader prepends <bos>; give TRL the same token sequence through the text
    dataset = Dataset.from_list([{"prompt": "<bos>" + r["prompt"], "ground_truth": r["ground_truth"]}
                                 for r in rows])

    def reverse_digits_reward(prompts, completions, ground_truth, **_):
        return [reward_score("builtin/digits_reverse", c, g)["score"] for c, g in zip(completions, ground_truth)]

    log = open(out_path, "w")
    start = {"t": None}
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            start["t"] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                log.write(json.dumps({"step": state.global_step, "wall_clock_s": time.perf_counter() - start["t"],
                                      "reward": logs["reward"]}) + "\n")
                log.flush()

        def on_step_end(self, args, state, control, **kw):
            # same stopping rule as ours: budget spent, or mean of the last 5 rewards >= 0.95
            recent = rewards[-5:]
            if time.perf_counter() - start["t"] > budget or (len(recent) == 5 and sum(recent) / 5 >= 0.95):
                control.should_training_stop = True

    ours = RunConfig()  # the defaults `rlhf run` trains with: TRL gets the same settings
    actor, rollout = ours.actor, ours.rollout
    steps = ours.data.train_batch_size // actor.ppo_mini_batch_size  # optimizer steps per generation batch
    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"), use_cpu=True, report_to=[], seed=0,
        learning_rate=actor.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=actor.weight_decay,
        num_generations=rollout.n, per_device_train_batch_size=actor.ppo_mini_batch_size * rollout.n,
        steps_per_generation=steps, num_iterations=actor.ppo_epochs,
        max_completion_length=rollout.response_length, temperature=rollout.temperature, top_p=rollout.top_p,
        beta=actor.kl_loss_coef if actor.use_kl_loss else 0.0,
        epsilon=actor.clip_ratio_low, epsilon_high=actor.clip_ratio_high, loss_type="bnpo", scale_rewards="group",
        max_grad_norm=actor.grad_clip, num_train_epochs=100, logging_steps=1, save_strategy="no",
        dataloader_num_workers=0, bf16=False,
    )
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=config,
                          reward_funcs=[reverse_digits_reward], train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()


if __name__ == "__main__":
    main()
