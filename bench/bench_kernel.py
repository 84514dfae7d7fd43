"""Attention for selected query rows, one layer: Triton kernel vs SDPA (dense causal, masked) and
compiled FlexAttention, on CUDA. GQA 40/8, head dim 128, bf16; contexts 4K/8K/16K; 10/20/30% of
the context selected in runs of 8 plus a 64-token question.

Useful FLOPs are counted from the causal pairs: a query at position p sees p + 1 keys, and each
pair costs 4·D FLOPs per head (2·D for QK^T, 2·D for PV).
Usage (GPU machine): python bench/bench_kernel.py [--contexts 4096 8192 16384] [--ratios 0.1 0.2 0.3]
                                                  [--json bench/results/kernel_h200.json]
The JSON holds one object per (context, ratio): dense_tflops, flex_tflops, masked_tflops,
kernel_tflops (the default tiles), kernel_<M>x<N>_w<warps>_s<stages>_tflops for each tile of --tiles,
question_only_tflops, context, ratio, rows, date. It is rewritten after every path, so a run stopped at
its time limit keeps what it measured; the headline paths (dense, masked, the kernel) come first.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from cacheclip_rag.kernels.selected_attention import selected_attention, selected_attention_reference

HEADS, KV_HEADS, DIM, QUESTION, RUN = 40, 8, 128, 64, 8


def selected_positions(context: int, ratio: float, generator: torch.Generator) -> torch.Tensor:
    """Runs of RUN tokens covering `ratio` of the chunk rows, then the question's rows."""
    chunk_rows = context - QUESTION
    runs = max(1, int(ratio * chunk_rows) // RUN)
    starts = torch.randperm(chunk_rows // RUN, generator=generator)[:runs] * RUN
    picked = (starts[:, None] + torch.arange(RUN)).flatten()
    return torch.cat([picked.sort().values, torch.arange(chunk_rows, context)])


def useful_flops(positions: torch.Tensor) -> float:
    return float((positions.double() + 1).sum()) * HEADS * DIM * 4


def time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--tiles", default="128x64x8x3,128x128x8x2,128x128x8x3,64x64x4x3",
                    help="kernel tiles to time beside the default: rows x keys x warps x stages, comma-separated")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernel needs CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=True)
    g = torch.Generator().manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    scale = DIM**-0.5
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} GQA {HEADS}/{KV_HEADS} d={DIM} bf16")
    cases = []
    print("| context | selected | rows | path | ms | TFLOP/s (useful) | vs dense SDPA TFLOP/s | max err vs ref |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in args.contexts:
        k = torch.randn(1, KV_HEADS, n, DIM, device=dev, dtype=dt)
        v = torch.randn(1, KV_HEADS, n, DIM, device=dev, dtype=dt)
        q_all = torch.randn(1, HEADS, n, DIM, device=dev, dtype=dt)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            dense_ms = time_ms(lambda: F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=True))
        dense_tf = useful_flops(torch.arange(n)) / dense_ms / 1e9
        print(f"| {n} | 100% | {n} | SDPA flash, dense causal | {dense_ms:.3f} | {dense_tf:.0f} | 1.00 | - |")
        for ratio in args.ratios:
            pos = selected_positions(n, ratio, g).to(dev)
            rows = pos.numel()
            q = q_all[:, :, pos]
            flops = useful_flops(pos)
            ref = selected_attention_reference(q.float(), k.float(), v.float(), pos[None], scale)

            case = {"context": n, "ratio": ratio, "rows": rows, "dense_tflops": dense_tf,
                    "date": datetime.date.today().isoformat()}

            def report(name: str, ms: float, out: torch.Tensor | None, field: str | None = None,
                       work: float = flops, reference: torch.Tensor = ref) -> None:
                tf = work / ms / 1e9
                err = "-" if out is None else f"{(out.float() - reference).abs().max().item():.1e}"
                print(f"| {n} | {ratio:.0%} | {rows} | {name} | {ms:.3f} | {tf:.0f} | {tf / dense_tf:.2f} | {err} |",
                      flush=True)
                if field:
                    case[field] = tf
                    if args.json:  # rewritten after every path: a stopped run keeps what it measured
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps(cases, indent=1))

            cases.append(case)
            mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]
            masked = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
            report("SDPA, boolean mask", time_ms(masked), masked().transpose(1, 2), "masked_tflops")
            pos32 = pos[None].to(torch.int32)
            run_tuned = lambda: selected_attention(q, k, v, pos32, scale, validate=False)  # noqa: E731
            report("Triton selected rows (ours, default tiles)", time_ms(run_tuned), run_tuned(), "kernel_tflops")
            for tile in args.tiles.split(","):
                bm, bn, warps, stages = (int(x) for x in tile.split("x"))
                run_tile = lambda bm=bm, bn=bn, w=warps, st=stages: selected_attention(  # noqa: E731
                    q, k, v, pos32, scale, block_m=bm, block_n=bn, num_warps=w, num_stages=st, validate=False)
                try:
                    report(f"Triton selected rows ({bm}x{bn}, {warps} warps, {stages} stages)", time_ms(run_tile),
                           run_tile(), f"kernel_{bm}x{bn}_w{warps}_s{stages}_tflops")
                except Exception as err:  # noqa: BLE001 - a tile that does not fit shared memory or registers
                    print(f"| {n} | {ratio:.0%} | {rows} | {bm}x{bn} w{warps} s{stages}: {type(err).__name__} | | | | |")
            question = pos[-QUESTION:]
            q_question = q[:, :, -QUESTION:]
            run_question = lambda: selected_attention(q_question, k, v, question[None].to(torch.int32), scale,  # noqa: E731
                                                      validate=False)
            report(f"Triton, question only ({QUESTION} rows, split keys)", time_ms(run_question), run_question(),
                   "question_only_tflops", useful_flops(question), ref[:, -QUESTION:])
            if flex is not None:
                def mask_mod(b, h, q_idx, kv_idx):
                    return kv_idx <= pos[q_idx]

                block = create_block_mask(mask_mod, 1, 1, rows, n, device=dev)
                run = lambda: flex(q, k, v, block_mask=block, enable_gqa=True, scale=scale)  # noqa: E731
                report("FlexAttention, compiled", time_ms(run), run().transpose(1, 2), "flex_tflops")
                report("FlexAttention + block mask build", time_ms(
                    lambda: flex(q, k, v, block_mask=create_block_mask(mask_mod, 1, 1, rows, n, device=dev),
                                 enable_gqa=True, scale=scale), warmup=2, iters=5), None)
            print(f"kernel / dense SDPA TFLOP/s at {n}, {ratio:.0%}: {case['kernel_tflops'] / dense_tf:.2f} "
                  f"(target >= 0.80)", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(cases, indent=1))


if __name__ == "__main__":
    main()
