"""Train a Llama model on several processes with PyTorch's own distributed engine, and save and
resume with Distributed Checkpoint (DCP). Launch with torchrun (NCCL on GPUs, Gloo on CPUs):

    torchrun --nproc_per_node 8 examples/fsdp2_train.py --optimizer adamw --checkpoint ckpt --stop-after 100
    torchrun --nproc_per_node 4 examples/fsdp2_train.py --optimizer adamw --checkpoint ckpt --resume
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --optimizer distributed_adamw \\
        --size tiny --device cpu --steps 20 --batch-size 4 --length 64

``adamw``: FSDP2 (``fully_shard`` per decoder layer, then the whole model) with our AdamW on the
sharded parameters, clipped by our ``clip_grad_norm_``. ``distributed_adamw``: the model left
unwrapped, ZeRO-2 by ``DistributedAdamW`` (gradients reduce-scattered during backward, clipped by
the optimizer's ``clip_grad_norm_``, where they live after backward; the updated parameters'
all-gathers finished module by module in the next forward). ``--checkpoint DIR`` saves model,
optimizer, scheduler and step there at the end; ``--resume`` loads them first, at any world size,
and trains on to ``--steps`` (the schedule's length); ``--stop-after N`` stops a run after N steps.
Prints the mean loss over ranks as it goes; ``main`` returns the losses.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from llama_setup import arguments, llama, random_windows, text_tokens, warmup_cosine
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kernel_factory.optimizers import AdamW, DistributedAdamW, clip_grad_norm_

OPTIMIZERS = ("adamw", "distributed_adamw")


def build(name: str, world: int, device: torch.device, size: str, lr: float):
    model = llama(size).to(device)
    hyper = dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "distributed_adamw":  # each step's all-gathers finished module by module in the next forward
        units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
        return model, DistributedAdamW(model.parameters(), gather_in_forward=units, **hyper)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, AdamW(model.parameters(), **hyper)


def main(argv=None) -> list[float]:
    ap = arguments(__doc__)
    ap.set_defaults(optimizer="adamw")
    ap.add_argument("--checkpoint", default=None, help="directory to save to at the end (and resume from)")
    ap.add_argument("--resume", action="store_true", help="load --checkpoint before training")
    ap.add_argument("--stop-after", type=int, default=None, help="steps to run now (default: to --steps)")
    for action in ap._actions:
        if action.dest == "optimizer":
            action.choices = OPTIMIZERS
    args = ap.parse_args(argv)

    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial model on every rank
    model, opt = build(args.optimizer, world, device, args.size, args.lr)
    sched = warmup_cosine(opt, args.steps)
    start = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        start = int(state["step"])
    tokens = text_tokens(args.data)
    losses = []
    stop = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    for step in range(start, stop):
        # Each rank's batch depends on (step, rank) only: a resumed run sees what a straight one would.
        x = random_windows(tokens, args.batch_size, args.length, torch.Generator().manual_seed(step * 1024 + rank))
        x = x.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if args.optimizer == "adamw":
            clip_grad_norm_(model.parameters(), 1.0)
        else:  # the gradients live reduced and sharded in the optimizer after backward
            opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == stop - 1):
            print(f"step {step:5d}  loss {losses[-1]:.6f}  lr {sched.get_last_lr()[0]:.2e}", flush=True)
    if args.checkpoint:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(),
                 "step": torch.tensor(stop)}  # fmt: skip
        dcp.save(state, checkpoint_id=args.checkpoint)
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    dist.barrier()
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
    # Gloo's threads can abort the interpreter's exit ("terminate called without an active
    # exception"), after a run that finished: leave without running the destructors.
    sys.stdout.flush()
    os._exit(0)
