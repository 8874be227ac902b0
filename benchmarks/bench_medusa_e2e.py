"""End-to-end Medusa training on one GPU: step time, throughput and peak memory of a training step as the
batch grows, with the heads' loss on materialised logits (``hf``) and through chunkloss (``chunkloss``).

    python -m benchmarks.bench_medusa_e2e --out benchmarks/results       # H100, about 7 minutes
    python -m benchmarks.bench_medusa_e2e --smoke --out /tmp/medusa_e2e  # tiny sizes on the CPU

The model: a randomly initialised Llama-3.2-1B-shaped ``LlamaForCausalLM`` (vocab 128256, hidden 2048,
intermediate 8192, 16 layers, 32 attention heads, 8 KV heads, head_dim 64, tied embeddings), built on the
device in bf16 from its config (nothing is downloaded), with K Medusa heads
(``chunkloss.heads.add_medusa_heads``: one residual block each and its own LM head, a copy of the base head).
Two stages:

* stage 1 (Medusa-1): the backbone and base head are frozen and run without autograd; only the heads train, on
  ``Σ_k 0.8^k · L_k``;
* stage 2 (Medusa-2): heads and model train jointly on ``λ₀ · L_0 + Σ_k 0.8^k · L_k`` (``L_0`` the base head's
  next-token loss, λ₀ = 1).

``L_k`` is head k's mean cross-entropy against the token k + 1 places ahead. The two implementations share the
model, the batches, the weights each run starts from and the optimizer, and differ only in the loss:

* ``hf``: each head's logits materialised, ``lm_head_k(block_k(hidden))``, as Medusa's own training code
  does, upcast to fp32 (as transformers' causal-LM loss upcasts them) and passed to ``F.cross_entropy`` with
  the shifted labels (stage 2 adds the base head's logits the same way); the backbone runs under
  ``torch.no_grad`` in stage 1. Medusa's code also stacks the K heads' logits into one tensor; here each
  head's are formed on their own, without that copy;
* ``chunkloss``: ``ChunkedMedusaTrainer.compute_loss`` (``chunkloss.trainers``; the trainer built on the same
  model with its default options), which runs the backbone (without autograd in stage 1) and the K heads'
  loss through ``FusedLinearMultiTokenLoss`` without the logits.

Each (stage, K) builds the model once. Per-step batches of ``--seq`` random tokens grow through ``--batches``
(1, 2, 4, ... by default); at each batch each implementation still in the sweep starts from the same initial
weights and a fresh ``torch.optim.AdamW`` and trains ``--warmup`` + ``--steps`` steps (forward, backward,
optimizer step). Recorded per run: the first step's loss (the two implementations' must agree), the median
step time of the timed steps (synchronized wall clock), tokens/s (batch · seq / step time), and the peak of
``torch.cuda.max_memory_allocated`` over the run (reset before it: weights, gradients, optimizer state and
activations). An implementation that runs out of memory is recorded as ``oom`` and leaves the sweep. The
sweep of a (stage, K) stops before a batch whose predicted time (the last step time scaled by the batch)
would pass its share of ``--time-budget-s`` (the time left split evenly over the (stage, K) pairs left).

Every run prints one JSON line, and the result set ``medusa_e2e.json`` (stamped with date, GPU and versions)
and ``medusa_e2e.md`` under ``--out`` are rewritten after every run, so a run cut short leaves its results;
``medusa_e2e.png`` (peak memory and tokens/s against the batch, one panel per stage and K) at the end.
``--smoke``: a tiny Llama on the CPU in fp32, batches 1 and 2, 2 steps, and a check that the two
implementations' first-step losses agree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import free_memory, is_oom, random_model, stamp, sync
from benchmarks.render import write_set
from chunkloss.data import tiny_dataset, tiny_tokenizer
from chunkloss.heads import add_medusa_heads

LLAMA_32_1B = dict(vocab=128256, hidden=2048, inter=8192, layers=16, heads=32, kv=8, head_dim=64)
TINY = dict(vocab=1000, hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=16)
IMPLS = ("hf", "chunkloss")
DECAY = 0.8  # head k's loss weight is DECAY^k
BASE_WEIGHT = 1.0  # λ₀, the base head's weight in stage 2
RUN_OVERHEAD_S = 2.0  # per run beyond its steps: restoring the weights, the optimizer, freeing memory
SMOKE_RTOL = 1e-4  # fp32 on the CPU: the two losses sum the same terms in another order


def build_model(spec: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A Llama of ``spec``'s shape with tied embeddings, initialised from ``seed`` directly on ``device``."""
    return random_model(spec, device, dtype, seed, max_position_embeddings=4096, tie_word_embeddings=True)


