"""`trainmem plan --model FILE --run` on a small config: plan with a budget
halfway between the smallest reachable peak and the unconstrained one, run it
on CPU, and check the measured figures against the plan (the saved bytes
exactly, the peak within 0.5 % and within the budget).

    python plan_model_check.py TRAINMEM CONFIG BATCH SEQ_LEN
"""
import json
import subprocess
import sys

cli, config, batch, seq = sys.argv[1:5]


def plan(budget, run):
    cmd = [cli, "plan", "--model", config, "--batch", batch, "--seq-len", seq, "--budget", str(budget), "--json"]
    out = subprocess.run(cmd + (["--run"] if run else []), capture_output=True, text=True)
    assert out.returncode == 0, (cmd, out.returncode, out.stderr)
    return json.loads(out.stdout)


free = plan(1 << 40, False)["plan"]
assert free["feasible"] and free["name"] == "none", free
budget = (free["predicted_peak_bytes"] + free["min_peak_bytes"]) // 2
d = plan(budget, True)
p, m = d["plan"], d["measured"]
assert d["kind"] == "plan_model" and p["feasible"] and p["name"] != "none", d
assert p["predicted_peak_bytes"] <= budget, d
assert m["activation_bytes"] == p["activation_bytes"], d
err = (m["peak_bytes"] - p["predicted_peak_bytes"]) / p["predicted_peak_bytes"]
assert abs(err) < 0.005 and m["peak_bytes"] <= budget, (err, d)
print(f"plan '{p['name']}' for {budget} B: predicted {p['predicted_peak_bytes']} B, "
      f"measured {m['peak_bytes']} B ({100 * err:+.3f} %), saved {m['activation_bytes']} B: plan fits")
