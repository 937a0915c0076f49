"""Agent loops (rlhf_core/agent/): hermes tool calls, the tool agent against a stand-in
rollout that answers scripted text, the loss over generated tokens only, the record and
its replay without tools, verl's tool configs, and the local code sandbox."""

import asyncio
import json
import os
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.agent import sandbox
from rlhf_core.agent.batch import batch_of, rows_of
from rlhf_core.agent.loops.tool_agent import ToolAgentLoop
from rlhf_core.agent.registry import BUILT_IN, loop_modules
from rlhf_core.agent.runner import AgentContext, AgentRow, ReplayMismatch, run_trajectories
from rlhf_core.agent.tool_calls import parse_hermes
from rlhf_core.agent.tool_config import ToolConfigError, build_tools, load_tool_config
from rlhf_core.agent.tools.base import BaseTool, ToolResponse
from rlhf_core.config import MultiTurnConfig
from rlhf_core.rollout.engine import Completion

CALC = {"type": "function", "function": {"name": "calc", "description": "arithmetic", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlhf_core.testing.model_folders import build_model_folder

    return AutoTokenizer.from_pretrained(build_model_folder(tmp_path_factory.mktemp("tool-model"), tools=True))


def test_hermes_calls_are_parsed_and_malformed_ones_carry_their_error():
    calls = parse_hermes('think <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call> and '
                         '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
                         '<tool_call>{not json}</tool_call><tool_call>["calc"]</tool_call>'
                         '<tool_call>{"name": "calc", "arguments": 3}</tool_call>')
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calc", {"expression": "2*3"}, True), ("calc", {"expression": "1"}, True)]
    assert "not JSON" in calls[2].error and "name" in calls[3].error and "JSON object" in calls[4].error
    assert parse_hermes("no calls here") == []


class Calculator(BaseTool):
    calls = 0

    async def execute(self, instance_id, parameters, **kwargs):
        type(self).calls += 1
        from rlhf_core.agent.tools.calculator import evaluate

        return ToolResponse(text=str(evaluate(parameters["expression"]))), 0.5, {}


class Hang(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.Event().wait()


class Scripted:
    """A stand-in rollout: the text each (row, turn) answers, tokenized; log-prob -0.5 per
    token; every request of a round recorded."""

    def __init__(self, tokenizer, script: dict) -> None:
        self.tokenizer, self.script, self.rounds = tokenizer, script, []

    def __call__(self, requests):
        self.rounds.append([r.request_id for r in requests])
        out = []
        for r in requests:
            row, turn = r.request_id.split("-t")
            tokens = self.tokenizer.encode(self.script[(int(row), int(turn))], add_special_tokens=False)
            tokens = (tokens + [self.tokenizer.eos_token_id])[:r.max_tokens]
            out.append(Completion(r.request_id, tokens, [-0.5] * len(tokens)))
        return out, [3] * len(out)


def _ctx(tokenizer, tools, response_length=800, **settings):
    multi = MultiTurnConfig(enable=True, **{"max_parallel_calls": 2, **settings})
    return AgentContext(tokenizer, multi, response_length, tools, eos_ids=(tokenizer.eos_token_id,),
                        tool_timeout_s=1.0)


def _row(i, seed=11, recorded=None):
    return AgentRow(i, [], [{"role": "user", "content": f"q{i}"}], seed, "tool_agent", {}, recorded)


def _call(expression, name="calc"):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


SCRIPT = {(0, 0): "Let me compute " + _call("12*34") + _call("2+2") + _call("9-1"),  # a third call: skipped
          (0, 1): "so 408 " + _call("1/0"),
          (0, 2): "#### 408",
          (1, 0): "#### 7",                                                          # no tool at all
          (2, 0): _call("1", name="nope") + '<tool_call>{"bad json</tool_call>' ,   # unknown tool, bad JSON
          (2, 1): _call("1", name="slow"),
          (2, 2): "done"}


def test_the_tool_agent_runs_calls_side_by_side_and_keeps_tool_tokens_out_of_the_loss(tokenizer):
    Calculator.calls = 0
    tools = {"calc": Calculator({}, CALC), "slow": Hang({}, {**CALC, "function": {**CALC["function"], "name": "slow"}})}
    ctx = _ctx(tokenizer, tools)
    engine = Scripted(tokenizer, SCRIPT)
    loops = {"tool_agent": ToolAgentLoop()}
    trajectories, stats = run_trajectories([_row(0), _row(1), _row(2)], loops, ctx, engine)
    first, plain, broken = trajectories
    # turns waiting together went as one call, in row order; rows leave as they finish
    assert engine.rounds == [["0-t0", "1-t0", "2-t0"], ["0-t1", "2-t1"], ["0-t2", "2-t2"]]
    assert [t["role"] for t in first.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    answers = [c["answer"] for c in first.tool_calls]
    assert answers[:2] == ["408", "4"] and first.tool_calls[2]["status"] == "skipped"
    assert first.tool_calls[3]["status"] == "error" and "Error when executing tool: division by zero" in answers[3]
    assert Calculator.calls == 3 and first.tool_rewards == [0.5, 0.5, 0.0]
    # the mask: 1 exactly on what the model generated; the tool answers' tokens 0
    for turn in first.turns:
        span = first.response_mask[turn["start"]:turn["end"]]
        assert span == [int(turn["role"] == "assistant")] * len(span)
    assert 0 < first.generated_tokens < len(first.response_ids)
    assert tokenizer.decode(first.response_ids[first.turns[1]["start"]:first.turns[1]["end"]]).count(
        "<tool_response>") == 2
    assert plain.turns == [plain.turns[0]] and plain.tool_calls == [] and plain.response_mask == [1] * len(
        plain.response_ids)
    statuses = [(c["name"], c["status"]) for c in broken.tool_calls]
    assert statuses == [("nope", "error"), ("", "error"), ("slow", "timeout")]
    assert "no tool named 'nope'" in broken.tool_calls[0]["answer"] and "not JSON" in broken.tool_calls[1]["answer"]
    assert stats == {"rounds": 3, "requests": 7}


def test_a_trajectory_replays_from_its_record_without_calling_a_tool(tokenizer):
    tools = {"calc": Calculator({}, CALC), "slow": Hang({}, {**CALC, "function": {**CALC["function"], "name": "slow"}})}
    loops = {"tool_agent": ToolAgentLoop()}
    original, _ = run_trajectories([_row(0), _row(2)], loops, _ctx(tokenizer, tools), Scripted(tokenizer, SCRIPT))
    Calculator.calls = 0
    replayed, _ = run_trajectories([_row(0, recorded=original[0].tool_calls), _row(2, recorded=original[1].tool_calls)],
                                   loops, _ctx(tokenizer, {}), Scripted(tokenizer, SCRIPT))
    assert Calculator.calls == 0  # no tool was built or called: the recorded answers were given
    for a, b in zip(original, replayed):
        assert (a.response_ids, a.response_mask, a.tool_calls) == (b.response_ids, b.response_mask, b.tool_calls)
    other = {**SCRIPT, (0, 0): "Let me compute " + _call("12*35")}
    with pytest.raises(ReplayMismatch, match="turn 0"):
        run_trajectories([_row(0, recorded=original[0].tool_calls)], loops, _ctx(tokenizer, {}),
                         Scripted(tokenizer, other))


def test_limits_cut_answers_turns_and_the_response_length(tokenizer):
    tools = {"calc": Calculator({}, CALC)}
    loops = {"tool_agent": ToolAgentLoop()}
    long = {(0, 0): _call("7**60"), (0, 1): _call("1"), (0, 2): "end"}
    [t], _ = run_trajectories([_row(0)], loops, _ctx(tokenizer, tools, max_tool_response_length=10,
                                                      tool_response_truncate_side="left"), Scripted(tokenizer, long))
    assert t.tool_calls[0]["truncated"] and t.tool_calls[0]["answer"] == str(7 ** 60)[:10] + "...(truncated)"
    [t], _ = run_trajectories([_row(0)], loops, _ctx(tokenizer, tools, max_assistant_turns=2),
                              Scripted(tokenizer, long))
    assert t.assistant_turns == 2 and [x["role"] for x in t.turns] == ["assistant", "tool", "assistant"]
    [t], _ = run_trajectories([_row(0)], loops, _ctx(tokenizer, tools, response_length=60), Scripted(tokenizer, long))
    assert t.cut and len(t.response_ids) <= 60 and t.assistant_turns == 1


def test_the_loss_over_a_trajectory_with_two_tool_answers_counts_generated_tokens_only(tokenizer):
    """The batch's response_mask, fed to the policy loss, gives what a hand computation
    over the generated tokens alone gives (and not what counting every token gives)."""
    from rlhf_core.algorithms.core import compute_policy_loss

    tools = {"calc": Calculator({}, CALC)}
    script = {(0, 0): _call("2*3"), (0, 1): _call("4*5"), (0, 2): "#### 26"}
    [t], _ = run_trajectories([_row(0)], {"tool_agent": ToolAgentLoop()}, _ctx(tokenizer, tools),
                              Scripted(tokenizer, script))
    assert [x["role"] for x in t.turns].count("tool") == 2
    prompts = SimpleNamespace(batch={"input_ids": torch.zeros(1, 400, dtype=torch.long)})
    out = batch_of(prompts, [t], response_length=800, pad_id=0)
    mask = out.batch["response_mask"].float()
    torch.manual_seed(0)
    old = out.batch["rollout_log_probs"]
    new = old + 0.1 * torch.randn_like(old)
    advantages = torch.full_like(old, 1.5)
    loss = compute_policy_loss(old, new, advantages, mask)["pg_loss"]
    ratio = torch.exp(new - old)
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    generated = [i for i, m in enumerate(t.response_mask) if m]
    expected = sum(per_token[0, i] for i in generated) / len(generated)
    assert torch.allclose(loss, expected)
    everything = per_token[0, :len(t.response_ids)].mean()
    assert not torch.allclose(loss, everything)
    assert out.batch["attention_mask"][0, 400:].sum() == len(t.response_ids)  # tool tokens are attended to


def test_rows_take_verls_multiturn_layout():
    from rlhf_core.protocol import DataProto, object_column

    prompts = DataProto.from_dict(
        {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]]),
         "sample_seed": torch.tensor([9])},
        {"raw_chat": object_column([[{"role": "user", "content": "hi"}]]), "raw_prompt": object_column(["hi"]),
         "extra_info": object_column([{"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "4"}}}}]),
         "agent_name": object_column([""])})
    [row] = rows_of(prompts, "tool_agent")
    assert (row.prompt_ids, row.messages, row.seed, row.agent_name) == ([5, 6], [{"role": "user", "content": "hi"}],
                                                                        9, "tool_agent")
    assert row.tools_kwargs["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == "4"


# ---------------------------------------------------------------- verl's tool configs

def test_verls_gsm8k_tool_config_maps_to_ours_and_scores(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text("""tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer"
          required: ["answer"]
""")
    [spec] = load_tool_config(str(path))
    tool = build_tools([spec])["calc_gsm8k_reward"]

    async def use():
        instance, _ = await tool.create(create_kwargs={"ground_truth": "42"})
        wrong = await tool.execute(instance, {"answer": "41"})
        right = await tool.execute(instance, {"answer": "42"})
        return wrong, right, await tool.calc_reward(instance)

    wrong, right, reward = asyncio.run(use())
    assert (wrong[1], right[1], reward) == (-0.05, 0.0, 1.0) and "reward=1.0" in right[0].text


@pytest.mark.parametrize("text,word", [
    ("tools: [", "not YAML"),
    ("tools: {}", "'tools' list"),
    ("tools:\n  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n    tool_schema: {function: {name: s}}", "refused"),
    ("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    tool_schema: {function: {name: s}}",
     "expected one of config.retrieval_service_url"),
    ("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    config: {retrieval_service_url: 'file:///etc'}\n"
     "    tool_schema: {function: {name: s}}", "expected an http(s) URL"),
    ("tools:\n  - class_name: no.such.Tool\n    tool_schema: {function: {name: s}}", "cannot import"),
    ("tools:\n  - class_name: json.JSONDecoder\n    tool_schema: {function: {name: s}}", "subclass"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    tool_schema: {type: function}", "tool_schema"),
])
def test_a_bad_tool_config_is_refused_in_one_line_naming_the_file_and_entry(tmp_path, text, word):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError) as caught:
        build_tools(load_tool_config(str(path)))
    message = str(caught.value)
    assert word in message and str(path) in message and "\n" not in message


def test_the_built_in_loops_are_one_module_each():
    assert set(BUILT_IN) <= set(loop_modules())


# ---------------------------------------------------------------- the local sandbox

LIMITS = sandbox.Limits(wall_s=20, cpu_s=2, memory_mb=256, processes=8)


def _run(code):
    result = sandbox.run_python(code, "", LIMITS)
    if result.status == "unavailable":
        pytest.fail(f"the sandbox should run on this machine: {result.stderr}")
    return result


def test_the_sandbox_runs_code_and_answers_its_output():
    result = sandbox.run_python("print(input()[::-1])", "abc\n", LIMITS)
    assert (result.status, result.stdout) == ("ok", "cba\n")


@pytest.mark.parametrize("case,code,expect", [
    ("fork bomb", "import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
    ("memory hog", "x = bytearray(1 << 31)", "MemoryError"),
    ("network", "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)", "unreachable"),
    ("write outside", "open('/etc/rlhf-sandbox-test', 'w')", "Read-only file system"),
])
def test_the_sandbox_stops_what_model_written_code_must_not_do(case, code, expect):
    result = _run(code)
    assert result.status == "error" and expect in result.stderr, (case, result)


def test_the_sandbox_cuts_an_endless_loop():
    result = _run("while True: pass")
    assert result.status == "killed"


def test_the_sandbox_sees_no_credentials_and_no_host_temp_files(tmp_path, monkeypatch):
    secret = tmp_path / "credentials"
    secret.write_text("AKIA-secret")
    secret.chmod(0o600)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "AKIA-secret")
    result = _run(f"import os\nprint(sorted(os.environ))\nprint(os.listdir('/tmp'))\nopen({str(secret)!r}).read()")
    environment, temp = result.stdout.splitlines()[:2]
    assert "AWS_SECRET_ACCESS_KEY" not in environment and temp == "['work']"
    assert result.status == "error" and ("ermission denied" in result.stderr or "No such file" in result.stderr)


def test_the_code_sees_a_root_of_its_own_without_capabilities(tmp_path):
    """The host's root is gone: no checkout, store, home or /run to read or write (what
    its user may read included), the system's folders read-only, no capability left."""
    here = os.path.realpath(os.getcwd())
    code = (f"import os\nprint(sorted(os.listdir('/')))\nprint(os.path.exists({here!r}), os.path.exists('/run'), "
            f"os.path.exists('/home'))\nprint([l.split()[1] for l in open('/proc/self/status') "
            f"if l.startswith(('CapEff', 'CapBnd', 'NoNewPrivs'))])\nopen('/tmp/work/kept', 'w').write('x')\n"
            f"open('/usr/rlhf-sandbox-test', 'w')")
    result = _run(code)
    listing, seen, status = result.stdout.splitlines()[:3]
    assert set(eval(listing)) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp",
                                  "usr", "var"}, listing
    assert seen == "False False False" and status == "['0000000000000000', '0000000000000000', '1']"
    assert result.status == "error" and "Read-only file system" in result.stderr


def test_run_by_a_user_who_is_not_root_the_code_reads_none_of_that_users_files(tmp_path):
    """The image runs as uid 1000: the code stays that user (a user namespace), and sees
    none of its files, its 0600 credentials included. Run by root, the test becomes uid
    1000 in a mount namespace of its own, where that user's home (with a copy of the
    sandbox's module) is bound at /srv or /mnt: outside every tmpfs of the sandbox, and
    reachable whatever folder the checkout is in. Nothing changes on the host."""
    import shutil
    import subprocess

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(sandbox.__file__, home / "sandbox_module.py")
    (home / "credentials").write_text("AKIA-secret")
    (home / "credentials").chmod(0o600)
    seen = next((d for d in ("/srv", "/mnt") if os.path.isdir(d)), None) if os.getuid() == 0 else str(home)
    if seen is None:
        pytest.fail("expected /srv or /mnt to bind the test user's home at")
    probe = ("import json, os\nprint(json.dumps([os.path.exists(os.environ['SECRET']), "
             "[l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')]]))")
    runner = (f"import importlib.util, json, sys\n"
              f"spec = importlib.util.spec_from_file_location('sbx', sys.argv[2] + '/sandbox_module.py')\n"
              f"sbx = sys.modules['sbx'] = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(sbx)\n"
              f"r = sbx.run_python({probe!r}.replace(\"os.environ['SECRET']\", repr(sys.argv[1])), '', "
              f"sbx.Limits(wall_s=20))\nprint(json.dumps([r.status, r.stdout, r.stderr]))")
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3")
    command = [python, "-I", "-c", runner, f"{seen}/credentials", seen]
    if os.getuid() == 0:
        for path in home.iterdir():
            os.chown(path, 1000, 1000)
        os.chown(home, 1000, 1000)
        home.chmod(0o700)
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount --bind "$0" "$1" && shift && exec setpriv --reuid=1000 --regid=1000 --clear-groups "$@"',
                   str(home), seen, *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "HOME": seen})
    assert done.returncode == 0, done.stderr[-2000:]
    status, stdout, stderr = json.loads(done.stdout)
    if status == "unavailable":
        pytest.fail(f"the sandbox should run as a user who is not root here: {stderr}")
    assert (status, json.loads(stdout)) == ("ok", [False, ["0000000000000000"]]), (stdout, stderr)


def test_a_run_gets_a_user_id_its_namespace_maps_and_an_installation_it_can_show():
    """Root in a user namespace that maps fewer ids (rootless containers, Kubernetes user
    namespaces) gets one of those; an interpreter whose folder is no installation, or sits
    where the code's tmpfs go, leaves the sandbox unavailable rather than the code failing."""
    assert sandbox._run_uid("         0          0 4294967295") in sandbox.SANDBOX_UIDS
    for _ in range(20):
        assert 61440 <= sandbox._run_uid("0 100000 65536") < 65534
    assert sandbox._run_uid("0 1000 1") == sandbox.NOBODY
    for python in ("/python3", "/tmp/py/bin/python3", "/var/tmp/py/bin/python3"):
        with pytest.raises(sandbox.SandboxUnavailable, match="is not in an installation folder"):
            sandbox._binds(python)
    assert "/usr" in sandbox._binds("/usr/bin/python3")


def _alive(marker: str) -> list:
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def test_the_wall_clock_stops_code_that_left_its_process_group():
    """setsid() takes the code out of the group the sandbox was started in: the wall
    clock kills the pid namespace's first process, and with it every process inside."""
    import threading
    import uuid

    marker = f"rlhf-sandbox-{uuid.uuid4().hex}"
    code = f"# {marker}\nimport os, time\nos.setsid()\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(600)"
    answer = {}
    runner = threading.Thread(target=lambda: answer.update(
        result=sandbox.run_python(code, "", sandbox.Limits(wall_s=2, cpu_s=2, memory_mb=256, processes=8))))
    runner.start()
    runner.join(timeout=120)  # a guard: without the fix the call waits on the code's 600 s sleep
    assert not runner.is_alive(), "the sandbox did not return at its wall clock"
    assert answer["result"].status == "timeout"
    assert _alive(marker) == [], "a process of the code outlived its sandbox"


def test_output_past_the_limit_stops_the_code_and_is_cut():
    result = sandbox.run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "",
                                sandbox.Limits(wall_s=60, cpu_s=30, output_bytes=4096))
    assert result.status == "killed" and result.truncated and result.stdout == "x" * 4096
    assert "sandbox: stopped past 4096 bytes of output" in result.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="a user id of its own per run is given only by root")
def test_runs_side_by_side_do_not_share_their_process_allowance():
    """Root gives each run a user id of its own: one run holding its whole allowance of
    processes leaves the other run's allowance whole (they would share nobody's)."""
    import threading
    import time
    import uuid

    marker = f"rlhf-sandbox-{uuid.uuid4().hex}"
    limits = sandbox.Limits(wall_s=30, cpu_s=5, memory_mb=256, processes=8)
    holder = (f"# {marker}\nimport os, time\nfor _ in range(7):\n    if os.fork() == 0:\n        time.sleep(600)\n"
              f"time.sleep(600)")
    held = threading.Thread(target=sandbox.run_python, args=(holder, "", limits))
    held.start()
    try:
        def holders():  # the holder's code and its children, as its user id (not unshare, not the launcher)
            return [p for p in _alive(marker) if p.uids().real in sandbox.SANDBOX_UIDS]

        deadline = time.monotonic() + 60
        while len(holders()) < 8 and time.monotonic() < deadline:  # a probe: the holder's processes
            time.sleep(0.05)
        assert len(holders()) == 8, "the holder did not take its processes"
        other = sandbox.run_python("import threading\nt = threading.Thread(target=print, args=('ok',))\n"
                                   "t.start()\nt.join()", "", limits)
        assert (other.status, other.stdout) == ("ok", "ok\n"), other
    finally:
        import psutil

        for process in _alive(marker):  # ends the holder early: its namespace dies with its first process
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        held.join()


def test_the_code_interpreter_tool_answers_from_the_sandbox():
    from rlhf_core.agent.tools.code_interpreter import CodeInterpreterTool

    tool = CodeInterpreterTool({}, {"type": "function", "function": {"name": "code_interpreter"}})
    response, _, metrics = asyncio.run(tool.execute("i", {"code": "print(6 * 7)"}))
    assert response.text == "42\n" and metrics["status"] == "ok"


# ---------------------------------------------------------------- verl's multi-turn script, end to end

#: examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml's own keys, then
#: run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh's arguments (verl b178a3c), as written
GSM8K_MULTITURN_GRPO_YAML = [
    "data.max_prompt_length=1024", "data.max_response_length=1024", "data.train_batch_size=256",
    "data.return_raw_chat=True", "actor_rollout_ref.hybrid_engine=True", "actor_rollout_ref.rollout.name=sglang",
    "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5"]
MULTITURN_VLLM_FSDP = [
    "actor_rollout_ref.rollout.name=vllm", "algorithm.adv_estimator=grpo", "data.train_batch_size=32",
    "data.max_prompt_length=1024", "data.max_response_length=1024", "data.filter_overlong_prompts=True",
    "data.truncation=error", "data.return_raw_chat=True", "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.9", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.project_name=gsm8k_async_rl",
    "trainer.experiment_name=qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-verify-n16",
    "trainer.n_gpus_per_node=16", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=20",
    "trainer.logger=['console']", "data.train_files=$HOME/data/gsm8k/train.parquet",
    "data.val_files=$HOME/data/gsm8k/test.parquet", "trainer.total_epochs=15",
    "actor_rollout_ref.rollout.trace.token2text=False", "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path=$PROJECT_DIR/examples/sglang_multiturn/config/"
    "tool_config/gsm8k_tool_config.yaml",
    "actor_rollout_ref.rollout.free_cache_engine=True"]
GSM8K_TOOL_CONFIG = """tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_verls_multiturn_script_scaled_down_calls_tools_trains_on_its_own_tokens_and_replays(
        tmp_path, ray_local, monkeypatch):
    """The script's keys, every one (its Hydra config's too), scaled to a tiny model on CPU
    (rollout.name=hf, one rank): the model, warm-started to call the gsm8k tool, calls it;
    the tool's answers are in the rollout snapshot and out of the loss; every stage of the
    iteration, the rollout and validation included, replays exactly with the tool unable
    to answer (the recorded answers are given)."""
    import yaml

    from rlhf_core.agent.tools.gsm8k import Gsm8kTool
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.testing.model_folders import build_model_folder, teach, write_verl_multiturn_parquet
    from rlhf_core.trainer.replay import replay

    tool_config = tmp_path / "gsm8k_tool_config.yaml"
    tool_config.write_text(GSM8K_TOOL_CONFIG)
    data = write_verl_multiturn_parquet(tmp_path / "train.parquet", count=4)
    test = write_verl_multiturn_parquet(tmp_path / "test.parquet", count=2)
    import pyarrow.parquet as pq

    chats = [row["prompt"] for row in pq.read_table(data).to_pylist()]
    schema = [yaml.safe_load(GSM8K_TOOL_CONFIG)["tools"][0]["tool_schema"]]
    model = teach(build_model_folder(tmp_path / "model", tools=True), chats,
                  '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "14"}}</tool_call>', schema,
                  steps=200, lr=5e-3)
    scaled = {"data.train_files": str(data), "data.val_files": str(test), "actor_rollout_ref.model.path": str(model),
              "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tool_config),
              "actor_rollout_ref.rollout.name": "hf", "data.train_batch_size": "2", "data.max_prompt_length": "640",
              "data.max_response_length": "160", "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.rollout.tensor_model_parallel_size": "1", "actor_rollout_ref.rollout.n": "2",
              "trainer.total_epochs": "1", "trainer.logger": "['console']",
              "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "3"}
    argv = []
    for item in GSM8K_MULTITURN_GRPO_YAML + MULTITURN_VLLM_FSDP:
        key = item.split("=", 1)[0]
        if key in ("trainer.n_gpus_per_node",):
            continue
        argv.append(f"{key}={scaled[key]}" if key in scaled else item)
    out = tmp_path / "out"
    store = tmp_path / "store"
    assert main(["run", "--direct", "--run-id", "mt", "--store", f"file://{store}", *argv,
                 f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    rows = [json.loads(line) for line in (out / "mt" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["num_turns/mean"] > 1 and rows[0]["agent/tool_calls/mean"] > 0
    rollout = IterationStore(RunRef(f"file://{store}", "mt")).load(1, "rollout")
    calls = [json.loads(c) for c in rollout.non_tensor_batch["agent/tool_calls"]]
    assert any(c and c[0]["name"] == "calc_gsm8k_reward" and c[0]["status"] == "ok" for c in calls)
    attended = rollout.batch["attention_mask"][:, -160:]
    inserted = attended.bool() & ~rollout.batch["response_mask"].bool()
    assert inserted.any()  # tool answers: attended to, not trained on
    assert (rollout.batch["rollout_log_probs"][inserted] == 0).all()
    # the rollout snapshot read back as chats with their calls (rlhf snapshots show)
    from rlhf_core.record import audit

    called = next(i for i, c in enumerate(calls) if c)
    shown = audit.show(f"file://{store}/mt/iter-000001/rollout", str(rollout.non_tensor_batch["uid"][called]))
    assert "  chat: " in shown and "    [assistant] tokens 0-" in shown and ", not trained on: " in shown
    assert "      -> calc_gsm8k_reward({\"answer\": " in shown

    manifest = IterationStore(RunRef(f"file://{store}", "mt")).read_manifest(1)
    assert manifest["tools"]["classes"]["calc_gsm8k_reward"] == {
        "class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "built": "rlhf_core.agent.tools.gsm8k:Gsm8kTool"}
    import hashlib
    assert manifest["tools"]["sha256"] == hashlib.sha256(tool_config.read_bytes()).hexdigest()

    async def unreachable(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool was called again")

    def unbuilt(self, *args, **kwargs):
        raise RuntimeError("a tool was built in a replay")

    monkeypatch.setattr(Gsm8kTool, "execute", unreachable)
    monkeypatch.setattr(Gsm8kTool, "__init__", unbuilt)
    results = [r for n in (0, 1) for r in replay(f"file://{store}/mt/iter-{n:06d}", log=lambda *a: None)]
    assert {r.stage for r in results} >= {"rollout", "validate", "reward", "update_actor"}
    assert all(r.ok for r in results), [(r.stage, [d for d in r.diffs if not d.equal]) for r in results if not r.ok]
    from rlhf_core.trainer.replay import ReplayError

    tool_config.write_text(GSM8K_TOOL_CONFIG.replace("must be a digits", "digits"))  # other schemas, other prompts
    with pytest.raises(ReplayError, match="tool_config_path: expected the tool config the iteration was generated"):
        replay(f"file://{store}/mt/iter-000001", stages=["rollout"], log=lambda *a: None)


def test_a_replay_imports_no_agent_loop_the_stored_config_chose(tmp_path):
    from rlhf_core.config import apply_overrides, RunConfig
    from rlhf_core.trainer.replay import ReplayError, check_reward_function

    cfg = apply_overrides(RunConfig(), ["rollout.multi_turn.enable=true",
                                        f"rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}"])
    with pytest.raises(ReplayError, match="agent_loop_config_path.*--trust-reward-function"):
        check_reward_function(cfg, [], trusted=False)
    check_reward_function(cfg, [], trusted=True)
    check_reward_function(cfg, [f"rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}"], trusted=False)


def test_replaying_filter_groups_builds_no_tool_or_interaction_the_stored_config_chose(tmp_path):
    """filter_groups may generate batches the record does not hold: for an agent run,
    with tools and interactions built from the stored config; a user's config (classes to
    import, addresses to call) is refused for it before any worker is placed, and a tool
    config without its recorded hash is refused for any stage."""
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.trainer.replay import ReplayError, _check_live_agent, _check_tools

    tools, users = str(tmp_path / "tools.yaml"), str(tmp_path / "interactions.yaml")
    for key, path in (("tool_config_path", tools), ("interaction_config_path", users)):
        cfg = apply_overrides(RunConfig(), ["rollout.multi_turn.enable=true", f"rollout.multi_turn.{key}={path}"])
        with pytest.raises(ReplayError, match=rf"^rollout.multi_turn.{key} '{path}' \(from the iteration's manifest\): "
                                              r"expected a builtin: config or one named by --override; .* only with "
                                              r"--trust-reward-function$"):
            _check_live_agent(cfg, ["filter_groups"], [], trusted=False)
        _check_live_agent(cfg, ["rollout", "reward"], [], trusted=False)  # recorded answers: nothing is built
        _check_live_agent(cfg, ["filter_groups"], [], trusted=True)
        _check_live_agent(cfg, ["filter_groups"], [f"rollout.multi_turn.{key}={path}"], trusted=False)
    builtin = apply_overrides(RunConfig(), ["rollout.multi_turn.enable=true",
                                            "rollout.multi_turn.tool_config_path=builtin:calculator"])
    _check_live_agent(builtin, ["filter_groups"], [], trusted=False)
    # a record that holds every further generation batch: their answers are given again, nothing is built
    recorded = {"metrics": {"train/num_gen_batches": 3},
                "snapshots": {name: "..." for name in ("reward", "filter_groups.gen_batch-1", "filter_groups.gen_batch-2")}}
    _check_live_agent(cfg, ["filter_groups"], [], trusted=False, manifest=recorded)
    with pytest.raises(ReplayError, match="only with --trust-reward-function"):  # a what-if may draw more
        _check_live_agent(cfg, ["filter_groups"], ["actor.clip_ratio_high=0.3"], trusted=False, manifest=recorded)
    del recorded["snapshots"]["filter_groups.gen_batch-2"]
    with pytest.raises(ReplayError, match="only with --trust-reward-function"):
        _check_live_agent(cfg, ["filter_groups"], [], trusted=False, manifest=recorded)
    with pytest.raises(ReplayError, match=r"^rollout.multi_turn.tool_config_path: expected the iteration's record "
                                          r"of its tool config \(the manifest's tools: its sha256\); found 'None'$"):
        _check_tools({}, builtin, [])


# ---------------------------------------------------------------- the built-in tool task

def test_the_calculator_task_scores_the_answer_after_the_tools(tmp_path):
    from rlhf_core.data.calculator import CALL_HEAD, CALL_TAIL, reward_score
    from rlhf_core.models.calculator import build_tokenizer, example

    tok = build_tokenizer(tmp_path)
    ids, mask = example(123, 456, with_tool=True)
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == f"123*456=<tool_call>{CALL_HEAD}123*456{CALL_TAIL}</tool_call><tool_response>56088</tool_response>56088"
    assert parse_hermes(text)[0].arguments == {"expression": "123*456"}
    assert reward_score("builtin/calculator", text.split("=", 1)[1], "56088") == {"score": 1.0, "used_tool": 1.0}
    copied_wrong = text.split("=", 1)[1].replace("</tool_response>56088", "</tool_response>56089")
    assert reward_score("builtin/calculator", copied_wrong, "56088")["score"] == 0.0
    assert reward_score("builtin/calculator", "56088", "56088") == {"score": 1.0, "used_tool": 0.0}
    # what the model is trained on: its own call and answer, never the tool's answer
    answer_span = [m for t, m in zip(ids, mask) if t in tok.convert_tokens_to_ids(["<tool_response>"])]
    assert answer_span == [0] and sum(mask) == len(ids) - 9 - 7
    # the chat template renders a tool answer as the tool task's model reads it
    from rlhf_core.agent import chat

    delta = chat.message_tokens(tok, [{"role": "tool", "content": "56088"}])
    assert tok.decode(delta) == "<tool_response>56088</tool_response>"
    assert chat.prompt_tokens(tok, [{"role": "user", "content": "123*456"}], None) == ids[:9]


def test_the_built_in_tool_config_loads_and_its_calculator_answers():
    from rlhf_core.agent.tools.calculator import evaluate

    [spec] = load_tool_config("builtin:calculator")
    tool = build_tools([spec])["calculator"]
    response, _, _ = asyncio.run(tool.execute("i", {"expression": "123*456"}))
    assert response.text == "56088"
    # nested powers within every exponent bound grow without one: refused before they are computed
    for bad in ("__import__('os')", "2**1000", "1/0", "x" * 300, "(((9**64)**64)**64)**64",
                "((9**64)**64)*((9**64)**64)*((9**64)**64)"):
        response, _, metrics = asyncio.run(tool.execute("i", {"expression": bad}))
        assert response.text.startswith("Error") and metrics["status"] == "error", bad
    assert evaluate("(9**64)**4") == 9 ** 256 and evaluate("-(2**63) * 2**63") == -(2 ** 126)
    with pytest.raises(ToolConfigError, match="builtin:calculator"):
        load_tool_config("builtin:nothing")
    assert evaluate("(2+3)*4 - 6/3") == 18.0


# ---------------------------------------------------------------- the search tool

SEARCH_SCHEMA = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query_list": {"type": "array"}}, "required": ["query_list"]}}}
CORPUS = [{"title": "Paris", "text": "Paris is the capital of France."},
          {"title": "Berlin", "text": "Berlin is the capital of Germany. Berlin has many museums."},
          {"title": "Rome", "text": "Rome is in Italy."}]


def _search(tool, queries):
    import asyncio
    import json as json_module

    async def use():
        instance, _ = await tool.create()
        return await tool.execute(instance, {"query_list": queries})

    response, reward, metrics = asyncio.run(use())
    return json_module.loads(response.text)["result"], reward, metrics


def test_the_search_tool_ranks_a_local_corpus_by_bm25_and_answers_as_verl_formats(tmp_path):
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.agent.tools.search import BM25, SearchTool

    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.Table.from_pylist(CORPUS), path)
    tool = SearchTool({"corpus_path": str(path), "topk": 2}, SEARCH_SCHEMA)
    text, reward, metrics = _search(tool, ["capital of Germany", "museums"])
    first, second = text.split("\n---\n")
    assert first.startswith("Doc 1 (Title: Berlin)\nBerlin is the capital of Germany.") and "Doc 2 (Title: " in first
    assert second == "Doc 1 (Title: Berlin)\nBerlin is the capital of Germany. Berlin has many museums."
    assert (reward, metrics) == (0.0, {"status": "success", "total_results": 3})
    # BM25 by hand for "museums" (in one document of 3): idf ln(1 + 2.5 / 1.5), tf 1
    index = BM25(["Paris\n" + CORPUS[0]["text"], "Berlin\n" + CORPUS[1]["text"], "Rome\n" + CORPUS[2]["text"]])
    norm = 11 / ((7 + 11 + 5) / 3)  # words per document, titles included
    assert index.scores("museums") == {1: pytest.approx(math.log(1 + 2.5 / 1.5) * 1.9 / (1 + 0.9 * (0.6 + 0.4 * norm)))}
    assert _search(tool, ["zzz"])[0] == "No search results found."
    assert "query_list" in _search(tool, "not a list")[0]


def test_the_search_tool_speaks_verls_retrieval_protocol(tmp_path):
    from json_http import JSONServer

    from rlhf_core.agent.tools.search import SearchTool

    def route(method, path, body):
        if body["queries"] == ["down"]:
            return 503, {"error": "overloaded"}
        return 200, {"result": [[{"document": {"contents": f"{q.title()}\nabout {q}"}, "score": 1.0}]
                                for q in body["queries"]]}

    server = JSONServer(route)
    try:
        tool = SearchTool({"retrieval_service_url": f"{server.url}/retrieve", "topk": 3}, SEARCH_SCHEMA)
        text, _, metrics = _search(tool, ["cats", "dogs"])
        assert server.requests[0]["body"] == {"queries": ["cats", "dogs"], "topk": 3, "return_scores": True}
        assert server.requests[0]["path"] == "/retrieve"
        assert text == "Doc 1 (Title: Cats)\nabout cats\n---\nDoc 1 (Title: Dogs)\nabout dogs"
        assert metrics == {"status": "success", "total_results": 2}
        # the service failing: the model is told, the run goes on
        text, _, metrics = _search(tool, ["down"])
        assert text.startswith("Search error: ") and "503" in text and metrics == {"status": "api_error"}
    finally:
        server.close()


# ---------------------------------------------------------------- a user's verl tool

VERL_STYLE_TOOL = '''
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class EchoTool(BaseTool):
    """Written for verl: its imports are verl's."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        self.prefix = config.get("prefix", "")

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = []
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        self._instance_dict[instance_id].append(parameters["text"])
        return ToolResponse(text=f"{self.prefix}{self.tool_schema.function.name}: {parameters['text']}"), 0.5, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''