def medusa_trainer(model, stage: int, k: int, device: torch.device, tokenizer, out_dir: str):
    """``ChunkedMedusaTrainer`` on ``model`` (which already has its K heads): stage 1 freezes the backbone.
    Its dataset and tokenizer are tiny stand-ins: the benchmark feeds its own batches to ``compute_loss``."""
    import datasets
    from chunkloss.trainers import ChunkedMedusaConfig, ChunkedMedusaTrainer

    datasets.disable_progress_bars()  # the stand-in dataset's preprocessing: not part of the progress lines
    args = ChunkedMedusaConfig(
        output_dir=out_dir,
        report_to="none",
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        gradient_checkpointing=False,
        save_strategy="no",
        dataloader_num_workers=0,
        medusa_num_heads=k,
        medusa_stage=stage,
        medusa_decay=DECAY,
        medusa_base_weight=BASE_WEIGHT,
        chunk_compile=device.type == "cuda",  # the CPU check skips torch.compile's compile time
    )
    return ChunkedMedusaTrainer(
        model, args, train_dataset=tiny_dataset("sft", n=8), processing_class=tokenizer
    )


def hf_loss(model, inputs: dict, stage: int, k: int) -> torch.Tensor:
    """Medusa's loss on materialised logits: Medusa head k (1-based) at position t predicts
    ``labels[t + 1 + k]`` from ``lm_head_k(block_k(hidden[t]))``, each head's logits upcast to fp32 for
    ``F.cross_entropy``; stage 2 adds ``λ₀`` times the base head's next-token loss."""
    heads = model.medusa_heads
    grad = contextlib.nullcontext() if stage == 2 else torch.no_grad()
    with grad:
        hidden = model.model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
        ).last_hidden_state
    hidden, target = hidden[:, :-1], inputs["labels"][:, 1:]
    t = hidden.shape[1]
    loss = 0.0
    if stage == 2:
        logits = model.lm_head(hidden)
        loss = BASE_WEIGHT * F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    for i in range(1, k + 1):
        logits = heads.lm_heads[i - 1](heads.blocks[i - 1](hidden[:, : t - i]))
        loss = loss + DECAY**i * F.cross_entropy(logits.float().flatten(0, 1), target[:, i:].flatten())
    return loss


