"""Python oracle for tests/audit_trainers_test.cpp.

Runs the PyTorch C++ examples' models (mnist, dcgan) and a scripted trunk with
a head on synthetic data, as the C++ test does, and measures with PyTorch's
own torch.autograd.graph.saved_tensors_hooks what autograd saves: unique
storages, parameters and buffers excluded by storage, counted from one
backward to the next (a step's figure is its largest such stretch, as
trainmem's Audit reports it). Prints one JSON document.

  saved_bytes.py mnist STEPS
  saved_bytes.py dcgan STEPS
  saved_bytes.py trunk STEPS TRUNK_PATH   (also saves the scripted trunk there)
  saved_bytes.py bptt STEPS      (embedding + 2-layer LSTM LM, truncated BPTT, state carried)
  saved_bytes.py decoder STEPS   (an LSTMCell decoder unrolled over 12 steps)
  saved_bytes.py style STEPS     (style transfer's optimized input: frozen convs, Adam over the image)
  saved_bytes.py gan STEPS       (the DCGAN's two planned steps, each alone: D on G's
                                  detached output, G through D)
"""
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Meter:
    """Saved bytes between backward passes, like trainmem's SavedTensorMeter."""

    def __init__(self, modules):
        self.excluded = set()
        for m in modules:
            for t in list(m.parameters()) + list(m.buffers()):
                self.excluded.add(t.untyped_storage()._cdata)
        self.segments = []
        self.new_segment()

    def new_segment(self):
        self.seen = {}
        self.segments.append(0)

    def pack(self, t):
        s = t.untyped_storage()
        key = s._cdata
        if key not in self.excluded and key not in self.seen:
            self.seen[key] = s  # hold it: the address is not reused meanwhile
            self.segments[-1] += s.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def backward(self, loss):
        loss.backward()
        self.new_segment()

    def take_step(self):
        figure = max(self.segments)
        self.segments = []
        self.new_segment()
        return figure


def nbytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in tensors}.values())


def state_bytes(opt):
    return sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


class MnistNet(nn.Module):  # pytorch/examples cpp/mnist
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = torch.relu(F.max_pool2d(self.conv1(x), 2))
        x = torch.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = torch.relu(self.fc1(x))
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.fc2(x)
        return torch.log_softmax(x, dim=1)


def mnist(steps):
    torch.manual_seed(0)
    model = MnistNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    meter = Meter([model])
    out = {"saved_bytes": []}
    for _ in range(steps):
        data = torch.randn(64, 1, 28, 28)
        target = torch.randint(0, 10, (64,))
        opt.zero_grad()
        with meter.hooks():
            loss = F.nll_loss(model(data), target)
        loss.item()
        meter.backward(loss)
        opt.step()
        out["saved_bytes"].append(meter.take_step())
    out["param_bytes"] = nbytes(model.parameters())
    out["state_bytes"] = state_bytes(opt)
    return out


class Generator(nn.Module):  # pytorch/examples cpp/dcgan
    def __init__(self, noise):
        super().__init__()
        self.conv1 = nn.ConvTranspose2d(noise, 256, 4, bias=False)
        self.batch_norm1 = nn.BatchNorm2d(256)
        self.conv2 = nn.ConvTranspose2d(256, 128, 3, stride=2, padding=1, bias=False)
        self.batch_norm2 = nn.BatchNorm2d(128)
        self.conv3 = nn.ConvTranspose2d(128, 64, 4, stride=2, padding=1, bias=False)
        self.batch_norm3 = nn.BatchNorm2d(64)
        self.conv4 = nn.ConvTranspose2d(64, 1, 4, stride=2, padding=1, bias=False)

    def forward(self, x):
        x = torch.relu(self.batch_norm1(self.conv1(x)))
        x = torch.relu(self.batch_norm2(self.conv2(x)))
        x = torch.relu(self.batch_norm3(self.conv3(x)))
        return torch.tanh(self.conv4(x))


