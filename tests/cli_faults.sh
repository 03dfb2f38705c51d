#!/bin/sh
# CLI fault injection: hostile and bad input to the `trainmem`
# command. Each case prints what the command printed, then "status N"; the
# ctests in tools/trainmem/CMakeLists.txt assert the message and exit code.
#
# Usage: cli_faults.sh TRAINMEM OUTDIR CASE
# The report cases read OUTDIR/fault.json, written by the `fixture` case.
set -u
tm=$1
out=$2
case_name=$3
dir=$out/$case_name
rm -rf "$dir"
mkdir -p "$dir"
report=$out/fault.json

# A copy of the fixture report with one value replaced (plain text, so any
# number can be planted, including ones JSON libraries would round).
plant() {  # plant KEY VALUE -> $dir/bad.json
  sed "0,/\"$1\": [^,]*/s//\"$1\": $2/" "$report" > "$dir/bad.json"
  grep -q "\"$1\": $2" "$dir/bad.json" || { echo "could not plant $1"; exit 99; }
}

run() { "$tm" "$@"; echo "status $?"; }

case $case_name in
  fixture)
    "$tm" audit --steps 1 --json > "$report"; echo "status $?" ;;

  # ---- output files: nothing overwritten, nothing lost ----
  symlink_not_followed)
    echo keep > "$dir/victim"
    ln -s "$dir/victim" "$dir/out.html"
    "$tm" report "$report" --html "$dir/out.html" > /dev/null; echo "status $?"
    echo "victim: $(cat "$dir/victim")"
    [ -L "$dir/out.html" ] && echo "still a link" || echo "link replaced by the report"
    grep -c "Content-Security-Policy" "$dir/out.html" ;;
  dev_stdout_kept)
    # /dev/stdout is this pipe: written in place, not replaced by a file.
    "$tm" report "$report" --html /dev/stdout | grep -c "Content-Security-Policy"
    [ -c /dev/null ] && echo "dev/null still a device" ;;
  dash_is_stdout)
    "$tm" report "$report" --trace - > "$dir/stdout"; echo "status $?"
    head -c 40 "$dir/stdout"; echo ;;
  two_stdouts)
    run report "$report" --html - --trace - ;;
  dev_full)
    run report "$report" --html /dev/full ;;
  failed_run_keeps_old_file)
    echo keep > "$dir/old.html"
    plant num_params -1
    run report "$dir/bad.json" --html "$dir/old.html"
    echo "old: $(cat "$dir/old.html")"
    echo "temporary files left: $(ls -A "$dir" | grep -c tmp)" ;;
  unwritable_proc)
    # root passes access(W_OK) here; the real open fails, before training.
    run audit --html /proc/trainmem-x.html ;;
  not_a_directory)
    run audit --trace /etc/passwd/x.json ;;
  empty_html)
    run audit --html "" ;;

  # ---- model and training flags ----
  layers_overflow)
    run estimate --layers 99999999999999999999 ;;
  d_model_too_big)
    run estimate --d-model 4294967296 ;;
  model_bytes_overflow)
    run estimate --layers 10000 --d-model 65536 --heads 64 --batch 1048576 --seq-len 1048576 ;;
  fractional_layers)
    run estimate --layers 1.5 ;;
  lr_inf)
    run audit --lr inf ;;
  lr_nan)
    run audit --lr nan ;;
  steps_zero)
    run audit --steps 0 ;;
  cpu_index)
    run audit --device cpu:1 ;;
  preflight)
    # Its own estimate is terabytes: refused with the figures, before training.
    run audit --layers 1000 --d-model 8192 --heads 64 ;;

  # ---- trainmem report FILE: every number checked ----
  report_negative)
    plant num_params -1; run report "$dir/bad.json" ;;
  report_fraction)
    plant peak_bytes 1.5; run report "$dir/bad.json" ;;
  report_int64_min)
    plant peak_bytes -9223372036854775808; run report "$dir/bad.json" ;;
  report_huge)
    plant saved_activation_bytes 1e30; run report "$dir/bad.json" ;;
  report_uint64)
    plant num_params 18446744073709551615; run report "$dir/bad.json" ;;
  report_dev_zero)
    run report /dev/zero ;;
  report_deep)
    python3 -c "print('{\"schema\": \"trainmem/1\", \"x\": ' + '[' * 100000 + ']' * 100000 + '}')" > "$dir/deep.json"
    run report "$dir/deep.json" ;;
  config_deep)
    # A config.json nested 100,000 deep: refused by the bounded reader (it
    # overflowed the JSON parser's stack before).
    python3 -c "print('{\"model_type\": \"llama\", \"x\": ' + '[' * 100000 + ']' * 100000 + '}')" > "$dir/config.json"
    run estimate --model "$dir/config.json" ;;
  report_control_chars)
    sed '0,/"title": "[^"]*"/s//"title": "evil\\u001b[31mred\\u0007\\u009b2J"/' "$report" > "$dir/bad.json"
    "$tm" report "$dir/bad.json" > "$dir/out.txt"; echo "status $?"
    echo "escape bytes: $(tr -dc '\033\007\233' < "$dir/out.txt" | wc -c)"
    head -1 "$dir/out.txt" ;;
  *)
    echo "unknown case $case_name"; exit 99 ;;
esac
