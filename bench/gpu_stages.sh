# Sourced by the device-call scripts (gpu_call1.sh, gpu_issue51.sh): a call's time budget spent stage by stage.
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