def make_batch(batch: int, seq: int, vocab: int, device: torch.device, seed: int = 0) -> dict:
    """``batch`` sequences of ``seq`` random tokens, every token a label."""
    g = torch.Generator(device=device).manual_seed(seed + batch)
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train_steps(loss_fn, params: list, inputs: dict, warmup: int, steps: int, device: torch.device) -> dict:
    """``warmup + steps`` training steps with a fresh AdamW: the first step's loss, the timed steps' times,
    their median, and the peak memory allocated over the run."""
    cuda = device.type == "cuda"
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(params, lr=1e-5, fused=cuda)
    times, first = [], None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = loss_fn(inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        elapsed = time.perf_counter() - t0
        if i == 0:
            first = float(loss.detach().float())
        if i >= warmup:
            times.append(elapsed)
        del loss
    return {
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "first_loss": first,
    }


def run_impl(loss_fn, params, initial, inputs, warmup, steps, device) -> dict:
    """One run from the initial weights; ``{"oom": True}`` when it runs out of memory."""
    with torch.no_grad():
        for p, w in zip(params, initial, strict=True):
            p.copy_(w, non_blocking=True)
    try:
        result = {"oom": False, **train_steps(loss_fn, params, inputs, warmup, steps, device)}
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if not is_oom(e):
            raise
        result = {"oom": True}
    for p in params:
        p.grad = None
    free_memory()  # after the except block: its traceback no longer holds the step's tensors
    return result


def _predicted_s(last: dict, impl: str, batch: int, steps: int) -> float:
    """Predicted time of a run at ``batch`` from the implementation's last step time (0 before its first)."""
    if impl not in last:
        return 0.0
    b, t = last[impl]
    return t * batch / b * steps + RUN_OVERHEAD_S


def sweep_pair(a, stage: int, k: int, share_end: float, device, dtype, tokenizer, data: dict, save) -> None:
    """One (stage, K)'s batch sweep: each run appended to ``data["runs"]`` and saved as it ends."""
    spec = TINY if a.smoke else LLAMA_32_1B
    t0 = time.perf_counter()
    model = build_model(spec, device, dtype)
    add_medusa_heads(model, k)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = medusa_trainer(model, stage, k, device, tokenizer, out_dir)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    initial = [p.detach().to("cpu", copy=True) for p in params]
    if device.type == "cuda":
        initial = [w.pin_memory() for w in initial]
    setup = {"stage": stage, "heads": k, "trainable_params": sum(p.numel() for p in params),
             "setup_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    print(json.dumps(setup), flush=True)
    fns = {
        "hf": lambda inputs: hf_loss(model, inputs, stage, k),
        "chunkloss": lambda inputs: trainer.compute_loss(model, dict(inputs)),
    }
    alive, last = list(IMPLS), {}
    for batch in a.batches:
        if not alive:
            break
        predicted = sum(_predicted_s(last, impl, batch, a.warmup + a.steps) for impl in alive)
        if time.perf_counter() + predicted > share_end:
            skip = {"stage": stage, "heads": k, "batch": batch, "reason": "time budget",
                    "predicted_s": round(predicted, 1)}  # fmt: skip
            data["skipped"].append(skip)
            print(json.dumps(skip), flush=True)
            break
        inputs = make_batch(batch, a.seq, spec["vocab"], device)
        for impl in list(alive):
            result = run_impl(fns[impl], params, initial, inputs, a.warmup, a.steps, device)
            row = {"stage": stage, "heads": k, "batch": batch, "impl": impl, "steps": a.steps, **result}
            if result["oom"]:
                alive.remove(impl)
            else:
                row["tokens_per_s"] = batch * a.seq / result["step_time_s"]
                last[impl] = (batch, result["step_time_s"])
            data["runs"].append(row)
            save()
            print(json.dumps({key: v for key, v in row.items() if key != "step_times_s"}), flush=True)


def sweep(a, device: torch.device, dtype: torch.dtype, data: dict, save) -> None:
    """Every (stage, K) pair's sweep, each with an even share of the time left."""
    deadline = time.perf_counter() + a.time_budget_s
    pairs = [(s, k) for s in a.stages for k in a.heads]
    tokenizer = tiny_tokenizer()
    for n, (stage, k) in enumerate(pairs):
        share_end = time.perf_counter() + max(0.0, deadline - time.perf_counter()) / (len(pairs) - n)
        sweep_pair(a, stage, k, share_end, device, dtype, tokenizer, data, save)
        free_memory()  # the pair's model, trainer and optimizer state


def check_losses(runs: list[dict], rtol: float) -> None:
    """The two implementations' first-step losses agree at every (stage, K, batch) both ran."""
    by = {(r["stage"], r["heads"], r["batch"], r["impl"]): r for r in runs if not r["oom"]}
    for (stage, k, batch, impl), r in by.items():
        if impl != "hf" or (stage, k, batch, "chunkloss") not in by:
            continue
        ours = by[(stage, k, batch, "chunkloss")]["first_loss"]
        if abs(ours - r["first_loss"]) > rtol * abs(r["first_loss"]):
            raise SystemExit(
                f"stage {stage} K={k} batch {batch}: first-step loss hf {r['first_loss']!r}, "
                f"chunkloss {ours!r}"
            )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="folder of medusa_e2e.json, .md and .png")
    p.add_argument("--stages", type=_ints, default=(1, 2), help="comma-separated Medusa stages (1, 2)")
    p.add_argument("--heads", type=_ints, default=(3, 5), help="comma-separated K values")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batches", type=_ints, default=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                   help="per-step batch sizes, in the order tried")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, optimizer state)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--time-budget-s", type=float, default=400.0, help="for all the sweeps together")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    a = p.parse_args(argv)
    if a.smoke:
        a.seq, a.batches, a.warmup, a.steps = min(a.seq, 64), (1, 2), 1, 1
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke for a CPU check at tiny sizes)")
    if not set(a.stages) <= {1, 2}:
        p.error(f"--stages takes 1 and 2, got {a.stages}")
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    spec = TINY if a.smoke else LLAMA_32_1B
    command = "python -m benchmarks.bench_medusa_e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {
        "stamp": stamp(command=command.strip()),
        "model": (
            f"{'Tiny Llama' if a.smoke else 'Llama-3.2-1B-shaped model'}: vocab {spec['vocab']}, hidden "
            f"{spec['hidden']}, intermediate {spec['inter']}, {spec['layers']} layers, {spec['heads']} "
            f"heads, {spec['kv']} KV heads, head_dim {spec['head_dim']}, tied embeddings, random weights"
        ),
        "dtype": str(dtype).removeprefix("torch."),
        "seq": a.seq,
        "warmup": a.warmup,
        "steps": a.steps,
        "decay": DECAY,
        "base_weight": BASE_WEIGHT,
        "time_budget_s": a.time_budget_s,
        "device_memory_gib": (
            torch.cuda.get_device_properties(0).total_memory / 2**30 if device.type == "cuda" else None
        ),
        "runs": [],
        "skipped": [],
    }
    sweep(a, device, dtype, data, lambda: write_set(a.out, "medusa_e2e", data, plot=False))
    write_set(a.out, "medusa_e2e", data)
    if a.smoke:
        check_losses(data["runs"], SMOKE_RTOL)
        print("first-step losses of hf and chunkloss agree at every (stage, K, batch)")
    print(f"wrote medusa_e2e.json, .md and .png under {a.out}")


if __name__ == "__main__":
    main()
