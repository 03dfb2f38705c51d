#!/usr/bin/env python3
"""Recorded figures of the CS336 2.7B Transformer LM memory snapshots.

Reads torch.cuda.memory._dump_snapshot pickles (plain data; no torch needed)
of kkaitlyn111/cs336-a2-systems (memory_files/, cs336_systems/memory_logs/)
and prints, from the point recording starts:
  - peak allocated: sum of live blocks, each request rounded up to 512 B
    (what trainmem's replay calls the recorded allocated series),
  - peak requested: sum of live requested sizes,
  - peak reserved: sum of segments (those present when recording began,
    plus segment_alloc, minus segment_free),
and what is live at the allocated peak, grouped by the innermost Python
frame of the run's own code (or "before recording").

Usage: tests/cs336_recorded.py FILE.pickle... [--layer]
       tests/cs336_recorded.py --without-kernel-scratch IN.pickle OUT.pickle
The second form writes IN without the CUDA kernels' own scratch allocations
(reductions' gpu_reduce_kernel global buffers and semaphores, cub's radix
sort), which meta kernels do not make: replaying OUT (trainmem snapshot OUT)
gives what a prediction on meta can match.
The figures it prints are those asserted in tests/cs336_predict_test.cpp.

What the recordings cover (benchmark.py's run_memory_foward_fullstep, in a
version between commits c1c174d and ebf6548: the frames' line numbers match
no committed version): the model (TransformerLM, float32), the AdamW
optimizer (no state yet) and the batch are made before recording starts; no
warm-up step. Recorded: one forward (`logits = model(inputs)`, kept), or one
whole first step (zero_grad, forward, cross_entropy_loss, backward,
optimizer.step(), which makes the optimizer state), under
torch.autocast(bfloat16) for *_mixed. The model that ran is NOT the
repository's cs336-basics/cs336_basics/model.py: the frames name
/home/c-kaitwang/assignment1/cs336_basics/{transformer,optimizers,training}.py,
the author's own assignment 1 (not public), whose ops the frames' aten ops
and sizes show (RMSNorm through linalg_vector_norm, softmax through max /
exp / sum / div, one RoPE table per layer, einsum for every matmul).

Measured (bytes; "blocks" is max_memory_allocated of the recording replayed
by trainmem's replay_snapshot(), which the trace alone cannot give):
  memory_files/memory_ctx128_forward.pickle (in the snapshot dir as
  files_memory_ctx128_forward.pickle; memory_ctx128_forward_.pickle has the
  same figures)
    start allocated 13,628,553,216  peak allocated 19,352,504,320 (= requested)
    start reserved  13,763,608,576  peak reserved  19,667,091,456
    blocks 19,498,420,224
  memory_files/memory_ctx128_forward_mixed.pickle
    peak allocated 23,873,313,792 (= requested)  peak reserved 24,245,174,272
    blocks 24,024,505,344
  memory_files/memory_ctx128_fullstep.pickle (fresh allocator; the _ variant
  ran after the forward runs: +32 MiB cuBLAS workspace live, 430 cached
  segments freed by empty_cache, same peaks)
    peak allocated 54,802,668,032  peak requested 54,802,667,524
    peak reserved  61,111,009,280  blocks 55,079,000,576
  ctx 256 / 512 (the _ files, after earlier runs in the same process):
    forward_       26,252,175,360 / 43,675,396,096  reserved 26,545,750,016 / 44,715,474,944
    forward_mixed  28,262,939,648 / 39,860,763,648  reserved 28,848,422,912 / 40,514,879,488
    fullstep_      54,824,462,848 / 54,868,052,480  reserved (cache before the trace) / 62,830,673,920
  cs336_systems/memory_logs/memory_ctx128_forward.pickle (in the snapshot dir
  as memory_ctx128_forward.pickle) is another run: torch.compile'd (Inductor
  kernels), peak allocated 17,602,723,840, reserved 17,878,220,800.
"""
import collections
import pickle
import sys


def round512(n):
    return 512 if n < 512 else (n + 511) // 512 * 512


def py_site(frames):
    """Innermost frame of the run's own Python code: 'file.py:line func'."""
    for f in frames:
        fn = f.get('filename', '')
        if fn.endswith('.py') and 'site-packages' not in fn:
            return '%s:%d %s' % (fn.split('/')[-1], f['line'], f['name'])
    for f in frames:
        fn = f.get('filename', '')
        if fn.endswith('.py'):
            return '%s:%d %s' % (fn.split('/')[-1], f['line'], f['name'])
    return '(no python frame)'


def aten_op(frames):
    """The aten op that allocated: the first at::_ops::NAME::call frame."""
    for f in frames:
        n = f.get('name', '')
        if n.startswith('at::_ops::') and '::call(' in n:
            return n[len('at::_ops::'):n.index('::call(')]
    for f in frames:
        n = f.get('name', '')
        if n.startswith('at::_ops::'):
            return n[len('at::_ops::'):].split('::')[0]
    return '?'


