"""Bi-directional attention among the Amphista heads of each request.

What it computes
----------------
``q``, ``k`` and ``v`` are ``[B, K, H, D]``: B requests, K head positions
(the Amphista drafting heads, K <= 16), H attention heads, head dim D. For
every request b and attention head h::

    out[b, :, h] = softmax(scale * q[b, :, h] @ k[b, :, h].T + mask_b) @ v[b, :, h]

Attention is full (not causal) among the K positions of one request and never
crosses requests. ``scale`` defaults to ``1 / sqrt(D)``. ``num_valid`` (``[B]``,
int32 or int64, optional) hides key positions ``>= num_valid[b]``; values
``>= K`` mean every position is valid and values ``<= 0`` mean none is, in
which case that request's output is all zeros instead of NaN. Outputs at
query positions ``>= num_valid[b]`` are unspecified but finite. The result has
the input dtype; all arithmetic is float32.

Entry points
------------
* ``bidirectional_head_attention`` is the one the drafter calls: the Triton
  kernel for CUDA tensors, the torch reference for CPU tensors, dispatched by
  the custom op ``amphista_kernels::bidirectional_head_attention`` so that
  compiled graphs (vLLM's ``support_torch_compile``) call the kernel as it is.
  Inputs are validated first; anything unsupported raises ``ValueError``.
* ``bidirectional_head_attention_triton`` launches the kernel. It accepts CPU
  tensors only when Triton runs in interpreter mode (``TRITON_INTERPRET=1``
  set before this module is imported), which is how the tests run it.
* ``bidirectional_head_attention_reference`` is plain torch.

Kernel layout and what it fuses
-------------------------------
One program per (request, attention head): grid ``(B, H)``. Each program
loads the ``K x D`` tiles of q, k and v once (strided loads, so
non-contiguous inputs need no copy), then fuses into that single pass:

* the softmax scale, applied to the fp32 scores;
* the ``num_valid`` key mask, read from the ``[B]`` tensor in the kernel, so
  no ``[B, K, K]`` mask is ever materialised;
* the softmax (fp32, max-subtracted) and the probabilities @ v product;
* the cast back to the input dtype, written straight into ``out``.

Not fused: the q/k/v projections before and the output projection after.
They are large GEMMs over the hidden size that cuBLAS already runs well, and
fusing them would need a tiled GEMM in here for little gain at K <= 16.

Assumptions
-----------
* q, k, v share shape, dtype (fp32, fp16 or bf16) and device; D is one of
  32, 64, 80, 96, 128; 1 <= K <= 16. Any strides are accepted; the output is a
  new contiguous tensor (or the caller's ``out``).
* Block sizes are constexpr: ``BLOCK_D`` is the next power of two of D and
  ``BLOCK_K`` that of K but at least 8, because ``tl.dot`` on NVIDIA needs a
  reduction dimension of at least 8 for fp32 operands (the probabilities @ v
  product reduces over K). Padding rows and columns are masked on load and
  store.
* Both products run as fp32 ``tl.dot`` with ``input_precision="ieee"``: the
  default TF32 would cost ~1e-3 relative error on fp32 inputs, and the
  K x K x D tiles (K <= 16) are too small for tensor cores to pay off. Whether
  a 16-bit tensor-core path is worth it is for the GPU benchmark to show.
"""

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128)
MAX_HEAD_POSITIONS = 16
# tl.dot's smallest reduction dimension on NVIDIA for fp32 operands (the
# kernel upcasts to fp32). The interpreter does not enforce it.
MIN_DOT_BLOCK = 8


