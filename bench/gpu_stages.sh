# Sourced by the device-call scripts (gpu_call1.sh, gpu_issue51.sh, gpu_issue48.sh): a call's time budget spent stage
# by stage.
# Needs BUDGET (seconds in all) and START ($SECONDS at the call's start); WORK, when set, collects each stage's
# name, exit status and seconds in $WORK/stages.

left() { echo $((BUDGET - (SECONDS - START))); }
# cap CAP RESERVE: the seconds a stage may take, at most CAP, leaving RESERVE for the later stages.
cap() { local c=$1 r=$(( $(left) - $2 )); [ "$r" -lt "$c" ] && c=$r; [ "$c" -lt 5 ] && c=0; echo "$c"; }
# stage SECS NAME CMD...: run CMD under timeout (SIGINT first so pytest finishes its reports, SIGKILL 15 s later).
stage() {
  local secs=$1 name=$2; shift 2
  if [ "$secs" -le 0 ]; then echo "=== $name: SKIPPED (no time left)"; return 0; fi
  echo "=== $name (at most ${secs}s; $(left)s of the budget left)"
  local t0=$SECONDS
  timeout -s INT -k 15 "$secs" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0))s$([ $rc = 124 ] || [ $rc = 137 ] && echo ' (TIMED OUT)')"
  [ -n "${WORK:-}" ] && echo "$name $rc $((SECONDS - t0))" >> "$WORK/stages"
  return 0
}
# setup CAP RESERVE: the carried wheels (.whl) installed into /tmp/site and put on PYTHONPATH with the checkout,
# fastppo built (a stage of at most CAP seconds, leaving RESERVE), the device, the versions and the tree printed.
setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  stage "$(cap "$1" "$2")" build python3 -m pip install -q --no-build-isolation --no-deps -e .
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers, fastppo.kernels as k; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, 'extension', k.extension_backend())"
  git rev-parse HEAD; git status --short | head; date -u
}
