# shellcheck shell=bash
# `lane CMD...`: run CMD in the background once fewer than PARALLEL (default 1) jobs are running;
# with PARALLEL > 1 each command gets one thread, so parallel lanes share the cores. Only for
# commands whose results do not depend on timing (tau, simulated tau). Source it, `wait` at the end.
parallel="${PARALLEL:-1}"

lane() {
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n; done
  if [ "$parallel" -gt 1 ]; then OMP_NUM_THREADS=1 "$@" & else "$@" & fi
}
