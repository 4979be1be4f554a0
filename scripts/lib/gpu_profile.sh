#!/usr/bin/env bash
# Nsight Compute's view of the main kernel of each bench_cuda case: speed of light, pipe use,
# memory, scheduler and warp-state (stall) statistics, occupancy and launch figures of one
# launch. Called by scripts/gpu-check --profile; needs ncu (the hardware counters, which some
# virtual machines do not expose).
#
#   scripts/lib/gpu_profile.sh BENCH_CUDA OUT_DIR
#
# OVQ_GPU_PROFILE_ONLY (an extended regex): only the targets whose names match it.
# One report per target in OUT_DIR/profile_<name>.txt; the exit status is ncu's worst.
set -uo pipefail
bench=$1
out=$2
command -v ncu >/dev/null 2>&1 || { echo "gpu_profile: no ncu" >&2; exit 1; }

# name | bench case (--only) | kernel (regex on the demangled name) | launches skipped first |
# bench_cuda's length option (--quick: a quarter)
targets=(
  "self_prefill_bf16|self_prefill_bf16|TensorReadProgram|0|--quick"
  "self_prefill_f32|self_prefill_f32|ReadProgram<float|0|--quick"
  "self_decode_bf16|self_decode_bf16|TensorDecodeProgram|0|--quick"
  "self_decode_f32|self_decode_f32|DecodeReadProgram<float|0|--quick"
  "ovq_decode_read_f32|ovq_decode_graph_f32|DecodeReadProgram<float|0|"
  "ovq_decode_read_bf16|ovq_decode_graph_bf16|TensorDecodeProgram|0|"
  "ovq_write_seeding_f32|ovq_prefill_f32|DictionaryWriteProgram|8|"
  "ovq_write_full_f32|ovq_prefill_f32|DictionaryWriteProgram|250|"
  "ovq_assign_full_f32|ovq_prefill_f32|AssignProgram|250|"
)
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats)
status=0
for target in "${targets[@]}"; do
  IFS='|' read -r name case kernel skip length <<<"$target"
  [[ -z "${OVQ_GPU_PROFILE_ONLY:-}" || "$name" =~ $OVQ_GPU_PROFILE_ONLY ]] || continue
  # shellcheck disable=SC2086  # $length: no option, or one
  ncu --clock-control none --kernel-name-base demangled -k "regex:$kernel" --launch-skip "$skip" \
    -c 1 "${sections[@]}" "$bench" $length --only "$case" >"$out/profile_$name.txt" 2>&1 ||
    status=1
  echo "gpu_profile: $name: $(grep -c . "$out/profile_$name.txt") lines"
done
exit $status
