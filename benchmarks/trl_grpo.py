"""TRL's GRPOTrainer on our built-in task, for benchmarks/learning.py (runs in .bench/trl).

    .bench/trl/bin/python benchmarks/trl_grpo.py MODEL_DIR OUT.jsonl BUDGET_S SEED

Same model (the warm-started built-in model of that seed), same prompts (the ones
`rlhf run trainer.seed=SEED` draws), same reward function, and the learning settings of
our defaults read from ``RunConfig`` (learning rate, group size, batch, optimizer steps
per generation batch, clip range, lengths, KL and entropy terms).

Writes one JSON line per generation round (our iteration), stamped when the round's last
optimizer step ends: the round, wall-clock seconds since training started, the mean
reward of the round's completions. TRL 1.16 logs that reward once per round (it is
recorded when the round generates and the metrics are cleared at every log, so only the
round's first optimizer step carries it); if that cadence changes, this script stops
with an error instead of writing rows that count something else.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CadenceError(RuntimeError):
    """TRL logged the reward at another cadence than once per generation round."""


def main() -> None:
    model_dir, out_path, budget, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_core.config import RunConfig
    from rlhf_core.data.builtin import make_rows, reward_score

    rows = make_rows(2048, seed=seed + 1)  # the prompts `rlhf run trainer.seed=SEED` uses
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # our loader prepends <bos>; give TRL the same token sequence through the text
    dataset = Dataset.from_list([{"prompt": "<bos>" + r["prompt"], "ground_truth": r["ground_truth"]}
                                 for r in rows])

    def reverse_digits_reward(prompts, completions, ground_truth, **_):
        return [reward_score("builtin/digits_reverse", c, g)["score"] for c, g in zip(completions, ground_truth)]

    ours = RunConfig()  # the defaults `rlhf run` trains with: TRL gets the same settings
    actor, rollout = ours.actor, ours.rollout
    steps = ours.data.train_batch_size // actor.ppo_mini_batch_size * actor.ppo_epochs  # optimizer steps per round
    log = open(out_path, "w")
    start = {"t": None}
    pending: dict[int, float] = {}   # round -> its reward, logged at the round's first step
    rewards: list[float] = []

    ended: dict[int, float] = {}     # round -> wall-clock when its last optimizer step ended

    def emit(control) -> None:
        """Write every round that has ended and has its reward (TRL calls on_step_end before
        on_log, so with one step per round the reward arrives just after the round ends)."""
        for round_ in sorted(set(ended) & set(pending)):
            rewards.append(pending.pop(round_))
            log.write(json.dumps({"round": round_, "step": (round_ + 1) * steps, "wall_clock_s": ended.pop(round_),
                                  "reward": rewards[-1]}) + "\n")
            log.flush()
            # same stopping rule as ours: budget spent, or mean of the last 5 rounds >= 0.95
            recent = rewards[-5:]
            if time.perf_counter() - start["t"] > budget or (len(recent) == 5 and sum(recent) / 5 >= 0.95):
                control.should_training_stop = True

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            start["t"] = time.perf_counter()
            # the machine-wide clock learning.py reads CPU-seconds against
            Path(out_path).with_name("started.json").write_text(json.dumps({"monotonic": time.monotonic()}))

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % steps == 0:
                round_ = state.global_step // steps - 1
                if round_ - 1 in ended:
                    raise CadenceError(f"round {round_ - 1} ended without a logged reward")
                ended[round_] = time.perf_counter() - start["t"]
                emit(control)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                step = state.global_step
                round_ = (step - 1) // steps
                if (step - 1) % steps != 0 or round_ in pending:
                    raise CadenceError(f"TRL logged a reward at optimizer step {step}; expected exactly one per "
                                       f"round of {steps} steps, at its first step (1, {1 + steps}, ...): "
                                       "the row count would no longer be the round count")
                pending[round_] = float(logs["reward"])
                emit(control)

    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"), use_cpu=True, report_to=[], seed=seed,
        learning_rate=actor.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=actor.weight_decay,
        num_generations=rollout.n, per_device_train_batch_size=actor.ppo_mini_batch_size * rollout.n,
        steps_per_generation=ours.data.train_batch_size // actor.ppo_mini_batch_size, num_iterations=actor.ppo_epochs,
        max_completion_length=rollout.response_length, temperature=rollout.temperature, top_p=rollout.top_p,
        beta=actor.kl_loss_coef if actor.use_kl_loss else 0.0, entropy_coef=actor.entropy_coeff,
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
