#!/usr/bin/env bash
# A compiler launcher: runs the compile command that follows the log path, and keeps what it
# printed on stderr (with -Xptxas -v, ptxas's report of every kernel) in that file as well.
#
#   ptxas_log.sh LOG COMPILER ARGS...
log=$1
shift
"$@" 2>"$log.part"
status=$?
cat "$log.part" >&2
mv "$log.part" "$log"
exit "$status"
