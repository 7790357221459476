"""Time the bi-directional head attention kernel against torch SDPA on a GPU.

Shapes are Vicuna-7B's (H=32 attention heads, D=128) with K Amphista head
positions per request. SDPA gets the same tensors as [B, H, K, D] transposed
views (no copies) and the ``num_valid`` key mask as a [B, 1, 1, K] boolean
``attn_mask``; its output is transposed back, again as a view. Both results
are checked against each other on the specified (valid) query rows.

    python -m amphista_kernels.bench_head_attention [--runs 100] ...
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from amphista_kernels.head_attention import bidirectional_head_attention_triton

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Looser than the unit tests: SDPA rounds its probabilities to the input dtype.
AGREEMENT_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--positions", type=int, nargs="+", default=[4, 5, 6, 7, 8],
                        help="K, the number of Amphista head positions per request")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float16", "bfloat16"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--runs", type=int, default=100, help="timed runs; the median is reported")
    parser.add_argument("--no-mask", action="store_true",
                        help="time without num_valid (every position valid)")
    return parser.parse_args(argv)


def sdpa_head_attention(q, k, v, num_valid):
    """The same attention through torch SDPA; q, k, v are [B, K, H, D]."""
    mask = None
    if num_valid is not None:
        positions = torch.arange(q.shape[1], device=q.device)
        mask = (positions[None, :] < num_valid[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def median_microseconds(fn, warmup, runs):
    for _ in range(warmup):
        fn()
    timings = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        timings.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(timings)


def relative_error_on_valid_rows(out, expected, num_valid):
    if num_valid is not None:
        positions = torch.arange(out.shape[1], device=out.device)
        valid_rows = positions[None, :] < num_valid[:, None]
        out, expected = out[valid_rows], expected[valid_rows]
    out, expected = out.double(), expected.double()
    return ((out - expected).norm() / expected.norm()).item()


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA GPU is available: the Triton head attention benchmark needs one. "
              "GPU figures are pending.")
        return 0

    print(f"GPU: {torch.cuda.get_device_name()}; H={args.heads}, D={args.head_dim}, "
          f"median of {args.runs} runs after {args.warmup} warmup, "
          f"{'no mask' if args.no_mask else 'num_valid mask in 1..K'}")
    print()
    print("| B | K | dtype | triton µs | sdpa µs | sdpa / triton | rel. error |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    all_agree = True
    generator = torch.Generator(device="cuda").manual_seed(0)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for positions in args.positions:
            for batch in args.batch_sizes:
                shape = (batch, positions, args.heads, args.head_dim)
                q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=generator)
                           for _ in range(3))
                num_valid = None if args.no_mask else torch.randint(
                    1, positions + 1, (batch,), device="cuda", generator=generator)
                out = torch.empty_like(q)

                triton_us = median_microseconds(
                    lambda: bidirectional_head_attention_triton(q, k, v, num_valid, out=out),
                    args.warmup, args.runs)
                sdpa_us = median_microseconds(
                    lambda: sdpa_head_attention(q, k, v, num_valid), args.warmup, args.runs)

                error = relative_error_on_valid_rows(
                    bidirectional_head_attention_triton(q, k, v, num_valid),
                    sdpa_head_attention(q, k, v, num_valid), num_valid)
                agrees = error <= AGREEMENT_TOLERANCE[dtype]
                all_agree &= agrees
                print(f"| {batch} | {positions} | {dtype_name} | {triton_us:.1f} | "
                      f"{sdpa_us:.1f} | {sdpa_us / triton_us:.2f} | "
                      f"{error:.1e}{'' if agrees else ' MISMATCH'} |")
    if not all_agree:
        print("\nTriton and SDPA results disagree beyond tolerance (rows marked MISMATCH).")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
