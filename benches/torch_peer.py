"""PyTorch eager on a GPU: the peer of dfc's GPU training steps (issue 21's bar).

The three standard models of ../shared/bench/README.md (logreg, mlp, cnn), as dfc's examples
write them (softmax_regression.df, mlp.df, cnn.df: u8 images scaled to [0, 1], softmax
cross-entropy, plain SGD at lr 0.01), trained on random data at each batch size asked for.
Prints, and writes to --out as JSON, the median time of a training step (forward, loss,
backward, update), timed by CUDA events over --steps steps after --warmup.

    python3 benches/torch_peer.py --batches 128 512 --out torch.json
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


class LogReg(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(784, 10)

    def forward(self, images):
        return self.out(images.float().div(255.0).flatten(1))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.h1 = torch.nn.Linear(784, 256)
        self.h2 = torch.nn.Linear(256, 256)
        self.out = torch.nn.Linear(256, 10)

    def forward(self, images):
        x = images.float().div(255.0).flatten(1)
        return self.out(F.relu(self.h2(F.relu(self.h1(x)))))


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 32, 3)
        self.c2 = torch.nn.Conv2d(32, 64, 3)
        self.hidden = torch.nn.Linear(1600, 64)
        self.out = torch.nn.Linear(64, 10)

    def forward(self, images):
        x = images.float().div(255.0).unsqueeze(1)
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.out(F.relu(self.hidden(x.flatten(1))))


MODELS = {"logreg": LogReg, "mlp": Mlp, "cnn": Cnn}


def step_times(model, batch, warmup, steps, device):
    model = model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = torch.randint(0, 256, (batch, 28, 28), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # µs
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": {}}
    for name, model in MODELS.items():
        for batch in args.batches:
            times = step_times(model, batch, args.warmup, args.steps, device)
            median = statistics.median(times)
            results["steps"][f"{name}@{batch}"] = median
            print(f"torch {name} batch {batch}: train step median {median:.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
