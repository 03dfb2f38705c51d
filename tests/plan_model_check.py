"""`trainmem plan --model FILE --run` on a small config: plan with a budget
halfway between the smallest reachable peak and the unconstrained one, run it
on CPU, and check the measured figures against the plan: the saved bytes
exactly, the plan's whole step on meta (Note [A plan checked by its whole
step]) exactly, within the budget, and, in fp32, the planner's composed peak
within 0.5 %. FLAGS (--precision, --lora-*) are given to both commands.

    python plan_model_check.py TRAINMEM CONFIG BATCH SEQ_LEN [FLAGS...]
"""
import json
import subprocess
import sys

cli, config, batch, seq = sys.argv[1:5]
flags = sys.argv[5:]


def plan(budget, run):
    cmd = [cli, "plan", "--model", config, "--batch", batch, "--seq-len", seq, "--budget", str(budget), "--json"] + flags
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
whole = d["whole_step_on_meta"]
assert whole["fits"] and m["peak_bytes"] == whole["peak_bytes"] <= budget, d
err = (m["peak_bytes"] - p["predicted_peak_bytes"]) / p["predicted_peak_bytes"]
assert flags or abs(err) < 0.005, (err, d)
print(f"plan '{p['name']}' for {budget} B{' with ' + ' '.join(flags) if flags else ''}: whole step on meta "
      f"{whole['peak_bytes']} B, measured {m['peak_bytes']} B; planner {p['predicted_peak_bytes']} B "
      f"({100 * err:+.3f} %), saved {m['activation_bytes']} B: plan fits")