@triton.jit
def _bidirectional_head_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, num_valid_ptr,
    stride_q_b, stride_q_k, stride_q_h, stride_q_d,
    stride_k_b, stride_k_k, stride_k_h, stride_k_d,
    stride_v_b, stride_v_k, stride_v_h, stride_v_d,
    stride_out_b, stride_out_k, stride_out_h, stride_out_d,
    stride_num_valid,
    num_positions, head_dim, scale,
    HAS_NUM_VALID: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 so request * stride cannot overflow for large batches.
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)

    positions = tl.arange(0, BLOCK_K)
    dims = tl.arange(0, BLOCK_D)
    tile_mask = (positions[:, None] < num_positions) & (dims[None, :] < head_dim)

    q_tile_ptrs = (q_ptr + request * stride_q_b + head * stride_q_h
                   + positions[:, None] * stride_q_k + dims[None, :] * stride_q_d)
    k_tile_ptrs = (k_ptr + request * stride_k_b + head * stride_k_h
                   + positions[:, None] * stride_k_k + dims[None, :] * stride_k_d)
    v_tile_ptrs = (v_ptr + request * stride_v_b + head * stride_v_h
                   + positions[:, None] * stride_v_k + dims[None, :] * stride_v_d)
    q = tl.load(q_tile_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    k = tl.load(k_tile_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    v = tl.load(v_tile_ptrs, mask=tile_mask, other=0.0).to(tl.float32)

    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale

    key_is_valid = positions < num_positions
    if HAS_NUM_VALID:
        num_valid = tl.load(num_valid_ptr + request * stride_num_valid)
        key_is_valid = key_is_valid & (positions < num_valid)
    scores = tl.where(key_is_valid[None, :], scores, float("-inf"))

    # A row with every key masked has max -inf; using 0 instead keeps
    # exp(-inf - 0) = 0, and the zero denominator is replaced below, so such
    # requests produce zeros rather than NaN.
    row_max = tl.max(scores, axis=1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    weights = tl.exp(scores - row_max[:, None])
    denominator = tl.sum(weights, axis=1)
    denominator = tl.where(denominator == 0.0, 1.0, denominator)
    probabilities = weights / denominator[:, None]

    out = tl.dot(probabilities, v, input_precision="ieee")
    out_tile_ptrs = (out_ptr + request * stride_out_b + head * stride_out_h
                     + positions[:, None] * stride_out_k + dims[None, :] * stride_out_d)
    tl.store(out_tile_ptrs, out.to(out_ptr.dtype.element_ty), mask=tile_mask)


# @triton.jit returns an interpreter-backed function instead of a JITFunction
# when TRITON_INTERPRET=1 was set at decoration time; only that one can run on
# CPU tensors.
_KERNEL_IS_INTERPRETED = not isinstance(_bidirectional_head_attention_kernel, triton.JITFunction)


def _validate_inputs(q, k, v, num_valid, scale):
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D [B, K, H, D] tensor, got shape {tuple(tensor.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k and v must have the same [B, K, H, D] shape, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; supported: {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            "q, k and v must be on the same device, got "
            f"q {q.device}, k {k.device}, v {v.device}")

    batch, num_positions, _, head_dim = q.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"unsupported head dim D={head_dim}; supported: {SUPPORTED_HEAD_DIMS}")
    if not 1 <= num_positions <= MAX_HEAD_POSITIONS:
        raise ValueError(
            f"number of head positions K={num_positions} must be in 1..{MAX_HEAD_POSITIONS}")

    if num_valid is not None:
        if not isinstance(num_valid, torch.Tensor):
            raise ValueError(
                f"num_valid must be a torch.Tensor or None, got {type(num_valid).__name__}")
        if num_valid.shape != (batch,):
            raise ValueError(
                f"num_valid must have shape [B] = ({batch},), got {tuple(num_valid.shape)}")
        if num_valid.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"num_valid must be int32 or int64, got {num_valid.dtype}")
        if num_valid.device != q.device:
            raise ValueError(
                f"num_valid is on {num_valid.device} but q, k, v are on {q.device}")

    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def _default_scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _block_sizes(num_positions, head_dim):
    """(BLOCK_K, BLOCK_D) constexprs for the kernel."""
    block_k = max(MIN_DOT_BLOCK, triton.next_power_of_2(num_positions))
    return block_k, triton.next_power_of_2(head_dim)


def bidirectional_head_attention_reference(q, k, v, num_valid=None, scale=None, batched_matmul=True):
    """Torch implementation; see the module docstring for the semantics.

    ``batched_matmul=False`` forms the two products as broadcast multiply-sums
    instead of batched GEMMs: the same float32 arithmetic, which a
    compiled graph fuses into its own kernels (at one request the two batched
    GEMM calls cost more than the rest of the attention). It materialises
    ``[B, K, K, H, D]``: for the few rows of inference, not for training."""
    _validate_inputs(q, k, v, num_valid, scale)
    num_positions, dtype = q.shape[1], q.dtype
    q, k, v = q.float(), k.float(), v.float()
    if batched_matmul:
        # matmul over [B, H, K, D] views: what einsum computes, with less dispatch at a few rows
        scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1)
    else:
        scores = (q[:, :, None] * k[:, None]).sum(-1).permute(0, 3, 1, 2)
    scores = scores * _default_scale(q, scale)
    if num_valid is not None:
        positions = torch.arange(num_positions, device=q.device)
        key_is_valid = positions[None, :] < num_valid[:, None]
        scores = scores.masked_fill(~key_is_valid[:, None, None, :], float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    if num_valid is not None:
        # softmax over an all-masked row is NaN; such requests return zeros.
        probabilities = probabilities.masked_fill((num_valid <= 0)[:, None, None, None], 0.0)
    if batched_matmul:
        out = (probabilities @ v.transpose(1, 2)).transpose(1, 2)
    else:
        out = (probabilities.permute(0, 2, 3, 1)[..., None] * v[:, None]).sum(2)
    return out.to(dtype)


def bidirectional_head_attention_triton(q, k, v, num_valid=None, scale=None, out=None):
    """Launch the Triton kernel; writes into ``out`` when given (same shape,
    dtype and device as q, any strides), otherwise into a new tensor."""
    _validate_inputs(q, k, v, num_valid, scale)
    if out is not None:
        expected = (tuple(q.shape), q.dtype, q.device)
        actual = ((tuple(out.shape), out.dtype, out.device)
                  if isinstance(out, torch.Tensor) else type(out).__name__)
        if actual != expected:
            raise ValueError(
                f"out must be a tensor with q's (shape, dtype, device) {expected}, got {actual}")
    if not q.is_cuda and not _KERNEL_IS_INTERPRETED:
        raise ValueError(
            f"the Triton kernel needs CUDA tensors, got {q.device}; set TRITON_INTERPRET=1 "
            "before importing amphista_kernels to run it on CPU tensors")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    batch, num_positions, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    block_k, block_d = _block_sizes(num_positions, head_dim)
    _bidirectional_head_attention_kernel[(batch, num_heads)](
        q, k, v, out, num_valid,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        0 if num_valid is None else num_valid.stride(0),
        num_positions, head_dim, _default_scale(q, scale),
        HAS_NUM_VALID=num_valid is not None,
        BLOCK_K=block_k,
        BLOCK_D=block_d,
        # Explicit, so results do not change when Triton 3.10 flips the default.
        enable_fp_fusion=True,
    )
    return out


# One op for compiled graphs (torch.compile / vLLM's support_torch_compile): opaque to the compiler,
# the Triton kernel on CUDA and the torch reference on CPU.
@torch.library.custom_op("amphista_kernels::bidirectional_head_attention", mutates_args=())
def _head_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_valid: torch.Tensor | None,
                       scale: float | None) -> torch.Tensor:
    # Contiguous, as the fake tensor below promises: compiled graphs rely on the output's strides.
    return bidirectional_head_attention_reference(q, k, v, num_valid, scale).contiguous()


@_head_attention_op.register_kernel("cuda")
def _head_attention_op_cuda(q, k, v, num_valid, scale):
    return bidirectional_head_attention_triton(q, k, v, num_valid, scale)


@_head_attention_op.register_fake
def _head_attention_op_fake(q, k, v, num_valid, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def bidirectional_head_attention(q, k, v, num_valid=None, scale=None):
    """Bi-directional attention among each request's head positions: the Triton
    kernel for CUDA tensors, the torch reference for CPU tensors, through one
    custom op that compiled graphs keep as it is. Inputs are validated first;
    anything unsupported raises ``ValueError``."""
    _validate_inputs(q, k, v, num_valid, scale)
    return _head_attention_op(q, k, v, num_valid, None if scale is None else float(scale))
