"""PyTorch's own GradScaler on the weights and schedule grad_scaler_test.cpp wrote.

Usage: grad_scaler_oracle.py DIR

DIR holds config.json (shapes, steps, overflow steps, scaler options, lr,
max_norm) and raw little-endian fp32 files: param_<i>.bin in the C++
module's parameter order, x.bin, target.bin. Trains the same MLP with
torch.amp.GradScaler("cpu"): unscale_ before clip_grad_norm_, step, update;
the loss is multiplied by inf on the overflow steps. Writes DIR/python.json
(scale after each update, whether each step ran) and DIR/py_param_<i>.bin
(parameters after training). Needs only torch.
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def read(path, shape):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.float32).clone().reshape(shape)


def main():
    d = sys.argv[1]
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(c["d_in"], c["d_hidden"]), nn.Tanh(), nn.Linear(c["d_hidden"], c["d_out"]))
    params = list(net.parameters())
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(read(os.path.join(d, f"param_{i}.bin"), p.shape))
    x = read(os.path.join(d, "x.bin"), (c["batch"], c["d_in"]))
    t = read(os.path.join(d, "target.bin"), (c["batch"], c["d_out"]))
    opt = torch.optim.SGD(params, lr=c["lr"])
    scaler = torch.amp.GradScaler("cpu", init_scale=c["init_scale"], growth_factor=c["growth_factor"],
                                  backoff_factor=c["backoff_factor"], growth_interval=c["growth_interval"])
    scales, stepped = [], []
    for step in range(c["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = ((net(x) - t) ** 2).mean()
        if step in c["overflow_steps"]:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, c["max_norm"])
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, params)))
        scaler.update()
        scales.append(scaler.get_scale())
    state = scaler.state_dict()
    with open(os.path.join(d, "python.json"), "w") as f:
        json.dump({"scales": scales, "stepped": stepped, "growth_tracker": state["_growth_tracker"]}, f)
    for i, p in enumerate(params):
        with open(os.path.join(d, f"py_param_{i}.bin"), "wb") as f:
            f.write(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))


if __name__ == "__main__":
    main()
