"""On-policy distillation (newer verl's ``distillation.*``): a teacher scores the policy's
own samples and the per-token reverse KL enters the advantages; the teacher is named by
content hash in every manifest, and its stage replays exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhf_core.algorithms.distillation import distillation_kl, distillation_metrics, distilled_advantages
from rlhf_core.config import ConfigError, RunConfig, apply_overrides

STUDENT = torch.tensor([[-1.0, -2.0, -3.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.1]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding


def test_the_per_token_kl_by_hand():
    assert distillation_kl(STUDENT, TEACHER, MASK, "k1").tolist() == [[0.5, -1.0, 0.0]]
    k3 = distillation_kl(STUDENT, TEACHER, MASK, "k3")[0].tolist()  # exp(t - s) - (t - s) - 1
    assert k3 == pytest.approx([math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0])
    assert distillation_kl(STUDENT, TEACHER, MASK, "k1", loss_max_clamp=0.2)[0].tolist() == pytest.approx([0.2, -0.2, 0])
    # both clamped from below first: student -2 -> -1.5, teacher -1.5 stays
    assert distillation_kl(STUDENT, TEACHER, MASK, "k1", log_prob_min_clamp=-1.5).tolist() == [[0.5, -0.5, 0.0]]


def test_the_advantages_with_and_without_the_task():
    kl = distillation_kl(STUDENT, TEACHER, MASK, "k1")
    task = torch.tensor([[2.0, 2.0, 2.0]])
    assert distilled_advantages(task, kl, MASK, use_task_rewards=True, coef=0.5).tolist() == [[1.75, 2.5, 0.0]]
    assert distilled_advantages(task, kl, MASK, use_task_rewards=False, coef=0.5).tolist() == [[-0.5, 1.0, 0.0]]
    assert distillation_metrics(kl, MASK) == {"distillation/loss": -0.25, "distillation/loss_min": -1.0,
                                              "distillation/loss_max": 0.5}


def test_the_top_k_forward_kl_by_hand():
    """sum_k p_T (log p_T - log p_S) over the teacher's top k, per token; clamped at 0 (over
    k tokens the sum can be negative), then at loss_max_clamp; log-probs clamped first."""
    from rlhf_core.algorithms.distillation import forward_kl_topk, topk_masses

    ln = math.log
    teacher = torch.tensor([[[ln(0.5), ln(0.25)], [ln(0.5), ln(0.25)], [ln(0.5), ln(0.25)]]])
    student = torch.tensor([[[ln(0.25), ln(0.25)], [ln(0.9), ln(0.09)], [ln(0.1), ln(0.1)]]])
    kl = forward_kl_topk(student, teacher, MASK)
    assert kl[0].tolist() == pytest.approx([0.5 * ln(2), 0.0, 0.0])  # 0.5 ln(5/9) + 0.25 ln(25/9) < 0 -> 0; padding
    assert forward_kl_topk(student, teacher, torch.ones(1, 3))[0, 2].item() == pytest.approx(
        0.5 * ln(5) + 0.25 * ln(2.5))
    assert forward_kl_topk(student, teacher, MASK, loss_max_clamp=0.1)[0].tolist() == pytest.approx([0.1, 0, 0])
    # clamped from below at ln(0.3) first: the first token's student 0.25 -> 0.3, teacher 0.25 -> 0.3
    clamped = forward_kl_topk(student, teacher, MASK, log_prob_min_clamp=ln(0.3))[0, 0].item()
    assert clamped == pytest.approx(0.5 * ln(0.5 / 0.3) + 0.3 * 0.0)
    masses = topk_masses(student, teacher, MASK)
    assert masses["distillation/teacher_mass"].item() == pytest.approx(0.75)
    assert masses["distillation/student_mass"].item() == pytest.approx((0.5 + 0.99) / 2)


def test_the_distillation_keys_are_checked():
    on = ["distillation.enabled=true", "distillation.teacher_model.model_path=/teacher"]
    apply_overrides(RunConfig(), on).validate()
    for overrides, message in [
        (on[:1], r"^distillation.teacher_model.model_path: expected the teacher's folder"),
        ([*on, "distillation.distillation_loss.use_policy_gradient=false"],
         r"^distillation.distillation_loss.use_policy_gradient: expected true with loss_mode=k3 "),
        ([*on, "distillation.distillation_loss.loss_mode=forward_kl_topk"],
         r"^distillation.distillation_loss.use_policy_gradient: expected false with loss_mode=forward_kl_topk "),
        ([*on, "distillation.distillation_loss.loss_mode=reverse_kl_topk"],
         r"^distillation.distillation_loss.loss_mode: expected a registered name"),
        ([*on, "distillation.distillation_loss.loss_max_clamp=0"], r"^distillation.distillation_loss.loss_max_clamp"),
    ]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(RunConfig(), overrides).validate()
    topk = apply_overrides(RunConfig(), [*on, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                         "distillation.distillation_loss.use_policy_gradient=false",
                                         "distillation.distillation_loss.topk=4"]).validate()
    assert topk.distillation.topk_width == 4 and apply_overrides(RunConfig(), on).validate().distillation.topk_width == 0
    with pytest.raises(ValueError, match=r"^verl key 'distillation.teacher_model.enable_resource_pool'=True"):
        apply_overrides(RunConfig(), ["distillation.teacher_model.enable_resource_pool=True"])


REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
"""