def analyse(path, show_layer=False):
    s = pickle.load(open(path, 'rb'))
    trace = s['device_traces'][0]
    # Live blocks at the end of recording.
    live = {}
    for seg in s['segments']:
        for b in seg['blocks']:
            if b['state'] in ('active_allocated', 'active_pending_free'):
                live[b['address']] = (b['requested_size'], b.get('frames', []), -1)
    seg_end = {seg['address']: seg['total_size'] for seg in s['segments']}
    # Walk back to the state when recording began.
    segs = dict(seg_end)
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        a = e['action']
        if a == 'alloc':
            live.pop(e['addr'], None)
        elif a == 'free_completed':
            live[e['addr']] = (e['size'], e.get('frames', []), -1)
        elif a == 'segment_alloc':
            segs.pop(e['addr'], None)
        elif a == 'segment_free':
            segs[e['addr']] = e['size']
    start_live = {k: (v[0], '(before recording)', -1) for k, v in live.items()}
    start_reserved = sum(segs.values())
    cur = dict(start_live)
    alloc = sum(round512(v[0]) for v in cur.values())
    req = sum(v[0] for v in cur.values())
    res = start_reserved
    out = dict(file=path.split('/')[-1], events=len(trace),
               start_allocated=alloc, start_requested=req, start_reserved=res,
               num_start_blocks=len(cur))
    peak_a, peak_r, peak_res = alloc, req, res
    peak_a_i = peak_r_i = peak_res_i = -1
    peak_live = dict(cur)
    for i, e in enumerate(trace):
        a = e['action']
        if a == 'alloc':
            cur[e['addr']] = (e['size'], py_site(e['frames']) + ' [' + aten_op(e['frames']) + ']', i)
            alloc += round512(e['size'])
            req += e['size']
        elif a == 'free_completed':
            v = cur.pop(e['addr'])
            alloc -= round512(v[0])
            req -= v[0]
        elif a == 'segment_alloc':
            res += e['size']
        elif a == 'segment_free':
            res -= e['size']
        if alloc > peak_a:
            peak_a, peak_a_i, peak_live = alloc, i, dict(cur)
        if req > peak_r:
            peak_r, peak_r_i = req, i
        if res > peak_res:
            peak_res, peak_res_i = res, i
    out.update(peak_allocated=peak_a, peak_allocated_event=peak_a_i,
               peak_requested=peak_r, peak_requested_event=peak_r_i,
               peak_reserved=peak_res, peak_reserved_event=peak_res_i,
               end_allocated=alloc, end_reserved=res,
               num_segment_alloc=sum(1 for e in trace if e['action'] == 'segment_alloc'),
               num_segment_free=sum(1 for e in trace if e['action'] == 'segment_free'))
    groups = collections.defaultdict(lambda: [0, 0, 0])
    for v in peak_live.values():
        g = groups[v[1]]
        g[0] += 1
        g[1] += round512(v[0])
        g[2] += v[0]
    out['live_at_peak'] = sorted(groups.items(), key=lambda kv: -kv[1][1])
    out['start_sizes'] = collections.Counter(v[0] for v in start_live.values())
    return out, s


def without_kernel_scratch(src, dst):
    """Writes src's snapshot without the kernels' scratch allocations."""
    s = pickle.load(open(src, 'rb'))
    trace = s['device_traces'][0]

    def scratch(frames):
        return any('gpu_reduce_kernel' in f.get('name', '') or 'radix_sort_pairs' in f.get('name', '')
                   for f in frames)

    live, kept, dropped = set(), [], 0
    for e in trace:
        a = e['action']
        if a == 'alloc' and scratch(e.get('frames', [])):
            live.add(e['addr'])
            dropped += 1
            continue
        if a in ('free_requested', 'free_completed') and e['addr'] in live:
            if a == 'free_completed':
                live.discard(e['addr'])
            continue
        kept.append(e)
    s['device_traces'][0] = kept
    with open(dst, 'wb') as f:
        pickle.dump(s, f, protocol=4)
    print('%s: %d of %d events kept, %d scratch allocations dropped' % (dst, len(kept), len(trace), dropped))


def main(argv):
    if argv and argv[0] == '--without-kernel-scratch':
        without_kernel_scratch(argv[1], argv[2])
        return
    show_layer = '--layer' in argv
    for path in [a for a in argv if not a.startswith('--')]:
        o, s = analyse(path, show_layer)
        print('== %s (%d events, %d segment_alloc, %d segment_free)' % (
            o['file'], o['events'], o['num_segment_alloc'], o['num_segment_free']))
        for k in ('start_allocated', 'start_requested', 'start_reserved', 'num_start_blocks',
                  'peak_allocated', 'peak_allocated_event', 'peak_requested', 'peak_requested_event',
                  'peak_reserved', 'peak_reserved_event', 'end_allocated', 'end_reserved'):
            v = o[k]
            print('  %-22s %18s%s' % (k, format(v, ','),
                  '  (%.2f MiB)' % (v / 2**20) if 'event' not in k and 'num' not in k else ''))
        print('  blocks live when recording began, by requested size:')
        for size, n in sorted(o['start_sizes'].items(), key=lambda kv: -kv[0] * kv[1]):
            print('    %6d x %14s B' % (n, format(size, ',')))
        print('  live at the allocated peak, by Python frame [aten op]:')
        for site, (n, b, r) in o['live_at_peak']:
            print('    %16s B %5d blocks  %s' % (format(b, ','), n, site))
        if show_layer:
            print('  trace (first 400 allocs/frees):')
            k = 0
            for i, e in enumerate(s['device_traces'][0]):
                if e['action'] in ('alloc', 'free_completed'):
                    print('    %6d %-14s %14s %s [%s]' % (i, e['action'], format(e['size'], ','),
                          py_site(e['frames']), aten_op(e['frames'])))
                    k += 1
                    if k >= 400:
                        break


if __name__ == '__main__':
    main(sys.argv[1:])
