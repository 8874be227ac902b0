"""Multi-GPU parity of the chunked trainers (issue 9): FSDP2 or DeepSpeed ZeRO-3 against one process.

Under ``accelerate launch`` (FSDP2 or ZeRO-3 config, 2 processes) this trains a tiny random model from
``chunkloss.data`` for one step (saving the full gradients on rank 0, taken before the optimizer step) and
for 20 steps (saving the loss curve). Without a launcher (``--single``) it does the same in one process on
the same global batch (per-device batch x world size), and ``--compare`` writes the errors as json::

    export NCCL_NVLS_ENABLE=0
    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 \\
        -m benchmarks.multigpu_parity --trainer sft --out DIR/fsdp2
    python -m benchmarks.multigpu_parity --trainer sft --single --world 2 --out DIR/single
    python -m benchmarks.multigpu_parity --trainer sft --compare DIR/fsdp2 DIR/single --out DIR/sft_fsdp2.json

GRPO samples completions, so the two runs see the same prompts but not the same completions: until
generation is made identical across the two runs (not done yet), its gradient comparison is not a
parity check.
"""

from __future__ import annotations

import os

# Before anything can initialise NCCL: NVLink multicast (NVLS) stays off on the shared H200 hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

STEPS = 20
PER_DEVICE_BATCH = 4


def _full_grad(param) -> torch.Tensor | None:
    """The full gradient of a parameter under FSDP2 (a DTensor), ZeRO-3 (partitioned) or plain DDP."""
    try:
        from deepspeed.utils import safe_get_full_grad
    except ImportError:
        safe_get_full_grad = None
    if safe_get_full_grad is not None and hasattr(param, "ds_id"):
        g = safe_get_full_grad(param)
    else:
        g = param.grad
        if g is not None and type(g).__name__ == "DTensor":
            g = g.full_tensor()
    return None if g is None else g.detach().float().cpu()


def _trainer(kind: str, out: Path, steps: int, batch: int, bf16: bool):
    from transformers import TrainerCallback

    from chunkloss.data import count_reward, tiny_dataset, tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(tok, hidden_size=64, num_layers=2)
    common = dict(
        output_dir=str(out / "trainer"),
        report_to="none",
        per_device_train_batch_size=batch,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        seed=0,
        bf16=bf16,
        dataloader_num_workers=0,
        chunk_compile=False,
    )
    ds = tiny_dataset(kind, n=256)
    if kind == "sft":
        from chunkloss.trainers.sft import ChunkedSFTConfig, ChunkedSFTTrainer

        tr = ChunkedSFTTrainer(model, ChunkedSFTConfig(**common), train_dataset=ds, processing_class=tok)
    elif kind == "dpo":
        from chunkloss.trainers.dpo import ChunkedDPOConfig, ChunkedDPOTrainer

        tr = ChunkedDPOTrainer(
            model, args=ChunkedDPOConfig(**common, max_length=48), train_dataset=ds, processing_class=tok
        )
    elif kind == "grpo":
        from chunkloss.trainers.grpo import ChunkedGRPOConfig, ChunkedGRPOTrainer

        cfg = ChunkedGRPOConfig(**common, num_generations=2, max_completion_length=12)
        tr = ChunkedGRPOTrainer(model, count_reward, cfg, train_dataset=ds, processing_class=tok)
    else:
        raise ValueError(f"--trainer must be sft, dpo or grpo, got {kind!r}")

    class GradTap(TrainerCallback):
        """The full gradients after the first backward, before clipping and the optimizer step."""

        grads: dict | None = None

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if state.global_step == 0 and self.grads is None:
                self.grads = {n: _full_grad(p) for n, p in tr.model.named_parameters() if p.requires_grad}

    tap = GradTap()
    tr.add_callback(tap)
    return tr, tap


def run(kind: str, out: Path, batch: int) -> None:
    bf16 = torch.cuda.is_available()
    out.mkdir(parents=True, exist_ok=True)
    tr, tap = _trainer(kind, out, STEPS, batch, bf16)
    tr.train()
    if tr.accelerator.is_main_process:
        curve = [h["loss"] for h in tr.state.log_history if "loss" in h]
        torch.save({k: v for k, v in tap.grads.items() if v is not None}, out / "grads_step1.pt")
        meta = dict(
            trainer=kind,
            num_processes=tr.accelerator.num_processes,
            distributed_type=str(tr.accelerator.distributed_type),
            per_device_batch=batch,
            bf16=bf16,
            loss_curve=curve,
            nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
        )
        (out / "run.json").write_text(json.dumps(meta, indent=1))


def compare(multi: Path, single: Path, out: Path) -> dict:
    g_m, g_s = torch.load(multi / "grads_step1.pt"), torch.load(single / "grads_step1.pt")
    r_m, r_s = json.loads((multi / "run.json").read_text()), json.loads((single / "run.json").read_text())
    per_param = {}
    for name, ref in g_s.items():
        got = g_m.get(name)
        if got is None:
            per_param[name] = None
            continue
        # Relative to the tensor's largest entry: single entries near zero are sums of cancelling terms.
        per_param[name] = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
    errors = [e for e in per_param.values() if e is not None]
    c_m, c_s = r_m["loss_curve"], r_s["loss_curve"]
    n = min(len(c_m), len(c_s))
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(c_m[:n], c_s[:n])]
    result = dict(
        trainer=r_m["trainer"],
        multi=dict(distributed_type=r_m["distributed_type"], num_processes=r_m["num_processes"]),
        missing_grads=sorted(n for n, e in per_param.items() if e is None),
        max_rel_grad_error=max(errors) if errors else None,
        per_param_rel_grad_error=per_param,
        curve_multi=c_m,
        curve_single=c_s,
        max_rel_curve_diff=max(diffs) if diffs else None,
        steps_compared=n,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=["sft", "dpo", "grpo"], required=True)
    p.add_argument("--out", type=Path, required=True, help="run folder, or the json file with --compare")
    p.add_argument("--single", action="store_true", help="one process on the global batch")
    p.add_argument("--world", type=int, default=2, help="with --single: the multi-process world size")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("MULTI", "SINGLE"))
    a = p.parse_args(argv)
    if a.compare:
        r = compare(*a.compare, a.out)
        print(json.dumps({k: r[k] for k in ("trainer", "max_rel_grad_error", "max_rel_curve_diff")}))
        return
    batch = PER_DEVICE_BATCH * a.world if a.single else PER_DEVICE_BATCH
    run(a.trainer, a.out, batch)


if __name__ == "__main__":
    main()