def _student_and_teacher(tmp_path):
    """A tiny student and a teacher from the same start, the teacher taught to answer 72 to
    every prompt, the student a little (it samples the answer now and then, and the
    teacher's log-probs say which tokens to keep); the task's reward zero. Returns (the
    teacher's folder, a store URI, the run's overrides without the teacher and loss)."""
    import pyarrow.parquet as pq

    from rlhf_core.testing.model_folders import build_model_folder, teach, write_verl_parquet

    data = write_verl_parquet(tmp_path / "train.parquet", count=16)
    chats = [row["prompt"] for row in pq.read_table(data).to_pylist()]
    student = teach(build_model_folder(tmp_path / "student", seed=0), chats, "72", steps=10)
    teacher = teach(build_model_folder(tmp_path / "teacher", seed=0), chats, "72", steps=60)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    common = [f"model.path={student}", f"data.train_files={data}",
              "data.max_prompt_length=64", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=8",
              "rollout.response_length=6", "actor.lr=1e-3", "trainer.progress=false",
              f"custom_reward_function.path={reward}", "custom_reward_function.name=score",
              f"trainer.output_dir={tmp_path / 'out'}", "distillation.enabled=true"]
    return teacher, f"file://{tmp_path / 'store'}", common


def test_a_student_moves_towards_its_teacher_and_the_record_names_the_teacher(tmp_path, ray_local):
    """A tiny student and a teacher taught to answer 72 (the student a little), the task's
    reward zero (distillation alone): the per-token KL of the student's samples falls over
    the run; each manifest names the teacher by content hash; the teacher's stage and the
    advantages replay exactly. A teacher with another vocabulary is refused in one line."""
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.trainer.replay import replay
    from rlhf_core.workers.modeling import content_sha256

    teacher, store, common = _student_and_teacher(tmp_path)
    common = [*common, "distillation.distillation_loss.loss_mode=k1"]
    assert main(["run", "--direct", "--iterations", "10", "--run-id", "opd", "--store", store, *common,
                 f"distillation.teacher_model.model_path={teacher}"]) == 0
    # the control: the same draws (the same seeds), the teacher's term weighted 0 (the task's zero advantages)
    assert main(["run", "--direct", "--iterations", "10", "--run-id", "control", "--store", store, *common,
                 f"distillation.teacher_model.model_path={teacher}", "distillation.distillation_loss.use_task_rewards=true",
                 "distillation.distillation_loss.distillation_loss_coef=0"]) == 0

    def kl_of(run):
        return [json.loads(line)["distillation/loss"]
                for line in (tmp_path / "out" / run / "metrics.jsonl").read_text().splitlines()]

    kl, control = kl_of("opd"), kl_of("control")
    assert kl[0] == control[0]  # the same first draws, before any update
    # towards the teacher: below where the run started, and below the control on the same seeds
    assert sum(kl[-4:]) < 0.8 * sum(kl[:4]) and sum(kl[4:]) < 0.9 * sum(control[4:]), (kl, control)
    istore = IterationStore(RunRef(store, "opd"))
    assert istore.read_manifest(9)["teacher"] == {"path": str(teacher), "sha256": content_sha256(str(teacher))}
    from rlhf_core.record.lineage import chain, format_lineage

    assert f"distilled from teacher {teacher} (sha256 {content_sha256(str(teacher))[:16]}...): iterations " \
           f"{','.join(map(str, range(10)))}" in format_lineage(chain(istore.run_uri))
    batch = istore.load(9, "advantage")
    assert torch.equal(batch.batch["advantages"], -distillation_kl(
        batch.batch["rollout_log_probs"], batch.batch["teacher_log_prob"], batch.batch["response_mask"].float(), "k1"))
    for r in replay(f"{store}/opd/iter-000009", stages=["teacher_log_prob", "advantage"], log=lambda *a: None,
                    trust_reward_function=True):
        assert r.ok and r.diffs and all(d.max_abs == 0 for d in r.diffs), (r.stage, [d for d in r.diffs if not d.equal])
    # a teacher whose folder changed since is refused for its stage, and for a run continued with it
    from types import SimpleNamespace

    from rlhf_core.config import ConfigError
    from rlhf_core.trainer.replay import ReplayError
    from rlhf_core.trainer.restore import check_models_unchanged

    digest = content_sha256(str(teacher))
    (teacher / "README.md").write_text("taught again")
    with pytest.raises(ReplayError, match=rf"^distillation.teacher_model.model_path: expected the teacher iteration 9 "
                                          rf"used \({teacher}, sha256 {digest[:16]}\.\.\.\); found {teacher} with "):
        replay(f"{store}/opd/iter-000009", stages=["teacher_log_prob"], log=lambda *a: None,
               trust_reward_function=True)
    now = {"path": str(teacher), "sha256": content_sha256(str(teacher))}
    with pytest.raises(ConfigError, match=r"^distillation.teacher_model.model_path: expected the teacher run opd was "
                                          r"taught by .* \(the folder's content changed"):
        check_models_unchanged(istore, SimpleNamespace(teacher_identity=lambda: now))
    (teacher / "README.md").unlink()
    check_models_unchanged(istore, SimpleNamespace(teacher_identity=lambda: {**now, "sha256": digest}))

    other = build_model_folder(tmp_path / "other", seed=1, tools=True)  # the tool-call tags are extra tokens
    with pytest.raises(SystemExit, match=r"distillation.teacher_model.model_path: expected the policy's tokenizer "
                                         r"\(the same 330 tokens\); found 334 tokens"):
        main(["run", "--direct", "--iterations", "1", "--run-id", "other", "--store", store, *common,
              f"distillation.teacher_model.model_path={other}"])


