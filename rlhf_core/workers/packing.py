"""Padding-free forwards (verl's ``use_remove_padding``): a micro-batch's sequences packed
into one row of real tokens, positions restarting per sequence, attention never crossing
from one sequence into another.

A padded micro-batch computes every layer over ``rows x longest`` positions; packed, over
the real tokens only. Attention is the one layer that must know where sequences begin:

- with FlashAttention installed (GPU), HF's ``flash_attention_2`` reads the sequence
  boundaries (``cu_seq_lens_q`` / ``cu_seq_lens_k``) and runs its varlen kernel, as verl's
  padding-free path does;
- on a GPU without it, ``PACKED_VARLEN``, registered here, calls PyTorch's own
  FlashAttention-backed ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) with the
  same boundaries: one kernel per layer, where per-sequence calls cost hundreds of small
  kernels per layer (16-bit inputs; it falls back to the per-sequence path otherwise);
- on the CPU ``PACKED_SDPA``, registered here, runs PyTorch's SDPA once per sequence
  (causal, no mask: exact). A block-diagonal mask over the packed row would be exact too,
  but it costs ``tokens^2`` memory and compute, where the per-sequence calls cost
  ``sum(length^2)``.

Calls without sequence boundaries (generation, the padded path) go to plain SDPA with
SDPA's masks, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The attention implementation a packed model runs with on the CPU.
PACKED_SDPA = "rlhf_packed_sdpa"
#: ... and on a GPU without the flash-attn package: torch's own varlen FlashAttention.
PACKED_VARLEN = "rlhf_packed_varlen"
#: what torch's varlen kernel takes (FlashAttention's limits)
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256


@dataclass
class PackedRows:
    """A padded micro-batch as one packed row, and the way back.

    ``input_ids`` / ``position_ids``: [1, tokens], the real tokens of every row in row order
    (each row's own position ids, so rotary positions are those of the padded layout).
    ``predictors``: the packed index of the position that predicts each response token
    (row-major over the real response tokens); ``targets``: those tokens.
    ``response_index``: where each of them sits in the [rows, response_length] output."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: list[int]           # [rows + 1]: where each sequence starts in the packed row
    max_length: int
    predictors: torch.Tensor
    targets: torch.Tensor
    response_index: torch.Tensor    # [rows, response_length] bool
    rows: int
    response_length: int

    def attention_kwargs(self, implementation: str) -> dict:
        """What the model's forward passes down to every attention layer: the boundaries
        on the tokens' device for FlashAttention, on the host for ``PACKED_SDPA`` (which
        loops over them in Python: no device read per layer)."""
        device = self.input_ids.device if implementation != PACKED_SDPA else "cpu"
        bounds = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)
        return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
                "max_length_q": self.max_length, "max_length_k": self.max_length}

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """[n, ...] values of the response tokens -> [rows, response_length, ...], 0 where
        a row has no response token (differentiable)."""
        out = per_token.new_zeros((self.rows, self.response_length) + tuple(per_token.shape[1:]))
        return out.index_put((self.response_index,), per_token)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
         response_length: int) -> PackedRows:
    """Pack a left-padded-prompt, right-padded-response micro-batch (the rollout's layout).

    A response token is predicted by the position just left of it, as in the padded
    forward; that position must be a real token of the same row."""
    rows, width = input_ids.shape
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    flat_real = real.flatten().nonzero().squeeze(1)
    packed_index = torch.full((rows * width,), -1, dtype=torch.long, device=input_ids.device)
    packed_index[flat_real] = torch.arange(flat_real.numel(), device=input_ids.device)
    packed_index = packed_index.view(rows, width)
    response_index = real[:, -response_length:]
    predictors = packed_index[:, width - response_length - 1:width - 1][response_index]
    targets = input_ids[:, -response_length:][response_index]
    host = [0] + torch.cumsum(lengths, 0).tolist()
    if bool((predictors < 0).any()):
        raise ValueError("attention_mask: expected every response token to follow a real token of its row "
                         "(a prompt of at least one token, no padding inside a sequence); found a response token "
                         "after padding")
    return PackedRows(
        input_ids=input_ids.flatten()[flat_real].unsqueeze(0),
        position_ids=position_ids.flatten()[flat_real].unsqueeze(0),
        cu_seqlens=host,
        max_length=int(max(b - a for a, b in zip(host, host[1:]))) if rows else 0,
        predictors=predictors, targets=targets, response_index=response_index, rows=rows,
        response_length=response_length)


