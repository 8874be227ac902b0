"""Multi-token (Medusa) heads on one GPU: chunkloss against the two ways Medusa trains today, in one process.

    python -m benchmarks.bench_medusa [--out benchmarks/results] [--repeats 7] [--heads 3,5]
    python -m benchmarks.bench_medusa --smoke --out /tmp/medusa   # tiny sizes on the CPU: checks the script

Llama-3-8B's head (H=4096, V=128256, bf16), N=8192 positions (8 x 1024), K heads: head k reads its own hidden
state and predicts the token k places ahead (K - 1 fewer targets per sequence for head K - 1), weights 0.8^k.
Each case runs forward + backward of the K heads' loss, with one shared (V, H) head or K per-head heads:

* ``chunkloss``: ``FusedLinearMultiTokenLoss`` (one chunk loop per distinct weight), its default fp32
  weight-gradient accumulator;
* ``chunkloss_bf16_accum``: the same with ``accum_dtype=torch.bfloat16`` (the weight gradient accumulated in
  the weight's dtype, as Liger accumulates it), chunks sized by the library (``chunk_size=None``);
* ``chunkloss_bf16_accum_liger_chunks``: the same with ``chunk_size`` set to the rows Liger's fused
  cross-entropy takes per chunk of one head's N rows, ``next_pow2(ceil(N / ceil(V / H)))`` (256 here), so
  that both hold the logits of as many rows at a time;
* ``torch``: materialised logits, ``F.cross_entropy`` per head on the fp32 upcast (what Medusa's code does);
* ``liger``: ``LigerFusedLinearCrossEntropyLoss`` applied once per head (skipped when not installed);
* ``chunkloss_single_head``: our ``FusedLinearCrossEntropyLoss`` on one head's N rows, the unit of the
  target ``chunkloss <= 1.05 · K · single head``.

Time: CUDA events after warm-up, median of ``--repeats``. Memory: peak allocated during one step minus the
memory allocated before it, less the gradients the step returns (``benchmarks.render.MEMORY_DEFINITION``).
Writes the result set ``medusa.json`` (stamped with date, GPU and versions), ``medusa.md`` and ``medusa.png``
under ``--out`` (``benchmarks.render``: tables, and the summary of each chunkloss row against K · single head
and the peers).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import PEAK_TFLOPS, grad_leaves, measure, measure_or_error, stamp
from benchmarks.render import write_set
from chunkloss import FusedLinearCrossEntropyLoss, FusedLinearMultiTokenLoss

FULL = dict(batch=8, seq=1024, hidden=4096, vocab=128256, dtype=torch.bfloat16)
SMOKE = dict(batch=2, seq=33, hidden=64, vocab=1000, dtype=torch.float32)


def head_weights(k: int) -> tuple[float, ...]:
    return tuple(0.8**i for i in range(k))


def make_inputs(k: int, form: str, size: dict, device: torch.device, seed: int = 0) -> dict:
    """``hidden{i}`` (B, T, H) for each head, as K Medusa heads produce them; ``weight`` (V, H) shared, or
    ``weight{i}`` (V, H) per head (separate parameters, as Medusa's heads are); ``labels`` (B, T)."""
    g = torch.Generator(device=device).manual_seed(seed)
    b, t, h, v, dtype = size["batch"], size["seq"], size["hidden"], size["vocab"], size["dtype"]

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype).requires_grad_()

    inputs = {f"hidden{i}": leaf(b, t, h) for i in range(k)}
    names = ["weight"] if form == "shared" else [f"weight{i}" for i in range(k)]
    inputs.update({name: leaf(v, h, scale=h**-0.5) for name in names})
    inputs["labels"] = torch.randint(0, v, (b, t), device=device, generator=g)
    return inputs


def _lists(inputs: dict, k: int):
    """The K hidden states and the weight: one tensor, or a list of K."""
    hiddens = [inputs[f"hidden{i}"] for i in range(k)]
    return hiddens, inputs["weight"] if "weight" in inputs else [inputs[f"weight{i}"] for i in range(k)]


def _head(inputs: dict, i: int):
    """Head i's hidden state (B, T, H), weight (V, H) and targets (B, T) shifted by i (ignored at the end)."""
    labels = inputs["labels"]
    target = torch.full_like(labels, -100)
    target[:, : labels.shape[1] - i] = labels[:, i:]
    return inputs[f"hidden{i}"], inputs.get("weight", inputs.get(f"weight{i}")), target