def test_the_top_k_forward_kl_pulls_a_student_to_its_teacher_and_replays(tmp_path, ray_local):
    """verl's forward_kl_topk as a supervised loss (use_policy_gradient=false), the task's
    reward zero: the teacher stage keeps its top-k log-probs and ids, the student's forward
    KL to them falls over the run and below a control that trains on the (zero) task
    alone with the same draws; the teacher stage and the update replay exactly."""
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.replay import replay

    teacher, store, common = _student_and_teacher(tmp_path)
    common = [*common, f"distillation.teacher_model.model_path={teacher}",
              "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8",
              "distillation.distillation_loss.use_policy_gradient=false"]
    assert main(["run", "--direct", "--iterations", "6", "--run-id", "topk", "--store", store, *common]) == 0
    assert main(["run", "--direct", "--iterations", "6", "--run-id", "control", "--store", store, *common,
                 "distillation.distillation_loss.use_task_rewards=true",
                 "distillation.distillation_loss.distillation_loss_coef=0"]) == 0

    def rows_of(run):
        return [json.loads(line) for line in (tmp_path / "out" / run / "metrics.jsonl").read_text().splitlines()]

    kl, control = ([r["actor/distillation/loss"] for r in rows_of(run)] for run in ("topk", "control"))
    assert kl[0] == control[0]  # the same first draws and weights: the first mini-batch's KL before its step
    assert sum(kl[-2:]) < 0.7 * sum(kl[:2]) and sum(kl[2:]) < 0.8 * sum(control[2:]), (kl, control)
    assert 0 < rows_of("topk")[-1]["actor/distillation/teacher_mass"] <= 1
    istore = IterationStore(RunRef(store, "topk"))
    taught = istore.load(5, "teacher_log_prob").batch
    assert taught["teacher_topk_ids"].shape == taught["teacher_topk_log_probs"].shape == (64, 6, 8)
    assert taught["teacher_topk_ids"].dtype == torch.long
    # the sampled token's log-prob is among the top k whenever the teacher ranks it there
    mask = taught["response_mask"].bool()
    hit = (taught["teacher_topk_ids"] == taught["responses"].unsqueeze(-1)) & mask.unsqueeze(-1)
    assert torch.allclose(taught["teacher_topk_log_probs"][hit], taught["teacher_log_prob"].unsqueeze(-1).expand(
        -1, -1, 8)[hit], atol=1e-6)
    assert "advantages" in istore.load(5, "advantage").batch.keys()
    for r in replay(f"{store}/topk/iter-000005", stages=["teacher_log_prob", "update_actor"], log=lambda *a: None,
                    trust_reward_function=True):
        assert r.ok and r.diffs, (r.stage, [d for d in r.diffs if not d.equal])
