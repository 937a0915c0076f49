"""Real-format model folders and verl-format datasets, built on this machine from configs.

Nothing is downloaded: a byte-level BPE tokenizer (Qwen2's pre-tokenizer, ChatML specials
and chat template) is trained here on GSM8K-style text, and a Qwen2 model of the given
shape gets random weights. Tests use a few-layer one; ``benchmarks/gpu_smoke.py`` a
0.5B-class one.
"""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: ChatML with tools, as Qwen2.5's template renders them (hermes tool calls; tool answers as
#: user turns in <tool_response>): the same text as CHATML for a chat without tools
CHATML_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\n' }}{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n\n' }}{% endif %}{{ '# Tools\n<tools>' }}{% for tool in tools %}"
    "{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n</tools>\nCall a tool as <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
#: A few layers, head_dim 64 (the smallest vLLM's CPU attention takes).
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "tie_word_embeddings": True}
#: Qwen2.5-0.5B's shape (494M parameters with its 151936-token vocabulary).
QWEN2_0_5B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "tie_word_embeddings": True, "vocab_size": 151936}


def question(i: int) -> tuple[str, str]:
    a, b = 3 + i % 7, 11 + (i * 5) % 13
    return f"Tom has {a} apples and buys {b} more. How many apples does he have?", str(a + b)


def build_model_folder(path: Path, shape: dict | None = None, seed: int = 0, tools: bool = False) -> Path:
    """A Hugging Face folder at ``path``: tokenizer (with chat template) and a Qwen2 model
    of ``shape`` (default ``TINY``) with random weights. ``tools``: the template renders
    tools and tool answers (``CHATML_TOOLS``), and the tool-call tags are tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlhf_core.models.qwen2 import qwen2_from_config

    shape = dict(shape or TINY)
    corpus = [f"{q} {INSTRUCTION} {a} apples. #### {a}" for q, a in map(question, range(200))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TOOLS if tools else CHATML
    if tools:
        fast.add_tokens(TOOL_TOKENS)
    fast.save_pretrained(path)
    shape.setdefault("vocab_size", len(fast))
    shape.setdefault("max_position_embeddings", 2048)
    model = qwen2_from_config(seed, use_cache=True, eos_token_id=tok.token_to_id("<|im_end|>"),
                              pad_token_id=tok.token_to_id("<|endoftext|>"), bos_token_id=None, **shape)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


#: A reward model's own chat template (not ChatML): responses are re-templated for it.
PLAIN_CHAT = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def build_reward_model_folder(path: Path, policy_folder: Path, shape: dict | None = None, seed: int = 1,
                              chat_template: str | None = None) -> Path:
    """A reward model at ``path``: a Qwen2 sequence classifier with one label and random
    weights, with the tokenizer of ``policy_folder`` (``chat_template``: another template
    for it, so responses are re-templated)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(policy_folder)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = Qwen2Config(**{"vocab_size": len(tokenizer), **TINY, **(shape or {})}, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         architectures=["Qwen2ForSequenceClassification"])
    model = Qwen2ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ between responses
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def write_verl_multiturn_parquet(path: Path, count: int = 64, interaction: str | None = None) -> Path:
    """GSM8K-style rows as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes
    them: a system prompt asking for the calc_gsm8k_reward tool, its tools_kwargs;
    ``interaction``: the interaction's name in interaction_kwargs, as
    gsm8k_multiturn_w_interaction.py writes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(count):
        text, answer = question(i)
        rows.append({"data_source": "openai/gsm8k", "prompt": [
            {"role": "system", "content": "You are a math expert. Use the `calc_gsm8k_reward` tool. "
                                          "Put your final answer in the format of `#### <answer>`."},
            {"role": "user", "content": f"{text} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "question": text, "need_tools_kwargs": True,
                           "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}},
                           "interaction_kwargs": {"query": text, "ground_truth": answer,
                                                  **({"name": interaction} if interaction else {})}}})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return Path(path)


def write_verl_parquet(path: Path, count: int = 64) -> Path:
    """GSM8K-style rows as verl's data preprocessing writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(count):
        text, answer = question(i)
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{text} {INSTRUCTION}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"split": "train", "index": i, "question": text}})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return Path(path)


def teach(folder: Path, prompts: list[list[dict]], answer: str, tools: list[dict] | None = None, steps: int = 80,
          lr: float = 3e-3, seed: int = 0) -> Path:
    """Supervise the model at ``folder`` to answer ``answer`` (then its end token) after
    each chat of ``prompts`` rendered with ``tools``: a warm start that knows a format,
    e.g. a tool call, so that tests see one happen. Saved in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    target = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    rows = [tokenizer.encode(tokenizer.apply_chat_template(p, tools=tools, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False) for p in prompts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        prompt = rows[step % len(rows)]
        ids = torch.tensor([prompt + target])
        logits = model(ids).logits[0, len(prompt) - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)
