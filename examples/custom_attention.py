"""seqpar.attention inside a custom model. Run: torchrun --nproc-per-node 4 examples/custom_attention.py"""

import os

import torch
import torch.distributed as dist

import seqpar


class SPSelfAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, mesh: seqpar.SequenceParallelMesh):
        super().__init__()
        self.h, self.kv, self.d, self.mesh = heads, kv_heads, dim // heads, mesh
        self.q = torch.nn.Linear(dim, heads * self.d)
        self.kv_proj = torch.nn.Linear(dim, 2 * kv_heads * self.d)
        self.o = torch.nn.Linear(heads * self.d, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S_local, dim], this rank's shard
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d)
        k, v = self.kv_proj(x).view(b, s, 2, self.kv, self.d).unbind(2)
        out = seqpar.attention(q, k, v, self.mesh, causal=True)  # exact, sequence-parallel
        return self.o(out.reshape(b, s, -1))


def main() -> float:
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python examples/custom_attention.py`: no ranks to talk to
            raise SystemExit("this example runs on several ranks: torchrun --nproc-per-node 4 "
                             "examples/custom_attention.py")
        dist.init_process_group("gloo")
    mesh = seqpar.init_mesh(sp_size=dist.get_world_size(), num_heads=14, num_kv_heads=2)
    torch.manual_seed(0)
    layer = SPSelfAttention(dim=112, heads=14, kv_heads=2, mesh=mesh)
    x_full = torch.randn(1, 256, 112)  # every rank builds the same full batch here
    y_local = layer(seqpar.shard(x_full, mesh, dim=1))
    y_local.pow(2).mean().backward()  # gradients flow back through the all-to-alls and the ring
    y_full = seqpar.unshard(y_local.detach(), mesh, dim=1)
    # Check against the same layer on one process without SP.
    ref_mesh = seqpar.SequenceParallelMesh(dp_size=1, ring_degree=1, ulysses_degree=1)
    layer.mesh = ref_mesh
    err = (layer(x_full) - y_full).abs().max().item()
    if dist.get_rank() == 0:
        print(f"{mesh}\nmax |SP - single process| = {err:.2e}")
    return err


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
