"""Case C01 as a model file: fp16 ``x @ w`` overflows (66355 > 65504), then an RMSNorm turns the inf into
NaN."""
import torch
from torch import nn


class Net(nn.Module):
    """C01: x @ w is 66355 > 65504 in fp16 -> inf; then a residual add and an RMSNorm -> NaN."""
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 1, bias=False)
        self.out = nn.Linear(1, 4, bias=False)
        with torch.no_grad():
            self.up.weight.fill_(16.2)
            self.out.weight.fill_(0.01)

    def forward(self, x):
        h = self.up(x) + x[:, :1]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.out(h).pow(2).mean()

def build_model():
    return Net()

def get_batch(step, device):
    return (torch.full((2, 256), 16.0, device=device),)
