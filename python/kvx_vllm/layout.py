"""Describing vLLM's KV-cache tensors to kvx: a ``LayoutSpec`` (as a dict) and the memory regions.

vLLM's CPU attention backend gives every attention layer one tensor of shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, contiguous. Its kernels (ISA ``vec``,
measured with ``cpu_attn_reshape_and_cache``) store, per block and head, the block's K vectors
*dimension-major* (``K[dim][token]``) and then its V vectors token-major (``V[token][dim]``).
kvx describes exactly that (mode ``exact``, the default): memory order ``hnd-kt`` (head-major,
keys dimension-major) in arrangement ``per-layer-head-kv`` (each head's K then its V, per
block). Token by token, so prefill and decode may use different block sizes and TP degrees.

Mode ``block`` describes the CPU cache at block granularity instead: each engine block is one
kvx "token" whose K half and V half are the first and second half of the block's bytes
(``head_dim = local_heads * block_size * head_size``, ``block_tokens = 1``,
``total_kv_heads = tp_size``), token counts rounded up to whole blocks (``token_unit =
block_size``). Whole blocks move byte for byte, which needs the same block size, KV heads per
rank and TP degree on both sides; the handshake refuses any other pairing.

That inner order is the one of the ``vec`` kernels (``vec``, ``vec16``). vLLM picks the kernel per
dtype, block size and CPU (``_get_attn_isa``): its AMX kernel (bf16 on recent Xeons), and the ARM
and fp8 ones, pack K and V differently. So ``exact`` is used only when the kernel is known to be
a ``vec`` one; otherwise (``auto``) the cache is described block by block, which needs the same
kernel on both sides: a prefill and a decode on different kernels that both describe their caches
block by block are not told apart.

On GPUs, vLLM from 0.32 on hands every layer a view ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` of one shared allocation whose last axis holds, per token and head, the K vector
then the V vector (its attention backends split it in halves). Its strides follow vLLM's cache
layout: ``LBHNC`` (head-major, what the kvx connectors ask vLLM for, as its ``HND``) or ``LBNHC``
(token-major): kvx describes those as ``per-layer-cell-kv`` in order ``hnd`` or ``nhd``, token
by token. Block-outermost layouts (a block of every layer together) and padded pages are refused.

The FlashAttention layout of earlier vLLMs, ``(2, num_blocks, block_size, num_kv_heads,
head_size)``, maps exactly onto ``per-layer-kv-halves``: in order ``nhd`` when contiguous, ``hnd``
when its strides put heads before tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

#: vLLM CPU attention kernels whose block layout is "per head: K dimension-major, then V".
VEC_KERNELS = ("vec", "vec16")

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int8: "int8",
    torch.uint8: "int8",
}
for _name, _kvx in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _kvx


@dataclass
class CacheDescription:
    """What the native ``Producer``/``Consumer`` take: layout, regions, token unit."""

    layout: dict[str, Any]
    regions: list[tuple[int, int]]
    token_unit: int
    mode: str
    # The tensors whose memory is registered: kept referenced for the connector's life.
    tensors: list[torch.Tensor]


def _layer_index(name: str) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(numbers[-1])


def ordered_layers(kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The caches in layer order; layers sharing one tensor (KV sharing) appear once."""
    seen: set[int] = set()
    out = []
    for name, tensor in sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0])):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out.append((name, tensor))
    return out


