"""One layer's decode attention over paged KV blocks against contiguous per-row KV, in one run
(issue 48): SDPA over contiguous K/V (what the slot pool read), a gather of each row's blocks into a
contiguous buffer then SDPA (the engine's fallback), and compiled ``flex_attention`` reading the
blocks in place through the BlockMask the KV cache builds (pipeline.engines.kv_cache.block_mask:
whole blocks full, the last partial), compiled as the engine compiles it (the pool's length static,
the row count dynamic), for each block size. Rows' blocks are scattered at random over the pool. Prints milliseconds per
call (median of --repeats) and each kernel's ratio to contiguous SDPA.

    python -m benchmarks.paged_attention --rows 128 --length 356 --threads 1 --json out/bench/paged-attention.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks import write_json


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
    parser.add_argument("--layers", type=int, default=30,
                        help="layers a KVCache.take copies (SmolLM2-135M: 30): the copy out of the pool that "
                             "speculative decoding's rows make, timed against one step's attention over as many layers")
    parser.add_argument("--pool-blocks", type=int, default=0,
                        help="blocks in the pool (0: the rows' blocks plus 64); a build's pool is sized by its budget")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from pipeline.engines import kv_cache
    from pipeline.engines.kv_cache import StepAttention, block_mask

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
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        per_row = -(-length // bs)
        blocks = max(args.pool_blocks, n * per_row) if args.pool_blocks else n * per_row + 64
        keys = torch.randn(1, hkv, blocks * bs, d, device=device)
        values = torch.randn(1, hkv, blocks * bs, d, device=device)
        tables = torch.randperm(blocks, device=device)[:n * per_row].view(n, per_row).to(torch.int32)

        table = np.zeros((n, blocks), dtype=np.int32)
        table[:, :per_row] = tables.cpu().numpy()
        step = StepAttention(block_mask(table, np.full(n, length), bs, blocks, device), table, np.full(n, length),
                             bs, device)
        mask = step.mask

        def gathered_step(keys=keys, values=values, step=step):  # the engine's fallback (kv_cache._attend)
            places, valid = step.places()
            return sdpa(query, keys[0][:, places].transpose(0, 1), values[0][:, places].transpose(0, 1),
                        attn_mask=valid, enable_gqa=True)

        results[f"gather {bs}-token blocks, then sdpa"] = _time(gathered_step, args.repeats)

        def take(keys=keys, values=values, step=step):  # KVCache.take: every layer's keys and values, copied out
            places, _ = step.places()
            for _ in range(args.layers):
                for tensor in (keys, values):
                    tensor[0].index_select(1, places.reshape(-1)).view(hkv, n, -1, d).transpose(0, 1).contiguous()

        results[f"KVCache.take of the rows, {args.layers} layers, {bs}-token blocks (once per speculative "
                f"session)"] = _time(take, max(1, args.repeats // 2))
        kv_cache._static(keys, 2), kv_cache._static(values, 2)
        kv_cache.warm_up(keys, values, hq, bs)  # the engine's compiles: the pool static, the row count dynamic
        name = f"flex_attention compiled as the engine does (pool static, rows dynamic), {bs}-token blocks"

        def paged(keys=keys, values=values, mask=mask):
            return kv_cache._flex()(query, keys, values, block_mask=mask, enable_gqa=True)

        try:
            error = (paged() - gathered_step()).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - reported: inductor's CPU template fails on some shapes
            results[f"{name}: {type(exc).__name__}"] = None
            continue
        results[f"{name} in place (max diff {error:.1e})"] = _time(paged, args.repeats)
    base = results["sdpa, contiguous K/V"]
    take = [ms for name, ms in results.items() if name.startswith("KVCache.take")]
    flex = [ms for name, ms in results.items() if name.startswith("flex_attention") and ms is not None]
    if take and flex:
        print(f"KVCache.take costs {take[-1] / (flex[-1] * args.layers):.1f} decode steps' attention "
              f"({args.layers} layers of flex_attention)")
    print(f"{n} rows x {length} tokens, {hq}/{hkv} heads, dim {d}, {args.threads} thread(s), {device}")
    for name, ms in results.items():
        print(f"{name:<100} " + (f"{ms:>8.2f} ms  {ms / base:>5.2f}x" if ms is not None else "not built"))
    write_json(args.json, {"command": " ".join(sys.argv), "ms": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
