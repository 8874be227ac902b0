"""Where an end-to-end training step's GPU time goes: the top CUDA kernels of a few steps of TRL's trainer and
of the chunked one, same model, batch and data (bench_e2e's setup), and each one's wall time per step (a wall
time well above the kernel time means the GPU waits on the host).

    python -m benchmarks.profile_e2e [--task dpo] [--batch 64] [--impls trl,chunkloss]
"""

import argparse
import statistics

import torch

from benchmarks import bench_e2e as e2e
from chunkloss.data import tiny_tokenizer


class _Profile(e2e.TrainerCallback):
    """Profiles steps ``start`` .. ``start + n`` (after compilation and warm-up)."""

    def __init__(self, start: int, n: int, host: bool = False, stack: bool = False):
        self.start, self.n, self.prof, self.host, self.stack = start, n, None, host, stack

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.start:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            acts = [
                torch.profiler.ProfilerActivity.CUDA
                if torch.cuda.is_available()
                else torch.profiler.ProfilerActivity.CPU
            ]
            if self.host and torch.profiler.ProfilerActivity.CPU not in acts:
                acts.append(torch.profiler.ProfilerActivity.CPU)
            self.prof = torch.profiler.profile(activities=acts, with_stack=self.stack)
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if self.prof is not None and state.global_step == self.start + self.n:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.prof.__exit__(None, None, None)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="dpo")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--impls", default="trl,chunkloss")
    p.add_argument("--rows", type=int, default=22)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (0: the real model's)")
    p.add_argument("--trace", default=None, help="folder for a Chrome trace of the profiled steps per impl")
    p.add_argument("--stack", action="store_true", help="record Python frames (for --trace; large traces)")
    p.add_argument("--host", action="store_true", help="also record host (CPU) ops; tables by host time too")
    p.add_argument(
        "--shape", default=None, help="bench_e2e shape (default: the task's; 'tiny' for a CPU check)"
    )
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = argparse.Namespace(device=dev, layers=args.layers, no_compile=dev == "cpu", completion_len=128,
                           seq_len=512, words=200, out="/tmp/profile_e2e")  # fmt: skip
    tokenizer = tiny_tokenizer()
    shape = args.shape or ("qwen3-0.6b" if args.task == "grpo" else "llama-3.2-1b")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    ds = e2e.counting_dataset(args.task, 8 * args.batch, a.words if args.task != "grpo" else 8)
    state = e2e.initial_state(shape, a, tokenizer, dtype)
    for impl in args.impls.split(","):
        model = e2e.build_model(shape, a.layers, tokenizer, dev, dtype, state)
        ref = None
        if args.task == "dpo":
            ref = e2e.build_model(shape, a.layers, tokenizer, dev, dtype, state)
            ref.requires_grad_(False)
        trainer = e2e.make_trainer(args.task, impl, model, ref, tokenizer, ds, f"/tmp/profile_e2e/{impl}",
                                   args.batch, 9, a)  # fmt: skip
        prof, timer = _Profile(start=3, n=2, host=args.host, stack=args.stack), e2e.StepTimer()
        trainer.add_callback(prof)
        trainer.add_callback(timer)
        if dev == "cuda":
            torch.cuda.reset_accumulated_memory_stats()
        trainer.train()
        wall = statistics.median(timer.times[6:]) * 1e3  # unprofiled steps after the profiled ones
        table = prof.prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows)
        total = sum(e.self_device_time_total for e in prof.prof.key_averages()) / 1e3 / 2
        print(f"\n=== {args.task} {impl} batch {args.batch}: {total:.1f} ms of kernels per step, "
              f"{wall:.1f} ms wall (median of 3 unprofiled steps) ===\n{table}",
              flush=True)  # fmt: skip
        if dev == "cuda":  # cudaMalloc/cudaFree over the 9 steps: a step that keeps allocating waits on them
            st = torch.cuda.memory_stats()
            print(f"segments allocated {st['num_device_alloc']}, freed {st['num_device_free']}, "
                  f"allocator retries {st['num_alloc_retries']}", flush=True)  # fmt: skip
        if args.trace:
            prof.prof.export_chrome_trace(f"{args.trace}/{args.task}_{impl}_bs{args.batch}.json")
        if args.host:
            by_host = prof.prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows)
            print(f"--- {impl}: by host time (2 steps) ---\n{by_host}", flush=True)
        del trainer, model, ref
        e2e._cleanup()


if __name__ == "__main__":
    main()