def discriminator():
    return nn.Sequential(
        nn.Conv2d(1, 64, 4, stride=2, padding=1, bias=False), nn.LeakyReLU(0.2),
        nn.Conv2d(64, 128, 4, stride=2, padding=1, bias=False), nn.BatchNorm2d(128), nn.LeakyReLU(0.2),
        nn.Conv2d(128, 256, 4, stride=2, padding=1, bias=False), nn.BatchNorm2d(256), nn.LeakyReLU(0.2),
        nn.Conv2d(256, 1, 3, stride=1, padding=0, bias=False), nn.Sigmoid())


def dcgan(steps):
    torch.manual_seed(0)
    noise_size, batch = 100, 64
    g, d = Generator(noise_size), discriminator()
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.5))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.5))
    meter = Meter([g, d])
    out = {"saved_bytes": []}
    for _ in range(steps):
        real = torch.randn(batch, 1, 28, 28)
        d.zero_grad()
        with meter.hooks():
            real_labels = torch.empty(batch).uniform_(0.8, 1.0)
            real_output = d(real).reshape(real_labels.shape)
            d_loss_real = F.binary_cross_entropy(real_output, real_labels)
        meter.backward(d_loss_real)
        with meter.hooks():
            noise = torch.randn(batch, noise_size, 1, 1)
            fake = g(noise)
            fake_labels = torch.zeros(batch)
            fake_output = d(fake.detach()).reshape(fake_labels.shape)
            d_loss_fake = F.binary_cross_entropy(fake_output, fake_labels)
        meter.backward(d_loss_fake)
        with meter.hooks():
            d_loss = d_loss_real + d_loss_fake
        opt_d.step()
        g.zero_grad()
        with meter.hooks():
            fake_labels.fill_(1)
            fake_output = d(fake).reshape(fake_labels.shape)
            g_loss = F.binary_cross_entropy(fake_output, fake_labels)
        meter.backward(g_loss)
        opt_g.step()
        del d_loss
        out["saved_bytes"].append(meter.take_step())
    out["g_param_bytes"] = nbytes(g.parameters())
    out["d_param_bytes"] = nbytes(d.parameters())
    out["buffer_bytes"] = nbytes(list(g.buffers()) + list(d.buffers()))
    out["state_bytes"] = state_bytes(opt_g) + state_bytes(opt_d)
    return out


def gan(steps):
    """The two steps the planner plans for the DCGAN, each measured alone:
    D's loss on G's detached output (the noise made into images without
    grad), and G's loss through D. The figures equal the store-everything
    plans' activation bytes (each storage once, the step's input where
    saved, the loss's targets included)."""
    torch.manual_seed(0)
    noise_size, batch = 100, 64
    g, d = Generator(noise_size), discriminator()
    meter = Meter([g, d])
    out = {"d_saved_bytes": [], "g_saved_bytes": []}
    for _ in range(steps):
        noise = torch.randn(batch, noise_size, 1, 1)
        with torch.no_grad():
            fake = g(noise)
        with meter.hooks():
            d_loss = F.binary_cross_entropy(d(fake).reshape(batch), torch.zeros(batch))
        meter.backward(d_loss)
        out["d_saved_bytes"].append(meter.take_step())
        with meter.hooks():
            g_loss = F.binary_cross_entropy(d(g(noise)).reshape(batch), torch.ones(batch))
        meter.backward(g_loss)
        out["g_saved_bytes"].append(meter.take_step())
    return out


def style(steps):
    """tests/audit_test.cpp's OptimizedInputHasItsOwnBucket: frozen conv
    features, Adam over the input image. The image is the optimized input,
    not an activation: excluded from the saved bytes like a parameter."""
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    for p in features.parameters():
        p.requires_grad_(False)
    image = torch.rand(1, 3, 32, 32).requires_grad_(True)
    opt = torch.optim.Adam([image], lr=0.01)
    meter = Meter([features])
    meter.excluded.add(image.untyped_storage()._cdata)
    out = {"saved_bytes": []}
    for _ in range(steps):
        opt.zero_grad()
        with meter.hooks():
            loss = features(image).pow(2).mean()
        meter.backward(loss)
        opt.step()
        out["saved_bytes"].append(meter.take_step())
    out["image_bytes"] = nbytes([image])
    out["grad_bytes"] = nbytes([image.grad])
    out["param_bytes"] = nbytes(features.parameters())
    out["state_bytes"] = state_bytes(opt)
    return out


class Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.fc = nn.Linear(16 * 15 * 15, 64)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return torch.relu(self.fc(x.flatten(1)))


def trunk(steps, path):
    torch.manual_seed(0)
    scripted = torch.jit.script(Trunk())
    scripted.save(path)
    scripted = torch.jit.load(path)
    head = nn.Linear(64, 10)
    opt_trunk = torch.optim.SGD(scripted.parameters(), lr=0.001)
    opt_head = torch.optim.Adam(head.parameters(), lr=1e-3)
    meter = Meter([scripted, head])
    out = {"saved_bytes": []}
    for _ in range(steps):
        x = torch.randn(32, 3, 32, 32)
        y = torch.randint(0, 10, (32,))
        opt_trunk.zero_grad()
        opt_head.zero_grad()
        with meter.hooks():
            loss = F.nll_loss(torch.log_softmax(head(scripted(x)), dim=1), y)
        meter.backward(loss)
        opt_trunk.step()
        opt_head.step()
        out["saved_bytes"].append(meter.take_step())
    out["trunk_param_bytes"] = nbytes(scripted.parameters())
    out["head_param_bytes"] = nbytes(head.parameters())
    out["state_bytes"] = state_bytes(opt_head)
    return out


class WordLm(nn.Module):  # an embedding + LSTM language model (word_language_model's shape)
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, dropout=0.2)
        self.out = nn.Linear(128, 1000)

    def forward(self, x, state):
        h, state = self.lstm(self.emb(x), state)
        return self.out(h), state


def bptt(steps):
    torch.manual_seed(0)
    model = WordLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = Meter([model])
    out = {"saved_bytes": []}
    state = None
    for _ in range(steps):
        x = torch.randint(0, 1000, (20, 8))
        y = torch.randint(0, 1000, (20 * 8,))
        if state is not None:
            state = tuple(s.detach() for s in state)  # truncated BPTT: the state carries, its graph does not
        opt.zero_grad()
        with meter.hooks():
            logits, state = model(x, state)
            loss = F.cross_entropy(logits.flatten(0, 1), y)
        meter.backward(loss)
        opt.step()
        out["saved_bytes"].append(meter.take_step())
    out["param_bytes"] = nbytes(model.parameters())
    return out


class Decoder(nn.Module):  # image captioning's decoder: an LSTMCell unrolled over the caption
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 48)
        self.cell = nn.LSTMCell(48, 48)
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        x = torch.tanh(self.embed(x))
        state, hs = None, []
        for t in range(x.size(1)):
            state = self.cell(x[:, t], state)
            hs.append(state[0])
        return self.head(torch.stack(hs, 1).mean(1))


def decoder(steps):
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    meter = Meter([model])
    out = {"saved_bytes": []}
    for _ in range(steps):
        x = torch.randn(32, 12, 16)
        y = torch.randint(0, 10, (32,))
        opt.zero_grad()
        with meter.hooks():
            loss = F.cross_entropy(model(x), y)
        meter.backward(loss)
        opt.step()
        out["saved_bytes"].append(meter.take_step())
    out["param_bytes"] = nbytes(model.parameters())
    out["state_bytes"] = state_bytes(opt)
    return out


if __name__ == "__main__":
    which, steps = sys.argv[1], int(sys.argv[2])
    result = {"mnist": lambda: mnist(steps), "dcgan": lambda: dcgan(steps),
              "trunk": lambda: trunk(steps, sys.argv[3]), "bptt": lambda: bptt(steps),
              "decoder": lambda: decoder(steps), "gan": lambda: gan(steps),
              "style": lambda: style(steps)}[which]()
    print(json.dumps(result))