ECHO_SCHEMA = ("    tool_schema: {type: function, function: {name: echo, parameters: {type: object, properties: "
               "{text: {type: string}}, required: [text]}}}\n")


@pytest.mark.parametrize("form", ["file", "module"])
def test_a_users_tool_written_for_verl_loads_with_verls_imports_answered_by_ours(tmp_path, monkeypatch, form):
    import asyncio
    import sys

    (tmp_path / "my_verl_tools.py").write_text(VERL_STYLE_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    class_name = f"{tmp_path / 'my_verl_tools.py'}:EchoTool" if form == "file" else "my_verl_tools.EchoTool"
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - class_name: {class_name}\n    config: {{prefix: '> '}}\n" + ECHO_SCHEMA)
    tools = build_tools(load_tool_config(str(config)))
    assert "verl" not in sys.modules and "verl.tools.base_tool" not in sys.modules  # nothing left behind

    async def use():
        instance, _ = await tools["echo"].create()
        answer = await tools["echo"].execute(instance, {"text": "hi"})
        await tools["echo"].release(instance)
        return answer

    response, reward, _ = asyncio.run(use())
    assert (response.text, reward) == ("> echo: hi", 0.5)


def test_a_users_tool_file_that_fails_as_it_runs_is_refused_in_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("from verl.tools.base_tool import BaseTool\nraise RuntimeError('boom')\n")
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - class_name: {tmp_path / 'broken.py'}:Broken\n" + ECHO_SCHEMA)
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.class_name: tool 'echo': .*broken.py:Broken: importing "
                                              r".*broken.py raised RuntimeError: boom$"):
        build_tools(load_tool_config(str(config)))
    config.write_text(f"tools:\n  - class_name: {tmp_path / 'missing.py'}:Gone\n" + ECHO_SCHEMA)
    with pytest.raises(ToolConfigError, match=r"cannot import .*missing.py: no such file"):
        build_tools(load_tool_config(str(config)))