def liger_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """The rows per chunk of Liger's fused linear cross-entropy on n rows,
    ``next_pow2(ceil(n / ceil(V / H)))`` (its logits chunk then holds about as many elements as the input)."""
    rows = -(-n // -(-vocab // hidden))
    return 1 << (rows - 1).bit_length()


def impls(k: int, device: torch.device, compile: bool, small_chunk: int) -> dict:
    """Implementation name -> ``inputs -> loss``; ``small_chunk``: the chunk rows of
    ``chunkloss_bf16_accum_liger_chunks``."""
    ours = FusedLinearMultiTokenLoss(head_weights(k), compile=compile)
    bf16_acc = FusedLinearMultiTokenLoss(head_weights(k), accum_dtype=torch.bfloat16, compile=compile)
    bf16_small = FusedLinearMultiTokenLoss(
        head_weights(k), accum_dtype=torch.bfloat16, chunk_size=small_chunk, compile=compile
    )

    def torch_materialised(inputs):
        loss = 0.0
        for i, w_i in enumerate(head_weights(k)):
            h, w, target = _head(inputs, i)
            t = h.shape[1] - i
            z = h[:, :t] @ w.t()
            loss = loss + w_i * F.cross_entropy(z.float().flatten(0, 1), target[:, :t].flatten())
        return loss

    out = {
        "chunkloss": lambda i: ours(*_lists(i, k), i["labels"]),
        "chunkloss_bf16_accum": lambda i: bf16_acc(*_lists(i, k), i["labels"]),
        "chunkloss_bf16_accum_liger_chunks": lambda i: bf16_small(*_lists(i, k), i["labels"]),
        "torch": torch_materialised,
    }
    if device.type == "cuda":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            print("liger-kernel is not installed: its column is skipped", file=sys.stderr)
        else:
            liger = LigerFusedLinearCrossEntropyLoss()

            def liger_per_head(inputs):
                loss = 0.0
                for i, w_i in enumerate(head_weights(k)):
                    h, w, target = _head(inputs, i)
                    loss = loss + w_i * liger(w, h.reshape(-1, h.shape[-1]), target.reshape(-1))
                return loss

            out["liger"] = liger_per_head
    return out


def single_head_inputs(size: dict, device: torch.device) -> dict:
    inputs = make_inputs(1, "shared", size, device)
    return {"hidden": inputs.pop("hidden0"), **inputs}


def measure_cpu(fn, inputs: dict, warmup: int = 1, repeats: int = 3) -> dict:
    """``harness.measure``'s fields off CUDA: wall-clock time; no memory figure."""
    leaves = grad_leaves(inputs)
    times = []
    for r in range(warmup + repeats):
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        loss = fn(inputs)
        loss.backward()
        if r >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return {
        "ms": statistics.median(times),
        "ms_all": times,
        "peak_extra_bytes": None,
        "loss": float(loss.detach()),
    }


def run(heads=(3, 5), forms=("shared", "per_head"), repeats=7, smoke=False) -> list[dict]:
    """One row per (K, form, implementation), plus the single-head CE row."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    size = SMOKE if smoke else FULL
    compile = device.type == "cuda"
    timer = measure if device.type == "cuda" else measure_cpu
    n = size["batch"] * size["seq"]
    flops_per_head = 6 * size["hidden"] * size["vocab"]  # the three GEMMs of one row (logits, two gradients)
    rows = []

    def record(row, fn, inputs):
        row.update(measure_or_error(timer, fn, inputs, repeats))
        rows.append(row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in row.items() if k != "ms_all"}), flush=True)

    ce = FusedLinearCrossEntropyLoss(compile=compile)
    single = single_head_inputs(size, device)
    record(
        {"case": f"single head N={n}", "heads": 1, "form": "shared", "impl": "chunkloss_single_head",
         "floor_ms": n * flops_per_head / (PEAK_TFLOPS * 1e12) * 1e3},
        lambda i: ce(i["hidden"], i["weight"], i["labels"]), single,
    )  # fmt: skip
    del single
    small_chunk = liger_chunk_rows(n, size["hidden"], size["vocab"])
    for k in heads:
        for form in forms:
            inputs = make_inputs(k, form, size, device)
            rows_valid = sum(n - size["batch"] * i for i in range(k))
            for impl, fn in impls(k, device, compile, small_chunk).items():
                row = {"case": f"K={k} {form} N={n}", "heads": k, "form": form, "impl": impl,
                       "floor_ms": rows_valid * flops_per_head / (PEAK_TFLOPS * 1e12) * 1e3}  # fmt: skip
                if impl == "chunkloss_bf16_accum_liger_chunks":
                    row["chunk_size"] = small_chunk
                record(row, fn, inputs)
            del inputs
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder of medusa.json, .md and .png")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heads", default="3,5", help="comma-separated K values")
    parser.add_argument("--forms", default="shared,per_head")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke for a CPU check at tiny sizes)")
    heads = tuple(int(k) for k in args.heads.split(","))
    rows = run(heads, tuple(args.forms.split(",")), args.repeats, args.smoke)
    size = {k: str(v) if k == "dtype" else v for k, v in (SMOKE if args.smoke else FULL).items()}
    command = "python -m benchmarks.bench_medusa " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {
        "stamp": stamp(command=command.strip()),
        "size": size,
        "peak_tflops": PEAK_TFLOPS,
        "rows": rows,
    }
    write_set(args.out, "medusa", data)
    print(f"wrote medusa.json, .md and .png under {args.out}")


if __name__ == "__main__":
    main()
