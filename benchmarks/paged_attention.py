"""One layer's decode attention over paged KV blocks against contiguous per-row KV, in one run
(issue 48): SDPA over contiguous K/V (what the slot pool read), a gather of each row's blocks into a
contiguous buffer then SDPA, and compiled ``flex_attention`` reading the blocks in place through
the BlockMask the KV cache builds (pipeline.engines.kv_cache: whole blocks full, the last partial),
for each block size. Rows' blocks are scattered at random over the pool. Prints milliseconds per
call (median of --repeats) and each kernel's ratio to contiguous SDPA.

    python -m benchmarks.paged_attention --rows 128 --length 356 --threads 1 --json out/bench/paged-attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _time(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--length", type=int, default=356, help="tokens per row")
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-sizes", default="32,64,128")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n, hq, hkv, d, length = args.rows, args.heads, args.kv_heads, args.head_dim, args.length
    sdpa = torch.nn.functional.scaled_dot_product_attention
    query = torch.randn(n, hq, 1, d, device=device)
    contiguous_k = torch.randn(n, hkv, length, d, device=device)
    contiguous_v = torch.randn(n, hkv, length, d, device=device)
    results = {"sdpa, contiguous K/V": _time(lambda: sdpa(query, contiguous_k, contiguous_v, enable_gqa=True),
                                             args.repeats)}
    compiled = torch.compile(flex_attention, dynamic=True)
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        per_row = -(-length // bs)
        blocks = n * per_row + 64
        keys = torch.randn(1, hkv, blocks * bs, d, device=device)
        values = torch.randn(1, hkv, blocks * bs, d, device=device)
        tables = torch.randperm(blocks, device=device)[:n * per_row].view(n, per_row).to(torch.int32)
        places = (tables.long()[:, :, None] * bs + torch.arange(bs, device=device)).view(n, -1)[:, :length]

        def gathered(places=places, keys=keys, values=values):
            k = keys[0][:, places].transpose(0, 1)  # [n, H, L, D]
            v = values[0][:, places].transpose(0, 1)
            return sdpa(query, k, v, enable_gqa=True)

        whole, fill = length // bs, length % bs
        last = tables[:, min(whole, per_row - 1)]
        filled = torch.full((n,), fill, dtype=torch.int32, device=device)

        def mask_mod(b, h, q, kv, last=last, filled=filled, bs=bs):
            return (kv // bs != last[b]) | (kv % bs < filled[b])

        index = torch.zeros((n, 1, 1, blocks), dtype=torch.int32, device=device)
        index[:, 0, 0, :per_row] = tables
        partial = torch.zeros((n, 1, 1, blocks), dtype=torch.int32, device=device)
        partial[:, 0, 0, 0] = last
        mask = BlockMask.from_kv_blocks(torch.full((n, 1, 1), int(fill > 0), dtype=torch.int32, device=device),
                                        partial, torch.full((n, 1, 1), whole, dtype=torch.int32, device=device),
                                        index, BLOCK_SIZE=(128, bs), mask_mod=mask_mod,
                                        seq_lengths=(1, blocks * bs), compute_q_blocks=False)

        def paged(keys=keys, values=values, mask=mask):
            return compiled(query, keys, values, block_mask=mask, enable_gqa=True)

        error = (paged() - gathered()).abs().max().item()
        results[f"gather {bs}-token blocks, then sdpa"] = _time(gathered, args.repeats)
        results[f"flex_attention, {bs}-token blocks in place (max diff {error:.1e})"] = _time(paged, args.repeats)
    base = results["sdpa, contiguous K/V"]
    print(f"{n} rows x {length} tokens, {hq}/{hkv} heads, dim {d}, {args.threads} thread(s), {device}")
    for name, ms in results.items():
        print(f"{name:<62} {ms:>8.2f} ms  {ms / base:>5.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "ms": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