def test_a_trajectory_prints_as_a_chat_with_its_calls():
    from rlhf_core.record.audit import chat_lines

    turns = [{"role": "assistant", "start": 0, "end": 9, "text": "<tool_call>...</tool_call>"},
             {"role": "tool", "start": 9, "end": 15, "text": "56088"},
             {"role": "assistant", "start": 15, "end": 20, "text": "56088"}]
    calls = [{"turn": 0, "index": 0, "name": "calculator", "arguments": {"expression": "123*456"}, "status": "ok",
              "answer": "56088", "truncated": False, "reward": 0.0, "started": 10.0, "ended": 10.25}]
    lines = chat_lines(json.dumps(turns), json.dumps(calls))
    assert lines == ["  chat: 3 turn(s), 1 tool call(s)",
                     "    [assistant] tokens 0-9: '<tool_call>...</tool_call>'",
                     '      -> calculator({"expression": "123*456"}): ok, 0.250 s, reward 0.0: \'56088\'',
                     "    [tool] tokens 9-15, not trained on: '56088'",
                     "    [assistant] tokens 15-20: '56088'"]
    assert chat_lines("{not json", "[]")[0].startswith("  chat: unreadable record")


# ---------------------------------------------------------------- interactions (simulated users)

GSM8K_INTERACTION_CONFIG = """interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""


def _interaction_row(i, truth, recorded=None):
    kwargs = {"name": "gsm8k", "query": f"q{i}", "ground_truth": truth}
    return AgentRow(i, [], [{"role": "user", "content": f"q{i}"}], 11, "tool_agent", {}, recorded, kwargs)


def test_verls_gsm8k_interaction_asks_again_until_right_and_replays_from_the_record(tokenizer, tmp_path):
    """verl's gsm8k interaction config: a turn without a tool call is answered by the
    simulated user, "try again" until the #### answer is right ("correct!" ends it); the
    user's tokens are out of the loss; a replay gives the recorded replies without
    building an interaction."""
    from rlhf_core.agent.interaction_config import build_interactions, load_interaction_config
    from rlhf_core.agent.interactions.gsm8k import CORRECT, TRY_AGAIN

    path = tmp_path / "gsm8k_interaction_config.yaml"
    path.write_text(GSM8K_INTERACTION_CONFIG)
    specs = load_interaction_config(str(path))
    assert [(s.name, s.target) for s in specs] == [("gsm8k", "rlhf_core.agent.interactions.gsm8k:Gsm8kInteraction")]
    script = {(0, 0): "#### 41", (0, 1): "#### 40", (0, 2): "#### 42", (0, 3): "unreached",
              (1, 0): "#### 7", (1, 1): "unreached"}
    ctx = _ctx(tokenizer, {}, max_user_turns=5)
    ctx.interactions = lambda: build_interactions(specs)
    loops = {"tool_agent": ToolAgentLoop()}
    (wrong_twice, right), _ = run_trajectories([_interaction_row(0, "42"), _interaction_row(1, "7")], loops, ctx,
                                              Scripted(tokenizer, script))
    assert [t["role"] for t in wrong_twice.turns] == ["assistant", "user"] * 3
    replies = [c["answer"] for c in wrong_twice.tool_calls]
    assert replies == [TRY_AGAIN, TRY_AGAIN, CORRECT] and wrong_twice.turn_scores == [0.0, 0.0, 1.0]
    assert [c["terminate"] for c in wrong_twice.tool_calls] == [False, False, True]
    assert [t["role"] for t in right.turns] == ["assistant", "user"] and right.turn_scores == [1.0]
    for turn in wrong_twice.turns:  # the user's words are context, not trained on
        span = wrong_twice.response_mask[turn["start"]:turn["end"]]
        assert span == [int(turn["role"] == "assistant")] * len(span)
    assert CORRECT in tokenizer.decode(wrong_twice.response_ids)

    replay_ctx = _ctx(tokenizer, {}, max_user_turns=5)
    replay_ctx.interactions = lambda: pytest.fail("an interaction was built in a replay")
    (again, _), _ = run_trajectories([_interaction_row(0, "42", recorded=wrong_twice.tool_calls),
                                      _interaction_row(1, "7", recorded=right.tool_calls)], loops, replay_ctx,
                                     Scripted(tokenizer, script))
    assert (again.response_ids, again.response_mask, again.tool_calls) == (
        wrong_twice.response_ids, wrong_twice.response_mask, wrong_twice.tool_calls)
    # max_user_turns ends the exchange: one reply, then the second assistant turn is the last
    short = _ctx(tokenizer, {}, max_user_turns=1)
    short.interactions = lambda: build_interactions(specs)
    (cut, _), _ = run_trajectories([_interaction_row(0, "42"), _interaction_row(1, "7")], loops, short,
                                   Scripted(tokenizer, script))
    assert [t["role"] for t in cut.turns] == ["assistant", "user", "assistant"]


def test_a_users_interaction_written_for_verl_loads_and_a_bad_config_is_refused_in_one_line(tmp_path, monkeypatch):
    import sys

    from rlhf_core.agent.interaction_config import build_interactions, load_interaction_config

    (tmp_path / "my_interaction.py").write_text(
        "from verl.interactions.base import BaseInteraction\n\n"
        "class EchoInteraction(BaseInteraction):\n"
        "    async def generate_response(self, instance_id, messages, **kwargs):\n"
        "        return True, 'you said ' + messages[-1]['content'], 0.5, {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "interaction.yaml"
    path.write_text("interaction:\n  - class_name: my_interaction.EchoInteraction\n")
    built = build_interactions(load_interaction_config(str(path)))
    assert list(built) == ["echo"] and built["echo"].name == "echo"  # verl's default name: the class less its suffix
    assert "verl.interactions.base" not in sys.modules
    for text, word in [("interaction: [", "not YAML"), ("interaction: []", "'interaction' list"),
                       ("interaction:\n  - class_name: no.such.Thing\n", "cannot import"),
                       ("interaction:\n  - class_name: json.JSONDecoder\n", "subclass"),
                       ("interaction:\n  - {name: a, class_name: my_interaction.EchoInteraction}\n"
                        "  - {name: a, class_name: my_interaction.EchoInteraction}\n", "named twice")]:
        path.write_text(text)
        with pytest.raises(ToolConfigError) as caught:
            build_interactions(load_interaction_config(str(path)))
        assert word in str(caught.value) and str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_with_verls_gsm8k_interaction_records_the_users_replies_and_replays_without_them(
        tmp_path, ray_local, monkeypatch):
    from rlhf_core.agent.interactions.gsm8k import Gsm8kInteraction, TRY_AGAIN
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.testing.model_folders import build_model_folder, teach, write_verl_multiturn_parquet
    from rlhf_core.trainer.replay import replay

    config = tmp_path / "gsm8k_interaction_config.yaml"
    config.write_text(GSM8K_INTERACTION_CONFIG)
    data = write_verl_multiturn_parquet(tmp_path / "train.parquet", count=4, interaction="gsm8k")
    import pyarrow.parquet as pq

    # a warm start that answers at once, and wrongly: the user asks again
    model = teach(build_model_folder(tmp_path / "model", tools=True),
                  [row["prompt"] for row in pq.read_table(data).to_pylist()], "#### 1", steps=120, lr=5e-3)
    store, out = tmp_path / "store", tmp_path / "out"
    assert main(["run", "--direct", "--run-id", "talk", "--store", f"file://{store}",
                 f"actor_rollout_ref.model.path={model}",
                 f"data.train_files={data}", "data.val_files=", "data.train_batch_size=2", "data.max_prompt_length=640",
                 "data.return_raw_chat=true", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.rollout.multi_turn.enable=true",
                 f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={config}",
                 "actor_rollout_ref.rollout.multi_turn.max_user_turns=2", "data.max_response_length=96",
                 "trainer.total_iterations=1", f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    istore = IterationStore(RunRef(f"file://{store}", "talk"))
    rollout = istore.load(0, "rollout")
    records = [json.loads(c) for c in rollout.non_tensor_batch["agent/tool_calls"]]
    asked = [c for calls in records for c in calls if c["name"] == "interaction:gsm8k"]
    assert asked and all(c["answer"] == TRY_AGAIN for c in asked)  # an untrained model: never right
    assert istore.read_manifest(0)["tools"]["interactions"]["classes"]["gsm8k"]["class_name"] == \
        "verl.interactions.gsm8k_interaction.Gsm8kInteraction"

    def unbuilt(self, *args, **kwargs):
        raise RuntimeError("an interaction was built in a replay")

    monkeypatch.setattr(Gsm8kInteraction, "__init__", unbuilt)
    [result] = replay(f"file://{store}/talk/iter-000000", stages=["rollout"], log=lambda *a: None)
    assert result.ok, [d for d in result.diffs if not d.equal]


def test_a_prompt_too_long_with_the_tools_schemas_is_refused_before_anything_is_generated(tokenizer):
    import torch

    from rlhf_core.agent.batch import AgentBatchError, run_batch
    from rlhf_core.protocol import DataProto, object_column

    chats = [[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}]]
    ids = torch.ones(2, 8, dtype=torch.long)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                   "sample_seed": torch.tensor([11, 12])}, {"raw_chat": object_column(chats)})
    engine = Scripted(tokenizer, {(0, 0): "#### 1", (1, 0): "#### 2"})
    with pytest.raises(AgentBatchError, match=r"^data.max_prompt_length: expected prompts of at most 8 tokens; "
                                              r"found one of \d+ \(row 0\) once rendered with the tools' schemas"):
        run_batch(prompts, _ctx(tokenizer, {"calc": Calculator({}, CALC)}), {"tool_agent": ToolAgentLoop()},
                  "tool_agent", engine, pad_id=0)
    assert engine.rounds == []  # refused before the first request
