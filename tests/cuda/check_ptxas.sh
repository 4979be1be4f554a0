#!/usr/bin/env bash
# Reads a ptxas -v report (ptxas_log.sh) and fails unless every kernel of it, for every
# architecture compiled, uses no stack frame and spills nothing: the read, decode, merge and
# write kernels keep their accumulators in registers.
#
#   check_ptxas.sh REPORT ARCH...      e.g. check_ptxas.sh ptxas_report.txt sm_80 sm_90
set -o pipefail  # the awk verdict, not c++filt's
report=$1
shift
if [[ ! -s "$report" ]]; then
  echo "FAIL: no ptxas report at $report (rebuild ovq_tests_cuda)" >&2
  exit 1
fi
status=0
for arch in "$@"; do
  if ! grep -q "for '$arch'" "$report"; then
    echo "FAIL: the report has no kernel compiled for $arch" >&2
    status=1
  fi
done
# Each "Compiling entry function 'NAME' for 'ARCH'" is followed by its properties line.
awk '
  /Compiling entry function/ { match($0, /function .[^'"'"']*/); name = substr($0, RSTART + 10, RLENGTH - 10);
                               match($0, /for .sm_[0-9a-z]*/); arch = substr($0, RSTART + 5, RLENGTH - 5); next }
  /bytes stack frame/ { kernels++; split($0, f, " ");
                        if (f[1] != 0 || f[5] != 0 || f[9] != 0) { bad++; print "SPILL " arch ": " $0 " in " name } }
  END { printf "%d kernel compilations, %d with a stack frame or spills\n", kernels, bad + 0; exit bad > 0 || kernels == 0 }
' "$report" | c++filt || status=1
exit $status
