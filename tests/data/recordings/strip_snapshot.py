#!/usr/bin/env python3
"""Writes a stripped copy of a torch.cuda.memory._dump_snapshot pickle.

Kept: each segment's layout (address, sizes, stream, device, segment type,
is_expandable, segment_pool_id) and its blocks (address, size, requested
size, state); each device's trace (action, addr, size, stream, and an oom's
device_free); allocator_settings' PYTORCH_CUDA_ALLOC_CONF. Dropped: every
frame, time stamp and annotation. The copy is a plain-data pickle
(protocol 4) that trainmem and Python's pickle module both read, and
replays to the same figures as the original.

    strip_snapshot.py IN OUT
"""
import pickle
import sys

SEGMENT_KEYS = ("address", "total_size", "allocated_size", "requested_size", "stream", "device", "segment_type",
                "is_expandable", "segment_pool_id")
BLOCK_KEYS = ("address", "size", "requested_size", "state")
ENTRY_KEYS = ("action", "addr", "size", "stream", "device_free")


def pick(d, keys):
    return {k: d[k] for k in keys if k in d}


def main():
    with open(sys.argv[1], "rb") as f:
        snap = pickle.load(f)
    out = {"segments": [], "device_traces": []}
    for s in snap["segments"]:
        seg = pick(s, SEGMENT_KEYS)
        seg["blocks"] = [pick(b, BLOCK_KEYS) for b in s["blocks"]]
        out["segments"].append(seg)
    for trace in snap.get("device_traces", []):
        out["device_traces"].append([pick(e, ENTRY_KEYS) for e in trace])
    conf = snap.get("allocator_settings", {}).get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is not None:
        out["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": conf}
    with open(sys.argv[2], "wb") as f:
        pickle.dump(out, f, protocol=4)


if __name__ == "__main__":
    main()
