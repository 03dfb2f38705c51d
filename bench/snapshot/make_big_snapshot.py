#!/usr/bin/env python3
"""Writes a memory snapshot pickle of about SIZE bytes for timing `trainmem snapshot`.

    make_big_snapshot.py OUT [--mib 1024]

The shape of torch.cuda.memory._dump_snapshot's output (a dict with
`segments` and `device_traces`, each trace entry a dict with action, addr,
size, stream, time_us and frames), written opcode by opcode so that a 1 GiB
file needs no 1 GiB of Python objects: each trace entry is pickled on its own
without memo (pickle's fast mode) and appended in batches. The trace is a
training-like loop: per step, 200 activations allocated (1 KiB to 64 MiB),
freed in reverse, each with 12 frames (distinct file names and lines, as a
deep Python + C++ stack gives).
"""
import argparse
import io
import pickle
import struct


def fragment(obj):
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=2)
    p.fast = True  # no memo: fragments are self-contained
    p.dump(obj)
    data = buf.getvalue()
    assert data[:2] == b"\x80\x02" and data[-1:] == b"."
    return data[2:-1]


def unicode(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mib", type=int, default=1024)
    a = ap.parse_args()
    target = a.mib << 20
    with open(a.out, "wb") as f:
        f.write(b"\x80\x02}(" + unicode("segments") + b"]" + unicode("device_traces") + b"]]")
        written, t, step, n = 0, 0, 0, 0
        while written < target:
            batch = [b"("]
            live = []
            for k in range(200):
                size = 1024 << (k % 17)
                addr = 0x7f0000000000 + ((step * 200 + k) % 100000) * (64 << 20)
                frames = [{"name": f"fn_{k}_{j}", "filename": f"/src/model/layer_{k % 40}_{j}.py", "line": 10 + j}
                          for j in range(12)]
                t += 1
                batch.append(fragment({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                                       "time_us": t, "frames": frames}))
                live.append((addr, size, frames))
            for addr, size, frames in reversed(live):
                for action in ("free_requested", "free_completed"):
                    t += 1
                    batch.append(fragment({"action": action, "addr": addr, "size": size, "stream": 0,
                                           "time_us": t, "frames": frames}))
            batch.append(b"e")
            chunk = b"".join(batch)
            f.write(chunk)
            written += len(chunk)
            n += 600
            step += 1
        f.write(b"au.")
    print(f"{a.out}: {written + 40:,} B, {n:,} trace entries")


if __name__ == "__main__":
    main()
