"""One layer's decode attention over paged KV blocks against contiguous per-row KV, in one run
(issues 48, 61): SDPA over contiguous K/V (what the slot pool read), a gather of each row's blocks
into a contiguous buffer then SDPA (the engine's fallback), and compiled ``flex_attention`` reading
the blocks in place as the engine runs it (pipeline.engines.attention_kernel.AttentionKernel:
static row buckets, compiled and self-checked at the pool's allocation; the compile count and
warm-up time per pool are printed), for each block size. Rows' blocks are scattered at random over
the pool. Prints milliseconds per call (median of --repeats) and each kernel's ratio to contiguous
SDPA; on CPU also the compiled kernel over rows of mixed lengths with each of inductor's CPU
templates (the general one the engine keeps, and the decoding one inductor would pick for a static
row count: ``pipeline.engines.attention_kernel.kernel_options``); then the host bookkeeping of one decoding step (``KVCache.stepping`` without the forward pass)
at --bookkeeping rows in pools of --bookkeeping-blocks blocks, and whether such a step runs the kernel.

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
    parser.add_argument("--bookkeeping", default="16,256,1024",
                        help="row counts whose per-step host bookkeeping is measured ('' : none)")
    parser.add_argument("--bookkeeping-blocks", default="4096,16384",
                        help="the bookkeeping pools' blocks, one pool each (comma-separated)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from pipeline.engines.attention_kernel import AttentionKernel, gather_attention

    compiles: dict = {}

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
        tables = torch.randperm(blocks, device=device)[:n * per_row].view(n, per_row).cpu().numpy().astype(np.int32)
        lengths = np.full(n, length)
        slots = np.arange(n)

        def gathered_step(keys=keys, values=values, tables=tables):  # the engine's fallback
            return gather_attention(query, keys, values, tables, lengths, bs, d ** -0.5)

        results[f"gather {bs}-token blocks, then sdpa"] = _time(gathered_step, args.repeats)

        def take(keys=keys, values=values, tables=tables):  # KVCache.take: every layer's keys and values, copied out
            logical = np.arange(length)
            places = torch.from_numpy((tables[:, logical // bs].astype(np.int64) * bs + logical % bs).reshape(-1))
            for _ in range(args.layers):
                for tensor in (keys, values):
                    tensor[0].index_select(1, places).view(hkv, n, -1, d).transpose(0, 1).contiguous()

        results[f"KVCache.take of the rows, {args.layers} layers, {bs}-token blocks (once per speculative "
                f"session)"] = _time(take, max(1, args.repeats // 2))
        kernel = AttentionKernel(keys, values, hq, bs, per_row, max_rows=n)
        kernel.warm_up()  # the engine's compiles and self-check: one per row bucket, at the pool's allocation
        compiles[bs] = {"buckets": kernel.buckets, "compiles": kernel.compiles,
                        "warm_up_s": round(kernel.warm_up_seconds, 1), "kernel": kernel.kernel,
                        "reason": kernel.reason}
        name = f"flex_attention compiled as the engine does (static row bucket {kernel.buckets[-1]}), {bs}-token blocks"
        if kernel.kernel != "flex_attention":
            results[f"{name}: {kernel.reason}"] = None
            continue
        kernel.write_rows(slots, tables)
        step = kernel.step(slots, lengths, tables)

        def paged(keys=keys, values=values, kernel=kernel, step=step):  # as the engine's steps run
            with torch.inference_mode():
                return kernel.attend(query, keys, values, step, d ** -0.5)

        error = (paged() - gathered_step()).abs().max().item()
        results[f"{name} in place (max diff {error:.1e})"] = _time(paged, args.repeats)
        assert kernel.gathered_steps == 0, "the compiled kernel was not called (a guard failed): not measured"
        if device.type == "cpu":
            results.update(_templates(kernel, query, tables, length, args.repeats))
    base = results["sdpa, contiguous K/V"]
    take = [ms for name, ms in results.items() if name.startswith("KVCache.take")]
    flex = [ms for name, ms in results.items() if name.startswith("flex_attention") and ms is not None]
    if take and flex:
        print(f"KVCache.take costs {take[-1] / (flex[-1] * args.layers):.1f} decode steps' attention "
              f"({args.layers} layers of flex_attention)")
    print(f"{n} rows x {length} tokens, {hq}/{hkv} heads, dim {d}, {args.threads} thread(s), {device}")
    for name, ms in results.items():
        print(f"{name:<100} " + (f"{ms:>8.2f} ms  {ms / base:>5.2f}x" if ms is not None else "not built"))
    for bs, figures in compiles.items():
        print(f"pool of {bs}-token blocks: {figures['compiles']} compiles for row buckets {figures['buckets']} "
              f"in {figures['warm_up_s']} s (kernel: {figures['kernel']}{', ' + figures['reason'] if figures['reason'] else ''})")
    bookkeeping = {}
    if args.bookkeeping:
        for pool in [int(b) for b in args.bookkeeping_blocks.split(",")]:
            bookkeeping[pool] = host_bookkeeping([int(r) for r in args.bookkeeping.split(",")], pool,
                                                 args.repeats * 10)
    write_json(args.json, {"command": " ".join(sys.argv), "ms": results, "compiles": compiles,
                           "host_bookkeeping_ms": bookkeeping})
    return 0


def _templates(kernel, query, tables: np.ndarray, length: int, repeats: int) -> dict:
    """Rows of mixed lengths (length / 2 to length, as a real step's), one layer, in ``kernel``'s pool,
    at all the query's rows and at a sixteenth of them (a pruned step, a smaller bucket): the CPU
    template the engine keeps (``kernel_options``: general) against the one inductor picks by itself
    for a static row count (decoding, where the pool's tokens over the bucket's rows reach 512), which
    spans the whole pool once rows differ."""
    from pipeline.engines.attention_kernel import AttentionKernel, gather_attention

    bs, scale = kernel.block_size, query.shape[-1] ** -0.5
    kernels = {}
    for label, options in (("general template (the engine's)", kernel.options), ("decoding template", {})):
        own = AttentionKernel(kernel.keys, kernel.values, kernel.heads, bs, kernel.row_blocks, max_rows=len(query))
        own.options = options
        own.warm_up()
        own.write_rows(np.arange(len(query)), tables)
        kernels[label] = own
    out = {}
    for n in sorted({len(query), max(1, len(query) // 16)}, reverse=True):
        lengths = np.random.default_rng(n).integers(max(1, length // 2), length + 1, n)
        slots = np.arange(n)
        reference = gather_attention(query[:n], kernel.keys, kernel.values, tables[:n], lengths, bs, scale)
        for label, own in kernels.items():
            step = own.step(slots, lengths, tables)

            def paged(own=own, step=step):
                with torch.inference_mode():
                    return own.attend(query[:n], own.keys, own.values, step, scale)

            error = (paged() - reference).abs().max().item()
            name = (f"flex_attention, {n} rows of mixed lengths (bucket {step.bucket}), {bs}-token blocks, "
                    f"{own.num_blocks}-block pool, CPU {label} (max diff {error:.1e})")
            out[name] = _time(paged, repeats) if own.kernel == "flex_attention" else None
            assert own.gathered_steps == 0, "the compiled kernel was not called (a guard failed): not measured"
    return out


def host_bookkeeping(row_counts: list[int], pool_blocks: int, steps: int) -> dict:
    """The host work of one decoding step as the engine does it (``KVCache.stepping`` entered and left,
    no forward pass: the rows' new blocks, places and positions, the kernel's per-row metadata), per
    step, for ``row_counts`` rows of a 100-token prompt in a pool of ``pool_blocks`` 128-token blocks,
    over ``steps`` steps (across a block edge). A small random Llama: the bookkeeping does not depend on
    the model's size. Milliseconds per step (median, and the mean with the steps that take blocks), and
    whether the step runs the compiled kernel (its row bucket; 0: it gathers) and the pool's kernel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.engines.kv_cache import KVCache
    from pipeline.engines.rows import RowBatch

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    out = {}
    probe = KVCache(model, torch.device("cpu"), memory=1 << 20, decode=False)
    probe._allocate_for_model()
    kv = KVCache(model, torch.device("cpu"), memory=pool_blocks * probe.block_bytes, max_rows=max(row_counts))
    prompt = [5 + i % 50 for i in range(100)]
    with torch.inference_mode():
        batch, _ = RowBatch.prefill(model, [prompt], 0, torch.device("cpu"))
        for rows in row_counts:
            handles = kv.admit(batch, [0] * rows)
            times = []
            tokens = torch.full((rows,), 7)
            for _ in range(steps):
                started = time.perf_counter()
                with kv.stepping(handles, tokens) as inputs:
                    pass
                times.append(time.perf_counter() - started)
            bucket = inputs["paged"].step.bucket  # the step's row bucket (0: it gathers)
            kv.release(handles)
            kv.collect()
            out[rows] = {"median": round(statistics.median(times) * 1e3, 3),
                         "mean": round(statistics.mean(times) * 1e3, 3), "bucket": bucket,
                         "kernel": kv.kernel.kernel, "buckets": kv.kernel.buckets}
            print(f"host bookkeeping per step, {rows} rows, pool of {kv.num_blocks} blocks: "
                  f"{out[rows]['median']:.3f} ms median, {out[rows]['mean']:.3f} ms mean over {steps} steps; "
                  + (f"the step runs the kernel (bucket {bucket})" if bucket else "the step gathers")
                  + f" (pool's kernel {kv.kernel.kernel}{': ' + kv.kernel.reason if kv.kernel.reason else ''}, "
                  f"{kv.kernel.compiles} compiles for buckets {kv.kernel.buckets})")
    return out


if __name__ == "__main__":
    sys.exit(main())