def describe(
    kv_caches: dict[str, torch.Tensor],
    *,
    head_size: int,
    total_kv_heads: int,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    mode: str = "auto",
    cpu_kernel: str | None = "vec",
    cells: bool | None = None,
    mla: bool = False,
) -> CacheDescription:
    """Describes the per-layer KV tensors vLLM hands to ``register_kv_caches``. ``cells``: a 4D
    tensor holds K then V per token and head (vLLM's GPU backends from 0.32 on) rather than
    vLLM's CPU blocks; by default, whether the tensors are on a GPU. ``mla``: the model uses
    multi-head latent attention, whose cache holds one latent vector of ``head_size`` values per
    token (``[num_blocks, block_size, head_size]`` per layer, or ``[num_blocks, 1, block_size,
    head_size]`` as vLLM's CPU MLA backend has it), the same on every TP rank."""
    if mode not in ("auto", "exact", "block"):
        raise ValueError(f"unknown layout mode {mode!r}")
    layers = ordered_layers(kv_caches)
    if not layers:
        raise ValueError("no KV cache tensors to register")
    first_name, first = layers[0]
    for name, t in layers:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"KV caches differ: {first_name} {tuple(first.shape)} {first.dtype} {first.device}"
                f" vs {name} {tuple(t.shape)} {t.dtype} {t.device}"
            )
    if first.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"KV caches on {first.device} are not supported by kvx_vllm (host or CUDA memory)"
        )
    dtype = _DTYPES.get(first.dtype)
    if dtype is None:
        raise NotImplementedError(f"KV cache dtype {first.dtype} is not supported")
    shape = tuple(first.shape)
    esize = first.element_size()
    base = {
        "num_layers": len(layers),
        "dtype": dtype,
        "mla": False,
        "tp_size": tp_size,
        "tp_rank": tp_rank,
    }
    if cells is None:
        cells = first.device.type == "cuda"

    if mla:
        # One latent vector per token, token after token within a block; no heads, no K/V
        # halves. Every TP rank holds all of it, and each decode rank reads it from one
        # prefill rank (the planner picks which).
        latent_shape = (shape[0], *shape[2:]) if len(shape) == 4 and shape[1] == 1 else shape
        if len(latent_shape) != 3 or latent_shape[1:] != (block_size, head_size):
            raise NotImplementedError(
                f"unknown MLA cache shape {shape}: expected [num_blocks, {block_size}, "
                f"{head_size}] (or [num_blocks, 1, {block_size}, {head_size}]) per layer"
            )
        if mode == "block":
            raise ValueError("layout 'block' is only for the CPU backend's attention cache, "
                             "not an MLA cache")
        _dense_order(layers, {"nhd": tuple(range(len(shape)))},
                     "a contiguous [blocks, tokens, latent] tensor")
        layout = dict(base, mla=True, total_kv_heads=1, head_dim=head_size,
                      block_tokens=block_size, num_blocks=shape[0], order="nhd",
                      arrangement="per-layer-split")
        return _described(layout, layers, esize, unit=1, mode="exact")

    def token_exact(num_blocks: int, order: str, arrangement: str) -> dict[str, Any]:
        return dict(base, total_kv_heads=total_kv_heads, head_dim=head_size,
                    block_tokens=block_size, num_blocks=num_blocks, order=order,
                    arrangement=arrangement)

    if len(shape) == 4 and shape[3] == 2 * head_size and shape[2] == block_size:
        # [num_blocks, local_heads, block_size, 2 * head_size] per layer.
        num_blocks, local_heads = shape[0], shape[1]
        if local_heads != max(1, total_kv_heads // tp_size):
            raise ValueError(
                f"KV cache {first_name} holds {local_heads} heads; {total_kv_heads} KV heads over "
                f"TP {tp_size} give {max(1, total_kv_heads // tp_size)} per rank"
            )
        if cells:
            # vLLM >= 0.32 on GPUs: per token and head, K then V.
            if mode == "block":
                raise ValueError("layout 'block' is only for the CPU backend's cache")
            order = _dense_order(layers, {"hnd": (0, 1, 2, 3), "nhd": (0, 2, 1, 3)},
                                 "vLLM's LBHNC or LBNHC cache layout (VLLM_KV_CACHE_LAYOUT)")
            layout = token_exact(num_blocks, order, "per-layer-cell-kv")
            unit, chosen = 1, "exact"
        else:
            # CPU attention: per block and head, K dimension-major then V token-major.
            _dense_order(layers, {"contiguous": (0, 1, 2, 3)}, "a contiguous tensor")
            vec = cpu_kernel in VEC_KERNELS
            if mode == "exact" and not vec:
                raise ValueError(
                    f"layout 'exact' needs one of vLLM's vec CPU attention kernels "
                    f"{VEC_KERNELS}; this cache uses {cpu_kernel!r}, whose block layout kvx does "
                    "not describe token by token: use 'auto' or 'block'"
                )
            if mode == "block" or not vec:
                layout = dict(
                    base,
                    total_kv_heads=tp_size,
                    head_dim=local_heads * block_size * head_size,
                    block_tokens=1,
                    num_blocks=num_blocks,
                    order="nhd",
                    arrangement="per-layer-kv-in-block",
                )
                unit, chosen = block_size, "block"
            else:
                layout = token_exact(num_blocks, "hnd-kt", "per-layer-head-kv")
                unit, chosen = 1, "exact"
    elif len(shape) == 5 and shape[0] == 2 and shape[2] == block_size and shape[4] == head_size:
        # FlashAttention before vLLM 0.32: (2, num_blocks, block_size, local_heads, head_size).
        if mode == "block":
            raise ValueError("layout 'block' is only for the CPU backend's cache")
        order = _dense_order(layers, {"nhd": (0, 1, 2, 3, 4), "hnd": (0, 1, 3, 2, 4)},
                             "vLLM's NHD or HND cache layout")
        layout = token_exact(shape[1], order, "per-layer-kv-halves")
        unit, chosen = 1, "exact"
    else:
        raise NotImplementedError(
            f"unknown KV cache shape {shape} (head size {head_size}, block size {block_size})"
        )
    return _described(layout, layers, esize, unit=unit, mode=chosen)


def _described(layout: dict[str, Any], layers: list[tuple[str, torch.Tensor]], esize: int, *,
               unit: int, mode: str) -> CacheDescription:
    # Each layer's tensor is dense (checked by the caller), so its bytes are one range from its
    # start.
    return CacheDescription(
        layout=layout,
        regions=[(t.data_ptr(), t.numel() * esize) for _, t in layers],
        token_unit=unit,
        mode=mode,
        tensors=[t for _, t in layers],
    )


def _dense_order(layers: list[tuple[str, torch.Tensor]], orders: dict[str, tuple[int, ...]],
                 expected: str) -> str:
    """The name of the order (axes from outermost to innermost in memory) in which every
    layer's tensor is dense, without gaps; axes of size 1 may have any stride."""
    for name, axes in orders.items():
        if all(_dense_in(t, axes) for _, t in layers):
            return name
    odd = [(n, t) for n, t in layers if not any(_dense_in(t, a) for a in orders.values())]
    if not odd:
        raise NotImplementedError(f"the KV caches' layers are laid out in different orders of "
                                  f"{sorted(orders)}")
    layer, t = odd[0]
    raise NotImplementedError(
        f"KV cache {layer} (shape {tuple(t.shape)}, strides {t.stride()}) is not laid out as "
        f"{expected}: kvx describes dense per-layer tensors only"
    )


def _dense_in(t: torch.Tensor, axes: tuple[int, ...]) -> bool:
    step = 1
    for axis in reversed(axes):
        if t.shape[axis] != 1 and t.stride(axis) != step:
            return False
        step *= t.shape[axis]
    return True