@dataclass
class PackedSequences:
    """Whole sequences packed (no response bookkeeping): what a scoring forward needs.
    ``last_tokens``: the packed index of each row's last real token."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: list[int]
    max_length: int
    last_tokens: torch.Tensor

    attention_kwargs = PackedRows.attention_kwargs


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor) -> PackedSequences:
    """Pack a padded batch whose rows each hold one contiguous run of real tokens (left or
    right padding); a row without a real token is refused."""
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    host = [0] + torch.cumsum(lengths, 0).tolist()
    if any(b == a for a, b in zip(host, host[1:])):
        raise ValueError("attention_mask: expected at least one real token in every row; found an empty row")
    flat_real = real.flatten().nonzero().squeeze(1)
    return PackedSequences(
        input_ids=input_ids.flatten()[flat_real].unsqueeze(0),
        position_ids=position_ids.flatten()[flat_real].unsqueeze(0),
        cu_seqlens=host, max_length=int(lengths.max()),
        last_tokens=torch.tensor(host[1:], device=input_ids.device) - 1)


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """HF attention-interface function: SDPA per packed sequence when the forward carries
    sequence boundaries, plain SDPA otherwise. Query/key/value: [1, heads, tokens, dim]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    host = bounds.tolist()
    if sliding_window is not None and max(b - a for a, b in zip(host, host[1:])) > sliding_window:
        raise ValueError(f"model.use_remove_padding: a sequence is longer than the model's sliding window "
                         f"({sliding_window}); packed attention here is full causal: turn padding removal off")
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                   dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
            for a, b in zip(host, host[1:]) if b > a]
    return torch.cat(outs, dim=1), None


def varlen_call(query, key, value, bounds: torch.Tensor, max_length: int, scaling: float | None,
                sliding_window: int | None) -> tuple[tuple, dict] | None:
    """The arguments of ``varlen_attn`` for a packed forward's attention (HF's layout:
    query/key/value [1, heads, tokens, dim]; ``bounds`` the cumulative sequence offsets):
    tokens-major tensors, int32 offsets on the tokens' device, causal (a sliding window of
    W tokens back: HF's ``sliding_window - 1`` left, as its FlashAttention path sets),
    GQA when the key has fewer heads. None where the kernel does not apply (not 16-bit,
    or a head wider than FlashAttention takes): the per-sequence path then."""
    head_dim = query.shape[-1]
    if query.dtype not in VARLEN_DTYPES or head_dim > VARLEN_MAX_HEAD_DIM or head_dim % 8:
        return None
    offsets = bounds.to(device=query.device, dtype=torch.int32)
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, 0)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [tokens, heads, dim]
    return (q, k, v, offsets, offsets, max_length, max_length), {
        "scale": scaling, "window_size": window, "enable_gqa": key.shape[1] != query.shape[1]}


def _varlen_kernel():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def packed_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """HF attention-interface function: torch's varlen FlashAttention over the packed row
    when the forward carries sequence boundaries (and the kernel applies), else as
    ``packed_sdpa_attention``. Returns [1, tokens, heads, dim] as HF's functions do."""
    bounds = kwargs.get("cu_seq_lens_q")
    call = None if bounds is None or dropout else varlen_call(
        query, key, value, bounds, kwargs.get("max_length_q") or int((bounds[1:] - bounds[:-1]).max()), scaling,
        sliding_window)
    if call is None:
        return packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     sliding_window=sliding_window, **kwargs)
    args, options = call
    return _varlen_kernel()(*args, **options).unsqueeze(0), None


def _no_mask_when_packed(*args, attention_mask=None, **kwargs):
    """The mask function of ``PACKED_SDPA``: SDPA's, except for a forward without a padding
    mask (a packed one), which needs none: its attention is bounded per sequence."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, _no_mask_when_packed)
    AttentionInterface.register(PACKED_VARLEN, packed_varlen_attention)
    AttentionMaskInterface.register(PACKED_VARLEN, _no_mask_when_packed)


def packed_attention_implementation(on_gpu: bool) -> str:
    """On a GPU ``flash_attention_2`` where the flash-attn package is installed, else torch's
    varlen FlashAttention (``PACKED_VARLEN``) where this torch has it; ``PACKED_SDPA`` on
    the CPU (and on a GPU with neither)."""
    import importlib.util

    if on_gpu and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    _register()
    if on_gpu and importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        return PACKED_VARLEN
    return PACKED_SDPA


def enable_packing(model, on_gpu: bool | None = None) -> str:
    """Switch ``model``'s attention to one that takes packed sequences; returns its name.
    ``on_gpu``: where it will run (default: wherever CUDA is; a model trained on the CPU of
    a GPU machine says False)."""
    name = packed_attention_implementation(torch.cuda.is_available() if on_gpu is None else on_gpu)
    model.set_attn_implementation(name)
    return name
