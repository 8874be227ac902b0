"""How many rows each pass of GRPO's entropy-mask case projects (B=16, T=1024, beta=0.04): prints the row
counts the chunk loop splits into chunks (``_even_bounds`` calls), for one forward+backward."""

import torch

import chunkloss.base as base
from benchmarks import cases_grpo

real = base._even_bounds


def logged(n_rows, chunk):
    print(f"_even_bounds(n_rows={n_rows}, chunk={chunk})", flush=True)
    return real(n_rows, chunk)


base._even_bounds = logged
i = cases_grpo._inputs(16, 1024)("cuda")
fn = cases_grpo.impls(top_entropy_quantile=0.2)["chunkloss"]
for _ in range(2):
    i["hidden"].grad = i["weight"].grad = None
    fn(i).backward()
    torch.cuda.synchronize()
    print("---")
