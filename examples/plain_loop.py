"""Train a Llama model with one of our optimizers in a plain PyTorch loop.

    python examples/plain_loop.py --optimizer muon            # 85M parameters on the GPU
    python examples/plain_loop.py --optimizer adam_mini --size tiny --device cpu --steps 20

Prints the loss as it goes and the optimizer's telemetry at the end; returns the losses.
"""

from __future__ import annotations

import math

import torch
from llama_setup import arguments, build_optimizer, llama, random_windows, text_tokens, warmup_cosine


def main(argv=None) -> list[float]:
    args = arguments(__doc__).parse_args(argv)

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = llama(args.size).to(device)
    opt = build_optimizer(args.optimizer, model, args.lr)
    sched = warmup_cosine(opt, args.steps)
    tokens, gen = text_tokens(args.data), torch.Generator().manual_seed(0)
    print(f"{args.optimizer}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}")
    losses = []
    for step in range(args.steps):
        x = random_windows(tokens, args.batch_size, args.length, gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {losses[-1]:.4f}  lr {sched.get_last_lr()[0]:.2e}")
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    print(opt.telemetry.table())
    return losses


if __name__ == "__main__":
    main()
